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


def _contrib_graph(op: str):  # type: ignore[no-untyped-def]
    """x -> (a com.microsoft op ONNX has no schema for) -> MatMul: ONNX's inference leaves
    both outputs unknown."""
    c = helper.make_tensor
    if op == "SkipLayerNormalization":
        first = helper.make_node(op, ["x", "x", "g"], ["s"], domain="com.microsoft")
    else:
        first = helper.make_node(op, ["x", "q"], ["s"], domain="com.microsoft")
    nodes = [first, helper.make_node("MatMul", ["s", "w"], ["y"])]
    inits = [c("g", TensorProto.FLOAT, [8], [1.0] * 8), c("q", TensorProto.FLOAT, [8], [0.5] * 8),
             c("w", TensorProto.FLOAT, [8, 4], [0.1] * 32)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return import_model(model.SerializeToString())


def test_a_contrib_op_gets_static_shapes_and_so_do_its_consumers() -> None:
    graph = _contrib_graph("SkipLayerNormalization")
    assert [v.spec.shape for n in graph.nodes for v in n.outputs] == [None, None]
    assert fold_constants(graph).changed
    assert [v.spec.shape for n in graph.nodes for v in n.outputs] == [(2, 3, 8), (2, 3, 4)]
    graph.validate()


def test_a_contrib_op_in_another_domain_is_not_run() -> None:
    graph = _contrib_graph("BiasGelu")
    graph.nodes[0].domain = "com.example"   # a domain whose kernels are not known to suit
    assert not fold_constants(graph).changed
    assert graph.nodes[0].outputs[0].spec.shape is None


def _reshaped_then(node, inits, shape_parts, width: int):  # type: ignore[no-untyped-def]
    """x[2, width] -> Reshape to the Concat of ``shape_parts`` -> ``node`` (reading ``r``,
    writing ``y``); the nodes' output shapes unknown, as where ONNX's inference stops."""
    from segflow.ir.types import DType, TensorSpec
    c = helper.make_tensor
    parts = [c(f"p{i}", TensorProto.INT64, [len(p)], p) for i, p in enumerate(shape_parts)]
    nodes = [helper.make_node("Concat", [p.name for p in parts], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["r"]), *([node] if node else [])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, width])],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
        [*parts, *inits])
    imported = import_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    for value in [v for n in imported.nodes for v in n.outputs]:
        value.spec = TensorSpec(DType.FLOAT32 if value.name != "shape" else DType.INT64, None)
    return imported


def _counted_meta_runs(monkeypatch):  # type: ignore[no-untyped-def]
    from segflow.passes import static_shapes
    runs: dict[str, list[tuple[str, ...]]] = {}
    run_meta = static_shapes._run_meta

    def counted(node, registry, ctx, inputs):  # type: ignore[no-untyped-def]
        runs.setdefault(node.op_type, []).append(
            tuple("-" if t is None else t.device.type for t in inputs))
        return run_meta(node, registry, ctx, inputs)
    monkeypatch.setattr(static_shapes, "_run_meta", counted)
    return runs


def test_a_weight_goes_on_meta_at_once_and_shape_values_stay(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from onnx import numpy_helper
    runs = _counted_meta_runs(monkeypatch)
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(48).astype(np.float32), n)
               for n in ("scale", "bias")]
    graph = _reshaped_then(helper.make_node("LayerNormalization", ["r", "scale", "bias"],
                                            ["y"], axis=-1), weights, [[2], [48]], 48)
    fold_constants(graph)
    assert graph.nodes[-1].outputs[0].spec.shape == (2, 48)
    # the shape stays a host tensor (its values are read), the 48-float weights do not:
    # one run each, none failing
    assert runs == {"Reshape": [("meta", "cpu")], "LayerNormalization": [("meta",) * 3]}


def test_a_large_constant_whose_values_make_the_shape_is_read(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    runs = _counted_meta_runs(monkeypatch)
    ones = [[1]] * 15
    graph = _reshaped_then(None, [], [*ones, [2], [12]], 12)    # a 17-element shape
    fold_constants(graph)
    assert graph.nodes[-1].outputs[0].spec.shape == (1,) * 15 + (2, 12)
    # on meta its values are unknown: the third run takes it as it is
    assert runs == {"Reshape": [("meta", "meta"), ("meta", "meta"), ("meta", "cpu")]}
