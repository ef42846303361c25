"""Tests for the fuse pass's ``attention`` rule on attention as torch's exporters write it
(passes/fuse/attention.py), and for the Attention node's ``nan_to_zero`` (torch's safe
softmax) in the native kernel and the torch reference.

Each graph is written with onnx.helper in one exporter's shape (the scale split over Q
and K, K transposed through a Reshape/Transpose chain, a Where mask, the safe softmax,
heads split and merged), checked against onnxruntime (atol 1e-4, rtol 1e-3) with finite
feeds and with NaN and Inf in them (the NaN, +Inf and -Inf places must be equal), with
the native kernels on and off, and the plan's Attention nodes counted.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow.kernels.attention import ScaledDotAttention
from segflow.kernels.native.build import NativeLibrary
from segflow.ops.fused import attention

LIB, WHY = NativeLibrary.probe()
needs_native = pytest.mark.skipif(LIB is None, reason=f"native kernels {WHY}")
ATOL, RTOL = 1e-4, 1e-3
B, S, H, D = 2, 7, 3, 4
C = H * D
C_SPLIT = float(np.float32(1 / math.sqrt(math.sqrt(D))))   # torch applies it to Q and to K
BIG = -3.4028234663852886e38


def _graph(nodes, inputs, outputs, inits):
    def info(name, shape):
        kind = TensorProto.BOOL if name.startswith("keep") else TensorProto.FLOAT
        return helper.make_tensor_value_info(name, kind, shape)
    graph = helper.make_graph(
        nodes, "g", [info(n, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(np.asarray(a), n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def _tail(nodes, scores, *, mask, safe, merge=True, where_order="isnan"):
    """Mask, softmax, safe softmax, P V and the heads merged back to ``out``."""
    if mask:
        nodes += [_node("Where", ["keep", "zero", mask], ["m"]),
                  _node("Add", [scores, "m"], ["sm"])]
        scores = "sm"
    nodes.append(_node("Softmax", [scores], ["p"], axis=-1))
    probs = "p"
    if safe and where_order == "isnan":
        nodes += [_node("IsNaN", ["p"], ["isnan"]), _node("Where", ["isnan", "zero", "p"], ["ps"])]
        probs = "ps"
    elif safe:
        nodes += [_node("IsNaN", ["p"], ["isnan"]), _node("Not", ["isnan"], ["fine"]),
                  _node("Where", ["fine", "p", "zero"], ["ps"])]
        probs = "ps"
    if merge:
        nodes += [_node("MatMul", [probs, "vh"], ["o"]),
                  _node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
                  _node("Reshape", ["ot", "merged"], ["out"])]
    else:
        nodes.append(_node("MatMul", [probs, "vh"], ["out"]))
    return nodes


def _inits(**extra):
    return {"split": np.array([B, S, H, D], np.int64), "merged": np.array([B, S, C], np.int64),
            "c": np.array(C_SPLIT, np.float32), "zero": np.array(0.0, np.float32), **extra}


def _dynamo(safe=True, where_order="isnan"):
    """torch.onnx.export(dynamo=True): c on Q and on Kt; Kt through [B*H, S, D] and back;
    the mask Where(keep, 0, -max float)."""
    nodes = [_node("Reshape", ["xq", "split"], ["q4"]),
             _node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
             _node("Mul", ["qh", "c"], ["qs"]),
             _node("Reshape", ["xk", "split"], ["k4"]),
             _node("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3]),
             _node("Reshape", ["kh", "flat"], ["k3"]),
             _node("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]),
             _node("Reshape", ["kt3", "kt4"], ["kt"]),
             _node("Mul", ["kt", "c"], ["kts"]),
             _node("Reshape", ["xv", "split"], ["v4"]),
             _node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
             _node("MatMul", ["qs", "kts"], ["sc"])]
    inits = _inits(flat=np.array([B * H, S, D], np.int64), kt4=np.array([B, H, D, S], np.int64),
                   big=np.array(BIG, np.float32))
    nodes = _tail(nodes, "sc", mask="big", safe=safe, where_order=where_order)
    return _graph(nodes, _acts(keep=[B, 1, S, S]), ["out"], inits)


def _torchscript(mask_value=-np.inf):
    """torch.onnx.export(dynamo=False): Kt by Transpose(0, 2, 3, 1); the mask with -inf, so
    that a query row that sees no key is all -inf, NaN after the softmax, 0 after the safe
    softmax."""
    nodes = [_node("Reshape", ["xq", "split"], ["q4"]),
             _node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
             _node("Mul", ["qh", "c"], ["qs"]),
             _node("Reshape", ["xk", "split"], ["k4"]),
             _node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
             _node("Mul", ["kt", "c"], ["kts"]),
             _node("Reshape", ["xv", "split"], ["v4"]),
             _node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
             _node("MatMul", ["qs", "kts"], ["sc"])]
    inits = _inits(masked=np.array([mask_value], np.float32))
    return _graph(_tail(nodes, "sc", mask="masked", safe=True), _acts(keep=[B, 1, S, S]),
                  ["out"], inits)


def _whisper():
    """Whisper's encoder (torchscript): the scale on the projection, before the heads are
    split; Mul by 1 on both heads; no mask, no safe softmax."""
    nodes = [_node("Mul", ["xq", "eighth"], ["xqs"]),
             _node("Reshape", ["xqs", "split"], ["q4"]),
             _node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
             _node("Mul", ["qh", "one"], ["qs"]),
             _node("Reshape", ["xk", "split"], ["k4"]),
             _node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
             _node("Mul", ["kt", "one"], ["kts"]),
             _node("Reshape", ["xv", "split"], ["v4"]),
             _node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
             _node("MatMul", ["qs", "kts"], ["sc"])]
    inits = _inits(eighth=np.array(0.125, np.float32), one=np.array(1.0, np.float32))
    return _graph(_tail(nodes, "sc", mask=None, safe=False), _acts(), ["out"], inits)


def _gpt2_past(past=6):
    """GPT-2 with a KV cache (dynamo): Q, K, V a Split of one projection, K and V the
    cache concatenated with the new heads (graph outputs), Kt through [B*H, T, D]; the
    merged result [B, C] (one token), so the plain form."""
    t = past + 1
    nodes = [_node("Split", ["x"], ["xq", "xk", "xv"], axis=2, num_outputs=3)]
    for name in ("q", "k", "v"):
        nodes += [_node("Reshape", [f"x{name}", "split1"], [f"{name}4"]),
                  _node("Transpose", [f"{name}4"], [f"{name}h1"], perm=[0, 2, 1, 3])]
    nodes += [_node("Concat", ["past_k", "kh1"], ["present_k"], axis=-2),
              _node("Concat", ["past_v", "vh1"], ["vh"], axis=-2),
              _node("Reshape", ["present_k", "flat"], ["k3"]),
              _node("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]),
              _node("Reshape", ["kt3", "kt4"], ["kt"]),
              _node("Mul", ["qh1", "c"], ["qs"]),
              _node("Mul", ["kt", "c"], ["kts"]),
              _node("MatMul", ["qs", "kts"], ["sc"]),
              _node("Where", ["keep", "zero", "big"], ["m"]),
              _node("Add", ["sc", "m"], ["sm"]),
              _node("Softmax", ["sm"], ["p"], axis=-1),
              _node("IsNaN", ["p"], ["isnan"]), _node("Where", ["isnan", "zero", "p"], ["ps"]),
              _node("MatMul", ["ps", "vh"], ["o"]),
              _node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              _node("Reshape", ["ot", "merged1"], ["out"])]
    inits = _inits(split1=np.array([B, 1, H, D], np.int64), merged1=np.array([B, C], np.int64),
                   flat=np.array([B * H, t, D], np.int64), kt4=np.array([B, H, D, t], np.int64),
                   big=np.array(BIG, np.float32))
    inputs = {"x": [B, 1, 3 * C], "past_k": [B, H, past, D], "past_v": [B, H, past, D],
              "keep": [B, 1, 1, t]}
    return _graph(nodes, inputs, ["out", "present_k", "vh"], inits)


def _acts(**extra):
    return {"xq": [B, S, C], "xk": [B, S, C], "xv": [B, S, C], **extra}


def _feeds(model, rng, poison=None):
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == TensorProto.BOOL:
            keep = rng.random(shape) < 0.7
            if shape[-2] > 1:
                keep[..., 1, :] = False        # a query row that sees no key
            feeds[value.name] = keep
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    if poison is not None:
        name, index, what = poison
        feeds[name][index] = what
    return feeds


def _run_both(model, feeds, **session):
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = segflow.InferenceSession(model, **session)
    return sess, sess.run(None, feeds), want


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        for name, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
            assert np.array_equal(test(g), test(w)), f"{name} at other places"
        fine = np.isfinite(w)
        np.testing.assert_allclose(g[fine], w[fine], atol=ATOL, rtol=RTOL)


def _attention_nodes(sess):
    return [n for n in sess.graph.nodes if n.op_type == "Attention"]


MODELS = {"dynamo": _dynamo, "dynamo_not_isnan": lambda: _dynamo(where_order="not"),
          "torchscript": _torchscript, "whisper": _whisper, "gpt2_past": _gpt2_past}
# (heads, nan_to_zero, scale) of each model's one Attention node.
FORMS = {"dynamo": (H, 1, C_SPLIT ** 2), "dynamo_not_isnan": (H, 1, C_SPLIT ** 2),
         "torchscript": (H, 1, C_SPLIT ** 2), "whisper": (H, 0, 0.125),
         "gpt2_past": (0, 1, C_SPLIT ** 2)}
NATIVE = [pytest.param("1", marks=needs_native, id="native"), pytest.param("0", id="torch")]


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name", list(MODELS))
def test_exporters_attention_is_one_node_that_matches_onnxruntime(name, native, monkeypatch):
    monkeypatch.setenv("SEGFLOW_NATIVE", native)
    model = MODELS[name]()
    rng = np.random.default_rng(len(name))
    sess, got, want = _run_both(model, _feeds(model, rng))
    _assert_same(got, want)
    nodes = _attention_nodes(sess)
    assert len(nodes) == 1
    heads, nan_to_zero, scale = FORMS[name]
    attrs = nodes[0].attrs
    assert (attrs.get("heads", 0), attrs.get("nan_to_zero", 0)) == (heads, nan_to_zero)
    assert attrs["scale"] == pytest.approx(scale, rel=1e-6)
    ops = Counter(n.op_type for n in sess.graph.nodes)
    assert not ops["Softmax"] and not ops["IsNaN"] and not ops["MatMul"] and not ops["Mul"]
    if heads:   # the split and merge went into the node: it reads and writes [B, S, C]
        assert not ops["Transpose"] and not ops["Reshape"]
    off, _, _ = _run_both(model, _feeds(model, rng), optimize={"fuse.attention": False})
    assert not _attention_nodes(off)


def test_a_fully_masked_row_comes_out_zeros_as_onnxruntimes():
    model = _torchscript()
    feeds = _feeds(model, np.random.default_rng(1))
    sess, got, want = _run_both(model, feeds)
    assert _attention_nodes(sess)[0].attrs["nan_to_zero"] == 1
    assert (want[0][:, 1] == 0).all() and np.isfinite(want[0]).all()
    _assert_same(got, want)


POISONS = [("xq", (0, 2, 5), np.nan), ("xq", (1, 3, 0), np.inf), ("xk", (0, 4, 7), -np.inf),
           ("xv", (1, 5, 2), np.inf), ("xv", (0, 0, 11), np.nan)]


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name", ["dynamo", "torchscript", "whisper"])
@pytest.mark.parametrize("poison", POISONS, ids=lambda p: f"{p[0]}_{p[2]}")
def test_nonfinite_feeds_give_onnxruntimes_nan_and_inf(name, poison, native, monkeypatch):
    monkeypatch.setenv("SEGFLOW_NATIVE", native)
    model = MODELS[name]()
    feeds = _feeds(model, np.random.default_rng(7), poison)
    sess, got, want = _run_both(model, feeds)
    assert len(_attention_nodes(sess)) == 1
    _assert_same(got, want)
    if name != "whisper" and poison[0] != "xv":   # the safe softmax zeroed a NaN row
        assert (got[0] == 0).any()


def test_gpt2_past_reads_the_cached_key_through_one_transpose():
    sess, got, want = _run_both(_gpt2_past(), _feeds(_gpt2_past(), np.random.default_rng(3)))
    _assert_same(got, want)
    (node,) = _attention_nodes(sess)
    kt = node.inputs[1].producer
    assert kt.op_type == "Transpose" and kt.attrs["perm"] == [0, 1, 3, 2]
    assert kt.inputs[0].name == "present_k"


def test_moves_that_do_not_split_heads_keep_the_plain_form():
    # Q split as [B, S, D, H]: the Transpose puts a different element at each place than
    # the heads split would, so the node must read the moved Q as the MatMul did.
    model = _torchscript()
    for node in model.graph.node:
        if node.output[0] == "q4":
            node.input[1] = "split_dh"
        if node.output[0] == "qh":
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("perm", [0, 3, 1, 2]))
    model.graph.initializer.append(numpy_helper.from_array(np.array([B, S, D, H], np.int64),
                                                           "split_dh"))
    sess, got, want = _run_both(model, _feeds(model, np.random.default_rng(4)))
    _assert_same(got, want)
    (node,) = _attention_nodes(sess)
    assert not node.attrs.get("heads")


def test_a_where_that_keeps_other_values_than_zero_is_not_the_safe_softmax():
    model = _dynamo()
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    for node in model.graph.node:
        if node.output[0] == "ps":
            node.input[1] = "half"
    sess, got, want = _run_both(model, _feeds(model, np.random.default_rng(5)))
    _assert_same(got, want)
    assert not _attention_nodes(sess)


# -- nan_to_zero in the kernels ------------------------------------------------------------
def _nan_rows():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    q[0, 0, 1, 3] = float("nan")               # row 1 of head 0: a NaN score
    mask = torch.zeros(1, 1, 5, 6)
    mask[0, 0, 2] = float("-inf")              # row 2: no key
    mask[0, 0, 4, :5] = float("-inf")          # row 4: key 5 only
    return q, k, v, mask


def _unfused(q, k, v, mask, scale):
    p = torch.softmax(q.double() @ k.double().transpose(-2, -1) * scale + mask.double(), -1)
    return (torch.where(torch.isnan(p), 0.0, p) @ v.double()).float()


@needs_native
def test_native_kernel_zeros_nan_rows_only_with_nan_to_zero():
    q, k, v, mask = _nan_rows()
    kt = k.transpose(-2, -1)
    safe = ScaledDotAttention(0.5, 0, LIB, WHY, nan_to_zero=True)(q, kt, v, mask)
    plain = ScaledDotAttention(0.5, 0, LIB, WHY)(q, kt, v, mask)
    want = _unfused(q, k, v, mask, 0.5)
    torch.testing.assert_close(safe, want, atol=1e-5, rtol=1e-5)
    assert (safe[0, 0, 1] == 0).all() and (safe[:, :, 2] == 0).all()
    assert torch.isnan(plain[0, 0, 1]).all() and torch.isnan(plain[:, :, 2]).all()
    torch.testing.assert_close(safe[:, :, 4], v[:, :, 5], atol=1e-5, rtol=1e-5)


@needs_native
def test_native_kernel_a_zeroed_row_over_an_infinite_value_is_nan_as_zero_times_inf():
    q, k, v, mask = _nan_rows()
    v[0, 0, 3, 2] = float("inf")
    got = ScaledDotAttention(0.5, 0, LIB, WHY, nan_to_zero=True)(q, k.transpose(-2, -1), v, mask)
    want = _unfused(q, k, v, mask, 0.5)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[0, 0, 1, 2])
    assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_torch_reference_zeros_nan_rows_only_with_nan_to_zero():
    q, k, v, mask = _nan_rows()
    kt = k.transpose(-2, -1)
    safe = attention(q, kt, v, mask, 0.5, 0, nan_to_zero=True)
    torch.testing.assert_close(safe, _unfused(q, k, v, mask, 0.5), atol=1e-5, rtol=1e-5)
    exact = attention(q, kt, v, mask, 0.5, 0, exact=True)
    assert torch.isnan(exact[:, :, 2]).all() and torch.isnan(exact[0, 0, 1]).all()


def test_symbolic_batch_and_sequence_keep_the_heads_form():
    # Dims named by the model, reshapes copying them (0): the moves are checked with the
    # names standing for sizes, and the node runs at other sizes than any check used.
    model = _torchscript()
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        dims[0].dim_param = "batch"
        for i in range(1, len(dims)):
            if dims[i].dim_value == S:
                dims[i].dim_param = "seq"
    for init in model.graph.initializer:
        if init.name in ("split", "merged"):
            shape = [0, 0, H, D] if init.name == "split" else [0, 0, C]
            init.CopyFrom(numpy_helper.from_array(np.array(shape, np.int64), init.name))
    sess = segflow.InferenceSession(model)
    (node,) = _attention_nodes(sess)
    assert node.attrs["heads"] == H and node.attrs["nan_to_zero"] == 1
    oracle = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(9)
    for b, s in ((1, 3), (3, 10)):
        feeds = {n: rng.standard_normal((b, s, C)).astype(np.float32) for n in ("xq", "xk", "xv")}
        keep = rng.random((b, 1, s, s)) < 0.7
        keep[..., 1, :] = False
        feeds["keep"] = keep
        _assert_same(sess.run(None, feeds), oracle.run(None, feeds))
