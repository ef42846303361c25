"""Linear algebra beyond MatMul/Gemm: Einsum, Det, and the matrix recurrences and
score/probability products of LinearAttention and FlexAttention."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from segflow.errors import UnsupportedOp
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.ops import gradients
from segflow.ops._common import has_input
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor

_EINSUM_NATIVE = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                  torch.int32, torch.int64, torch.complex64, torch.complex128)


def _einsum(node: Node, ctx: BindContext) -> Kernel:
    # torch.einsum accepts ONNX's grammar (implicit output, "..." broadcasting) once the
    # whitespace ONNX allows is gone.
    equation = "".join(str(node.attrs["equation"]).split())

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        operands = [t for t in inputs if t is not None]
        dtype = operands[0].dtype
        if dtype in _EINSUM_NATIVE:
            return [torch.einsum(equation, *operands)]
        # Narrow integer types: accumulate in int64 and wrap back, as a C loop would.
        wide = [t.to(torch.int64) for t in operands]
        return [torch.einsum(equation, *wide).to(dtype)]
    return kernel


def _det(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if x.dtype in (torch.float16, torch.bfloat16):
            return [torch.linalg.det(x.to(torch.float32)).to(x.dtype)]
        return [torch.linalg.det(x)]
    return kernel


def _heads(x: Tensor, num_heads: int) -> Tensor:
    """(B, T, H*D) -> (B, H, T, D)."""
    b, t, hd = x.shape
    return x.reshape(b, t, num_heads, hd // num_heads).transpose(1, 2)


_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


def _linear_attention(node: Node, ctx: BindContext) -> Kernel:
    """Linear-attention recurrence over a (d_k x d_v) state per KV head, in float32."""
    attrs = node.attrs
    rule = str(attrs.get("update_rule", "gated_delta"))
    if rule not in _UPDATE_RULES:
        raise UnsupportedOp(f"{node.label}: unknown update_rule {rule!r}")
    q_heads, kv_heads = int(attrs["q_num_heads"]), int(attrs["kv_num_heads"])
    scale_attr = float(attrs.get("scale", 0.0) or 0.0)
    gating = rule in ("gated", "gated_delta")
    delta = rule in ("delta", "gated_delta")
    has_past = has_input(node, 3)
    group = q_heads // kv_heads

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        query, key, value = inputs[0], inputs[1], inputs[2]
        assert query is not None and key is not None and value is not None
        past = inputs[3] if has_past else None
        decay = inputs[4] if len(inputs) > 4 else None
        beta = inputs[5] if len(inputs) > 5 else None
        b, t, _ = query.shape
        d_k = query.shape[-1] // q_heads
        d_v = value.shape[-1] // kv_heads
        q = _heads(query.float(), q_heads)
        k = _heads(key.float(), kv_heads)
        v = _heads(value.float(), kv_heads)
        if gating:
            assert decay is not None
            # Per-head scalar decay (B, T, H) or per-key-dimension decay (B, T, H*d_k).
            g = _heads(decay.float(), kv_heads)            # (B, H, T, 1 or d_k)
        if delta:
            assert beta is not None
            rate = beta.float().reshape(b, t, beta.shape[-1], 1).transpose(1, 2)
        state = past.float().clone() if past is not None else \
            query.new_zeros((b, kv_heads, d_k, d_v), dtype=torch.float32)
        scale = scale_attr or 1.0 / math.sqrt(d_k)
        outputs = []
        for i in range(t):
            k_t, v_t = k[:, :, i], v[:, :, i]
            if gating:
                state = state * torch.exp(g[:, :, i]).unsqueeze(-1)
            if delta:
                retrieved = torch.einsum("bhdm,bhd->bhm", state, k_t)
                v_t = rate[:, :, i] * (v_t - retrieved)
            state = state + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
            read = state.repeat_interleave(group, dim=1) if group > 1 else state
            outputs.append(scale * torch.einsum("bhd,bhdm->bhm", q[:, :, i], read))
        out = torch.stack(outputs, dim=2) if outputs else q.new_zeros((b, q_heads, 0, d_v))
        out = out.transpose(1, 2).reshape(b, t, q_heads * d_v)
        state_dtype = past.dtype if past is not None else query.dtype
        return [out.to(query.dtype), state.to(state_dtype)]
    return kernel


def _flex_attention(node: Node, ctx: BindContext) -> Kernel:
    """Scaled dot-product attention with optional score_mod / prob_mod subgraphs."""
    scale_attr = node.attrs.get("scale")
    precision = node.attrs.get("softmax_precision")
    compute_attr = DType.from_onnx(int(precision)).torch if precision else None
    score_mod = node.subgraphs.get("score_mod")
    prob_mod = node.subgraphs.get("prob_mod")
    score_run = ctx.subgraph(score_mod) if score_mod is not None else None
    prob_run = ctx.subgraph(prob_mod) if prob_mod is not None else None
    captured = ctx.captured(node)
    n_explicit = len(node.inputs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        q, k, v = inputs[0], inputs[1], inputs[2]
        assert q is not None and k is not None and v is not None
        outer = dict(zip(captured, inputs[n_explicit:]))
        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        scale = float(scale_attr) if scale_attr is not None else 1.0 / math.sqrt(q.shape[-1])
        # Scale both operands by sqrt(scale) in the input type, as ONNX's reference does.
        root = torch.tensor(math.sqrt(scale), dtype=torch.float32).to(q.dtype)
        scores = torch.matmul(q * root, (k * root).transpose(-1, -2))
        compute = compute_attr or (q.dtype if q.dtype == torch.float64 else torch.float32)
        scores = scores.to(compute)
        if score_run is not None:
            scores = score_run([scores], outer)[0].to(compute)
        probs = torch.softmax(scores, dim=-1)
        if prob_run is not None:
            probs = prob_run([probs], outer)[0].to(compute)
        return [torch.matmul(probs, v.to(compute)).to(v.dtype)]
    return kernel


OPS: list[OpDef] = [
    OpDef("Einsum", _einsum, since=12, grad=gradients.recompute),
    OpDef("Det", _det, since=11, grad=gradients.recompute),
    OpDef("LinearAttention", _linear_attention, since=27, grad=gradients.recompute),
    OpDef("FlexAttention", _flex_attention, domain="ai.onnx.preview", since=1),
]
