"""Rule ``gelu_tanh``: the tanh approximation of GELU as the exporters write it,
``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))``, becomes one
``Gelu(approximate="tanh")`` node (which ``activation`` then makes a post-op).

The cube is a ``Pow(x, 3)`` or ``x * x * x``; every binary op may take its operands
in either order, and the final product of ``x``, ``0.5`` and ``1 + tanh`` may be
associated any way (:func:`~segflow.passes.fuse._match.scaled_product`).
"""

from __future__ import annotations

import math

from segflow.ir.graph import Graph, Node, Value
from segflow.passes._rewrite import const_scalar, replace_nodes
from segflow.passes.fuse._match import (
    close_to,
    constant_operand,
    is_op,
    live_nodes,
    only_consumer,
    other_input,
    scaled_product,
)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def fuse_gelu_tanh(graph: Graph) -> int:
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` -> Gelu(tanh)."""
    count = 0
    for tanh in live_nodes(graph, "Tanh"):
        inner = _inner(graph, tanh)
        if inner is None:
            continue
        x, head = inner
        add = only_consumer(graph, tanh.outputs[0])
        if not is_op(add, "Add") or add is None \
                or not constant_operand(add, tanh.outputs[0], 1.0):
            continue
        product = scaled_product(graph, add.outputs[0], x, 0.5)
        if product is None:
            continue
        last, tail = product
        gelu = Node("Gelu", [x], [Value(last.outputs[0].name)], {"approximate": "tanh"},
                    name=tanh.name, opset=tanh.opset)
        replace_nodes(graph, last, [*head, tanh, add, *tail], gelu)
        count += 1
    return count


def _inner(graph: Graph, tanh: Node) -> tuple[Value, list[Node]] | None:
    """``x`` and the nodes computing ``sqrt(2/pi) * (x + 0.044715 * x^3)`` for ``tanh``,
    each read only by the next."""
    arg = tanh.inputs[0]
    scale = arg.producer if arg is not None else None
    if arg is None or not is_op(scale, "Mul") or only_consumer(graph, arg) is not tanh:
        return None
    assert scale is not None
    for inner in scale.inputs:
        if inner is None or not constant_operand(scale, inner, _SQRT_2_OVER_PI):
            continue
        add = inner.producer
        if not is_op(add, "Add") or add is None or only_consumer(graph, inner) is not scale:
            return None
        for x in add.inputs:
            term = other_input(add, x) if x is not None else None
            cubic = _cubic_term(graph, term, x) if term is not None else None
            if x is not None and cubic is not None:
                return x, [*cubic, add, scale]
    return None


def _cubic_term(graph: Graph, term: Value, x: Value | None) -> list[Node] | None:
    """The nodes computing ``term = 0.044715 * x^3`` (read only by the next), or None."""
    mul = term.producer
    if not is_op(mul, "Mul") or mul is None or x is None or term is x:
        return None
    for cube in mul.inputs:
        if cube is None or not constant_operand(mul, cube, _CUBIC) \
                or only_consumer(graph, cube) is not mul:
            continue
        nodes = _cube(graph, cube, x)
        return None if nodes is None else [*nodes, mul]
    return None


def _cube(graph: Graph, cube: Value, x: Value) -> list[Node] | None:
    """The nodes computing ``cube = x^3``: ``Pow(x, 3)`` or ``x * x * x`` in either
    association."""
    node = cube.producer
    if node is None:
        return None
    if is_op(node, "Pow") and node.inputs[0] is x and close_to(const_scalar(node.inputs[1]), 3.0):
        return [node]
    if not is_op(node, "Mul") or x not in node.inputs:
        return None
    square = other_input(node, x)
    inner = square.producer if square is not None else None
    if square is None or square is x or not is_op(inner, "Mul") or inner is None \
            or only_consumer(graph, square) is not node:
        return None
    if inner.inputs[0] is x and inner.inputs[1] is x:
        return [inner, node]
    return None
