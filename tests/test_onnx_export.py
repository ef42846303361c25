"""segflow graph -> ONNX (frontend/onnx_export.py): onnxruntime loads what it writes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from segflow.errors import InvalidModel
from segflow.frontend.model_info import describe_model
from segflow.frontend.onnx_export import export_model
from segflow.frontend.onnx_import import import_model
from segflow.passes.fuse import fuse


def _model() -> onnx.ModelProto:
    """An If whose branch holds a Constant node (a subgraph initializer after import),
    a float attribute, and an initializer two nodes read."""
    then = helper.make_graph(
        [helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(
            np.array(2.0, np.float32))), helper.make_node("Mul", ["x", "two"], ["t"])],
        "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("If", ["flag"], ["b"], then_branch=then, else_branch=other),
             helper.make_node("LeakyRelu", ["b"], ["l"], alpha=0.25),
             helper.make_node("Unsqueeze", ["l", "axes"], ["u"]),
             helper.make_node("Squeeze", ["u", "axes"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        initializer=[numpy_helper.from_array(np.array([0], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    helper.set_model_props(model, {"k": "v"})
    return model


def test_exported_graph_runs_in_onnxruntime() -> None:
    model = _model()
    exported = export_model(import_model(model), describe_model(model))
    onnx.checker.check_model(exported)
    assert exported.metadata_props[0].key == "k"
    ours = onnxruntime.InferenceSession(exported.SerializeToString(),
                                        providers=["CPUExecutionProvider"])
    theirs = onnxruntime.InferenceSession(model.SerializeToString(),
                                          providers=["CPUExecutionProvider"])
    x = np.array([1.0, -2.0, 3.0], np.float32)
    for flag in (True, False):
        feeds = {"x": x, "flag": np.array(flag)}
        np.testing.assert_array_equal(ours.run(None, feeds)[0], theirs.run(None, feeds)[0])


def test_fused_ops_are_refused_by_name() -> None:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    imported = import_model(model)
    assert fuse(imported, ["linear"]).changed
    with pytest.raises(InvalidModel, match=r"segflow\.FusedGemm, which has no ONNX form"):
        export_model(imported, describe_model(model))


def test_sequence_and_optional_types_are_exported() -> None:
    """A sequence input and output, and an If returning an optional: the exported model
    declares their types, so onnxruntime runs it as it runs the original."""
    held = helper.make_tensor_type_proto(TensorProto.FLOAT, [2])
    then = helper.make_graph([helper.make_node("Optional", ["t"], ["o_then"])], "then", [],
                             [helper.make_value_info("o_then",
                                                     helper.make_optional_type_proto(held))])
    other = helper.make_graph([helper.make_node("Optional", [], ["o_else"], type=held)],
                              "else", [],
                              [helper.make_value_info("o_else",
                                                      helper.make_optional_type_proto(held))])
    nodes = [helper.make_node("SequenceInsert", ["s", "t"], ["out"]),
             helper.make_node("If", ["flag"], ["opt"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("t", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_sequence_value_info("out", TensorProto.FLOAT, [2]),
         helper.make_value_info("opt", helper.make_optional_type_proto(held))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    exported = export_model(import_model(model), describe_model(model))
    onnx.checker.check_model(exported)
    kinds = [v.type.WhichOneof("value") for v in [*exported.graph.input, *exported.graph.output]]
    assert kinds == ["sequence_type", "tensor_type", "tensor_type", "sequence_type",
                     "optional_type"]
    feeds = {"s": [np.ones(2, np.float32)], "t": np.zeros(2, np.float32),
             "flag": np.array(False)}
    ours = onnxruntime.InferenceSession(exported.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, feeds)
    theirs = onnxruntime.InferenceSession(model.SerializeToString(),
                                          providers=["CPUExecutionProvider"]).run(None, feeds)
    assert len(ours[0]) == len(theirs[0]) == 2 and ours[1] is None and theirs[1] is None
