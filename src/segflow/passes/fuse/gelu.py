"""Rule ``gelu``: the exporters' erf pattern ``x * 0.5 * (1 + erf(x / sqrt 2))``,
in any association of its multiplications, becomes one Gelu node.

TorchScript writes ``(x * (1 + erf)) * 0.5``, the dynamo exporter
``x * (0.5 * (1 + erf))``, hand-written graphs often ``(x * 0.5) * (1 + erf)``
(:func:`~segflow.passes.fuse._match.scaled_product` takes all three).
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


def fuse_gelu(graph: Graph) -> int:
    """``x * 0.5 * (1 + erf(x / sqrt2))`` (any association of the muls) -> Gelu."""
    count = 0
    for erf in live_nodes(graph, "Erf"):
        scaled = erf.inputs[0]
        pre = scaled.producer if scaled is not None else None
        if pre is None or only_consumer(graph, scaled) is not erf:  # type: ignore[arg-type]
            continue
        x = pre.inputs[0]
        if is_op(pre, "Div") and close_to(const_scalar(pre.inputs[1]), math.sqrt(2.0)):
            pass
        elif is_op(pre, "Mul") and x is not None and close_to(
                const_scalar(other_input(pre, x) if x.const is None else pre.inputs[0]),
                1 / math.sqrt(2.0)):
            x = pre.inputs[0] if pre.inputs[0] is not None and pre.inputs[0].const is None \
                else pre.inputs[1]
        else:
            continue
        match = _gelu_tail(graph, erf, x)
        if match is None or x is None:
            continue
        last, absorbed = match
        gelu = Node("Gelu", [x], [Value(last.outputs[0].name)], {"approximate": "none"},
                    name=erf.name, opset=erf.opset)
        replace_nodes(graph, last, [pre, erf, *absorbed], gelu)
        count += 1
    return count


def _gelu_tail(graph: Graph, erf: Node, x: Value | None) -> tuple[Node, list[Node]] | None:
    """Match ``+1``, ``* x`` and ``* 0.5`` after the Erf; returns (last node, the others)."""
    add = only_consumer(graph, erf.outputs[0])
    if not is_op(add, "Add") or x is None:
        return None
    assert add is not None
    if not constant_operand(add, erf.outputs[0], 1.0):
        return None
    product = scaled_product(graph, add.outputs[0], x, 0.5)
    if product is None:
        return None
    last, absorbed = product
    return last, [add, *absorbed]
