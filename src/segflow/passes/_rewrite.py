"""Small graph-rewriting helpers shared by the optimization passes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType, TensorSpec


def single_use(graph: Graph, value: Value) -> bool:
    """``value`` feeds exactly one node input and is not a graph output."""
    return len(value.uses) == 1 and value not in graph.outputs


def const_scalar(value: Value | None) -> float | None:
    """The number held by a one-element constant, else None."""
    if value is None or value.const is None or value.const.numel() != 1:
        return None
    if value.const.is_mkldnn:
        return None
    return float(value.const.reshape(-1)[0])


def spec_of(tensor: torch.Tensor, declared: DType | None = None) -> TensorSpec:
    """``tensor``'s spec; ``declared``, the type its value had, tells an int4 or float4 from
    the ordinary type of its one-byte container."""
    return TensorSpec(DType.from_container(tensor.dtype, declared),
                      tuple(int(d) for d in tensor.shape))


def new_const(graph: Graph, name: str, tensor: torch.Tensor,
              declared: DType | None = None) -> Value:
    """A fresh initializer named ``name`` (made unique within ``graph``); ``declared`` as
    for :func:`spec_of`."""
    taken = graph.initializers
    unique = name
    suffix = 1
    while unique in taken:
        unique = f"{name}~{suffix}"
        suffix += 1
    return graph.add_initializer(Value(unique, spec_of(tensor, declared), const=tensor))


def replace_value(graph: Graph, old: Value, new: Value) -> None:
    """Point every use of ``old`` (and graph outputs) at ``new``, keeping the output's name.

    When ``old`` is a graph output, ``new`` takes its name so callers still see it.
    """
    if old in graph.outputs and new.name != old.name and new.producer is not None:
        new.name = old.name
    graph.replace_all_uses(old, new)


def replace_nodes(graph: Graph, anchor: Node, absorbed: Sequence[Node], fused: Node) -> None:
    """Put ``fused`` where ``anchor`` is and drop ``anchor`` and ``absorbed``; ``fused``'s
    output takes over ``anchor``'s (its name, spec and uses)."""
    old = anchor.outputs[0]
    new = fused.outputs[0]
    new.name = old.name
    new.spec = old.spec
    graph.insert_before(anchor, fused)
    graph.replace_all_uses(old, new)
    for node in [anchor, *reversed(absorbed)]:
        if node.graph is graph:
            graph.remove(node)


def remove_dead(graph: Graph) -> int:
    """Remove nodes whose outputs nobody reads, then unused initializers. Returns nodes removed."""
    removed = 0
    outputs = {id(v) for v in graph.outputs}
    for node in reversed(list(graph.nodes)):
        if any(v.uses or id(v) in outputs for v in node.outputs):
            continue
        graph.remove(node)
        removed += 1
    inputs = {id(v) for v in graph.inputs}
    for name, value in list(graph.initializers.items()):
        if not value.uses and id(value) not in outputs and id(value) not in inputs:
            del graph.initializers[name]
    return removed


def can_bypass(graph: Graph, node: Node, source: Value) -> bool:
    """Whether ``node``'s first output can be replaced by ``source`` (see :func:`bypass`)."""
    if any(v.uses or v in graph.outputs for v in node.outputs[1:]):
        return False
    if node.outputs[0] in graph.outputs:
        # The output keeps its name by renaming ``source``: only an internal value can be.
        return source.producer is not None and source not in graph.outputs
    return True


def bypass(graph: Graph, node: Node, source: Value) -> None:
    """Replace ``node``'s first output by ``source`` and drop the node (check can_bypass)."""
    out = node.outputs[0]
    if out in graph.outputs:
        source.name = out.name
    graph.replace_all_uses(out, source)
    graph.remove(node)
