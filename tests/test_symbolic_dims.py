"""frontend/symbolic_dims.py: anonymous dims from ONNX shape inference get their real names."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models
from segflow.frontend.onnx_import import import_model
from segflow.frontend.symbolic_dims import _broadcast_dim
from segflow.passes.plan_memory import plan_memory

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=None):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, F32, None) for n in outputs],
        initializer=[numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _shapes(graph):
    return {v.name: v.spec.shape for n in graph.nodes for v in n.outputs}


def _position_model():
    """x[batch, seq, 8] + table[Range(0, Shape(x)[1], 1)]: the BERT embedding pattern."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq_len"], axis=0),
        helper.make_node("Range", ["zero", "seq_len", "one"], ["positions"]),
        helper.make_node("Gather", ["table", "positions"], ["pos"], axis=0),
        helper.make_node("Add", ["x", "pos"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    inits = {"zero": np.array(0, np.int64), "one": np.array(1, np.int64),
             "table": np.arange(32 * 8, dtype=np.float32).reshape(32, 8)}
    return _model(nodes, {"x": (F32, ["batch", "seq", 8])}, ["y"], inits)


def test_range_of_a_shape_dim_and_the_broadcast_after_it_are_named():
    shapes = _shapes(import_model(_position_model()))
    assert shapes["positions"] == ("seq",)
    assert shapes["pos"] == ("seq", 8)
    assert shapes["h"] == ("batch", "seq", 8) and shapes["y"] == ("batch", "seq", 8)


def test_named_dims_make_the_memory_plan_complete_and_runs_stay_correct():
    model = _position_model()
    plan = plan_memory(import_model(model), dims={"batch": 2, "seq": 5})
    assert plan.unplanned == 0
    sess = segflow.InferenceSession(model)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in (3, 7):
        feeds = {"x": np.random.default_rng(seq).standard_normal((2, seq, 8)).astype(np.float32)}
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   rtol=1e-6, atol=1e-6)


def test_two_input_dims_are_never_merged():
    # a[n] + b[m] broadcasts only if n == m (or one is 1): segflow must not assume it.
    model = _model([helper.make_node("Add", ["a", "b"], ["y"])],
                   {"a": (F32, ["n"]), "b": (F32, ["m"])}, ["y"])
    graph = import_model(model)
    assert graph.inputs[0].spec.shape == ("n",) and graph.inputs[1].spec.shape == ("m",)
    assert _shapes(graph)["y"] != ("n",) and _shapes(graph)["y"] != ("m",)


def test_range_with_other_start_or_delta_is_left_alone():
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
             helper.make_node("Range", ["one", "n", "one"], ["r"]),
             helper.make_node("Cast", ["r"], ["y"], to=F32)]
    model = _model(nodes, {"x": (F32, ["len"])}, ["y"],
                   {"zero": np.array(0, np.int64), "one": np.array(1, np.int64)})
    assert _shapes(import_model(model))["r"] != ("len",)  # its length is len - 1


def test_broadcast_rules():
    assert _broadcast_dim(["seq", "seq"]) == "seq"
    assert _broadcast_dim(["seq", 1]) == "seq"
    assert _broadcast_dim(["seq", 8]) == 8          # seq must be 8 (or 1)
    assert _broadcast_dim([1, 1]) == 1
    assert _broadcast_dim(["n", "m"]) is None       # n == m, or either is 1: unknown
    assert _broadcast_dim([None, "seq"]) is None
    assert _broadcast_dim([4, 8]) is None


def test_bert_hidden_states_are_batch_by_seq():
    graph = import_model(models.build("bert_tiny"))
    anonymous = {d for v in graph.values() for d in (v.spec.shape or ())
                 if isinstance(d, str) and d.startswith("unk__")}
    assert not anonymous
    assert plan_memory(graph, dims={"batch": 1, "seq": 128}).unplanned == 0


def _windows_model():
    """Over x[N, 3, H, W]: a 3x3 Conv with pads 1, a dilated 3x3 Conv with pads 2, a 3x3
    MaxPool with SAME_UPPER (each keeps H and W); then a stride-2 Conv and an unpadded 3x3
    Conv (each gives new dims)."""
    inits = {"w": np.ones((4, 3, 3, 3), np.float32), "w2": np.ones((4, 4, 3, 3), np.float32)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["same"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["same", "w2"], ["dilated"], pads=[2, 2, 2, 2],
                         dilations=[2, 2]),
        helper.make_node("MaxPool", ["dilated"], ["pooled"], kernel_shape=[3, 3],
                         auto_pad="SAME_UPPER"),
        helper.make_node("Conv", ["pooled", "w2"], ["strided"], pads=[1, 1, 1, 1],
                         strides=[2, 2]),
        helper.make_node("Conv", ["pooled", "w2"], ["valid"]),
    ]
    return _model(nodes, {"x": (F32, ["N", 3, "H", "W"])}, ["strided", "valid"], inits)


def test_windows_of_stride_one_that_pad_their_extent_keep_the_spatial_dims():
    shapes = _shapes(import_model(_windows_model()))
    for name in ("same", "dilated", "pooled"):
        assert shapes[name] == ("N", 4, "H", "W")
    for name in ("strided", "valid"):
        assert shapes[name][:2] == ("N", 4)
        assert not {"H", "W"} & set(shapes[name][2:])
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 9, 7)).astype(np.float32)}
    model = _windows_model()
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)
    for want, got in zip(expected, segflow.InferenceSession(model).run(None, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
