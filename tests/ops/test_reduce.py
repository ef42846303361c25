"""Reduce*, ArgMax/ArgMin, CumSum/CumProd against onnxruntime (and ONNX's reference evaluator
where onnxruntime disagrees with the spec or lacks the case)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from ort_compare import assert_matches_ort, make_model

import segflow
from segflow.errors import InvalidModel

RNG = np.random.default_rng(0)

REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]

# (axes or None, keepdims, noop_with_empty_axes)
AXES_CASES = [
    ([1], 1, 0),
    ([-1, 0], 0, 0),
    (None, 1, 0),
    (None, 0, 0),
    ([], 1, 1),
]


def _axes_input_since(op: str) -> int:
    return 13 if op == "ReduceSum" else 18


def _positive(op: str) -> bool:
    return op in ("ReduceLogSum",)


def _data(op: str, shape: tuple[int, ...] = (2, 3, 4)) -> np.ndarray:
    x = RNG.standard_normal(shape).astype(np.float32)
    return np.abs(x) + 0.1 if _positive(op) else x


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize(("axes", "keepdims", "noop"), AXES_CASES,
                         ids=["axis1", "neg_axes_nokeep", "all", "all_nokeep", "noop"])
def test_reduce_axes_input(op: str, axes: list[int] | None, keepdims: int, noop: int) -> None:
    opset = 18
    feeds = {"x": _data(op)}
    inputs = ["x"]
    inits = {}
    if axes is not None:
        inits["axes"] = np.array(axes, dtype=np.int64)
        inputs.append("axes")
    node = helper.make_node(op, inputs, ["y"], keepdims=keepdims, noop_with_empty_axes=noop)
    assert_matches_ort(make_model([node], feeds, ["y"], opset, inits), feeds,
                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize(("axes", "keepdims"), [([1], 1), ([0, -1], 0), (None, 0)],
                         ids=["axis1", "neg_axes_nokeep", "all_nokeep"])
def test_reduce_axes_attribute(op: str, axes: list[int] | None, keepdims: int) -> None:
    opset = _axes_input_since(op) - 2  # an opset where axes is still an attribute
    feeds = {"x": _data(op)}
    attrs = {"keepdims": keepdims} | ({"axes": axes} if axes is not None else {})
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], opset), feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("op", "dtype"), [("ReduceSum", np.int32), ("ReduceMax", np.int64),
                                           ("ReduceMin", np.int32), ("ReduceProd", np.int64),
                                           ("ReduceMean", np.int32), ("ReduceSum", np.float64)])
def test_reduce_keeps_dtype(op: str, dtype: type) -> None:
    feeds = {"x": RNG.integers(-4, 5, (3, 4)).astype(dtype)}
    inits = {"axes": np.array([1], dtype=np.int64)}
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=0)
    got = assert_matches_ort(make_model([node], feeds, ["y"], 18, inits), feeds)
    assert got[0].dtype == dtype


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_empty_input(op: str) -> None:
    """Reducing zero elements yields the identity of the reduction (reference semantics)."""
    feeds = {"x": np.zeros((2, 0, 3), dtype=np.float32)}
    inits = {"axes": np.array([1], dtype=np.int64)}
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)
    model = make_model([node], feeds, ["y"], 18, inits)
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)[0]
    assert got.shape == (2, 1, 3)
    np.testing.assert_array_equal(got, expected)


def test_reduce_axes_attribute_in_new_opset_is_rejected() -> None:
    feeds = {"x": _data("ReduceMean")}
    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1])
    with pytest.raises(InvalidModel, match="axes"):
        segflow.InferenceSession(make_model([node], feeds, ["y"], 18), engine="inline")


def test_reduce_bool_max() -> None:
    feeds = {"x": np.array([[True, False], [False, False]])}
    inits = {"axes": np.array([1], dtype=np.int64)}
    node = helper.make_node("ReduceMax", ["x", "axes"], ["y"], keepdims=0)
    model = make_model([node], feeds, ["y"], 20, inits)
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)[0]
    np.testing.assert_array_equal(got, [True, False])


# -- ArgMax / ArgMin -----------------------------------------------------------------------

ARG_CASES = [
    (0, 1, 0), (1, 0, 0), (-1, 1, 0), (-2, 0, 1), (2, 1, 1),
]


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize(("axis", "keepdims", "last"), ARG_CASES)
def test_arg(op: str, axis: int, keepdims: int, last: int) -> None:
    # Few distinct values, so ties are common and select_last_index matters.
    feeds = {"x": RNG.integers(0, 3, (3, 4, 5)).astype(np.float32)}
    node = helper.make_node(op, ["x"], ["y"], axis=axis, keepdims=keepdims,
                            select_last_index=last)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float64])
def test_arg_dtypes(dtype: type) -> None:
    feeds = {"x": RNG.integers(0, 50, (4, 6)).astype(dtype)}
    node = helper.make_node("ArgMax", ["x"], ["y"], axis=1)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


# -- CumSum / CumProd ----------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize(("exclusive", "reverse"), [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_cumsum(axis: int, exclusive: int, reverse: int, dtype: type) -> None:
    feeds = {"x": RNG.integers(-5, 5, (3, 4)).astype(dtype)}
    inits = {"axis": np.array(axis, dtype=np.int64)}
    node = helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)
    assert_matches_ort(make_model([node], feeds, ["y"], 14, inits), feeds)


@pytest.mark.parametrize(("exclusive", "reverse"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod(exclusive: int, reverse: int) -> None:
    feeds = {"x": RNG.uniform(0.5, 1.5, (3, 4)).astype(np.float32)}
    inits = {"axis": np.array(1, dtype=np.int32)}
    node = helper.make_node("CumProd", ["x", "axis"], ["y"], exclusive=exclusive,
                            reverse=reverse)
    model = make_model([node], feeds, ["y"], 26, inits)
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

