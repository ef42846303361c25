"""``segflow.DenseChain``: a run of small dense layers as one kernel.

``DenseChain(X, W_1, B_1, ..., W_L, B_L)`` computes
``act_L(... act_1(X @ W_1 + B_1) ...)`` with every ``W_l`` a constant in
``[K, N]`` (input-major) layout, every ``B_l`` a constant ``[N_l]``, and
the activations (``FusedGemm``'s: see :data:`segflow.ops.fused.ACTIVATIONS`)
in the ``activations`` / ``activation_params`` attributes (two parameters a
layer). ``X`` may have any rank >= 2; the layers act on its last axis.

The CPU pass :mod:`segflow.passes.dense_chain` builds it from consecutive small
``FusedGemm`` nodes; its kernel (native, or torch per call) is
:class:`segflow.kernels.dense_chain.DenseChain`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from segflow.ir.graph import Node

# The row's bind constructs the kernel (until a kernel registry does); the activations
# the native kernel takes are re-exported for the chaining pass (passes/dense_chain.py).
from segflow.kernels.dense_chain import NATIVE_ACTIVATIONS as NATIVE_ACTIVATIONS
from segflow.kernels.dense_chain import ChainLayer, DenseChain, DenseChainKernel
from segflow.ops.fused import ACTIVATIONS, FUSED_DOMAIN, Inline
from segflow.ops.registry import BindContext, OpDef

Tensor = torch.Tensor


def layers_of(node: Node) -> list[ChainLayer]:
    """The layers of a DenseChain node, from its constant inputs and attributes."""
    names = [str(a) for a in node.attrs.get("activations", [])]
    flat = [float(p) for p in node.attrs.get("activation_params", [])]
    consts = [v.const if v is not None else None for v in node.inputs[1:]]
    if len(consts) != 2 * len(names) or len(flat) != 2 * len(names):
        raise ValueError(f"{node.label}: {len(names)} activations, {len(flat)} parameters and "
                         f"{len(consts)} weight/bias inputs do not describe one chain")
    layers = []
    for i, name in enumerate(names):
        weight, bias = consts[2 * i], consts[2 * i + 1]
        if weight is None or bias is None:
            raise ValueError(f"{node.label}: layer {i} has no constant weight or bias")
        layers.append(ChainLayer(weight, bias, ACTIVATIONS[name], (flat[2 * i], flat[2 * i + 1])))
    return layers


def _bind(node: Node, ctx: BindContext) -> DenseChainKernel:
    library, why = (ctx.target.native, ctx.target.native_why) if ctx.device.type == "cpu" \
        else (None, f"is CPU-only (the node runs on {ctx.device.type})")
    return DenseChainKernel(DenseChain(layers_of(node), library, why))


def inline_chain(node: Node, kernel: object) -> Inline | None:
    """Generated code calls the kernel's op with the chain's input only."""
    if isinstance(kernel, DenseChainKernel):
        return Inline("{fn}({in0})", {"fn": kernel.op})
    return None


def traceable_chain(node: Node) -> Inline:
    """Plain torch ops over the node's inputs, for tracers (inductor, oneDNN Graph)."""
    acts = [(layer.activation, list(layer.params)) for layer in layers_of(node)]

    def chain(x: Tensor, *weights_and_biases: Tensor) -> Tensor:
        # Rank 2 (the usual case) without reshapes: tracers see plain addmm + activation.
        h = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        for i, (act, params) in enumerate(acts):
            # F.linear over the transposed view: oneDNN Graph's fuser rejects addmm here.
            h = act.apply(F.linear(h, weights_and_biases[2 * i].t(),
                                   weights_and_biases[2 * i + 1]), params)
        return h if x.dim() == 2 else h.reshape(*x.shape[:-1], h.shape[-1])
    args = ", ".join(f"{{in{i}}}" for i in range(len(node.inputs)))
    return Inline(f"{{fn}}({args})", {"fn": chain})


OPS: list[OpDef] = [
    OpDef("DenseChain", _bind, domain=FUSED_DOMAIN,
          doc="act_L(...act_1(X @ W_1 + B_1)...): consecutive small dense layers as one "
              "native kernel (W in [K, N] layout)"),
]
