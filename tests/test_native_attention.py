"""Tests for the Attention kernel (kernels/attention.py, kernels/native/attention.c) and the
fuse pass's ``attention`` rule absorbing the heads' split and merge
(passes/fuse/attention.py).

The native path is checked against the unfused ops (``softmax(q k^T * s + m) v`` in
float64, atol/rtol 1e-5 on unit-scale inputs) at every edge of its blocking (6 query
rows, 16-wide panels of keys and of output columns), through strides and broadcast
masks; the rule against onnxruntime on models where it absorbs the heads and where it
must not.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import segflow
from concurrency import run_in_threads
from segflow import models
from segflow.kernels.attention import ScaledDotAttention
from segflow.kernels.choice import KernelKind
from segflow.kernels.native.build import NativeLibrary

LIB, WHY = NativeLibrary.probe()
needs_native = pytest.mark.skipif(LIB is None, reason=f"native kernels {WHY}")
ATOL = RTOL = 1e-5
RNG = np.random.default_rng(5)


def _reference(q, k, v, mask, scale):
    """[..., Sq, D], [..., Sk, D], [..., Sk, Dv]: the unfused ops in float64."""
    s = q.double() @ k.double().transpose(-2, -1) * scale
    if mask is not None:
        s = s + mask.double()
    return (torch.softmax(s, dim=-1) @ v.double()).float()


def _heads(x, h):
    b, s, c = x.shape
    return x.reshape(b, s, h, c // h).transpose(1, 2)


def _merged(y):
    b, h, s, d = y.shape
    return y.transpose(1, 2).reshape(b, s, h * d)


# -- the kernel ------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("sq", [1, 5, 6, 7, 13])
@pytest.mark.parametrize("sk,d,dv", [(1, 4, 4), (15, 7, 9), (16, 16, 16), (17, 64, 64),
                                     (33, 100, 24), (130, 8, 40)])
def test_heads_form_matches_the_unfused_ops_at_every_blocking_edge(sq, sk, d, dv):
    b, h = 2, 3
    q, k, v = torch.randn(b, sq, h * d), torch.randn(b, sk, h * d), torch.randn(b, sk, h * dv)
    mask = torch.randn(b, 1, 1, sk)
    op = ScaledDotAttention(1 / math.sqrt(d), h, LIB, WHY)
    got = op(q, k, v, mask)
    assert got.shape == (b, sq, h * dv) and got.is_contiguous()
    want = _merged(_reference(_heads(q, h), _heads(k, h), _heads(v, h), mask, 1 / math.sqrt(d)))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert op.native_calls == 1 and op.torch_calls == 0


@needs_native
@pytest.mark.parametrize("mask_shape", [None, (17,), (5, 17), (1, 1, 5, 17), (2, 1, 1, 17),
                                        (2, 3, 5, 17), (1, 3, 1, 17), (2, 3, 5, 1)])
def test_masks_broadcast_like_the_unfused_add(mask_shape):
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 17, 8), torch.randn(2, 3, 17, 8)
    mask = None if mask_shape is None else torch.randn(*mask_shape) * 4
    op = ScaledDotAttention(0.3, 0, LIB, WHY)
    got = op(q, k.transpose(-2, -1), v, mask)      # the 4-D form takes K transposed
    torch.testing.assert_close(got, _reference(q, k, v, mask, 0.3), atol=ATOL, rtol=RTOL)
    assert op.native_calls == 1


@needs_native
def test_three_dimensional_inputs_are_one_head():
    q, k, v = torch.randn(4, 9, 12), torch.randn(4, 20, 12), torch.randn(4, 20, 5)
    mask = torch.randn(4, 9, 20)
    op = ScaledDotAttention(0.25, 0, LIB, WHY)
    got = op(q, k.transpose(-2, -1), v, mask)
    assert got.shape == (4, 9, 5)
    torch.testing.assert_close(got, _reference(q, k, v, mask, 0.25), atol=ATOL, rtol=RTOL)
    assert op.native_calls == 1


@needs_native
def test_strided_inputs_are_read_in_place():
    # Q, K, V as slices of one packed projection [B, S, 3C]; K^T as a strided view.
    packed = torch.randn(2, 11, 3 * 48)
    q, k, v = packed.split(48, dim=-1)
    op = ScaledDotAttention(0.2, 4, LIB, WHY)
    want = _merged(_reference(_heads(q, 4), _heads(k, 4), _heads(v, 4), None, 0.2))
    torch.testing.assert_close(op(q, k, v), want, atol=ATOL, rtol=RTOL)
    kt = torch.randn(2, 4, 11, 12).transpose(-2, -1).contiguous().transpose(-2, -1)
    qh, vh = torch.randn(2, 4, 7, 12)[..., ::1], torch.randn(2, 4, 11, 24)[..., ::2]
    four = ScaledDotAttention(0.2, 0, LIB, WHY)
    torch.testing.assert_close(four(qh, kt.transpose(-2, -1), vh),
                               _reference(qh, kt, vh, None, 0.2), atol=ATOL, rtol=RTOL)
    assert op.native_calls == 1 and four.native_calls == 1


@needs_native
def test_nan_and_fully_masked_rows_come_out_nan_as_through_the_unfused_ops():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    q[0, 0, 1, 3] = float("nan")
    mask = torch.zeros(1, 1, 4, 6)
    mask[0, 0, 2] = float("-inf")                   # row 2 masked out entirely
    mask[0, 0, 3, :5] = float("-inf")               # row 3 sees key 5 only
    op = ScaledDotAttention(0.5, 0, LIB, WHY)
    got = op(q, k.transpose(-2, -1), v, mask)
    want = _reference(q, k, v, mask, 0.5)
    assert torch.isnan(got[0, 0, 1]).all() and torch.isnan(want[0, 0, 1]).all()
    assert torch.isnan(got[:, :, 2]).all() and torch.isnan(want[:, :, 2]).all()
    torch.testing.assert_close(got[:, :, 3], v[:, :, 5], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[0, 1, :2], want[0, 1, :2], atol=ATOL, rtol=RTOL)


@needs_native
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_large_scores_neither_overflow_nor_underflow(seed):
    # Scores of ~1e4 (each a float32 sum of 16 products of ~N(0, 30^2) values) carry
    # rounding of ~1e4 x 2^-24 x 16 ~ 1e-2 into exp(): the weights, and so the output,
    # are within ~1e-2 of the float64 reference, not 1e-4: with unseeded data 1.5% of
    # draws differed by more (2.6e-4, 4e-4), and the test failed at random.
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 6, 16, generator=gen) * 30
    k = torch.randn(1, 2, 40, 16, generator=gen) * 30
    v = torch.randn(1, 2, 40, 16, generator=gen)
    op = ScaledDotAttention(1.0, 0, LIB, WHY)
    got = op(q, k.transpose(-2, -1), v)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _reference(q, k, v, None, 1.0), atol=1e-2, rtol=1e-3)


@needs_native
def test_the_split_between_threads_does_not_change_a_bit():
    # One pair of (batch, head) per unit, 4 units a thread: 1 x 2 pairs split their rows.
    for shape in ((1, 128, 12 * 64), (1, 50, 2 * 32)):
        h = shape[2] // (64 if shape[2] > 64 else 32)
        q, k, v = torch.randn(*shape), torch.randn(*shape), torch.randn(*shape)
        mask = torch.randn(1, 1, 1, shape[1])
        op = ScaledDotAttention(0.125, h, LIB, WHY)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = op(q, k, v, mask)
            torch.set_num_threads(max(2, threads))
            many = op(q, k, v, mask)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, many)      # every row is one thread's, summed in one order


@needs_native
def test_calls_of_growing_and_shrinking_shapes_reuse_the_scratch_correctly():
    op = ScaledDotAttention(0.1, 2, LIB, WHY)
    for s, d in ((4, 8), (300, 96), (3, 4), (129, 40)):
        q, k, v = torch.randn(1, s, 2 * d), torch.randn(1, s, 2 * d), torch.randn(1, s, 2 * d)
        want = _merged(_reference(_heads(q, 2), _heads(k, 2), _heads(v, 2), None, 0.1))
        torch.testing.assert_close(op(q, k, v), want, atol=ATOL, rtol=RTOL)
    assert op.native_calls == 4


def test_what_the_native_path_does_not_take_runs_through_torch():
    op = ScaledDotAttention(0.5, 0, LIB, WHY)
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    cases = [
        ((q.double(), k.double(), v.double(), None), "not all float32 on the CPU"),
        ((q[None], k[None], v[None], None), "ranks 5, 5, 5 (3 or 4 run native)"),
        ((q, k[:1], v[:1], None), "shapes [2, 3, 4, 8], [1, 3, 5, 8], [1, 3, 5, 8] do not pair "
                                  "up batch for batch"),
        ((q[:1], k[:1], v[:1], torch.randn(2, 3, 4, 5)),      # the mask grows the scores
         "a mask [2, 3, 4, 5] that does not broadcast to [1, 3, 4, 5]"),
        ((q[:, :, :0], k, v, None), "empty queries or keys"),
    ]
    for (a, b, c, m), _ in cases:
        got = op(a, b.transpose(-2, -1), c, m)
        want = torch.matmul(torch.softmax(
            a @ b.transpose(-2, -1) * 0.5 + (m if m is not None else 0), dim=-1), c)
        torch.testing.assert_close(got, want.to(got.dtype), atol=ATOL, rtol=RTOL)
    assert op.native_calls == 0 and op.torch_calls == len(cases)
    if LIB is not None:
        assert set(op.why_torch) == {why for _, why in cases}
    heads = ScaledDotAttention(0.5, 3, LIB, WHY)
    x = torch.randn(2, 4, 10)
    with pytest.raises(RuntimeError):                 # 10 is not 3 heads' width: torch says so
        heads(x, x, x)
    if LIB is not None:
        assert heads.why_torch == {"widths 10, 10, 10 not split by 3 heads": 1}
    nowhere = ScaledDotAttention(0.5, 0, None, "are off (SEGFLOW_NATIVE=0)")
    nowhere(q, k.transpose(-2, -1), v)
    assert nowhere.why_torch == {"native kernels are off (SEGFLOW_NATIVE=0)": 1}


# -- the rule: heads split and merged around the attention -----------------------------------
def _mha_model(h=3, d=8, merge=True, k_perm=(0, 2, 3, 1), v_split=(0, 0, 3, 8), extra=False):
    """Xq, Xk, Xv [B, S, H*D] -> heads -> softmax(Q Kt / sqrt(D) + M) V -> merged heads."""
    c = h * d
    nodes = []
    for name, perm in (("q", (0, 2, 1, 3)), ("k", k_perm), ("v", (0, 2, 1, 3))):
        nodes += [helper.make_node("Reshape", [f"x{name}", "split" if name != "v" else "vsplit"],
                                   [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}h"], perm=list(perm))]
    nodes += [helper.make_node("MatMul", ["qh", "kh"], ["sc"]),
              helper.make_node("Div", ["sc", "root"], ["sd"]),
              helper.make_node("Add", ["sd", "mask"], ["sm"]),
              helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vh"], ["ctx"])]
    outputs = ["out"]
    if merge:
        nodes += [helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", ["ctx_t", "merge"], ["out"])]
    else:
        nodes.append(helper.make_node("Identity", ["ctx"], ["out"]))
    if extra:
        nodes.append(helper.make_node("Relu", ["qh"], ["side"]))
        outputs.append("side")
    inits = {"split": np.array([0, 0, h, d], np.int64), "vsplit": np.array(v_split, np.int64),
             "merge": np.array([0, 0, c], np.int64), "root": np.array(math.sqrt(d), np.float32)}
    inputs = {"xq": ["batch", "seq", c], "xk": ["batch", "seq", c], "xv": ["batch", "seq", c],
              "mask": ["batch", 1, 1, "seq"]}
    graph = helper.make_graph(
        nodes, "mha",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _mha_feeds(b=2, s=7, c=24):
    feeds = {n: RNG.standard_normal((b, s, c)).astype(np.float32) for n in ("xq", "xk", "xv")}
    feeds["mask"] = (RNG.integers(0, 2, (b, 1, 1, s)) * -10000).astype(np.float32)
    feeds["mask"][:, :, :, 0] = 0                     # every row sees a key
    return feeds


def _run(model, feeds, **session):
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = segflow.InferenceSession(model, **session)
    for r, g in zip(ref, sess.run(None, feeds)):
        np.testing.assert_allclose(g, r, atol=ATOL, rtol=RTOL)
    return sess, [n for n in sess.graph.nodes]


@pytest.mark.parametrize("compile_mode", ["codegen", "none", "onednn"])
def test_the_rule_absorbs_the_split_and_merge_of_the_heads(compile_mode):
    sess, nodes = _run(_mha_model(), _mha_feeds(), compile=compile_mode)
    assert [n.op_type for n in nodes] == ["Attention"]
    assert nodes[0].attrs["heads"] == 3 and [v.name for v in nodes[0].inputs] == \
        ["xq", "xk", "xv", "mask"]
    report = "\n".join(sess.kernel_report())
    if compile_mode == "onednn":   # oneDNN Graph traces the reference: no kernel is chosen
        assert sess.plan.choices.kind(nodes[0]) is KernelKind.REFERENCE
        assert "attention:" not in report
        return
    assert sess.plan.choices.kind(nodes[0]) is KernelKind.NATIVE_ATTENTION
    assert "attention: 1 node (1 reading heads in place); " in report
    if LIB is not None:
        assert "1 calls native, 0 through torch" in report


@pytest.mark.parametrize("case", ["merge missing", "K read untransposed", "V split differently",
                                  "a head read elsewhere"])
def test_the_rule_keeps_the_heads_where_the_pattern_differs(case):
    if case == "merge missing":
        model = _mha_model(merge=False)
    elif case == "K read untransposed":              # Q K with K [B, H, S, D]: not attention
        model = _mha_model(k_perm=(0, 2, 1, 3))
    elif case == "V split differently":              # V in 6 heads of 4: the heads differ
        model = _mha_model(v_split=(0, 0, 6, 4))
    else:
        model = _mha_model(extra=True)
    sess = segflow.InferenceSession(model)
    attention = [n for n in sess.graph.nodes if n.op_type == "Attention"]
    assert all(not n.attrs.get("heads") for n in attention)
    if case != "K read untransposed" and case != "V split differently":
        assert len(attention) == 1                   # still fused, in the [B, H, S, D] form
        _run(model, _mha_feeds())


def test_bert_reads_every_layers_heads_in_place_and_matches_onnxruntime():
    model = models.build("bert_tiny")
    feeds = models.example_inputs("bert_tiny", batch_size=2, seq_len=16)
    sess, nodes = _run(model, feeds)
    ops = [n.op_type for n in nodes]
    attention = [n for n in nodes if n.op_type == "Attention"]
    assert len(attention) == 2 and all(n.attrs["heads"] == 2 for n in attention)
    assert "Transpose" not in ops and ops.count("Reshape") == 0
    off = segflow.InferenceSession(model, optimize={"fuse.attention": False})
    assert [n.op_type for n in off.graph.nodes].count("Transpose") == 8


@needs_native
def test_concurrent_runs_of_one_session_match_onnxruntime():
    model = _mha_model()
    sess = segflow.InferenceSession(model)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def worker(seed: int) -> None:
        for s in (3, 7, 12) * 3:
            feeds = _mha_feeds(b=1 + seed % 2, s=s)
            np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                       atol=ATOL, rtol=RTOL)

    run_in_threads(worker, 3)
