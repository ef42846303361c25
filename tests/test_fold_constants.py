"""Tests for passes/fold_constants.py: folded and unfolded cases, numerics vs onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models
from segflow.frontend.onnx_import import import_model
from segflow.passes.fold_constants import fold_constants

ATOL, RTOL = 1e-4, 1e-3


def _model(nodes, inputs, outputs, inits=None, opset=17, out_type=TensorProto.FLOAT):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, out_type, None) for n in outputs],
        initializer=[numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _check(model, feeds):
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, atol=ATOL, rtol=RTOL)


F32 = TensorProto.FLOAT


def test_constant_subgraph_folds_to_one_initializer():
    inits = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32(2.0),
             "shape": np.array([3, 2], np.int64)}
    nodes = [helper.make_node("Mul", ["a", "b"], ["ab"]),
             helper.make_node("Reshape", ["ab", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
             helper.make_node("Add", ["x", "t"], ["out"])]
    model = _model(nodes, {"x": (F32, [2, 3])}, ["out"], inits)
    graph = import_model(model)
    result = fold_constants(graph)
    graph.validate()
    assert result.modified
    assert [n.op_type for n in graph.nodes] == ["Add"]
    folded = graph.nodes[0].inputs[1]
    assert folded is not None and folded.is_const
    torch.testing.assert_close(folded.const, torch.tensor([[0.0, 4, 8], [2, 6, 10]]))
    # The inputs of the folded nodes are gone: nothing else read them.
    assert set(graph.initializers) == {folded.name}
    _check(model, {"x": np.ones((2, 3), np.float32)})


def test_graph_without_constants_is_unchanged():
    model = _model([helper.make_node("Relu", ["x"], ["out"])], {"x": (F32, [2])}, ["out"])
    graph = import_model(model)
    result = fold_constants(graph)
    assert not result.modified and [n.op_type for n in graph.nodes] == ["Relu"]


def test_shape_of_a_static_value_folds_and_of_a_symbolic_one_does_not():
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Cast", ["s"], ["sf"], to=F32),
             helper.make_node("Shape", ["y"], ["ys"]),
             helper.make_node("Cast", ["ys"], ["ysf"], to=F32),
             helper.make_node("Shape", ["y"], ["tail"], start=1),
             helper.make_node("Size", ["x"], ["n"]),
             helper.make_node("Cast", ["n"], ["nf"], to=F32)]
    model = _model(nodes, {"x": (F32, [2, 3]), "y": (F32, ["batch", 4])},
                   ["sf", "ysf", "tail", "nf"])
    graph = import_model(model)
    assert fold_constants(graph).modified
    ops = [n.op_type for n in graph.nodes]
    assert ops == ["Shape", "Cast"]  # only Shape(y) (symbolic batch) and its Cast remain
    consts = {v.name: v.const.tolist() for v in graph.outputs if v.is_const}
    assert consts == {"sf": [2.0, 3.0], "tail": [4], "nf": 6.0}
    feeds = {"x": np.zeros((2, 3), np.float32), "y": np.zeros((5, 4), np.float32)}
    sess = segflow.InferenceSession(model)
    sf, ysf, tail, nf = sess.run(None, feeds)
    assert sf.tolist() == [2, 3] and ysf.tolist() == [5, 4] and tail.tolist() == [4]
    assert nf == 6


def test_graph_output_keeps_its_name_when_folded():
    inits = {"a": np.float32(3.0)}
    model = _model([helper.make_node("Neg", ["a"], ["out"]),
                    helper.make_node("Relu", ["x"], ["y"])], {"x": (F32, [1])}, ["out", "y"],
                   inits)
    sess = segflow.InferenceSession(model)
    assert [o.name for o in sess.get_outputs()] == ["out", "y"]
    out, _ = sess.run(None, {"x": np.ones(1, np.float32)})
    assert out == -3.0
    out[...] = 7  # the caller's copy: the folded constant stays intact
    assert sess.run(None, {"x": np.ones(1, np.float32)})[0] == -3.0


def test_random_ops_are_not_folded():
    model = _model([helper.make_node("RandomUniformLike", ["a"], ["r"]),
                    helper.make_node("Add", ["x", "r"], ["out"])],
                   {"x": (F32, [4])}, ["out"], {"a": np.zeros(4, np.float32)})
    graph = import_model(model)
    fold_constants(graph)
    assert "RandomUniformLike" in [n.op_type for n in graph.nodes]


def test_large_results_are_not_folded():
    inits = {"one": np.ones(1, np.float32), "shape": np.array([1024, 1024], np.int64)}
    model = _model([helper.make_node("Expand", ["one", "shape"], ["big"]),
                    helper.make_node("Add", ["x", "big"], ["out"])],
                   {"x": (F32, [1024, 1024])}, ["out"], inits)
    graph = import_model(model)
    result = fold_constants(graph, max_bytes=1 << 20)
    assert not result.modified and [n.op_type for n in graph.nodes] == ["Expand", "Add"]
    assert fold_constants(graph).modified  # 4 MiB is under the default limit


def test_folding_agrees_with_the_kernels_on_integer_semantics():
    inits = {"a": np.array([-7, 7], np.int64), "b": np.array([2, -2], np.int64)}
    model = _model([helper.make_node("Div", ["a", "b"], ["q"]),
                    helper.make_node("Mod", ["a", "b"], ["m"]),
                    helper.make_node("Add", ["q", "x"], ["out"]),
                    helper.make_node("Add", ["m", "x"], ["out2"])],
                   {"x": (TensorProto.INT64, [2])}, ["out", "out2"], inits,
                   out_type=TensorProto.INT64)
    _check(model, {"x": np.zeros(2, np.int64)})


def test_folding_switch_and_log():
    model = models.build("bert_tiny")
    on = segflow.InferenceSession(model)
    off = segflow.InferenceSession(model, optimize={"fold_constants": False})
    assert any(line.startswith("fold_constants: ") and "off" not in line
               for line in on.plan.pass_log)
    assert "fold_constants: off" in off.plan.pass_log
    feeds = models.example_inputs("bert_tiny", batch_size=2, seq_len=12)
    for a, b in zip(on.run(None, feeds), off.run(None, feeds)):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("opset", [11, 13, 17])
def test_folded_unsqueeze_and_slice_across_opsets(opset):
    inits = {"c": np.arange(12, dtype=np.float32).reshape(3, 4)}
    if opset < 13:
        nodes = [helper.make_node("Unsqueeze", ["c"], ["u"], axes=[0])]
    else:
        inits["ax"] = np.array([0], np.int64)
        nodes = [helper.make_node("Unsqueeze", ["c", "ax"], ["u"])]
    inits.update({"st": np.array([1], np.int64), "en": np.array([3], np.int64),
                  "axs": np.array([2], np.int64)})
    nodes += [helper.make_node("Slice", ["u", "st", "en", "axs"], ["s"]),
              helper.make_node("Mul", ["x", "s"], ["out"])]
    model = _model(nodes, {"x": (F32, [1, 3, 2])}, ["out"], inits, opset=opset)
    graph = import_model(model)
    assert fold_constants(graph).modified and [n.op_type for n in graph.nodes] == ["Mul"]
    _check(model, {"x": np.full((1, 3, 2), 2.0, np.float32)})


def test_sequences_of_constants_are_left_alone():
    """Every input constant, yet nothing folds: a sequence is no tensor a constant can hold,
    so the nodes that make or read one run (unchanged case of the pass)."""
    nodes = [helper.make_node("SequenceConstruct", ["w", "w"], ["s"]),
             helper.make_node("SequenceLength", ["s"], ["n"])]
    graph = import_model(_model(nodes, {}, ["n"], {"w": np.array([1.0, 2.0], np.float32)},
                                opset=17, out_type=TensorProto.INT64))
    result = fold_constants(graph)
    assert not result.changed
    assert [n.op_type for n in graph.nodes] == ["SequenceConstruct", "SequenceLength"]
