"""Tests for AddLayerNorm (kernels/layer_norm.py, kernels/native/layer_norm.c) and the fuse
pass's ``layernorm`` rule (passes/fuse/layernorm.py): a residual Add and the
LayerNormalization after it as one kernel.

The native path is checked against ``F.layer_norm(a + b)`` (float32, atol/rtol 1e-5 on
unit-scale rows), the rule against onnxruntime on models where it fires and where it
must not.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow.kernels.choice import REFERENCE, KernelChoices, KernelKind
from segflow.kernels.layer_norm import AddLayerNorm
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.report import OpKernel
from segflow.ops.fused import inline_fused, traceable_fused
from segflow.runtime.executor import Executor

LIB, WHY = NativeLibrary.probe()
needs_native = pytest.mark.skipif(LIB is None, reason=f"native kernels {WHY}")
ATOL = RTOL = 1e-5
RNG = np.random.default_rng(3)


def _reference(a, b, scale, bias, eps):
    return F.layer_norm(a + b, a.shape[-1:], scale, bias, eps)


def _rms_reference(s, scale, eps):
    """RMSNormalization in float64: the native kernel's float32 error is measured against it."""
    d = s.double()
    return (d / torch.sqrt((d * d).mean(-1, keepdim=True) + eps) * scale.double()).float()


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
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (3, 8), (2, 64, 768), (130, 1000)])
@pytest.mark.parametrize("simplified", [False, True])
@pytest.mark.parametrize("second", [True, False])
def test_native_writes_the_sum_and_the_rms_form(shape, simplified, second):
    a, b = torch.randn(*shape) * 3 + 1, torch.randn(*shape) if second else None
    scale = torch.randn(shape[-1])
    op = AddLayerNorm(1e-6, LIB, WHY, simplified=simplified, with_sum=True)
    y, s = op(a, b, scale)
    want_sum = a if b is None else a + b
    assert torch.equal(s, want_sum)     # one float32 add, as torch rounds it
    want = _rms_reference(want_sum, scale, 1e-6) if simplified else \
        F.layer_norm(want_sum, shape[-1:], scale, None, 1e-6)
    torch.testing.assert_close(y, want, atol=ATOL, rtol=RTOL)
    assert op.native_calls == 1 and op.torch_calls == 0
    # The reference (the fallback, and the op's row) gives the same pair.
    ref_y, ref_s = op.through_torch(a, b, scale)
    assert torch.equal(ref_s, s)
    torch.testing.assert_close(ref_y, y, atol=ATOL, rtol=RTOL)


@needs_native
def test_nan_and_inf_rows_stay_in_their_rows():
    a, b = torch.randn(6, 40), torch.randn(6, 40)
    a[1, 3], b[4, 39] = float("nan"), float("inf")
    scale = torch.randn(40)
    for simplified in (False, True):
        op = AddLayerNorm(1e-5, LIB, WHY, simplified=simplified, with_sum=True)
        y, s = op(a, b, scale)
        ref_y, ref_s = op.through_torch(a, b, scale)
        torch.testing.assert_close(y, ref_y, atol=ATOL, rtol=RTOL, equal_nan=True)
        torch.testing.assert_close(s, ref_s, atol=0, rtol=0, equal_nan=True)
        # A NaN spoils its row only; an infinity its row's statistics (RMS: x / inf is 0
        # but inf / inf NaN), as in the reference.
        assert torch.isnan(y[1]).all() and torch.isnan(y[4, 39])
        assert torch.isfinite(y[[0, 2, 3, 5]]).all()


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
    rms = AddLayerNorm(1e-6, LIB, WHY, simplified=True, with_sum=True)
    try:
        torch.set_num_threads(1)
        one_rms = rms(a, b, scale)
        torch.set_num_threads(max(2, threads))
        many_rms = rms(a, b, scale)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(one_rms, many_rms, strict=True))
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


