"""Rule ``global_pool``: a ReduceMean over every spatial axis of a 4-D or 5-D float32
tensor, dims kept, becomes the GlobalAveragePool it is.

Some exporters write a squeeze-excitation block's (or a classifier's) pooling as
``ReduceMean(x, axes=[2, 3], keepdims=1)``. Both are the mean over the spatial axes,
with the same ``[N, C, 1, 1]`` output; as a GlobalAveragePool it is the pooling the
layout pass can give to libdnnl beside the direct convolutions (``DIRECT_POOL``),
where a ReduceMean ends the run of direct kernels around it.
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node, Value
from segflow.passes._rewrite import replace_nodes
from segflow.passes.fuse._match import const_tensor, is_float32, live_nodes

# ReduceMean takes its axes as an input from this opset on (an attribute before).
AXES_INPUT_SINCE = 18


def fuse_global_pool(graph: Graph) -> int:
    """``ReduceMean(x, axes=spatial, keepdims=1)`` -> ``GlobalAveragePool(x)``."""
    count = 0
    for node in live_nodes(graph, "ReduceMean"):
        x = node.inputs[0] if node.inputs else None
        rank = x.spec.rank if x is not None else None
        if x is None or rank not in (4, 5) or not is_float32(x) or len(node.outputs) != 1:
            continue
        if int(node.attrs.get("keepdims", 1)) != 1:
            continue
        axes = _axes(node)
        assert rank is not None
        if axes is None or sorted({a + rank if a < 0 else a for a in axes}) != list(
                range(2, rank)):
            continue
        pool = Node("GlobalAveragePool", [x], [Value(node.outputs[0].name)], {},
                    name=node.name, opset=node.opset)
        replace_nodes(graph, node, [], pool)
        count += 1
    return count


def _axes(node: Node) -> list[int] | None:
    """The node's constant axes (None: not constant, or absent: every axis)."""
    if node.opset < AXES_INPUT_SINCE:
        attr = node.attrs.get("axes")
        return None if attr is None else [int(a) for a in attr]
    axes = const_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
    if axes is None or axes.dim() != 1:
        return None
    return [int(a) for a in axes.tolist()]
