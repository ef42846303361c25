"""GraphBuilder: the small Python graph API."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import segflow
from segflow.frontend.builder import GraphBuilder
from segflow.ir import DType


def test_builds_a_checked_model_that_runs() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    b = GraphBuilder("tiny")
    x = b.input("x", DType.FLOAT32, ["N", 1, 8, 8])
    y = b.op("Relu", b.op("Conv", x, b.param("w", w), pads=[1, 1, 1, 1]))
    b.output(y, "y")
    model = b.to_model()
    onnx.checker.check_model(model)
    assert [t.name for t in model.graph.initializer] == ["w"]
    out = model.graph.output[0]
    assert out.name == "y" and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    graph = b.to_graph()
    graph.validate()
    assert [n.op_type for n in graph.nodes] == ["Conv", "Relu"]  # renamed, no Identity
    assert graph.outputs[0].spec.shape == ("N", 4, 8, 8)
    data = rng.standard_normal((2, 1, 8, 8)).astype(np.float32)
    result, = segflow.InferenceSession(model).run(None, {"x": data})
    expected = torch.relu(torch.nn.functional.conv2d(torch.tensor(data), torch.tensor(w),
                                                     padding=1)).numpy()
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)


def test_operators_and_constants_follow_input_dtype() -> None:
    b = GraphBuilder()
    x = b.input("x", DType.FLOAT64, [2])
    y = -(((x + 1.0) * 2.0 - x) / 4.0)
    b.output(y, "y")
    model = b.to_model()
    assert [n.op_type for n in model.graph.node if n.op_type != "Constant"] == [
        "Add", "Mul", "Sub", "Div", "Neg"]
    consts = [n for n in model.graph.node if n.op_type == "Constant"]
    assert consts and all(c.attribute[0].t.data_type == onnx.TensorProto.DOUBLE for c in consts)
    assert not model.graph.initializer  # constants are not parameters
    out, = segflow.InferenceSession(model).run(None, {"x": np.array([1.0, 3.0])})
    np.testing.assert_allclose(out, -(((np.array([1.0, 3.0]) + 1) * 2 - [1.0, 3.0]) / 4))


def test_matmul_operator_multi_outputs_and_optional_inputs() -> None:
    b = GraphBuilder()
    x = b.input("x", DType.FLOAT32, [2, 3])
    w = b.param("w", np.ones((3, 4), np.float32))
    y, mask = b.op("Dropout", x @ w, None, outputs=2)
    b.output(y, "y")
    b.output(mask, "mask")
    graph = b.to_graph()
    dropout = next(n for n in graph.nodes if n.op_type == "Dropout")
    assert dropout.inputs[1] is None and len(dropout.outputs) == 2


def test_renamed_outputs_keep_earlier_handles_working() -> None:
    b = GraphBuilder()
    x = b.input("x", DType.FLOAT32, [3])
    h = b.op("Relu", x)
    b.output(h, "hidden")
    b.output(b.op("Neg", h), "out")  # `h` was renamed to "hidden"; still usable
    graph = b.to_graph()
    assert [v.name for v in graph.outputs] == ["hidden", "out"]
    assert graph.nodes[1].inputs[0] is graph.outputs[0]


def test_input_of_a_graph_as_output_uses_identity_and_names_are_unique() -> None:
    b = GraphBuilder()
    x = b.input("x", DType.FLOAT32, [3])
    b.output(x, "same")
    assert [n.op_type for n in b.to_graph().nodes] == ["Identity"]
    with pytest.raises(ValueError, match="already used"):
        b.input("x", DType.FLOAT32, [3])
    with pytest.raises(ValueError, match="already used"):
        b.param("same", np.zeros(1))
