"""Gathers, scatters, TopK, Unique, NonMaxSuppression, Compress, OneHot, Trilu, EyeLike:
segflow against onnxruntime (ONNX's reference evaluator for ops onnxruntime lacks)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from ort_compare import assert_matches_ort, make_model

import segflow
from segflow.engine.base import ExecType
from segflow.errors import InvalidModel

RNG = np.random.default_rng(0)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return segflow.InferenceSession(model, engine="inline").run(None, feeds)


def _exec_types(model: onnx.ModelProto) -> list[ExecType]:
    sess = segflow.InferenceSession(model, engine="inline")
    return [seg.exec_type for seg in sess.plan.segments]


# -- gathers -------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(axis: int) -> None:
    data = RNG.standard_normal((3, 4)).astype(np.float32)
    size = data.shape[axis]
    feeds = {"x": data, "i": RNG.integers(-size, size, (2, 4) if axis == 0 else (3, 2))}
    node = helper.make_node("GatherElements", ["x", "i"], ["y"], axis=axis)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


GATHER_ND = [
    ((2, 3, 4), (5, 2), 0),
    ((2, 3, 4), (2, 2, 3), 0),
    ((2, 3, 4), (2, 1), 1),
    ((2, 3, 4, 5), (2, 3, 1), 2),
    ((3, 4), (0, 2), 0),
]


@pytest.mark.parametrize(("shape", "ishape", "batch_dims"), GATHER_ND)
def test_gather_nd(shape: tuple[int, ...], ishape: tuple[int, ...], batch_dims: int) -> None:
    data = RNG.standard_normal(shape).astype(np.float32)
    depth = ishape[-1]
    limits = shape[batch_dims: batch_dims + depth]
    idx = np.stack([RNG.integers(-n, n, ishape[:-1]) for n in limits], axis=-1) if depth else \
        np.zeros(ishape, dtype=np.int64)
    feeds = {"x": data, "i": idx.reshape(ishape).astype(np.int64)}
    node = helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=batch_dims)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


# -- scatters ------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, -1])
def test_scatter_elements(reduction: str, axis: int) -> None:
    data = RNG.standard_normal((4, 5)).astype(np.float32)
    # Unique indices per column/row for "none" (duplicates are order-dependent there).
    if axis == 0:
        idx = np.stack([RNG.permutation(4)[:2] for _ in range(5)], axis=1)
    else:
        idx = np.stack([RNG.permutation(5)[:3] - 5 for _ in range(4)], axis=0)
    if reduction != "none":
        idx = np.zeros_like(idx)  # all collide: exercises the reduction
    feeds = {"x": data, "i": idx.astype(np.int64),
             "u": RNG.standard_normal(idx.shape).astype(np.float32)}
    node = helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=axis,
                            reduction=reduction)
    assert_matches_ort(make_model([node], feeds, ["y"], 18), feeds)


def test_scatter_opset10() -> None:
    feeds = {"x": np.zeros((3, 3), np.float32), "i": np.array([[1, 0, 2], [0, 2, 1]]),
             "u": RNG.standard_normal((2, 3)).astype(np.float32)}
    node = helper.make_node("Scatter", ["x", "i", "u"], ["y"], axis=0)
    assert_matches_ort(make_model([node], feeds, ["y"], 10), feeds)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd(reduction: str) -> None:
    data = RNG.standard_normal((4, 4, 4)).astype(np.float32)
    idx = np.array([[0], [2]]) if reduction == "none" else np.array([[0], [2], [0], [-2]])
    upd = RNG.standard_normal((idx.shape[0], 4, 4)).astype(np.float32)
    feeds = {"x": data, "i": idx.astype(np.int64), "u": upd}
    node = helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction=reduction)
    model = make_model([node], feeds, ["y"], 18)
    if reduction == "none" or np.all(idx >= 0):
        assert_matches_ort(model, feeds)
    else:  # onnxruntime rejects negative ScatterND indices; the spec allows them
        np.testing.assert_allclose(_run(model, feeds)[0],
                                   ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-6)


def test_scatter_nd_element_updates() -> None:
    feeds = {"x": RNG.standard_normal((3, 4)).astype(np.float32),
             "i": np.array([[0, 1], [2, 3], [1, 0]], dtype=np.int64),
             "u": np.array([10.0, 20.0, 30.0], dtype=np.float32)}
    node = helper.make_node("ScatterND", ["x", "i", "u"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 16), feeds)


def test_bad_reduction_is_rejected_at_load() -> None:
    feeds = {"x": np.zeros((2, 2), np.float32), "i": np.zeros((1, 2), np.int64),
             "u": np.zeros((1, 2), np.float32)}
    node = helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], reduction="avg")
    with pytest.raises(InvalidModel, match="reduction"):
        segflow.InferenceSession(make_model([node], feeds, ["y"], 18), engine="inline")


def test_tensor_scatter() -> None:
    feeds = {"past": RNG.standard_normal((2, 3, 6, 4)).astype(np.float32),
             "upd": RNG.standard_normal((2, 3, 2, 4)).astype(np.float32),
             "w": np.array([1, 5], dtype=np.int64)}
    node = helper.make_node("TensorScatter", ["past", "upd", "w"], ["y"], mode="circular")
    model = make_model([node], feeds, ["y"], 24)
    np.testing.assert_array_equal(_run(model, feeds)[0],
                                  ReferenceEvaluator(model).run(None, feeds)[0])


# -- TopK ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("axis", "largest", "k"), [(-1, 1, 3), (0, 0, 2), (1, 1, 5), (1, 0, 0)])
def test_topk(axis: int, largest: int, k: int) -> None:
    # Integer-valued floats: ties resolve to the lower index, as onnxruntime does.
    feeds = {"x": RNG.integers(0, 4, (4, 5)).astype(np.float32)}
    inits = {"k": np.array([k], dtype=np.int64)}
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)
    model = make_model([node], feeds, ["v", "i"], 11, inits)
    assert_matches_ort(model, feeds)
    assert _exec_types(model) == [ExecType.SYNC]


def test_topk_opset1_attribute_k() -> None:
    feeds = {"x": RNG.standard_normal((3, 6)).astype(np.float32)}
    node = helper.make_node("TopK", ["x"], ["v", "i"], k=2)
    assert_matches_ort(make_model([node], feeds, ["v", "i"], 9), feeds)


def test_topk_computed_k_runs_local() -> None:
    feeds = {"x": RNG.standard_normal((2, 6)).astype(np.float32),
             "k": np.array([4], dtype=np.int64)}
    nodes = [helper.make_node("Identity", ["k"], ["k2"]),
             helper.make_node("TopK", ["x", "k2"], ["v", "i"])]
    model = make_model(nodes, feeds, ["v", "i"], 11)
    assert_matches_ort(model, feeds)
    assert ExecType.LOCAL in _exec_types(model)


def test_topk_k_too_large_is_refused_at_load_naming_node() -> None:
    feeds = {"x": np.zeros((2, 3), np.float32)}
    inits = {"k": np.array([4], dtype=np.int64)}
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk_node")
    with pytest.raises(InvalidModel, match="topk_node.*TopK"):
        _run(make_model([node], feeds, ["v", "i"], 11, inits), feeds)


# -- Unique / Compress / NonMaxSuppression (data-dependent shapes: LOCAL) ------------------

@pytest.mark.parametrize(("axis", "sorted_"), [(None, 1), (None, 0), (0, 1), (1, 0), (-1, 1)])
def test_unique(axis: int | None, sorted_: int) -> None:
    feeds = {"x": RNG.integers(0, 3, (4, 3)).astype(np.float32)}
    attrs = {"sorted": sorted_} | ({"axis": axis} if axis is not None else {})
    node = helper.make_node("Unique", ["x"], ["y", "idx", "inv", "cnt"], **attrs)
    model = make_model([node], feeds, ["y", "idx", "inv", "cnt"], 11)
    assert_matches_ort(model, feeds)
    assert _exec_types(model) == [ExecType.LOCAL]


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_compress(axis: int | None) -> None:
    feeds = {"x": RNG.standard_normal((3, 4)).astype(np.float32),
             "c": np.array([True, False, True])}
    attrs = {"axis": axis} if axis is not None else {}
    node = helper.make_node("Compress", ["x", "c"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 11), feeds)


def test_compress_empty_result() -> None:
    feeds = {"x": RNG.standard_normal((3, 4)).astype(np.float32),
             "c": np.array([False, False, False])}
    node = helper.make_node("Compress", ["x", "c"], ["y"], axis=0)
    got = assert_matches_ort(make_model([node], feeds, ["y"], 11), feeds)
    assert got[0].shape == (0, 4)


@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("score_threshold", [None, 0.3])
def test_non_max_suppression(center: int, score_threshold: float | None) -> None:
    corners = RNG.uniform(0, 10, (2, 12, 2)).astype(np.float32)
    sizes = RNG.uniform(1, 5, (2, 12, 2)).astype(np.float32)
    if center:
        boxes = np.concatenate([corners, sizes], axis=-1)
    else:
        boxes = np.concatenate([corners, corners + sizes], axis=-1)
    feeds = {"boxes": boxes, "scores": RNG.uniform(0, 1, (2, 3, 12)).astype(np.float32)}
    inits = {"max": np.array([4], dtype=np.int64), "iou": np.array([0.4], dtype=np.float32)}
    inputs = ["boxes", "scores", "max", "iou"]
    if score_threshold is not None:
        inits["score"] = np.array([score_threshold], dtype=np.float32)
        inputs.append("score")
    node = helper.make_node("NonMaxSuppression", inputs, ["sel"], center_point_box=center)
    model = make_model([node], feeds, ["sel"], 11, inits)
    assert_matches_ort(model, feeds)
    assert _exec_types(model) == [ExecType.LOCAL]


def test_non_max_suppression_no_max_selects_nothing() -> None:
    feeds = {"boxes": np.array([[[0, 0, 1, 1]]], np.float32),
             "scores": np.array([[[0.9]]], np.float32)}
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["sel"])
    got = assert_matches_ort(make_model([node], feeds, ["sel"], 11), feeds)
    assert got[0].shape == (0, 3)


# -- constructors --------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("idx_dtype", [np.int64, np.float32])
def test_one_hot(axis: int, idx_dtype: type) -> None:
    feeds = {"i": np.array([[0, 2, -1], [4, 1, -5]], dtype=idx_dtype)}
    inits = {"depth": np.array(4, dtype=np.int64),
             "values": np.array([-1.0, 3.0], dtype=np.float32)}
    node = helper.make_node("OneHot", ["i", "depth", "values"], ["y"], axis=axis)
    model = make_model([node], feeds, ["y"], 11, inits)
    if idx_dtype is np.int64:
        assert_matches_ort(model, feeds)
    else:  # onnxruntime has no float-index kernel for this type combination
        np.testing.assert_array_equal(_run(model, feeds)[0],
                                      ReferenceEvaluator(model).run(None, feeds)[0])


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 2, -1, 7])
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 3), (0, 3)])
def test_trilu(upper: int, k: int | None, shape: tuple[int, ...]) -> None:
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    inputs, inits = ["x"], {}
    if k is not None:
        inputs.append("k")
        inits["k"] = np.array(k, dtype=np.int64)
    node = helper.make_node("Trilu", inputs, ["y"], upper=upper)
    assert_matches_ort(make_model([node], feeds, ["y"], 14, inits), feeds)


@pytest.mark.parametrize(("shape", "k", "dtype"), [((3, 3), 0, None), ((3, 5), 1, None),
                                                   ((4, 2), -1, TensorProto.INT32),
                                                   ((2, 2), 3, TensorProto.DOUBLE)])
def test_eye_like(shape: tuple[int, int], k: int, dtype: int | None) -> None:
    feeds = {"x": np.zeros(shape, dtype=np.float32)}
    attrs = {"k": k} | ({"dtype": dtype} if dtype is not None else {})
    node = helper.make_node("EyeLike", ["x"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 9), feeds)
