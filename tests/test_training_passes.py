"""Tests for training's graph rewrites: passes/attach_loss.py, lift_state.py,
training_mode.py (each: the changed and the unchanged case)."""

from __future__ import annotations

import numpy as np
import pytest

from segflow.errors import InvalidModel
from segflow.frontend.builder import GraphBuilder
from segflow.ir import DType, Graph
from segflow.passes.attach_loss import CrossEntropyLoss, attach_loss
from segflow.passes.lift_state import lift_state
from segflow.passes.training_mode import training_mode


def _classifier(batchnorm: bool = False) -> Graph:
    b = GraphBuilder("clf")
    x = b.input("x", DType.FLOAT32, ["N", 2, 4, 4])
    if batchnorm:
        ones, zeros = np.ones(2, np.float32), np.zeros(2, np.float32)
        x = b.op("BatchNormalization", x, b.param("scale", ones), b.param("bias", zeros),
                 b.param("mean", zeros), b.param("var", ones), name="bn")
    h = b.op("Flatten", x)
    b.output(b.op("Gemm", h, b.param("w", np.ones((3, 32), np.float32)), transB=1), "logits")
    return b.to_graph()


def test_attach_loss_appends_cross_entropy_or_names_a_value():
    graph = _classifier()
    result = attach_loss(graph, CrossEntropyLoss(labels="y"))
    assert result.changed and result.loss is not None and result.loss.name == "loss"
    assert graph.nodes[-1].op_type == "SoftmaxCrossEntropyLoss"
    assert [v.name for v in graph.inputs] == ["x", "y"]
    named = attach_loss(graph, "loss")                  # unchanged: an existing value
    assert not named.changed and named.loss is result.loss
    with pytest.raises(InvalidModel, match="no value named 'nope'"):
        attach_loss(graph, "nope")


def test_lift_state_turns_initializers_into_inputs():
    graph = _classifier()
    result = lift_state(graph, ["w", "absent"])
    assert result.changed and "w" not in graph.initializers
    assert graph.inputs[-1].name == "w" and graph.inputs[-1].const is None
    assert not lift_state(graph, ["w"]).changed          # already an input


def test_training_mode_switches_batchnorm_and_reports_running_statistics():
    graph = _classifier(batchnorm=True)
    lift_state(graph, ["mean", "var"])
    result = training_mode(graph)
    bn = graph.nodes[0]
    assert result.changed and bn.attrs["training_mode"] == 1 and len(bn.outputs) == 3
    assert dict(result.running) == {"mean": bn.outputs[1], "var": bn.outputs[2]}
    unchanged = training_mode(_classifier())
    assert not unchanged.changed and unchanged.running == {}
