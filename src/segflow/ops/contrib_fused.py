"""Float fused ``com.microsoft`` ops (opset 1): what onnxruntime's transformer optimizer and
its graph fusions write. Reference kernels in plain torch, with onnxruntime's semantics.

- ``FusedConv(X, W, B?, Z?)``: ``act(conv(X, W) + B + Z)``, ``activation`` /
  ``activation_params`` as segflow's own FusedConv names them (``ops/fused.py``).
- ``FusedGemm``: Gemm, then ``activation`` with ``activation_alpha`` / ``_beta``.
- ``FusedMatMul``: MatMul with ``alpha``, ``transA`` / ``transB`` (the last two dims) and
  ``transBatchA`` / ``transBatchB`` (the first dim moved behind the batch dims).
- ``Gelu`` (erf), ``FastGelu(X, bias?)`` (tanh), ``BiasGelu(A, B)`` = Gelu(A + B).
- ``SkipLayerNormalization(x, skip, gamma, beta?, bias?)``: LayerNorm(x + skip + bias) over
  the last axis; optional outputs mean, inverse std and the sum.
- ``EmbedLayerNormalization``: word + position (+ segment) embeddings, LayerNorm; the mask
  index (the mask's row sums); optionally the embedding sum.
- ``Attention``: one projection to Q, K, V (``qkv_hidden_sizes``), scaled dot-product
  attention over ``num_heads`` with a key mask (``mask_index`` as end positions, a 2-D or
  3-D 0/1 mask), ``unidirectional``, an additive ``attention_bias``, and ``past`` /
  ``present`` (the stacked keys and values).
- ``MultiHeadAttention``: the same attention over separate query, key, value (3-D, with an
  optional packed bias), ``key_padding_mask``, ``attention_bias``, past / present key
  and value.
- ``MatMulNBits``: ``A @ dequantize(B)^T``, with B 4-bit in blocks of ``block_size``
  along K (two values a byte, low nibble first), a scale per block and a zero point per
  block (packed 4-bit, or of the scales' type; 8 where absent); with ``accuracy_level``
  4, A quantized to int8 per block first, as onnxruntime's CPU kernel does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from segflow.errors import UnsupportedOp
from segflow.ir.graph import Node
from segflow.ops._common import gelu_erf, has_input
from segflow.ops.fused import ACTIVATIONS
from segflow.ops.nn import _conv
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
MS_DOMAIN = "com.microsoft"
# onnxruntime's default additive value for a masked attention score.
MASK_FILTER_VALUE = -10000.0


def _inputs(inputs: Sequence[Tensor | None], count: int) -> list[Tensor | None]:
    return list(inputs) + [None] * (count - len(inputs))


def _activation(node: Node, name: str, params: list[float]):  # type: ignore[no-untyped-def]
    act = ACTIVATIONS.get(name)
    if act is None:
        raise UnsupportedOp(f"{node.label}: activation {name!r} is not supported (one of "
                            f"{', '.join(sorted(k for k in ACTIVATIONS if k))})")
    return lambda x: act.apply(x, params)


# -- conv / gemm / matmul ------------------------------------------------------------------
def _fused_conv(node: Node, ctx: BindContext) -> Kernel:
    name = str(node.attrs.get("activation", ""))
    act = _activation(node, name, [float(v) for v in node.attrs.get("activation_params", [])])
    conv = _conv(node, ctx)   # the Conv row's kernel: auto_pad, groups, dilations

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w, b, z = _inputs(inputs, 4)
        y = conv([x, w, b])[0]
        if z is not None:
            y = y + z
        return [act(y)]
    return kernel


# FusedGemm's activation attributes, per activation, in the order Activation.apply reads.
_GEMM_PARAMS = {"LeakyRelu": ("activation_alpha",),
                "HardSigmoid": ("activation_alpha", "activation_beta")}
_GEMM_DEFAULTS = {"LeakyRelu": (0.01,), "HardSigmoid": (0.2, 0.5)}


def _fused_gemm(node: Node, ctx: BindContext) -> Kernel:
    name = str(node.attrs.get("activation", ""))
    names = _GEMM_PARAMS.get(name, ())
    defaults = _GEMM_DEFAULTS.get(name, ())
    params = [float(node.attrs.get(n, d)) for n, d in zip(names, defaults)]
    act = _activation(node, name, params)
    alpha = float(node.attrs.get("alpha", 1.0))
    beta = float(node.attrs.get("beta", 1.0))
    trans_a, trans_b = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b, c = _inputs(inputs, 3)
        assert a is not None and b is not None
        y = (a.t() if trans_a else a) @ (b.t() if trans_b else b)
        if alpha != 1.0:
            y = y * alpha
        if c is not None:
            y = y + c * beta
        return [act(y)]
    return kernel


def _batch_first(t: Tensor) -> Tensor:
    """``transBatch``: dim 0 moved behind the batch dims ([M, B.., K] -> [B.., M, K])."""
    if t.dim() < 3:
        return t
    return t.permute(*range(1, t.dim() - 1), 0, t.dim() - 1)


def _fused_matmul(node: Node, ctx: BindContext) -> Kernel:
    alpha = float(node.attrs.get("alpha", 1.0))
    trans_a, trans_b = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))
    batch_a = int(node.attrs.get("transBatchA", 0))
    batch_b = int(node.attrs.get("transBatchB", 0))

    def prepare(t: Tensor, batch: int, trans: int) -> Tensor:
        if batch:
            t = _batch_first(t)
        return t.transpose(-1, -2) if trans and t.dim() >= 2 else t

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        y = torch.matmul(prepare(a, batch_a, trans_a), prepare(b, batch_b, trans_b))
        return [y * alpha if alpha != 1.0 else y]
    return kernel


# -- GELU family ---------------------------------------------------------------------------
def _gelu(node: Node, ctx: BindContext) -> Kernel:
    return lambda inputs: [gelu_erf(inputs[0])]  # type: ignore[arg-type]


def _bias_gelu(node: Node, ctx: BindContext) -> Kernel:
    return lambda inputs: [gelu_erf(inputs[0] + inputs[1])]  # type: ignore[operator]


def _fast_gelu(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, bias = _inputs(inputs, 2)
        assert x is not None
        if bias is not None:
            x = x + bias
        return [F.gelu(x, approximate="tanh")]
    return kernel


# -- layer norms -------------------------------------------------------------------------------
def _skip_layer_norm(node: Node, ctx: BindContext) -> Kernel:
    eps = float(node.attrs.get("epsilon", 1e-12))
    n_out = len(node.outputs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, skip, gamma, beta, bias = _inputs(inputs, 5)
        assert x is not None and skip is not None and gamma is not None
        total = x + skip
        if bias is not None:
            total = total + bias
        # One op for the normalized sum and its statistics ([.., 1] mean and inverse std).
        y, mean, inv = torch.native_layer_norm(total, total.shape[-1:], gamma, beta, eps)
        return [y, mean, inv, total][:n_out]
    return kernel


def _embed_layer_norm(node: Node, ctx: BindContext) -> Kernel:
    eps = float(node.attrs.get("epsilon", 1e-12))
    n_out = len(node.outputs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        ids, segments, words, positions, segment_table, gamma, beta, mask, position_ids = \
            _inputs(inputs, 9)
        assert ids is not None and words is not None and positions is not None
        assert gamma is not None
        seq = ids.shape[1]
        if position_ids is None:
            pos = positions[:seq].unsqueeze(0)
        else:
            pos = positions[position_ids.to(torch.int64)].expand(ids.shape[0], seq, -1)
        total = words[ids.to(torch.int64)] + pos
        if segments is not None and segment_table is not None:
            total = total + segment_table[segments.to(torch.int64)]
        y = F.layer_norm(total, total.shape[-1:], gamma, beta, eps)
        if mask is None:
            mask_index = torch.zeros(ids.shape[0], dtype=torch.int32)
        else:
            mask_index = mask.to(torch.int32).sum(dim=1, dtype=torch.int32)
        return [y, mask_index, total][:n_out]
    return kernel


# -- attention -----------------------------------------------------------------------------
def _heads(t: Tensor, heads: int) -> Tensor:
    """[B, S, N*H] -> [B, N, S, H]."""
    b, s, _ = t.shape
    return t.reshape(b, s, heads, -1).transpose(1, 2)


def _key_mask(mask: Tensor | None, batch: int, q_len: int, kv_len: int, filter_value: float,
              what: str) -> Tensor | None:
    """An additive [B, 1, S or 1, T] mask from onnxruntime's mask formats."""
    if mask is None:
        return None
    keys = torch.arange(kv_len)
    if mask.dim() == 1:
        ends = mask[:batch].to(torch.int64)
        keep = keys[None, :] < ends[:, None]
        if mask.shape[0] == 2 * batch:
            keep = keep & (keys[None, :] >= mask[batch:].to(torch.int64)[:, None])
        keep = keep[:, None, None, :]
    elif mask.dim() == 2:
        keep = (mask != 0)[:, None, None, :]
    elif mask.dim() == 3:
        keep = (mask != 0)[:, None, :, :]
    else:
        raise UnsupportedOp(f"a {mask.dim()}-D {what} is not supported (1-D, 2-D and 3-D are)")
    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(keep, zero, torch.tensor(filter_value, dtype=torch.float32))


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None,
          bias: Tensor | None, causal_offset: int | None, filter_value: float) -> Tensor:
    """softmax(q k^T * scale + masks) v over [B, N, S, H] heads."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    if bias is not None:
        scores = scores + bias
    if causal_offset is not None:
        s, t = scores.shape[-2], scores.shape[-1]
        future = torch.arange(t)[None, :] > (torch.arange(s)[:, None] + causal_offset)
        scores = scores.masked_fill(future, filter_value)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _merge(t: Tensor) -> Tensor:
    """[B, N, S, H] -> [B, S, N*H]."""
    b, n, s, h = t.shape
    return t.transpose(1, 2).reshape(b, s, n * h)


def _attention(node: Node, ctx: BindContext) -> Kernel:
    heads = int(node.attrs["num_heads"])
    causal = bool(node.attrs.get("unidirectional", 0))
    sizes = [int(v) for v in node.attrs.get("qkv_hidden_sizes", [])]
    filter_value = float(node.attrs.get("mask_filter_value", MASK_FILTER_VALUE))
    scale_attr = float(node.attrs.get("scale", 0.0))
    if node.attrs.get("do_rotary", 0):
        raise UnsupportedOp(f"{node.label}: Attention with do_rotary is not supported")
    if has_input(node, 6):
        raise UnsupportedOp(f"{node.label}: Attention with past_sequence_length (a shared "
                            "past buffer) is not supported")
    wants_present = len(node.outputs) > 1

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, weights, bias, mask, past, attn_bias = _inputs(inputs, 6)
        assert x is not None and weights is not None
        qkv = torch.matmul(x, weights)
        if bias is not None:
            qkv = qkv + bias
        split = sizes or [weights.shape[1] // 3] * 3
        q, k, v = (_heads(t, heads) for t in torch.split(qkv, split, dim=-1))
        past_len = 0
        if past is not None:
            past_len = past.shape[3]
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        scale = scale_attr or 1.0 / math.sqrt(q.shape[-1])
        key_mask = _key_mask(mask, x.shape[0], x.shape[1], k.shape[2], filter_value,
                             "mask_index")
        out = _sdpa(q, k, v, scale, key_mask, attn_bias, past_len if causal else None,
                    filter_value)
        result = [_merge(out)]
        if wants_present:
            result.append(torch.stack([k, v]))
        return result
    return kernel


def _multi_head_attention(node: Node, ctx: BindContext) -> Kernel:
    heads = int(node.attrs["num_heads"])
    causal = bool(node.attrs.get("unidirectional", 0))
    filter_value = float(node.attrs.get("mask_filter_value", MASK_FILTER_VALUE))
    scale_attr = float(node.attrs.get("scale", 0.0))
    n_out = len(node.outputs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        query, key, value, bias, mask, attn_bias, past_key, past_value = _inputs(inputs, 8)
        assert query is not None
        if key is None or value is None or key.dim() != 3 or value.dim() != 3 \
                or query.dim() != 3:
            raise UnsupportedOp(f"{node.label}: MultiHeadAttention takes 3-D query, key "
                                "and value here (packed and per-head layouts are not "
                                "supported)")
        if bias is not None:
            d, dv = query.shape[-1], value.shape[-1]
            query = query + bias[:d]
            key = key + bias[d:2 * d]
            value = value + bias[2 * d:2 * d + dv]
        q, k, v = _heads(query, heads), _heads(key, heads), _heads(value, heads)
        past_len = 0
        if past_key is not None and past_value is not None:
            past_len = past_key.shape[2]
            k = torch.cat([past_key, k], dim=2)
            v = torch.cat([past_value, v], dim=2)
        scale = scale_attr or 1.0 / math.sqrt(q.shape[-1])
        key_mask = _key_mask(mask, query.shape[0], query.shape[1], k.shape[2], filter_value,
                             "key_padding_mask")
        out = _sdpa(q, k, v, scale, key_mask, attn_bias, past_len if causal else None,
                    filter_value)
        return [_merge(out), k, v][:n_out]
    return kernel


# -- MatMulNBits ---------------------------------------------------------------------------
def _unpack_nibbles(packed: Tensor) -> Tensor:
    """uint8 [..., n] -> [..., 2n] 4-bit values, the low nibble first."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)


