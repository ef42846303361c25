"""Rule ``views``: shape changes that move no element become one Reshape.

A Transpose that keeps the order of its input's axes longer than one only moves
size-1 axes: its output is its input's elements in the same order, so it is a
Reshape (a view) instead of a copy. A run of reshape-like nodes (Reshape, Flatten,
Squeeze, Unsqueeze, and those Transposes) is one Reshape from the run's first input to
the last static shape, or nothing when that is the input's own shape.

Exporters write such runs around each linear and head split (``[1, 1, 768]`` to
``[1, 768]`` to ``[1, 1, 12, 64]`` to ``[1, 12, 1, 64]``), and they are common once a
plan per input shape fixes a dim at 1 (one decoded token, batch 1). The rule runs
after ``attention``, which reads head splits as the exporters write them.
"""

from __future__ import annotations

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ops import default_registry
from segflow.ops.registry import OpRegistry
from segflow.passes._rewrite import bypass, can_bypass, new_const, replace_nodes
from segflow.passes.fuse._match import live_nodes, reshapes


def moves_only_unit_axes(perm: list[int], shape: tuple[int, ...]) -> bool:
    """Whether transposing ``shape`` by ``perm`` keeps the order of its non-1 axes.

    >>> moves_only_unit_axes([0, 2, 1, 3], (1, 1, 12, 64))
    True
    >>> moves_only_unit_axes([0, 2, 1, 3], (1, 4, 12, 64))
    False
    """
    kept = [axis for axis in perm if shape[axis] != 1]
    return kept == sorted(kept)


def static_shape(value: Value) -> tuple[int, ...] | None:
    """``value``'s shape when every dim is a known number."""
    if not value.spec.is_static or value.spec.shape is None:
        return None
    return tuple(int(d) for d in value.spec.shape if isinstance(d, int))


def _is_view(graph: Graph, node: Node, registry: OpRegistry) -> bool:
    """``node``'s output 0 is its input 0's elements, in order, under its static shape."""
    if node.domain != "" or not node.inputs or node.inputs[0] is None:
        return False
    shape, out = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    if shape is None or out is None or 0 in out:
        return False
    if any(v.uses or v in graph.outputs for v in node.outputs[1:]):
        return False
    if node.op_type == "Transpose":
        perm = node.attrs.get("perm")
        return perm is not None and len(perm) == len(shape) and moves_only_unit_axes(
            [int(p) for p in perm], shape)
    return reshapes(node, registry)


def _run_source(graph: Graph, node: Node, registry: OpRegistry) -> Value:
    """The first input of the run of view nodes that ends at ``node``."""
    source = node.inputs[0]
    assert source is not None
    while source.producer is not None and _is_view(graph, source.producer, registry):
        upstream = source.producer.inputs[0]
        assert upstream is not None
        source = upstream
    return source


def fuse_views(graph: Graph) -> int:
    registry = default_registry()
    count = 0
    for node in live_nodes(graph):
        if not _is_view(graph, node, registry):
            continue
        source = _run_source(graph, node, registry)
        shape = static_shape(node.outputs[0])
        assert shape is not None
        if static_shape(source) == shape and can_bypass(graph, node, source):
            bypass(graph, node, source)
            count += 1
            continue
        if node.op_type == "Reshape" and source is node.inputs[0]:
            continue  # already the one Reshape of its run
        target = new_const(graph, f"{node.outputs[0].name}/shape",
                           torch.tensor(shape, dtype=torch.int64))
        reshape = Node("Reshape", [source, target], [Value(node.outputs[0].name)], {},
                       name=node.name, opset=node.opset)
        replace_nodes(graph, node, [], reshape)
        count += 1
    return count

