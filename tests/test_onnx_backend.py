"""The onnx.backend.base.Backend implementation."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import segflow
from segflow.onnx_backend import SegflowBackend


def _model(op: str = "Add") -> object:
    graph = helper.make_graph(
        [helper.make_node(op, ["a", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_prepare_and_run_positional_and_named() -> None:
    rep = SegflowBackend.prepare(_model(), "CPU")
    a, b = np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)
    np.testing.assert_array_equal(rep.run([a, b])[0], a + b)
    out = rep.run({"a": a, "b": b})
    np.testing.assert_array_equal(out.y, a + b)  # outputs are a namedtuple by name


def test_run_model_and_run_node() -> None:
    a, b = np.array([1.0, 2.0], np.float32), np.array([5.0, 1.0], np.float32)
    np.testing.assert_array_equal(SegflowBackend.run_model(_model("Sub"), [a, b])[0], a - b)
    node = helper.make_node("Mul", ["x", "z"], ["w"])
    np.testing.assert_array_equal(SegflowBackend.run_node(node, [a, b])[0], a * b)


def test_scalar_feed_stays_scalar() -> None:
    graph = helper.make_graph(
        [helper.make_node("Neg", ["s"], ["y"])], "g",
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = SegflowBackend.run_model(model, [np.float32(2.0)])[0]
    assert out.shape == () and out == -2.0


def test_unsupported_op_fails_at_prepare() -> None:
    with pytest.raises(segflow.UnsupportedOp):
        SegflowBackend.prepare(_model("NoSuchOp"), "CPU")


def test_supports_device() -> None:
    assert SegflowBackend.supports_device("CPU")
    assert not SegflowBackend.supports_device("TPU")
