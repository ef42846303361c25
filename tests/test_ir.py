"""IR invariants: producers/uses, validate(), toposort(), mutation through Graph methods."""

from __future__ import annotations

import pytest

from segflow.frontend.onnx_import import import_model
from segflow.ir import DType, Graph, IRError, Node, TensorSpec, Value
from segflow.ir.types import Device, OptionalSpec, SequenceSpec
from segflow.models import build


def small_graph() -> tuple[Graph, list[Node]]:
    g = Graph("g")
    x = g.add_input(Value("x", TensorSpec(DType.FLOAT32, ("N", 4))))
    a, b, c = Value("a"), Value("b"), Value("c")
    n1 = g.append(Node("Relu", [x], [a], name="n1"))
    n2 = g.append(Node("Neg", [a], [b], name="n2"))
    n3 = g.append(Node("Add", [a, b], [c], name="n3"))
    g.outputs.append(c)
    return g, [n1, n2, n3]


def test_producers_and_uses_are_tracked():
    g, (n1, n2, n3) = small_graph()
    g.validate()
    a = n1.outputs[0]
    assert a.producer is n1 and a.uses == [n2, n3]


def test_validate_rejects_use_before_definition():
    g, (n1, n2, n3) = small_graph()
    g.nodes = [n2, n1, n3]
    with pytest.raises(IRError, match="before it is defined"):
        g.validate()
    g.toposort()
    g.validate()
    assert g.nodes == [n1, n2, n3]


def test_toposort_detects_cycles():
    g = Graph("cycle")
    a, b = Value("a"), Value("b")
    g.append(Node("Relu", [b], [a]))
    g.append(Node("Relu", [a], [b]))
    with pytest.raises(IRError, match="cycle"):
        g.toposort()


def test_replace_all_uses_and_remove():
    g, (n1, n2, n3) = small_graph()
    g.replace_all_uses(n2.outputs[0], n1.outputs[0])
    assert n3.inputs == (n1.outputs[0], n1.outputs[0])
    g.remove(n2)
    g.validate()
    assert n2 not in n1.outputs[0].uses


def test_remove_refuses_a_used_node():
    g, (n1, _, _) = small_graph()
    with pytest.raises(IRError, match="still used"):
        g.remove(n1)


def test_double_definition_is_an_error():
    g = Graph("g")
    x = g.add_input(Value("x"))
    y = Value("y")
    g.append(Node("Relu", [x], [y]))
    with pytest.raises(IRError, match="already produced"):
        g.append(Node("Neg", [x], [y]))


def test_imported_model_validates_and_specs_are_parsed():
    graph = import_model(build("bert_tiny"))
    graph.validate()
    ids = graph.inputs[0]
    assert ids.spec == TensorSpec(DType.INT64, ("batch", "seq"))
    assert ids.spec.describe() == "int64[batch,seq]"
    assert all(v.const is not None for v in graph.initializers.values())


def test_node_label_names_inputs_outputs_and_node():
    g, (n1, _, n3) = small_graph()
    assert n3.label == "%c = Add(%a, %b) [n3]"


def test_device_parse():
    assert str(Device.parse("cpu")) == "cpu:0"
    assert str(Device.parse("cuda:1")) == "cuda:1"
    with pytest.raises(ValueError, match="unknown device"):
        Device.parse("tpu:0")


def test_shape_inference_runs_without_the_weight_data():
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from segflow.frontend.onnx_import import INFERENCE_DATA_LIMIT, _with_inferred_shapes

    model = build("resnet18", num_classes=10, image_size=32)
    big = {t.name: t for t in model.graph.initializer if len(t.raw_data) > INFERENCE_DATA_LIMIT}
    assert big
    light = _with_inferred_shapes(model)
    stripped = {t.name: t for t in light.graph.initializer if t.name in big}
    assert stripped.keys() == big.keys() and not any(t.raw_data for t in stripped.values())
    assert [list(t.dims) for t in stripped.values()] == [list(t.dims) for t in big.values()]
    full = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    assert ({v.name: v.SerializeToString() for v in light.graph.value_info}
            == {v.name: v.SerializeToString() for v in full.graph.value_info})
    graph = import_model(model)  # the data comes from the original model
    for name, tensor in big.items():
        np.testing.assert_array_equal(graph.initializers[name].const.numpy(),
                                      numpy_helper.to_array(tensor))
    # The caller's model is untouched.
    assert all(len(t.raw_data) > INFERENCE_DATA_LIMIT for t in big.values())


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "int16", "int32",
                                   "int64", "uint8", "uint16", "uint32", "uint64", "bool",
                                   "complex64"])
def test_initializers_read_from_raw_data_equal_onnx_own_reading(dtype):
    """_tensor reads raw_data in one copy; what it returns must be numpy_helper's array."""
    import numpy as np
    from onnx import helper, numpy_helper

    from segflow.frontend.onnx_import import _data_bytes, _tensor

    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 5, 2)) * 50).astype(dtype)
    raw = numpy_helper.from_array(array, "w")
    assert raw.HasField("raw_data") and _data_bytes(raw) == array.nbytes
    got = _tensor(raw)
    np.testing.assert_array_equal(got.numpy(), numpy_helper.to_array(raw))
    assert got.numpy().flags.writeable and got.shape == (3, 5, 2)
    if dtype in ("float32", "int32", "int64"):      # typed fields: the general path
        typed = helper.make_tensor("w", raw.data_type, [3, 5, 2], array.reshape(-1).tolist())
        assert not typed.HasField("raw_data")
        np.testing.assert_array_equal(_tensor(typed).numpy(), array)


def test_raw_data_of_the_wrong_length_is_an_invalid_model():
    import numpy as np
    from onnx import numpy_helper

    from segflow.errors import InvalidModel
    from segflow.frontend.onnx_import import _tensor

    tensor = numpy_helper.from_array(np.zeros((4, 4), np.float32), "w")
    tensor.raw_data = tensor.raw_data[:-4]
    with pytest.raises(InvalidModel, match="cannot read tensor 'w'"):
        _tensor(tensor)


def test_an_input_that_is_also_an_output_keeps_the_shapes_after_it():
    """onnx's inference, given an output declared without a shape under the input's
    name, lost the input's shape and every shape computed from it."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Flatten", ["y"], ["z"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    imported = import_model(model)
    relu = next(n for n in imported.nodes if n.op_type == "Relu")
    assert relu.outputs[0].spec.shape == ("N", 3, 4)
    assert [v.name for v in imported.outputs] == ["x", "z"]


def test_container_values_and_the_nodes_that_touch_them():
    g = Graph("g")
    x = g.add_input(Value("x", TensorSpec(DType.FLOAT32, (2,))))
    s = Value("s", container=SequenceSpec(TensorSpec(DType.FLOAT32, (2,))))
    y = Value("y", TensorSpec(DType.FLOAT32))
    relu = g.append(Node("Relu", [x], [Value("r")]))
    construct = g.append(Node("SequenceConstruct", [relu.outputs[0]], [s]))
    concat = g.append(Node("ConcatFromSequence", [s], [y], {"axis": 0}))
    g.outputs.append(y)
    g.validate()
    assert x.is_tensor and not s.is_tensor
    assert not relu.touches_containers
    assert construct.touches_containers and concat.touches_containers
    assert s.describe() == "seq(float[2])"
    assert Value("o", container=OptionalSpec(SequenceSpec())).describe() == \
        "optional(seq(?[?]))"
