"""Rule ``linear``: Gemm, and MatMul (+ Add of a bias) with a constant 2-D weight (or
the 2-D Transpose of one), become ``segflow.FusedGemm``.

The weight is stored once in ``[N, K]`` layout (torch's ``linear``), the bias as
an ``[N]`` vector. A weight stored ``[K, N]`` (a MatMul's, a Gemm's without
``transB``) is kept as the transposed view of its initializer, not copied: the
layout pass packs the large ones straight from it (``kernels/linear.pack``),
and the pipeline makes what is left contiguous after layout
(``passes/pipeline.contiguous_constants``). That saves a transposing copy of the
weights at load (~0.3 s for 340 MB). Left alone:
``transA``, ``alpha != 1``, a ``C`` that is not a bias along the last axis, a
computed weight.
"""

from __future__ import annotations

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import new_const, replace_nodes
from segflow.passes.fuse._match import const_tensor, is_float32, is_op, live_nodes, only_consumer


def _bias_vector(value: Value | None, n: int, scale: float = 1.0) -> torch.Tensor | None:
    """A bias broadcast along the last axis as an ``[n]`` tensor, if it is one."""
    c = const_tensor(value)
    if c is None or not c.is_floating_point():
        return None
    if c.numel() == 1:
        return (c.reshape(1) * scale).expand(n).contiguous()
    if c.shape[-1] == n and c.numel() == n:
        return (c.reshape(n) * scale).contiguous()
    return None


def fuse_linear(graph: Graph) -> int:
    count = 0
    for node in live_nodes(graph):
        if is_op(node, "Gemm"):
            count += _gemm_to_fused(graph, node)
        elif is_op(node, "MatMul"):
            count += _matmul_to_fused(graph, node)
    return count


def _gemm_to_fused(graph: Graph, gemm: Node) -> bool:
    if len(gemm.inputs) < 2:       # malformed: its binding names it
        return False
    b = const_tensor(gemm.inputs[1])
    x = gemm.inputs[0]
    if (b is None or b.dim() != 2 or b.dtype != torch.float32 or not is_float32(x)
            or gemm.attrs.get("transA", 0) or float(gemm.attrs.get("alpha", 1.0)) != 1.0):
        return False
    w = b if gemm.attrs.get("transB", 0) else b.t()
    n = w.shape[0]
    c_value = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    bias = None
    if c_value is not None:
        bias = _bias_vector(c_value, n, float(gemm.attrs.get("beta", 1.0)))
        if bias is None:
            return False
    inputs: list[Value | None] = [x, new_const(graph, f"{gemm.name}.weight_nk", w)]
    if bias is not None:
        inputs.append(new_const(graph, f"{gemm.name}.bias", bias))
    fused = Node("FusedGemm", inputs, [Value(gemm.outputs[0].name)], {}, name=gemm.name,
                 domain=FUSED_DOMAIN, opset=1)
    replace_nodes(graph, gemm, [], fused)
    return True


def _weight_nk(value: Value | None) -> torch.Tensor | None:
    """A MatMul's constant 2-D ``[K, N]`` operand in ``[N, K]`` layout: the transposed
    view of a constant, or the constant itself where the operand is a 2-D Transpose of
    one (exporters write a tied or ``[N, K]``-stored weight that way, and a Transpose of
    a weight over folding's size limit stays a node: a language model's head)."""
    b = const_tensor(value)
    if b is not None:
        return b.t() if b.dim() == 2 and b.dtype == torch.float32 else None
    transpose = value.producer if value is not None else None
    if not is_op(transpose, "Transpose") or transpose is None:
        return None
    w = const_tensor(transpose.inputs[0])
    if w is None or w.dim() != 2 or w.dtype != torch.float32 \
            or tuple(transpose.attrs.get("perm", (1, 0))) != (1, 0):
        return None
    return w


def _matmul_to_fused(graph: Graph, mm: Node) -> bool:
    if len(mm.inputs) < 2:
        return False
    x = mm.inputs[0]
    w = _weight_nk(mm.inputs[1])
    if w is None or not is_float32(x) or x is None or x.spec.rank is None or x.spec.rank < 2:
        return False
    n = w.shape[0]
    anchor, absorbed, bias = mm, [], None
    consumer = only_consumer(graph, mm.outputs[0])
    if is_op(consumer, "Add"):
        assert consumer is not None
        other = consumer.inputs[1] if consumer.inputs[0] is mm.outputs[0] else consumer.inputs[0]
        bias = _bias_vector(other, n)
        if bias is not None:
            anchor, absorbed = consumer, [mm]
    inputs: list[Value | None] = [x, new_const(graph, f"{mm.name}.weight_nk", w)]
    if bias is not None:
        inputs.append(new_const(graph, f"{anchor.name}.bias", bias))
    fused = Node("FusedGemm", inputs, [Value(anchor.outputs[0].name)], {}, name=mm.name,
                 domain=FUSED_DOMAIN, opset=1)
    replace_nodes(graph, anchor, absorbed, fused)
    return True
