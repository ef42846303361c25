"""Transformer building blocks: Attention (opset 23+), RotaryEmbedding, RMSNormalization.

Rows live in nn.py; semantics follow the ONNX reference implementation,
including its corner cases (fully masked rows give zeros, not NaN; boolean
masks mean "may attend"; a per-batch causal frontier with ``nonpad_kv_seqlen``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from segflow.errors import InvalidModel
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.ops._common import normalize_axis
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Attention attributes, parsed once."""

    scale: float | None = None
    is_causal: bool = False
    q_heads: int | None = None
    kv_heads: int | None = None
    softmax_dtype: torch.dtype | None = None
    softcap: float = 0.0
    qk_mode: int = 0
    left_window: int = -1
    right_window: int = -1


def _safe_softmax(x: Tensor) -> Tensor:
    """Softmax over the last axis that yields 0 (not NaN) for rows that are all -inf."""
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    e = torch.exp(x - top)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s == 0, torch.ones_like(s), s)


def _split_heads(t: Tensor, heads: int) -> Tensor:
    b, s, hidden = t.shape
    return t.reshape(b, s, heads, hidden // heads).transpose(1, 2)


def _frontier_mask(q_len: int, kv_len: int, offset: Tensor | int, device: torch.device,
                   allowed_fn) -> Tensor:  # type: ignore[no-untyped-def]
    i = torch.arange(q_len, device=device).reshape(q_len, 1)
    j = torch.arange(kv_len, device=device).reshape(1, kv_len)
    if isinstance(offset, Tensor):
        pos = i + offset.reshape(-1, 1, 1)        # [batch, q, 1]
        return allowed_fn(pos, j).unsqueeze(1)    # [batch, 1, q, kv]
    return allowed_fn(i + offset, j)


def attention(cfg: AttentionConfig, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
              past_k: Tensor | None, past_v: Tensor | None, nonpad: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Y, present_key, present_value, qk output (per ``qk_matmul_output_mode``)."""
    three_d = q.dim() == 3
    if three_d:
        if cfg.q_heads is None or cfg.kv_heads is None:
            raise ValueError("3-D Attention inputs need q_num_heads and kv_num_heads")
        q, k, v = (_split_heads(q, cfg.q_heads), _split_heads(k, cfg.kv_heads),
                   _split_heads(v, cfg.kv_heads))
    dtype, device = q.dtype, q.device
    scale = cfg.scale if cfg.scale is not None else 1 / math.sqrt(q.shape[3])
    root = math.sqrt(scale)
    if past_k is not None:
        k = torch.cat([past_k, k], dim=2)
    if past_v is not None:
        v = torch.cat([past_v, v], dim=2)
    present_k, present_v = k, v
    q_len, kv_len = q.shape[2], k.shape[2]
    neg_inf = torch.tensor(-math.inf, dtype=dtype, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    if mask is not None and mask.shape[-1] < kv_len:
        fill = False if mask.dtype == torch.bool else -math.inf
        pad = torch.full((*mask.shape[:-1], kv_len - mask.shape[-1]), fill, dtype=mask.dtype,
                         device=device)
        mask = torch.cat([mask, pad], dim=-1)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, zero, neg_inf)
    bias: Tensor = torch.zeros((q_len, kv_len), dtype=dtype, device=device)
    if mask is not None:
        bias = bias + mask.to(dtype)
    offset: Tensor | int
    if past_k is None and nonpad is not None:
        offset = nonpad.reshape(-1).to(torch.int64) - q_len
    else:
        offset = past_k.shape[2] if past_k is not None else 0
    if cfg.is_causal:
        allowed = _frontier_mask(q_len, kv_len, offset, device, lambda p, j: j <= p)
        bias = bias + torch.where(allowed, zero, neg_inf)
    if cfg.left_window >= 0 or cfg.right_window >= 0:
        left, right = cfg.left_window, cfg.right_window

        def in_window(p: Tensor, j: Tensor) -> Tensor:
            ok = torch.ones_like(p - j, dtype=torch.bool)
            if left >= 0:
                ok = ok & (p - j <= left)
            if right >= 0:
                ok = ok & (j - p <= right)
            return ok
        bias = bias + torch.where(_frontier_mask(q_len, kv_len, offset, device, in_window),
                                  zero, neg_inf)
    if nonpad is not None:
        keep = torch.arange(kv_len, device=device).reshape(1, -1) < nonpad.reshape(-1, 1)
        bias = bias + torch.where(keep, zero, neg_inf).reshape(-1, 1, 1, kv_len)
    heads_q, heads_k = q.shape[1], k.shape[1]
    if heads_q != heads_k and heads_q % heads_k == 0:
        k = k.repeat_interleave(heads_q // heads_k, dim=1)
        v = v.repeat_interleave(heads_q // heads_k, dim=1)
    qk = torch.matmul(q * root, (k * root).transpose(-1, -2))
    if cfg.softcap > 0:
        qk = torch.tanh(qk / cfg.softcap) * cfg.softcap
    with_bias = qk + bias
    qk_out = with_bias if cfg.qk_mode == 2 else qk
    scores = with_bias.to(cfg.softmax_dtype) if cfg.softmax_dtype is not None else with_bias
    probs = _safe_softmax(scores)
    masked_rows = torch.isneginf(bias.amax(dim=-1, keepdim=True))
    probs = torch.where(masked_rows, torch.zeros((), dtype=probs.dtype, device=device), probs)
    if cfg.qk_mode == 3:
        qk_out = probs
    y = torch.matmul(probs.to(dtype), v)
    if three_d:
        y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
    return y, present_k, present_v, qk_out.to(dtype)


_HALF = (torch.float16, torch.bfloat16)


def bind_attention(node: Node, ctx: BindContext) -> Kernel:
    attrs = node.attrs
    precision = attrs.get("softmax_precision")
    cfg = AttentionConfig(
        scale=float(attrs["scale"]) if "scale" in attrs else None,
        is_causal=bool(int(attrs.get("is_causal", 0))),
        q_heads=int(attrs["q_num_heads"]) if "q_num_heads" in attrs else None,
        kv_heads=int(attrs["kv_num_heads"]) if "kv_num_heads" in attrs else None,
        softmax_dtype=DType.from_onnx(int(precision)).torch if precision else None,
        softcap=float(attrs.get("softcap", 0.0)),
        qk_mode=int(attrs.get("qk_matmul_output_mode", 0)),
        left_window=int(attrs.get("left_window_size", -1)),
        right_window=int(attrs.get("right_window_size", -1)),
    )
    if cfg.qk_mode not in (0, 1, 2, 3):
        raise InvalidModel(f"{node.label}: qk_matmul_output_mode must be 0..3, "
                           f"got {cfg.qk_mode}")
    n_out = len(node.outputs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        q, k, v = inputs[0], inputs[1], inputs[2]
        assert q is not None and k is not None and v is not None
        opt = [inputs[i] if len(inputs) > i else None for i in range(3, 7)]
        if q.dtype not in _HALF:
            return list(attention(cfg, q, k, v, *opt)[:n_out])
        # Half inputs run in float32 and round once at the end: rounding every step
        # (scores, exponentials, their sum) puts Y one half-precision step off
        # onnxruntime's and ONNX's reference results in about 1% of the elements.
        def widen(t: Tensor | None) -> Tensor | None:
            return t.float() if t is not None and t.dtype in _HALF else t
        outs = attention(cfg, q.float(), k.float(), v.float(), *map(widen, opt))
        return [out.to(q.dtype) for out in outs[:n_out]]
    return kernel


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None,
                     interleaved: bool, rotary_dim: int, num_heads: int) -> Tensor:
    """ONNX RotaryEmbedding over [B, H, S, D] or [B, S, H*D] inputs."""
    shape = x.shape
    if x.dim() == 4:
        x = x.transpose(1, 2)  # [B, S, H, D]
    else:
        if num_heads <= 0:
            raise ValueError("RotaryEmbedding on 3-D input needs num_heads")
        x = x.reshape(shape[0], shape[1], num_heads, shape[2] // num_heads)
    dim = rotary_dim or x.shape[3]
    rot, rest = x[..., :dim], x[..., dim:]
    if positions is not None:
        cos, sin = cos[positions.to(torch.int64)], sin[positions.to(torch.int64)]
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : dim // 2], rot[..., dim // 2:]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rot = torch.stack([real, imag], dim=-1).reshape(rot.shape)
    else:
        rot = torch.cat([real, imag], dim=-1)
    out = torch.cat([rot, rest], dim=-1)
    return out.reshape(shape) if len(shape) == 3 else out.transpose(1, 2)


def bind_rotary(node: Node, ctx: BindContext) -> Kernel:
    interleaved = bool(int(node.attrs.get("interleaved", 0)))
    rotary_dim = int(node.attrs.get("rotary_embedding_dim", 0))
    num_heads = int(node.attrs.get("num_heads", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, cos, sin = inputs[0], inputs[1], inputs[2]
        assert x is not None and cos is not None and sin is not None
        positions = inputs[3] if len(inputs) > 3 else None
        return [rotary_embedding(x, cos, sin, positions, interleaved, rotary_dim, num_heads)]
    return kernel


def rms_norm(x: Tensor, scale: Tensor, axis: int, eps: float) -> Tensor:
    """RMSNormalization's semantics, ``x / sqrt(mean(x * x) + eps) * scale`` over the axes
    from ``axis`` on (half types computed in float32): the op's kernel, and the reference
    of ``segflow.AddLayerNorm``'s ``simplified`` form (``ops/fused.py``)."""
    a = normalize_axis(axis, x.dim())
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dims = tuple(range(a, x.dim()))
    inv = torch.rsqrt((work * work).mean(dim=dims, keepdim=True) + eps)
    return ((work * inv).to(x.dtype) * scale).to(x.dtype)


def bind_rms_norm(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", -1))
    eps = float(node.attrs.get("epsilon", 1e-5))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale = inputs[0], inputs[1]
        assert x is not None and scale is not None
        return [rms_norm(x, scale, axis, eps)]
    return kernel


def bind_causal_conv_with_state(node: Node, ctx: BindContext) -> Kernel:
    """Depthwise causal conv1d carrying its last k-1 inputs as state (Mamba-style blocks)."""
    activation = str(node.attrs.get("activation", "none"))
    if activation not in ("none", "silu", "swish"):
        raise InvalidModel(f"{node.label}: unsupported activation {activation!r} "
                           "(expected none, silu or swish)")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        bias = inputs[2] if len(inputs) > 2 else None
        past = inputs[3] if len(inputs) > 3 else None
        batch, channels, _ = x.shape
        k = w.shape[2]
        if past is None:
            past = x.new_zeros((batch, channels, k - 1))
        padded = torch.cat([past.to(x.dtype), x], dim=2)
        y = torch.nn.functional.conv1d(padded, w, bias, groups=channels)
        if activation != "none":
            y = (y.float() * torch.sigmoid(y.float())).to(x.dtype)
        return [y, padded[:, :, padded.shape[2] - (k - 1):]]
    return kernel
