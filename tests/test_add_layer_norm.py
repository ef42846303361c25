"""Tests for AddLayerNorm (kernels/layer_norm.py, kernels/native/layer_norm.c) and the fuse
pass's ``layernorm`` rule (passes/fuse/layernorm.py): a residual Add and the
LayerNormalization after it as one kernel.

The native path is checked against ``F.layer_norm(a + b)`` (float32, atol/rtol 1e-5 on
unit-scale rows), the rule against onnxruntime on models where it fires and where it
must not.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow.kernels.layer_norm import AddLayerNorm
from segflow.kernels.native.build import NativeLibrary

LIB, WHY = NativeLibrary.probe()
needs_native = pytest.mark.skipif(LIB is None, reason=f"native kernels {WHY}")
ATOL = RTOL = 1e-5
RNG = np.random.default_rng(3)


def _reference(a, b, scale, bias, eps):
    return F.layer_norm(a + b, a.shape[-1:], scale, bias, eps)


@needs_native
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (3, 8), (2, 64, 768), (130, 1000)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_native_matches_torch_at_every_width(shape, with_bias):
    a, b = torch.randn(*shape) * 3 + 1, torch.randn(*shape)
    scale, bias = torch.randn(shape[-1]), torch.randn(shape[-1]) if with_bias else None
    op = AddLayerNorm(1e-5, LIB, WHY)
    torch.testing.assert_close(op(a, b, scale, bias), _reference(a, b, scale, bias, 1e-5),
                               atol=ATOL, rtol=RTOL)
    assert op.native_calls == 1 and op.torch_calls == 0


@needs_native
def test_the_split_between_threads_does_not_change_a_bit_and_inputs_are_kept():
    a, b = torch.randn(128, 768), torch.randn(128, 768)
    scale, bias = torch.randn(768), torch.randn(768)
    kept = a.clone(), b.clone()
    op = AddLayerNorm(1e-12, LIB, WHY)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(a, b, scale, bias)
        torch.set_num_threads(max(2, threads))
        many = op(a, b, scale, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)     # each row is one thread's, summed in one order
    assert torch.equal(a, kept[0]) and torch.equal(b, kept[1])
    # A non-contiguous addend is read through a contiguous copy.
    wide = torch.randn(128, 1536)[:, ::2]
    torch.testing.assert_close(op(wide, b, scale, bias), _reference(wide, b, scale, bias, 1e-12),
                               atol=ATOL, rtol=RTOL)


def test_what_the_native_path_does_not_take_runs_through_torch():
    scale, bias = torch.randn(16), torch.randn(16)
    op = AddLayerNorm(1e-5, LIB, WHY)
    a = torch.randn(4, 16)
    cases = [(a, torch.randn(16)),                        # broadcasting
             (a.double(), torch.randn(4, 16).double())]   # float64
    for x, y in cases:
        torch.testing.assert_close(
            op(x, y, scale.to(x.dtype), bias.to(x.dtype)),
            _reference(x, y, scale.to(x.dtype), bias.to(x.dtype), 1e-5), atol=ATOL, rtol=RTOL)
    assert op.native_calls == 0 and op.torch_calls == 2
    if LIB is not None:
        assert set(op.why_torch) == {"the addends' shapes differ ([4, 16] and [16])",
                                     "not all float32 on the CPU"}
    nowhere = AddLayerNorm(1e-5, None, "are off (SEGFLOW_NATIVE=0)")
    torch.testing.assert_close(nowhere(a, a, scale, bias), _reference(a, a, scale, bias, 1e-5))
    assert nowhere.why_torch == {"native kernels are off (SEGFLOW_NATIVE=0)": 1}


def _model(add_inputs=("x", "r"), axis=-1, extra_use=False, mean_out=False, shapes=None):
    shapes = shapes or {"x": ["batch", 8, 32], "r": ["batch", 8, 32]}
    nodes = [helper.make_node("Add", list(add_inputs), ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"],
                              ["out", "mean"] if mean_out else ["out"], axis=axis,
                              epsilon=1e-6)]
    outputs = ["out"]
    if extra_use:
        nodes.append(helper.make_node("Relu", ["s"], ["side"]))
        outputs.append("side")
    if mean_out:
        outputs.append("mean")
    width = 32 if axis == -1 else 8 * 32
    inits = {"g": RNG.standard_normal(width).astype(np.float32),
             "b": RNG.standard_normal(width).astype(np.float32)}
    if axis != -1:
        inits = {k: v.reshape(8, 32) for k, v in inits.items()}
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model, feeds, **session):
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = segflow.InferenceSession(model, **session)
    for r, g in zip(ref, sess.run(None, feeds)):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)
    return sess, [n.op_type for n in sess.graph.nodes]


@pytest.mark.parametrize("compile_mode", ["codegen", "none"])
def test_the_rule_fuses_a_residual_add_and_its_layer_norm(compile_mode):
    feeds = {k: RNG.standard_normal((2, 8, 32)).astype(np.float32) for k in ("x", "r")}
    sess, ops = _run(_model(), feeds, compile=compile_mode)
    assert ops == ["AddLayerNorm"]
    assert any("layernorm 1" in line for line in sess.plan.pass_log)
    report = "\n".join(sess.kernel_report())
    assert "add + layer norm: 1 node; " in report
    if LIB is not None:
        assert "1 calls native, 0 through torch" in report
    _, ops = _run(_model(), feeds, optimize={"fuse.layernorm": False})
    assert ops == ["Add", "LayerNormalization"]


@pytest.mark.parametrize("case", ["not the last axis", "broadcast", "mean output read"])
def test_the_rule_leaves_what_it_must_not_fuse(case):
    x = RNG.standard_normal((2, 8, 32)).astype(np.float32)
    r = RNG.standard_normal((2, 8, 32)).astype(np.float32)
    if case == "not the last axis":
        model, feeds = _model(axis=1), {"x": x, "r": r}
    elif case == "broadcast":
        model = _model(shapes={"x": ["batch", 8, 32], "r": [32]})
        feeds = {"x": x, "r": r[0, 0]}
    else:
        model, feeds = _model(mean_out=True), {"x": x, "r": r}
    _, ops = _run(model, feeds)
    assert "AddLayerNorm" not in ops and "LayerNormalization" in ops


def test_bert_fuses_every_residual_layer_norm():
    from segflow import models

    model = models.build("bert_tiny")
    feeds = models.example_inputs("bert_tiny", batch_size=2, seq_len=16)
    _, ops = _run(model, feeds)
    # Two per layer; the embeddings' LayerNorm reads a sum of three and stays.
    assert ops.count("AddLayerNorm") == 4 and ops.count("LayerNormalization") == 1
