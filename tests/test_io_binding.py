"""OrtValue and IOBinding over torch tensors (runtime/io_binding.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import segflow
from segflow.errors import InvalidInput


def _model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


X = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], np.float32)


def test_ortvalue_shares_cpu_arrays_and_takes_torch_tensors() -> None:
    value = segflow.OrtValue.ortvalue_from_numpy(X)
    assert value.numpy().ctypes.data == X.ctypes.data
    assert (value.shape(), value.data_type(), value.element_type()) == ([2, 3],
                                                                         "tensor(float)", 1)
    tensor = segflow.OrtValue.ortvalue_from_numpy(torch.ones(2, dtype=torch.int64))
    assert tensor.data_type() == "tensor(int64)" and tensor.device_name() == "cpu"
    empty = segflow.OrtValue.ortvalue_from_shape_and_type([4], np.int32)
    assert empty.tensor_size_in_bytes() == 16
    with pytest.raises(InvalidInput, match="device_type='tpu'"):
        segflow.OrtValue.ortvalue_from_numpy(X, "tpu")
    with pytest.raises(InvalidInput, match="element_type"):
        segflow.OrtValue.ortvalue_from_shape_and_type([1], "nonsense")


def test_binding_outputs_in_bind_order_and_torch_inputs() -> None:
    sess = segflow.InferenceSession(_model())
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", torch.from_numpy(X))
    binding.bind_output("z")
    binding.bind_output("y")
    sess.run_with_iobinding(binding)
    z, y = binding.copy_outputs_to_cpu()
    np.testing.assert_array_equal(z, -X)
    np.testing.assert_array_equal(y, np.maximum(X, 0))
    outputs = sess.run_with_ort_values(["y"], {"x": segflow.OrtValue.ortvalue_from_numpy(X)})
    np.testing.assert_array_equal(outputs[0].numpy(), y)


def test_binding_errors_name_the_problem() -> None:
    sess = segflow.InferenceSession(_model())
    binding = sess.io_binding()
    with pytest.raises(InvalidInput, match="unknown output name 'w'"):
        binding.bind_output("w")
    binding.bind_cpu_input("x", X)
    with pytest.raises(InvalidInput, match="no outputs are bound"):
        sess.run_with_iobinding(binding)
    binding.bind_ortvalue_output("y", segflow.OrtValue.ortvalue_from_shape_and_type([3, 3]))
    with pytest.raises(InvalidInput, match=r"output 'y' is float \[2, 3\], but its bound "
                                            r"buffer is float \[3, 3\]"):
        sess.run_with_iobinding(binding)
    with pytest.raises(InvalidInput, match="needs its element_type and shape"):
        binding.bind_output("y", buffer_ptr=X.ctypes.data)
    with pytest.raises(InvalidInput, match="null"):
        binding.bind_input("x", "cpu", 0, np.float32, [2, 3], 0)
