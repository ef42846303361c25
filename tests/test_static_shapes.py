"""passes/static_shapes.py: a Reshape whose shape input folds to a constant gets its
static output shape during constant folding, so a Shape after it folds too."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from segflow.frontend.onnx_import import import_model
from segflow.passes.fold_constants import fold_constants


def _graph():  # type: ignore[no-untyped-def]
    c = helper.make_tensor
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["shape"], axis=0),        # computed: [4, 6]
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        helper.make_node("Reshape", ["x", "rs"], ["y"]),
    ]
    inits = [c("a", TensorProto.INT64, [1], [4]), c("b", TensorProto.INT64, [1], [6])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return import_model(model.SerializeToString())


def test_computed_reshape_gets_a_static_shape_and_its_shape_folds() -> None:
    graph = _graph()
    assert fold_constants(graph).changed
    assert [n.op_type for n in graph.nodes] == ["Reshape", "Reshape"]
    assert graph.nodes[0].outputs[0].spec.shape == (4, 6)
    assert graph.nodes[1].inputs[1].const is not None
    assert graph.nodes[1].inputs[1].const.tolist() == [4, 6]
    graph.validate()


def test_a_value_reading_kernel_leaves_the_spec() -> None:
    import segflow
    model = helper.make_model(helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)]),
        opset_imports=[helper.make_opsetid("", 17)])
    sess = segflow.InferenceSession(model.SerializeToString())
    out = sess.run(None, {"x": np.array([0, 1, 2], np.float32)})[0]
    assert out.tolist() == [[1, 2]]
    assert not sess.graph.nodes[0].outputs[0].spec.is_static
