"""Rule ``activation``: an activation right after a FusedConv or FusedGemm becomes
its post-op (``activation`` and ``activation_params`` attributes).

A Reshape (Flatten, Squeeze, Unsqueeze) read only by the activation may stand between
them: the activation is elementwise, so it moves before the reshape.

Relu, LeakyRelu, Clip (constant bounds), Sigmoid, Tanh, HardSigmoid, HardSwish,
Gelu (erf or tanh) and Swish (SiLU and its scaled form) qualify; the kernels decide
at bind time whether the library fuses it or it runs in place after the kernel
(``ops/fused.py``).
"""

from __future__ import annotations

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import const_scalar, replace_nodes
from segflow.passes.fuse._match import live_nodes, only_consumer


def _activation(node: Node) -> tuple[str, list[float]] | None:
    """(name, params) of an activation node the fused ops can end with."""
    if node.domain != "" or len(node.inputs) < 1:
        return None
    op = node.op_type
    if op in ("Relu", "Sigmoid", "Tanh", "HardSwish"):
        return op, []
    if op == "Swish":
        return op, [float(node.attrs.get("alpha", 1.0))]
    if op == "LeakyRelu":
        return op, [float(node.attrs.get("alpha", 0.01))]
    if op == "HardSigmoid":
        return op, [float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5))]
    if op == "Gelu":
        return ("GeluTanh" if node.attrs.get("approximate", "none") == "tanh" else "Gelu"), []
    if op == "Clip":
        # A bound left out is the type's lowest or highest value (an infinity becomes
        # the largest finite float, as onnxruntime gives it).
        dtype = node.outputs[0].spec.dtype if node.outputs else None
        if dtype is None or not dtype.torch.is_floating_point:
            return None
        info = torch.finfo(dtype.torch)
        if node.opset < 11:
            lo, hi = node.attrs.get("min", info.min), node.attrs.get("max", info.max)
        else:
            bounds: list[float | None] = []
            for i in (1, 2):
                v = node.inputs[i] if len(node.inputs) > i else None
                if v is None:
                    bounds.append(None)
                    continue
                scalar = const_scalar(v)
                if scalar is None:
                    return None
                bounds.append(scalar)
            lo = info.min if bounds[0] is None else bounds[0]
            hi = info.max if bounds[1] is None else bounds[1]
        return "Clip", [float(lo), float(hi)]
    return None


# Ops that only reshape their first input: an elementwise activation after one is the
# same activation before it (GPT-2's exports reshape the MLP's 2-D Gemm back to 3-D
# before its GELU).
_RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})


def fuse_activation(graph: Graph) -> int:
    count = 0
    for node in live_nodes(graph):
        if node.domain != FUSED_DOMAIN or node.op_type not in ("FusedConv", "FusedGemm") \
                or node.attrs.get("activation"):
            continue
        consumer = only_consumer(graph, node.outputs[0])
        reshape = None
        if consumer is not None and consumer.domain == "" and consumer.op_type in _RESHAPES \
                and consumer.inputs[0] is node.outputs[0]:
            reshape, consumer = consumer, only_consumer(graph, consumer.outputs[0])
        act = _activation(consumer) if consumer is not None else None
        if consumer is None or act is None \
                or consumer.inputs[0] is not (reshape or node).outputs[0]:
            continue
        attrs = dict(node.attrs)
        attrs["activation"], attrs["activation_params"] = act
        if reshape is None:
            fused = Node(node.op_type, node.inputs, [Value(consumer.outputs[0].name)], attrs,
                         name=node.name, domain=FUSED_DOMAIN, opset=node.opset)
            replace_nodes(graph, consumer, [node], fused)
        else:
            fused = Node(node.op_type, node.inputs, [Value(node.outputs[0].name)], attrs,
                         name=node.name, domain=FUSED_DOMAIN, opset=node.opset)
            replace_nodes(graph, node, [], fused)
            # The reshape now carries the activation's result, under its name.
            reshaped, activated = reshape.outputs[0], consumer.outputs[0]
            graph.replace_all_uses(activated, reshaped)
            graph.remove(consumer)
            reshaped.name = activated.name
        count += 1
    return count