def _model(add_inputs=("x", "r"), axis=-1, extra_use="", mean_out=False, shapes=None):
    """``out = LayerNormalization(x + r)``; ``extra_use``: the sum is read again, by a Relu
    after the norm ("after"), one before it in node order ("before"), or as a graph output
    ("output")."""
    shapes = shapes or {"x": ["batch", 8, 32], "r": ["batch", 8, 32]}
    nodes = [helper.make_node("Add", list(add_inputs), ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"],
                              ["out", "mean"] if mean_out else ["out"], axis=axis,
                              epsilon=1e-6)]
    outputs = ["out"]
    if extra_use in ("after", "before"):
        nodes.insert(2 if extra_use == "after" else 1,
                     helper.make_node("Relu", ["s"], ["side"]))
        outputs.append("side")
    elif extra_use == "output":
        outputs.append("s")
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


def _nonfinite_feeds():
    feeds = {k: RNG.standard_normal((2, 8, 32)).astype(np.float32) for k in ("x", "r")}
    feeds["x"][0, 2, 5] = np.nan
    feeds["r"][1, 7, 31] = -np.inf
    return feeds


@pytest.mark.parametrize("compile_mode", ["codegen", "none"])
@pytest.mark.parametrize("reader", ["after", "before", "output"])
def test_a_sum_read_again_is_the_fused_nodes_second_output(compile_mode, reader):
    sess, ops = _run(_model(extra_use=reader), _nonfinite_feeds(), compile=compile_mode)
    assert sorted(ops) == sorted(["AddLayerNorm"] + (["Relu"] if reader != "output" else []))
    (fused,) = [n for n in sess.graph.nodes if n.op_type == "AddLayerNorm"]
    assert [v.name for v in fused.outputs] == ["out", "s"]
    report = "\n".join(sess.kernel_report())
    assert "add + layer norm: 1 node (1 writing the sum); " in report
    if LIB is not None:
        assert "1 calls native, 0 through torch" in report
    sess.graph.validate()
    _, ops = _run(_model(extra_use=reader), _nonfinite_feeds(),
                  optimize={"fuse.layernorm": False})
    assert "Add" in ops and "LayerNormalization" in ops


def test_the_sum_output_runs_on_the_reference_kernel_and_its_inline_forms():
    feeds = _nonfinite_feeds()
    sess, _ = _run(_model(extra_use="after"), feeds, compile="none")
    want = sess.run(None, feeds)
    (node,) = [n for n in sess.graph.nodes if n.op_type == "AddLayerNorm"]
    assert sess.plan.choices.kind(node) is KernelKind.NATIVE_ADD_LAYER_NORM
    # Forced to the reference: the OpDef row's torch kernel, both outputs.
    choices = dict(sess.plan.choices.by_node)
    choices[node] = REFERENCE
    plan = dataclasses.replace(sess.plan, choices=KernelChoices.of_mapping(choices))
    forced = Executor(plan, sess.registry, sess._engine, target=sess.target)
    kernels = {step.node: step.kernel for task in forced.tasks for step in task.steps}
    assert not isinstance(kernels[node], OpKernel)
    got = forced.run([torch.from_numpy(v) for v in feeds.values()])
    for g, w in zip(got[0], want, strict=True):
        np.testing.assert_allclose(g.numpy(), w, atol=1e-5, rtol=1e-5)
    # Generated code's forms of the reference (inline and traceable) give the pair.
    a, r = (torch.from_numpy(feeds[k]) for k in ("x", "r"))
    scale, bias = (node.inputs[i].const for i in (2, 3))
    for form in (inline_fused(node, torch.device("cpu"), None, [None] * 4),
                 traceable_fused(node)):
        assert form is not None
        y, total = form.bound["fn"](a, r, scale, bias)
        torch.testing.assert_close(total, a + r, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(y, F.layer_norm(a + r, (32,), scale, bias, 1e-6),
                                   atol=1e-5, rtol=1e-5, equal_nan=True)


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
