"""Rule ``batchnorm``: fold an inference BatchNormalization into the Conv or Gemm
before it.

``BN(conv(x, W, b)) = conv(x, W * s, b * s + t)`` per output channel, with
``s = gamma / sqrt(var + eps)`` and ``t = beta - mean * s`` computed in float64;
the new weight (``W * s``, in float32 for a float32 weight) and bias are stored in
the weight's dtype as new constants. Left alone: training-mode
BatchNormalization, one whose running statistics are read, and one whose input
has other readers.
"""

from __future__ import annotations

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.passes._rewrite import new_const, replace_nodes
from segflow.passes.fuse._match import const_tensor, is_op, live_nodes, only_consumer


def _bn_affine(bn: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scale, shift) with BN(y) = y * scale + shift per channel, or None."""
    if bn.attrs.get("training_mode", 0) or len(bn.inputs) < 5:
        return None
    if any(v.uses or v in (bn.graph.outputs if bn.graph else []) for v in bn.outputs[1:]):
        return None
    params = [const_tensor(v) for v in bn.inputs[1:5]]
    if any(p is None for p in params):
        return None
    # Parameters of one length C each; anything else is the node's error at run time.
    if len({tuple(p.shape) for p in params}) != 1 or params[0].dim() != 1:  # type: ignore[union-attr]
        return None
    gamma, beta, mean, var = (p.double() for p in params)  # type: ignore[union-attr]
    eps = float(bn.attrs.get("epsilon", 1e-5))
    scale = gamma / torch.sqrt(var + eps)
    return scale, beta - mean * scale


def fuse_batchnorm(graph: Graph) -> int:
    count = 0
    for bn in live_nodes(graph, "BatchNormalization"):
        y = bn.inputs[0]
        producer = y.producer if y is not None else None
        if y is None or producer is None or only_consumer(graph, y) is not bn:
            continue
        affine = _bn_affine(bn)
        if affine is None:
            continue
        if is_op(producer, "Conv"):
            done = _bn_into_conv(graph, producer, bn, *affine)
        elif is_op(producer, "Gemm"):
            done = _bn_into_gemm(graph, producer, bn, *affine)
        else:
            done = False
        count += done
    return count


def _bn_into_conv(graph: Graph, conv: Node, bn: Node, scale: torch.Tensor,
                  shift: torch.Tensor) -> bool:
    weight = const_tensor(conv.inputs[1])
    if weight is None or not weight.is_floating_point() or weight.shape[0] != scale.shape[0]:
        return False
    has_bias = len(conv.inputs) > 2 and conv.inputs[2] is not None
    bias = const_tensor(conv.inputs[2]) if has_bias else None
    if has_bias and bias is None:
        return False
    shape = [-1] + [1] * (weight.dim() - 1)
    # A float32 weight is scaled in float32 (one rounding more than float64, under an
    # ulp; tens of millions of weights in float64 take ~0.1 s of a load); narrower
    # weights in float64, where a rounded scale would cost precision.
    wide = torch.float32 if weight.dtype == torch.float32 else torch.float64
    new_w = (weight.to(wide) * scale.to(wide).reshape(shape)).to(weight.dtype)
    old_b = bias.double() if bias is not None else torch.zeros_like(scale)
    new_b = (old_b * scale + shift).to(weight.dtype)
    w_value = new_const(graph, f"{conv.name}.weight_bn", new_w.contiguous())
    b_value = new_const(graph, f"{conv.name}.bias_bn", new_b.contiguous())
    x = conv.inputs[0]
    fused = Node("Conv", [x, w_value, b_value], [Value(bn.outputs[0].name)], dict(conv.attrs),
                 name=conv.name, opset=conv.opset)
    replace_nodes(graph, bn, [conv], fused)
    return True


def _bn_into_gemm(graph: Graph, gemm: Node, bn: Node, scale: torch.Tensor,
                  shift: torch.Tensor) -> bool:
    b = const_tensor(gemm.inputs[1])
    c_value = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    c = const_tensor(c_value)
    if b is None or b.dim() != 2 or (c_value is not None and c is None):
        return False
    trans_b = int(gemm.attrs.get("transB", 0))
    n = b.shape[0] if trans_b else b.shape[1]
    if n != scale.shape[0]:
        return False
    beta = float(gemm.attrs.get("beta", 1.0))
    if c is not None and c.numel() not in (1, n):
        return False
    c_vec = (c.double().reshape(-1).expand(n) * beta) if c is not None else torch.zeros(n).double()
    new_b = b.double() * (scale.reshape(-1, 1) if trans_b else scale.reshape(1, -1))
    new_c = c_vec * scale + shift
    attrs = dict(gemm.attrs)
    attrs["beta"] = 1.0
    b_value = new_const(graph, f"{gemm.name}.weight_bn", new_b.to(b.dtype).contiguous())
    c_new = new_const(graph, f"{gemm.name}.bias_bn", new_c.to(b.dtype).contiguous())
    fused = Node("Gemm", [gemm.inputs[0], b_value, c_new], [Value(bn.outputs[0].name)], attrs,
                 name=gemm.name, opset=gemm.opset)
    replace_nodes(graph, bn, [gemm], fused)
    return True
