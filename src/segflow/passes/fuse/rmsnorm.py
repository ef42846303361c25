"""Rule ``rmsnorm``: the exporters' root-mean-square normalization over the last axis,
``x / sqrt(mean(x * x, -1) + eps) * w``, becomes one ONNX ``RMSNormalization``.

The dataflow it takes, each intermediate read only by the next step:

- the square: ``Pow(x, 2)`` or ``Mul(x, x)``;
- ``ReduceMean`` over the last axis only (``axes`` attribute or constant input), keepdims;
- ``Add`` of a one-element constant ``eps`` (either operand order);
- the inverse root, then the product with ``x``: ``Sqrt`` and ``Div(x, ·)``; ``Sqrt``,
  then ``Div(1, ·)`` or ``Reciprocal`` and ``Mul(x, ·)``; or ``Pow(·, -0.5)`` and
  ``Mul(x, ·)``;
- ``Mul`` by a constant 1-D weight of the last axis' width (either operand order).

``x`` must be float32 with its last dimension known. Casts to float32 of a float32 tensor
around it (how torch writes ``x.to(torch.float32)``) are gone by then: the ``noops`` rule
drops them. The node is the op's own declaration (``ops/_transformer.rms_norm``); the
``layernorm`` rule, which runs after this one, gives it the native kernel and takes in a
residual Add before it.
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node, Value
from segflow.passes._rewrite import const_scalar, replace_nodes
from segflow.passes.fuse._match import (
    close_to,
    const_tensor,
    is_float32,
    is_op,
    live_nodes,
    only_consumer,
    other_input,
)

# The opset that declares RMSNormalization; the node carries it (the graph may import an
# older one).
RMS_NORMALIZATION_SINCE = 23


def fuse_rmsnorm(graph: Graph) -> int:
    """``x / sqrt(mean(x^2, -1) + eps) * w`` (the forms above) -> ``RMSNormalization``."""
    count = 0
    for mean in live_nodes(graph, "ReduceMean"):
        match = _match(graph, mean)
        if match is None:
            continue
        x, weight, eps, last, absorbed = match
        norm = Node("RMSNormalization", [x, weight], [Value(last.outputs[0].name)],
                    {"axis": -1, "epsilon": eps}, name=mean.name,
                    opset=max(RMS_NORMALIZATION_SINCE, mean.opset))
        replace_nodes(graph, last, absorbed, norm)
        count += 1
    return count


def _match(graph: Graph, mean: Node) -> tuple[Value, Value, float, Node, list[Node]] | None:
    """``(x, weight, eps, the last Mul, the other nodes)`` where ``mean`` is the
    ReduceMean of one of the forms, else None."""
    square_value = mean.inputs[0]
    square = square_value.producer if square_value is not None else None
    if square is None or square_value is None or only_consumer(graph, square_value) is not mean:
        return None
    x = _squared(square)
    if x is None or not is_float32(x) or not _last_axis_mean(mean, x):
        return None
    width = x.spec.shape[-1] if x.spec.shape else None
    if not isinstance(width, int):
        return None
    add = only_consumer(graph, mean.outputs[0])
    if not is_op(add, "Add"):
        return None
    assert add is not None
    eps_value = other_input(add, mean.outputs[0])
    eps = const_scalar(eps_value)
    if eps is None or eps_value is None or eps < 0 \
            or (eps_value.spec.rank or 0) > (x.spec.rank or 0):   # would widen the result
        return None
    scaled = _scaled_by_inverse_root(graph, add.outputs[0], x)
    if scaled is None:
        return None
    product, between = scaled
    last = only_consumer(graph, product.outputs[0])
    if not is_op(last, "Mul"):
        return None
    assert last is not None
    weight = other_input(last, product.outputs[0])
    w = const_tensor(weight)
    if weight is None or w is None or w.dim() != 1 or w.numel() != width or not is_float32(weight):
        return None
    return x, weight, eps, last, [square, mean, add, *between, product]


def _squared(square: Node) -> Value | None:
    """``x`` where ``square`` is ``Pow(x, 2)`` or ``Mul(x, x)``."""
    x = square.inputs[0]
    if is_op(square, "Pow") and close_to(const_scalar(square.inputs[1]), 2.0):
        return x
    if is_op(square, "Mul") and x is not None and square.inputs[1] is x:
        return x
    return None


def _last_axis_mean(mean: Node, x: Value) -> bool:
    """The ReduceMean keeps its dims and reduces the last axis of ``x`` only."""
    if not int(mean.attrs.get("keepdims", 1)):
        return False
    if "axes" in mean.attrs:
        axes = [int(a) for a in mean.attrs["axes"]]
    else:
        given = const_tensor(mean.inputs[1]) if len(mean.inputs) > 1 else None
        if given is None:
            return False
        axes = [int(a) for a in given.reshape(-1).tolist()]
    rank = x.spec.rank
    return len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))


def _scaled_by_inverse_root(graph: Graph, variance: Value, x: Value
                            ) -> tuple[Node, list[Node]] | None:
    """``(the node computing x / sqrt(variance), the nodes between)``: ``Div(x, Sqrt)``,
    ``Mul(x, Div(1, Sqrt))``, ``Mul(x, Reciprocal(Sqrt))`` or ``Mul(x, Pow(v, -0.5))``."""
    root = only_consumer(graph, variance)
    if root is None:
        return None
    if is_op(root, "Pow") and root.inputs[0] is variance \
            and close_to(const_scalar(root.inputs[1]), -0.5):
        inverse, between = root, [root]
    elif is_op(root, "Sqrt"):
        after = only_consumer(graph, root.outputs[0])
        if after is None:
            return None
        if is_op(after, "Div") and after.inputs[1] is root.outputs[0]:
            if after.inputs[0] is x:
                return after, [root]
            if not close_to(const_scalar(after.inputs[0]), 1.0):
                return None
        elif not is_op(after, "Reciprocal"):
            return None
        inverse, between = after, [root, after]
    else:
        return None
    product = only_consumer(graph, inverse.outputs[0])
    if not is_op(product, "Mul") or product is None \
            or other_input(product, inverse.outputs[0]) is not x:
        return None
    return product, between
