"""frontend/onnx_import.py: initializers are read in place from the bytes protobuf hands
back (one copy of the weights, not three), only where their size is what their dims and
type say; what they hold equals onnx's own reading."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from segflow.errors import InvalidModel
from segflow.frontend.onnx_import import import_model
from segflow.ir.types import DType, OptionalSpec, SequenceSpec, TensorSpec


def _address(raw: bytes) -> int:
    return int(np.frombuffer(raw, np.uint8).ctypes.data)


def test_a_large_buffer_is_read_in_place_and_a_small_one_copied() -> None:
    from segflow.frontend.onnx_import import SHARED_MIN_BYTES, _over_bytes
    large = np.arange(64, dtype=np.float32).tobytes()
    tensor = _over_bytes(large, np.dtype(np.float32), torch.float32, (8, 8))
    assert tensor.data_ptr() == _address(large)
    np.testing.assert_array_equal(tensor.numpy(), np.arange(64, dtype=np.float32).reshape(8, 8))
    small = bytes(SHARED_MIN_BYTES)
    copied = _over_bytes(small, np.dtype(np.float32), torch.float32, (SHARED_MIN_BYTES // 4,))
    assert copied.data_ptr() != _address(small)


def _model(weight: TensorProto) -> onnx.ModelProto:
    """y = Identity(w), w the initializer given."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])], "g", [],
        [helper.make_tensor_value_info("y", weight.data_type, list(weight.dims))], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_])
def test_initializers_equal_onnx_reading_them(dtype: type) -> None:
    data = (np.random.default_rng(0).standard_normal((512, 256)) * 4).astype(dtype)
    weight = numpy_helper.from_array(data, "w")
    const = import_model(_model(weight)).initializers["w"].const
    assert const is not None
    np.testing.assert_array_equal(const.numpy(), numpy_helper.to_array(weight))
    assert const.dtype == torch.from_numpy(data).dtype and tuple(const.shape) == data.shape


def test_the_weights_are_held_once_while_importing() -> None:
    """Python's allocations while a model with 4 MiB of weights imports: the bytes read
    off the message (which the tensor keeps), not a second array copied from them."""
    data = np.random.default_rng(0).standard_normal((4096, 256)).astype(np.float32)
    model = _model(numpy_helper.from_array(data, "w"))
    tracemalloc.start()
    try:
        graph = import_model(model)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data.nbytes <= peak < 1.5 * data.nbytes, (peak, data.nbytes)
    assert graph.initializers["w"].const is not None


def test_raw_data_of_the_wrong_size_is_refused() -> None:
    weight = numpy_helper.from_array(np.zeros((512, 256), np.float32), "w")
    weight.raw_data = weight.raw_data[:-4]
    with pytest.raises(InvalidModel, match="'w'"):
        import_model(_model(weight))


def test_sequence_and_optional_types_are_imported() -> None:
    """ONNX's sequence and optional types become the values' ``container`` specs: graph
    inputs, node outputs (from shape inference) and the inputs and outputs of a Loop
    body; tensors keep ``container`` None."""
    float2 = helper.make_tensor_type_proto(TensorProto.FLOAT, [2])
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]),
         helper.make_node("SequenceInsert", ["acc", "x"], ["acc_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_sequence_value_info("acc", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_sequence_value_info("acc_out", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Loop", ["n", "", "s"], ["acc_final"], body=body),
             helper.make_node("Optional", ["x"], ["o"]),
             helper.make_node("OptionalHasElement", ["o"], ["has"])]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("n", TensorProto.INT64, [])],
        [helper.make_tensor_sequence_value_info("acc_final", TensorProto.FLOAT, [2]),
         helper.make_value_info("o", helper.make_optional_type_proto(float2)),
         helper.make_tensor_value_info("has", TensorProto.BOOL, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    imported = import_model(model)
    float_spec = TensorSpec(DType.FLOAT32, (2,))
    s, x, _ = imported.inputs
    assert s.container == SequenceSpec(float_spec) and not s.is_tensor
    assert x.container is None and x.is_tensor
    loop, wrap, has = imported.nodes
    assert loop.outputs[0].container == SequenceSpec(float_spec)
    assert wrap.outputs[0].container == OptionalSpec(float_spec)
    assert has.outputs[0].is_tensor and has.touches_containers   # it reads an optional
    acc = loop.subgraphs["body"].inputs[2]
    assert acc.container == SequenceSpec(float_spec)
    assert loop.subgraphs["body"].outputs[1].container == SequenceSpec(float_spec)
    assert acc.describe() == "seq(float[2])" and wrap.outputs[0].describe() == "optional(float[2])"
