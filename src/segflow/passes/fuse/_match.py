"""What the fuse rules match with: node and value predicates shared by the rules."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from segflow.errors import UnsupportedOp
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType
from segflow.ops.registry import OpRegistry, ViewOfInput
from segflow.passes._rewrite import const_scalar


def live_nodes(graph: Graph, op_type: str | None = None) -> Iterator[Node]:
    """The graph's nodes as they were when the rule started, skipping those a rewrite
    has since absorbed; only default-domain ``op_type`` ones when it is given."""
    for node in list(graph.nodes):
        if node.graph is graph and (op_type is None or is_op(node, op_type)):
            yield node


def is_op(node: Node | None, op_type: str) -> bool:
    """``node`` is a default-domain ``op_type`` node."""
    return node is not None and node.domain == "" and node.op_type == op_type


def only_consumer(graph: Graph, value: Value) -> Node | None:
    """The single node reading ``value`` (once), if ``value`` is not a graph output."""
    if value in graph.outputs or len(value.uses) != 1:
        return None
    node = value.uses[0]
    return node if sum(1 for v in node.inputs if v is value) == 1 else None


def reshapes(node: Node, registry: OpRegistry) -> bool:
    """Whether the row says output 0 is input 0's elements under a new shape (Reshape,
    Flatten, Squeeze, Unsqueeze)."""
    try:
        opdef = registry.resolve(node)
    except UnsupportedOp:
        return False
    return opdef.view_of_input is ViewOfInput.RESHAPE


def is_float32(value: Value | None) -> bool:
    """``value`` is known to be float32."""
    return value is not None and value.spec.dtype is DType.FLOAT32


def const_tensor(value: Value | None) -> torch.Tensor | None:
    """``value``'s constant as a plain (not oneDNN-packed) tensor, or None."""
    if value is None or value.const is None or value.const.is_mkldnn:
        return None
    return value.const


def close_to(value: float | None, target: float) -> bool:
    """``value`` is ``target`` within a relative 1e-4 (exporters round constants)."""
    return value is not None and abs(value - target) <= 1e-4 * abs(target)


def other_input(node: Node, value: Value) -> Value | None:
    """The other operand of a binary ``node`` that reads ``value``."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a


def constant_operand(node: Node | None, value: Value, target: float) -> bool:
    """``node`` is a binary op reading ``value`` and a one-element constant ``target``
    (:func:`close_to`) that does not widen ``value``'s rank by broadcasting."""
    if node is None or len(node.inputs) != 2 or value not in node.inputs:
        return False
    other = other_input(node, value)
    if other is None or other is value or not close_to(const_scalar(other), target):
        return False
    rank, const_rank = value.spec.rank, other.spec.rank
    return const_rank is None or const_rank == 0 or (rank is not None and const_rank <= rank)


def scaled_product(graph: Graph, value: Value, x: Value, factor: float
                   ) -> tuple[Node, list[Node]] | None:
    """Match ``value * x * factor`` in any association of the two multiplications,
    ``value`` and the partial product each read once; returns (the last Mul, the other).

    The exporters write an activation's final product in each of ``(value * x) * c``,
    ``(value * c) * x`` and ``(x * c) * value`` (the GELU forms' ``0.5``).
    """
    first = only_consumer(graph, value)
    if not is_op(first, "Mul"):
        return None
    assert first is not None
    partner = other_input(first, value)
    if partner is None or partner is value:
        return None
    if partner is x or constant_operand(first, value, factor):
        second = only_consumer(graph, first.outputs[0])
        if not is_op(second, "Mul"):
            return None
        assert second is not None
        if partner is x and constant_operand(second, first.outputs[0], factor):
            return second, [first]
        if partner is not x and other_input(second, first.outputs[0]) is x:
            return second, [first]
        return None
    half = partner.producer
    if (is_op(half, "Mul") and half is not None and x in half.inputs
            and constant_operand(half, x, factor)
            and only_consumer(graph, half.outputs[0]) is first):
        return first, [half]
    return None
