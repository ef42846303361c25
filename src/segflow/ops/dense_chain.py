"""``segflow.DenseChain``: a run of small dense layers as one kernel.

``DenseChain(X, W_1, B_1, ..., W_L, B_L)`` computes
``act_L(... act_1(X @ W_1 + B_1) ...)`` with every ``W_l`` a constant in
``[K, N]`` (input-major) layout, every ``B_l`` a constant ``[N_l]``, and
the activations (``FusedGemm``'s: see :data:`segflow.ops.fused.ACTIVATIONS`)
in the ``activations`` / ``activation_params`` attributes (two parameters a
layer). ``X`` may have any rank >= 2; the layers act on its last axis.

The CPU pass :mod:`segflow.passes.dense_chain` builds it from consecutive small
``FusedGemm`` nodes. The row's kernel is the reference, one torch ``addmm`` a layer;
on CPU the kernel selection chooses the native chain
(:class:`segflow.kernels.dense_chain.DenseChain`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from segflow.ir.graph import Node
from segflow.ops.fused import ACTIVATIONS, FUSED_DOMAIN, Activation, Inline
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class ChainLayer:
    """One layer: ``act(x @ weight + bias)``, weight ``[K, N]``."""

    weight: Tensor
    bias: Tensor
    activation: Activation
    params: tuple[float, float]

    @property
    def macs_per_row(self) -> int:
        return int(self.weight.shape[0]) * int(self.weight.shape[1])


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


def run_chain(x: Tensor, layers: Sequence[ChainLayer]) -> Tensor:
    """The chain through torch, one ``addmm`` (and activation) a layer: the node's
    reference kernel, and its native kernel's fallback (``kernels/dense_chain.py``)."""
    in_features = int(layers[0].weight.shape[0])
    h = x.reshape(-1, in_features)
    for layer in layers:
        act, params = layer.activation, list(layer.params)
        if act.name == "Relu":   # relu(addmm) in one ATen call (same bits)
            h = torch._addmm_activation(layer.bias, h, layer.weight)
            continue
        h = torch.addmm(layer.bias, h, layer.weight)
        h = act.inplace(h, params) if act.inplace is not None else act.apply(h, params)
    return h.reshape(*x.shape[:-1], int(layers[-1].weight.shape[1]))


def _bind(node: Node, ctx: BindContext) -> Kernel:
    layers = layers_of(node)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        return [run_chain(x, layers)]
    return kernel


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
