"""Rule ``silu``: ``x * sigmoid(x)`` (SiLU) and ``x * sigmoid(alpha * x)`` become one
``Swish`` node (``alpha`` attribute), which ``activation`` then makes a post-op.

The exporters write SiLU as a Sigmoid and a Mul reading the same value (the Mul's
operands in either order); ``alpha * x`` is a Mul by a one-element constant (the
1.702 of QuickGELU). Swish is an opset-24 op: the node gets that opset, whatever the
model's, since it is segflow's rewrite and not the model's own node.
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node, Value
from segflow.passes._rewrite import const_scalar, replace_nodes
from segflow.passes.fuse._match import is_op, live_nodes, only_consumer, other_input

SWISH_SINCE = 24


def fuse_silu(graph: Graph) -> int:
    """``x * sigmoid(alpha * x)`` (alpha 1 where there is no scaling Mul) -> Swish."""
    count = 0
    for sigmoid in live_nodes(graph, "Sigmoid"):
        mul = only_consumer(graph, sigmoid.outputs[0])
        if not is_op(mul, "Mul") or mul is None:
            continue
        x = other_input(mul, sigmoid.outputs[0])
        arg = sigmoid.inputs[0]
        if x is None or arg is None or x is sigmoid.outputs[0]:
            continue
        absorbed: list[Node] = [sigmoid]
        alpha = 1.0 if arg is x else _scale_of(graph, arg, x)
        if alpha is None:
            continue
        if arg is not x:
            assert arg.producer is not None
            absorbed.insert(0, arg.producer)
        swish = Node("Swish", [x], [Value(mul.outputs[0].name)], {"alpha": alpha},
                     name=sigmoid.name, opset=max(SWISH_SINCE, mul.opset))
        replace_nodes(graph, mul, absorbed, swish)
        count += 1
    return count


def _scale_of(graph: Graph, arg: Value, x: Value) -> float | None:
    """``alpha`` where ``arg = alpha * x`` (a Mul by a one-element constant, read only
    by the Sigmoid), else None."""
    scale = arg.producer
    if not is_op(scale, "Mul") or scale is None or x not in scale.inputs \
            or only_consumer(graph, arg) is None:
        return None
    other = other_input(scale, x)
    if other is None or other is x:
        return None
    rank = other.spec.rank
    if rank is not None and rank > 0 and (x.spec.rank is None or rank > x.spec.rank):
        return None
    return const_scalar(other)
