"""Rule ``activation``: an activation right after a FusedConv or FusedGemm becomes
its post-op (``activation`` and ``activation_params`` attributes).

Relu, LeakyRelu, Clip (constant bounds), Sigmoid, Tanh, HardSigmoid, HardSwish
and Gelu (erf or tanh) qualify; the kernels decide at bind time whether the
library fuses it or it runs in place after the kernel (``ops/fused.py``).
"""

from __future__ import annotations

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import const_scalar, replace_nodes
from segflow.passes.fuse._match import live_nodes, only_consumer

_FLOAT_MAX = torch.finfo(torch.float32).max


def _activation(node: Node) -> tuple[str, list[float]] | None:
    """(name, params) of an activation node the fused ops can end with."""
    if node.domain != "" or len(node.inputs) < 1:
        return None
    op = node.op_type
    if op in ("Relu", "Sigmoid", "Tanh", "HardSwish"):
        return op, []
    if op == "LeakyRelu":
        return op, [float(node.attrs.get("alpha", 0.01))]
    if op == "HardSigmoid":
        return op, [float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5))]
    if op == "Gelu":
        return ("GeluTanh" if node.attrs.get("approximate", "none") == "tanh" else "Gelu"), []
    if op == "Clip":
        if node.opset < 11:
            lo, hi = node.attrs.get("min", -_FLOAT_MAX), node.attrs.get("max", _FLOAT_MAX)
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
            # A bound left out is float32's lowest / highest (not -Inf / +Inf: ONNX's
            # Clip maps the infinities to them), like the Clip kernel.
            lo = -_FLOAT_MAX if bounds[0] is None else bounds[0]
            hi = _FLOAT_MAX if bounds[1] is None else bounds[1]
        return "Clip", [float(lo), float(hi)]
    return None


def fuse_activation(graph: Graph) -> int:
    count = 0
    for node in live_nodes(graph):
        if node.domain != FUSED_DOMAIN or node.op_type not in ("FusedConv", "FusedGemm") \
                or node.attrs.get("activation"):
            continue
        consumer = only_consumer(graph, node.outputs[0])
        act = _activation(consumer) if consumer is not None else None
        if consumer is None or act is None or consumer.inputs[0] is not node.outputs[0]:
            continue
        attrs = dict(node.attrs)
        attrs["activation"], attrs["activation_params"] = act
        fused = Node(node.op_type, node.inputs, [Value(consumer.outputs[0].name)], attrs,
                     name=node.name, domain=FUSED_DOMAIN, opset=node.opset)
        replace_nodes(graph, consumer, [node], fused)
        count += 1
    return count
