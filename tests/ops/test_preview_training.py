"""ai.onnx.preview.training optimizer steps (Adagrad, Adam, Momentum) against ONNX's
reference evaluator, which implements them (onnxruntime's default build does not)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from ort_compare import make_model

import segflow
from segflow.errors import InvalidModel

RNG = np.random.default_rng(0)
DOMAIN = "ai.onnx.preview.training"
STATES = {"Adagrad": ["H"], "Adam": ["V", "H"], "Momentum": ["V"]}
ATTRS: dict[str, dict[str, object]] = {
    "Adagrad": {"decay_factor": 0.1, "epsilon": 1e-5, "norm_coefficient": 0.01},
    "Adam": {"alpha": 0.9, "beta": 0.95, "epsilon": 1e-4, "norm_coefficient": 0.01,
             "norm_coefficient_post": 0.02},
    "Momentum": {"alpha": 0.9, "beta": 0.5, "norm_coefficient": 0.01, "mode": "standard"},
}


def _model(op: str, shapes: list[tuple[int, ...]], step: int, dtype: type = np.float32,
           **attrs: object) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    n = len(shapes)
    feeds: dict[str, np.ndarray] = {"R": np.array(0.1, dtype), "T": np.array(step, np.int64)}
    for kind in ["X", "G", *STATES[op]]:
        for i, shape in enumerate(shapes):
            values = RNG.standard_normal(shape)
            # Second moments and accumulated squares are never negative.
            feeds[f"{kind}{i}"] = (np.abs(values) if kind == "H" else values).astype(dtype)
    inputs = list(feeds)
    outputs = [f"{kind}{i}_new" for kind in ["X", *STATES[op]] for i in range(n)]
    node = helper.make_node(op, inputs, outputs, domain=DOMAIN, **{**ATTRS[op], **attrs})
    return make_model([node], feeds, outputs, 18, domains={DOMAIN: 1}), feeds


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    expected = ReferenceEvaluator(model).run(None, feeds)
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, f"output {i}"
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=f"output {i}")
    return got


@pytest.mark.parametrize("op", sorted(STATES))
@pytest.mark.parametrize("step", [0, 3])
@pytest.mark.parametrize("shapes", [[(5,)], [(2, 3), (4,), (1, 2, 2)]])
def test_step_matches_reference(op: str, step: int, shapes: list[tuple[int, ...]]) -> None:
    model, feeds = _model(op, shapes, step)
    got = _check(model, feeds)
    assert all(g.dtype == np.float32 for g in got)
    # A step changes the parameters (a rule that passed X through would fail here too).
    assert not np.allclose(got[0], feeds["X0"])


def test_nesterov_momentum_matches_reference() -> None:
    _check(*_model("Momentum", [(3, 4), (2,)], 2, mode="nesterov"))


@pytest.mark.parametrize("op", sorted(STATES))
def test_float64_stays_float64(op: str) -> None:
    model, feeds = _model(op, [(6,)], 1, dtype=np.float64)
    got = _check(model, feeds)
    assert all(g.dtype == np.float64 for g in got)


def test_adam_defaults() -> None:
    model, feeds = _model("Adam", [(4,)], 2)
    node = model.graph.node[0]
    del node.attribute[:]
    _check(model, feeds)


def test_unknown_momentum_mode_is_invalid() -> None:
    model, _ = _model("Momentum", [(3,)], 1, mode="heavy")
    with pytest.raises(InvalidModel, match="mode"):
        segflow.InferenceSession(model, engine="inline")


def test_momentum_without_alpha_is_invalid() -> None:
    model, _ = _model("Momentum", [(3,)], 1)
    node = model.graph.node[0]
    keep = [a for a in node.attribute if a.name != "alpha"]
    del node.attribute[:]
    node.attribute.extend(keep)
    with pytest.raises(InvalidModel, match="alpha"):
        segflow.InferenceSession(model, engine="inline")


def test_group_count_mismatch_is_invalid() -> None:
    model, _ = _model("Adagrad", [(3,), (2,)], 1)
    node = model.graph.node[0]
    del node.output[-1]
    model.graph.output.pop()
    with pytest.raises(InvalidModel, match="groups"):
        segflow.InferenceSession(model, engine="inline")
