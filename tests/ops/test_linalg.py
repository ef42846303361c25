"""Einsum and Det against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from ort_compare import assert_matches_ort, make_model

import segflow

RNG = np.random.default_rng(0)

EINSUM = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij, bjk -> bik", [(2, 3, 4), (2, 4, 5)]),
    ("ii->i", [(4, 4)]),
    ("...ii->...i", [(2, 3, 3)]),
    ("i,i", [(5,), (5,)]),
    ("ij->", [(3, 4)]),
    ("ij", [(3, 4)]),
    ("ba", [(3, 4)]),
    ("...j,jk->...k", [(2, 3, 4), (4, 2)]),
    ("i,j->ij", [(3,), (4,)]),
]


@pytest.mark.parametrize(("equation", "shapes"), EINSUM, ids=[e for e, _ in EINSUM])
def test_einsum(equation: str, shapes: list[tuple[int, ...]]) -> None:
    feeds = {f"x{i}": RNG.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    node = helper.make_node("Einsum", list(feeds), ["y"], equation=equation)
    assert_matches_ort(make_model([node], feeds, ["y"], 12), feeds, rtol=1e-5, atol=1e-5)


def test_einsum_integer() -> None:
    feeds = {"a": RNG.integers(-5, 5, (3, 4)).astype(np.int32),
             "b": RNG.integers(-5, 5, (4, 2)).astype(np.int32)}
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik")
    assert_matches_ort(make_model([node], feeds, ["y"], 12), feeds, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 1, 2, 2)])
def test_det(shape: tuple[int, ...]) -> None:
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    node = helper.make_node("Det", ["x"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 11), feeds, rtol=1e-4, atol=1e-5)


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime lacks these newer ops: compare with ONNX's reference evaluator."""
    return list(ReferenceEvaluator(model).run(None, feeds))


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention(rule: str) -> None:
    b, t, hq, hkv, dk, dv = 2, 5, 4, 2, 3, 4
    feeds = {"q": RNG.standard_normal((b, t, hq * dk)).astype(np.float32),
             "k": RNG.standard_normal((b, t, hkv * dk)).astype(np.float32),
             "v": RNG.standard_normal((b, t, hkv * dv)).astype(np.float32),
             "past": RNG.standard_normal((b, hkv, dk, dv)).astype(np.float32)}
    inputs = ["q", "k", "v", "past", "", ""]
    if rule in ("gated", "gated_delta"):
        # per-key-dimension decay for "gated", per-head scalar decay for "gated_delta"
        width = hkv * dk if rule == "gated" else hkv
        feeds["decay"] = -RNG.uniform(0.0, 0.5, (b, t, width)).astype(np.float32)
        inputs[4] = "decay"
    if rule in ("delta", "gated_delta"):
        feeds["beta"] = RNG.uniform(0.0, 1.0, (b, t, hkv)).astype(np.float32)
        inputs[5] = "beta"
    while inputs[-1] == "":
        inputs.pop()
    node = helper.make_node("LinearAttention", inputs, ["y", "state"], q_num_heads=hq,
                            kv_num_heads=hkv, update_rule=rule)
    model = make_model([node], feeds, ["y", "state"], 27)
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    for g, e in zip(got, _reference(model, feeds)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_flex_attention_mods_read_outer_values() -> None:
    # score_mod adds an outer-graph bias; prob_mod scales by a constant; GQA 4 -> 2 heads.
    dims = ["B", "H", "L", "S"]
    score_mod = helper.make_graph(
        [helper.make_node("Add", ["scores", "bias"], ["scores_out"])], "score_mod",
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("scores_out", TensorProto.FLOAT, dims)])
    prob_mod = helper.make_graph(
        [helper.make_node("Mul", ["probs", "half"], ["probs_out"])], "prob_mod",
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("probs_out", TensorProto.FLOAT, dims)],
        [helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])])
    feeds = {"Q": RNG.standard_normal((1, 4, 3, 8)).astype(np.float32),
             "K": RNG.standard_normal((1, 2, 5, 8)).astype(np.float32),
             "V": RNG.standard_normal((1, 2, 5, 6)).astype(np.float32),
             "bias": RNG.standard_normal((1, 1, 3, 5)).astype(np.float32)}
    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain="ai.onnx.preview",
                            score_mod=score_mod, prob_mod=prob_mod)
    model = make_model([node], feeds, ["Y"], 23)
    model.opset_import.append(helper.make_opsetid("ai.onnx.preview", 1))
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    # ONNX's reference cannot feed outer values to the mods: compute the expectation in numpy.
    k = np.repeat(feeds["K"], 2, axis=1)
    v = np.repeat(feeds["V"], 2, axis=1)
    scores = feeds["Q"] @ np.swapaxes(k, -1, -2) / np.sqrt(8.0) + feeds["bias"]
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = 0.5 * probs / probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(got[0], probs @ v, rtol=1e-5, atol=1e-5)