def _matmul_nbits(node: Node, ctx: BindContext) -> Kernel:
    k_dim, n_dim = int(node.attrs["K"]), int(node.attrs["N"])
    bits = int(node.attrs.get("bits", 4))
    block = int(node.attrs["block_size"])
    if bits != 4:
        raise UnsupportedOp(f"{node.label}: MatMulNBits with bits={bits} is not supported "
                            "(bits=4 is)")
    if has_input(node, 4):
        raise UnsupportedOp(f"{node.label}: MatMulNBits with g_idx is not supported")
    blocks = -(-k_dim // block)

    # accuracy_level 4: onnxruntime quantizes A to int8 per block of K (symmetric, scale
    # max|a| / 127) and multiplies in integers, where the zero points are 4-bit ones.
    int8_a = int(node.attrs.get("accuracy_level", 0)) == 4

    def codes(b: Tensor, zero_points: Tensor | None) -> tuple[Tensor, Tensor]:
        """The weight's 4-bit values [N, blocks, block] and zero points [N, blocks]."""
        q = _unpack_nibbles(b.reshape(n_dim, -1))[:, :blocks * block]
        if zero_points is None:
            zp = torch.full((n_dim, blocks), 8, dtype=torch.uint8, device=b.device)
        elif zero_points.dtype == torch.uint8:
            zp = _unpack_nibbles(zero_points.reshape(n_dim, -1))[:, :blocks]
        else:
            zp = zero_points.reshape(n_dim, blocks)
        return q.reshape(n_dim, blocks, block), zp

    def weight(b: Tensor, scales: Tensor, zero_points: Tensor | None) -> Tensor:
        q, zp = codes(b, zero_points)
        s = scales.reshape(n_dim, blocks).to(torch.float32)
        w = (q.to(torch.float32) - zp.to(torch.float32)[:, :, None]) * s[:, :, None]
        return w.reshape(n_dim, blocks * block)[:, :k_dim]

    def int8_product(a: Tensor, b: Tensor, scales: Tensor, zero_points: Tensor | None
                     ) -> Tensor:
        q, zp = codes(b, zero_points)
        centered = q.to(torch.float64) - zp.to(torch.float64)[:, :, None]
        padded = F.pad(a, (0, blocks * block - k_dim)).reshape(*a.shape[:-1], blocks, block)
        a_scale = padded.abs().amax(dim=-1, keepdim=True) / 127.0
        inverse = torch.where(a_scale != 0, 1.0 / a_scale, torch.zeros_like(a_scale))
        qa = torch.round(padded * inverse).to(torch.float64)
        acc = torch.einsum("...bk,nbk->...nb", qa, centered).to(torch.float32)
        s = scales.reshape(n_dim, blocks).to(torch.float32)
        return (acc * a_scale.squeeze(-1).unsqueeze(-2) * s).sum(dim=-1)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b, scales, zero_points, _, bias = _inputs(inputs, 6)
        assert a is not None and b is not None and scales is not None
        if int8_a and a.dtype == torch.float32 and (zero_points is None
                                                    or zero_points.dtype == torch.uint8):
            y = int8_product(a, b, scales, zero_points)
        else:
            y = torch.matmul(a, weight(b, scales, zero_points).to(a.dtype).t())
        return [y if bias is None else y + bias]
    return kernel


OPS: list[OpDef] = [
    OpDef("FusedConv", _fused_conv, domain=MS_DOMAIN),
    OpDef("FusedGemm", _fused_gemm, domain=MS_DOMAIN),
    OpDef("FusedMatMul", _fused_matmul, domain=MS_DOMAIN),
    OpDef("Gelu", _gelu, domain=MS_DOMAIN),
    OpDef("FastGelu", _fast_gelu, domain=MS_DOMAIN),
    OpDef("BiasGelu", _bias_gelu, domain=MS_DOMAIN),
    OpDef("SkipLayerNormalization", _skip_layer_norm, domain=MS_DOMAIN),
    OpDef("EmbedLayerNormalization", _embed_layer_norm, domain=MS_DOMAIN),
    OpDef("Attention", _attention, domain=MS_DOMAIN),
    OpDef("MultiHeadAttention", _multi_head_attention, domain=MS_DOMAIN),
    OpDef("MatMulNBits", _matmul_nbits, domain=MS_DOMAIN),
]
