"""Rule ``layernorm``: an Add whose only reader is a LayerNormalization over the last
axis becomes one ``segflow.AddLayerNorm`` (a transformer's residual add and the
normalization after it; onnxruntime's SkipLayerNormalization).

The Add's two operands must have the same shape and dtype as each other (no
broadcasting; symbolic dimensions compare by name), and the LayerNormalization must
produce only its normalized output: its mean and inverse standard deviation outputs,
if declared, must be unused.
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import replace_nodes
from segflow.passes.fuse._match import is_float32, is_op, live_nodes, only_consumer


def fuse_layernorm(graph: Graph) -> int:
    """``LayerNormalization(A + B)`` (last axis) -> ``AddLayerNorm(A, B, Scale, Bias)``."""
    count = 0
    for norm in live_nodes(graph, "LayerNormalization"):
        x = norm.inputs[0]
        add = x.producer if x is not None else None
        if x is None or add is None or not is_op(add, "Add") \
                or only_consumer(graph, x) is not norm or not _last_axis(norm, x):
            continue
        if any(out.uses or out in graph.outputs for out in norm.outputs[1:]):
            continue
        a, b = add.inputs[0], add.inputs[1]
        if a is None or b is None or not (is_float32(a) and is_float32(b)) \
                or a.spec.shape is None or a.spec != b.spec:
            continue
        inputs = [a, b, *norm.inputs[1:3]]
        fused = Node("AddLayerNorm", inputs, [Value(norm.outputs[0].name)],
                     {"epsilon": float(norm.attrs.get("epsilon", 1e-5))},
                     name=norm.name, domain=FUSED_DOMAIN, opset=1)
        replace_nodes(graph, norm, [add], fused)
        count += 1
    return count


def _last_axis(norm: Node, x: Value) -> bool:
    """The LayerNormalization normalizes over the last axis only."""
    axis = int(norm.attrs.get("axis", -1))
    rank = x.spec.rank
    return axis == -1 or (rank is not None and axis == rank - 1)
