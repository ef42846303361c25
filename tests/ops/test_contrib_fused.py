"""Float fused com.microsoft ops (ops/contrib_fused.py) against onnxruntime (rtol 1e-4 and
atol 1e-5 unless stated), with NaN / infinity feeds where the op passes them through."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from ort_compare import assert_matches_ort, make_model

MS = {"com.microsoft": 1}
RNG = np.random.default_rng(11)
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _ms(op: str, inputs: list[str], outputs: list[str], **attrs: object):  # type: ignore[no-untyped-def]
    return helper.make_node(op, inputs, outputs, domain="com.microsoft", **attrs)


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _check(nodes, feeds, outputs, inits=None, **tol):  # type: ignore[no-untyped-def]
    model = make_model(nodes, feeds, outputs, 17, inits, MS)
    return assert_matches_ort(model, feeds, **(tol or TOL))


@pytest.mark.parametrize("activation,params", [("Relu", []), ("LeakyRelu", [0.2]),
                                               ("Clip", [-0.5, 0.7]), ("Sigmoid", []),
                                               ("Tanh", []), ("HardSigmoid", [0.3, 0.4])])
def test_fused_conv(activation: str, params: list[float]) -> None:
    feeds = {"x": _f(2, 4, 9, 9), "z": _f(2, 6, 5, 5)}
    inits = {"w": _f(6, 4, 3, 3), "b": _f(6)}
    extra = {"activation_params": params} if params else {}
    node = _ms("FusedConv", ["x", "w", "b", "z"], ["y"], activation=activation,
               strides=[2, 2], pads=[1, 1, 1, 1], **extra)
    _check([node], feeds, ["y"], inits)


def test_fused_conv_auto_pad_without_bias() -> None:
    feeds = {"x": _f(1, 3, 8, 7)}
    node = _ms("FusedConv", ["x", "w"], ["y"], activation="Relu", auto_pad="SAME_UPPER",
               kernel_shape=[3, 3], strides=[2, 2])
    _check([node], feeds, ["y"], {"w": _f(5, 3, 3, 3)})


@pytest.mark.parametrize("activation", ["Relu", "LeakyRelu", "Sigmoid", "Tanh"])
@pytest.mark.parametrize("trans", [(0, 0), (1, 1)])
def test_fused_gemm(activation: str, trans: tuple[int, int]) -> None:
    a = _f(6, 5) if trans[0] else _f(5, 6)
    b = _f(4, 6) if trans[1] else _f(6, 4)
    node = _ms("FusedGemm", ["a", "b", "c"], ["y"], activation=activation, alpha=0.7, beta=1.3,
               transA=trans[0], transB=trans[1], activation_alpha=0.3)
    _check([node], {"a": a}, ["y"], {"b": b, "c": _f(4)})


@pytest.mark.parametrize("attrs,shapes", [
    ({}, ((2, 3, 4, 5), (2, 3, 5, 6))),
    ({"alpha": 0.5, "transA": 1}, ((2, 5, 4), (2, 5, 3))),
    ({"transB": 1}, ((3, 4, 5), (6, 5))),
    ({"transBatchA": 1}, ((4, 2, 3, 5), (2, 3, 5, 6))),
    ({"transBatchB": 1, "transB": 1}, ((2, 3, 4, 5), (6, 2, 3, 5))),
    ({"transBatchA": 1, "transA": 1}, ((5, 2, 3, 4), (2, 3, 5, 6))),
])
def test_fused_matmul(attrs: dict[str, object], shapes: tuple[tuple[int, ...], ...]) -> None:
    node = _ms("FusedMatMul", ["a", "b"], ["y"], **attrs)
    _check([node], {"a": _f(*shapes[0]), "b": _f(*shapes[1])}, ["y"])


def test_gelu_family() -> None:
    x = _f(3, 16)
    x[0, :4] = [np.inf, -np.inf, np.nan, 0.0]
    feeds = {"x": x, "bias": _f(16)}
    nodes = [_ms("Gelu", ["x"], ["g"]), _ms("FastGelu", ["x", "bias"], ["fg"]),
             _ms("FastGelu", ["x"], ["fg0"]), _ms("BiasGelu", ["x", "bias"], ["bg"])]
    _check(nodes, feeds, ["g", "fg", "fg0", "bg"])


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_norm(with_bias: bool) -> None:
    feeds = {"x": _f(2, 5, 16), "skip": _f(2, 5, 16)}
    inits = {"gamma": _f(16), "beta": _f(16), "bias": _f(16)}
    inputs = ["x", "skip", "gamma", "beta"] + (["bias"] if with_bias else [])
    node = _ms("SkipLayerNormalization", inputs, ["y", "mean", "inv", "sum"], epsilon=1e-5)
    _check([node], feeds, ["y", "mean", "inv", "sum"], inits)


def test_skip_layer_norm_one_output() -> None:
    feeds = {"x": _f(2, 5, 16), "skip": _f(2, 5, 16)}
    node = _ms("SkipLayerNormalization", ["x", "skip", "gamma"], ["y"])
    _check([node], feeds, ["y"], {"gamma": _f(16)})


@pytest.mark.parametrize("with_segments", [False, True])
def test_embed_layer_norm(with_segments: bool) -> None:
    batch, seq, hidden = 2, 7, 16
    feeds = {"ids": RNG.integers(0, 30, (batch, seq)).astype(np.int32),
             "mask": (np.arange(seq)[None, :] < np.array([[7], [4]])).astype(np.int32)}
    inits = {"words": _f(30, hidden), "pos": _f(10, hidden), "gamma": _f(hidden),
             "beta": _f(hidden)}
    segment = ["", ""]
    if with_segments:
        feeds["seg"] = RNG.integers(0, 2, (batch, seq)).astype(np.int32)
        inits["segs"] = _f(2, hidden)
        segment = ["seg", "segs"]
    inputs = ["ids", segment[0], "words", "pos", segment[1], "gamma", "beta", "mask"]
    node = _ms("EmbedLayerNormalization", inputs, ["y", "mask_index", "sum"], epsilon=1e-5)
    _check([node], feeds, ["y", "mask_index", "sum"], inits)


def _attention_case(mask_kind: str, batch: int, seq: int) -> tuple[str, np.ndarray | None]:
    if mask_kind == "none":
        return "", None
    lengths = np.array([seq, seq - 2][:batch], np.int32)
    if mask_kind == "1d":
        return "mask", lengths
    keep = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    if mask_kind == "2d":
        return "mask", keep
    return "mask", np.repeat(keep[:, None, :], seq, axis=1)


@pytest.mark.parametrize("mask_kind", ["none", "1d", "2d", "3d"])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_attention(mask_kind: str, unidirectional: int) -> None:
    batch, seq, hidden, heads = 2, 6, 16, 4
    mask_name, mask = _attention_case(mask_kind, batch, seq)
    feeds = {"x": _f(batch, seq, hidden)}
    if mask is not None:
        feeds[mask_name] = mask
    inits = {"w": _f(hidden, 3 * hidden) * 0.3, "b": _f(3 * hidden)}
    node = _ms("Attention", ["x", "w", "b", mask_name], ["y"], num_heads=heads,
               unidirectional=unidirectional)
    _check([node], feeds, ["y"], inits)


def test_attention_qkv_sizes_bias_and_present() -> None:
    batch, seq, hidden, heads = 2, 5, 12, 2
    sizes = [8, 8, 12]
    feeds = {"x": _f(batch, seq, hidden), "ab": _f(batch, heads, seq, seq)}
    inits = {"w": _f(hidden, sum(sizes)) * 0.3, "b": _f(sum(sizes))}
    node = _ms("Attention", ["x", "w", "b", "", "", "ab"], ["y"], num_heads=heads,
               qkv_hidden_sizes=sizes, scale=0.4)
    _check([node], feeds, ["y"], inits)
    feeds = {"x": _f(batch, seq, hidden), "past": _f(2, batch, heads, 3, hidden // heads)}
    inits = {"w": _f(hidden, 3 * hidden) * 0.3, "b": _f(3 * hidden)}
    node = _ms("Attention", ["x", "w", "b", "", "past"], ["y", "present"], num_heads=heads,
               unidirectional=1)
    _check([node], feeds, ["y", "present"], inits)


@pytest.mark.parametrize("with_mask", [False, True])
def test_multi_head_attention(with_mask: bool) -> None:
    batch, q_len, kv_len, hidden, heads = 2, 4, 6, 16, 4
    feeds = {"q": _f(batch, q_len, hidden), "k": _f(batch, kv_len, hidden),
             "v": _f(batch, kv_len, hidden)}
    inputs = ["q", "k", "v", "bias"]
    if with_mask:
        feeds["mask"] = (np.arange(kv_len)[None, :] < np.array([[6], [3]])).astype(np.int32)
        inputs.append("mask")
    node = _ms("MultiHeadAttention", inputs, ["y"], num_heads=heads)
    _check([node], feeds, ["y"], {"bias": _f(3 * hidden)})


@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("zero_points", ["none", "packed", "float"])
@pytest.mark.parametrize("k_dim,block", [(64, 32), (48, 32), (32, 16)])
def test_matmul_nbits(zero_points: str, k_dim: int, block: int, accuracy_level: int) -> None:
    n_dim = 6
    blocks = -(-k_dim // block)
    b = RNG.integers(0, 256, (n_dim, blocks, block // 2)).astype(np.uint8)
    inits = {"b": b, "scales": RNG.uniform(0.01, 0.1, n_dim * blocks).astype(np.float32),
             "bias": _f(n_dim)}
    inputs = ["a", "b", "scales", "", "", "bias"]
    if zero_points == "packed":
        inits["zp"] = RNG.integers(0, 256, n_dim * ((blocks + 1) // 2)).astype(np.uint8)
        inputs[3] = "zp"
    elif zero_points == "float":
        inits["zp"] = RNG.uniform(5, 10, n_dim * blocks).astype(np.float32)
        inputs[3] = "zp"
    node = _ms("MatMulNBits", inputs, ["y"], K=k_dim, N=n_dim, bits=4, block_size=block,
               accuracy_level=accuracy_level)
    _check([node], {"a": _f(3, k_dim)}, ["y"], inits, rtol=1e-4, atol=1e-4)


def test_nonfinite_inputs_propagate_as_in_onnxruntime() -> None:
    # NaN and infinities where activations clamp (Relu, Clip) and through the norms and
    # attention: compared NaN for NaN.
    x = _f(1, 2, 5, 5)
    x[0, 0, 2, 2], x[0, 1, 1, 1], x[0, 1, 3, 3] = np.nan, np.inf, -np.inf
    w = _f(3, 2, 3, 3)
    conv = [_ms("FusedConv", ["x", "w"], [f"c{i}"], activation=act, pads=[1, 1, 1, 1], **extra)
            for i, (act, extra) in enumerate([("Relu", {}),
                                              ("Clip", {"activation_params": [-0.5, 0.5]})])]
    got = _check(conv, {"x": x}, ["c0", "c1"], {"w": w})
    assert np.isnan(got[0]).any() and np.isnan(got[1]).any()
    a = _f(4, 6)
    a[0, 0], a[1, 1] = np.nan, np.inf
    _check([_ms("FusedGemm", ["a", "b"], ["y"], activation="Relu")], {"a": a}, ["y"],
           {"b": _f(6, 3)})
    h = _f(2, 4, 8)
    h[0, 0, 0], h[0, 1, 3] = np.inf, np.nan
    nodes = [_ms("SkipLayerNormalization", ["h", "h", "g"], ["n"]),
             _ms("Attention", ["h", "wq", "bq"], ["att"], num_heads=2)]
    _check(nodes, {"h": h}, ["n", "att"], {"g": _f(8), "wq": _f(8, 24), "bq": _f(24)})
