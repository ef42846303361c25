"""Rule ``siblings``: FusedGemms that read one input become one FusedGemm and a Split.

A transformer's query, key and value projections are three linears over the same
activations; as one linear over the three weights stacked (``[Nq + Nk + Nv, K]``)
they are one kernel call instead of three, the input is read once, and the wider
output gives the threads more columns to share. A Split along the last axis hands
each former output on as a view of the merged one (no copy; the Attention node
reads its heads through strides). With AVX2's 24-wide panels three 768 -> 768
projections run faster as one 768 -> 2304 through the native kernel.

On CPUs where the native linear kernel is the AVX-512 build's, the pipeline keeps
siblings whose weights it packs each apart (``passes/pipeline.py``, ``_siblings_off``;
measured faster there: docs/performance.md), unless ``optimize={"fuse.siblings": True}``.

Merged: two or more FusedGemms reading the same float32 input (of known rank), each with a
constant 2-D float32 weight of the same K, all with a bias or none, the same
activation, none of whose outputs is a graph output. The merged node sits where the
first of them was (the input is computed before it), the Split right after it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType, TensorSpec
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import new_const
from segflow.passes.fuse._match import const_tensor, is_float32


def fuse_siblings(graph: Graph, apart: Callable[[list[Node]], bool] | None = None) -> int:
    """Merge each group of siblings; ``apart(nodes)`` True leaves that group as it is
    (``passes/pipeline.py`` decides so where the kernels run them faster apart)."""
    count = 0
    for nodes in sibling_groups(graph):
        if apart is None or not apart(nodes):
            _merge(graph, nodes)
            count += 1
    return count


def sibling_groups(graph: Graph) -> list[list[Node]]:
    """The groups of two or more FusedGemms the rule would merge, in graph order."""
    groups: dict[tuple[int, tuple[object, ...]], list[Node]] = defaultdict(list)
    for node in list(graph.nodes):
        key = _sibling_key(graph, node)
        if key is not None:
            groups[key].append(node)
    return [nodes for nodes in groups.values() if len(nodes) > 1]


def _sibling_key(graph: Graph, node: Node) -> tuple[int, tuple[object, ...]] | None:
    """What siblings share (the input, K, bias or not, the attributes), or None where
    ``node`` cannot be merged."""
    if node.domain != FUSED_DOMAIN or node.op_type != "FusedGemm" or len(node.outputs) != 1:
        return None
    x = node.inputs[0]
    w = const_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
    b = node.inputs[2] if len(node.inputs) > 2 else None
    bias = const_tensor(b)
    if x is None or not is_float32(x) or x.spec.rank is None or w is None or w.dim() != 2 \
            or w.dtype is not torch.float32 or node.outputs[0] in graph.outputs:
        return None
    if b is not None and (bias is None or bias.dtype is not torch.float32
                          or bias.shape != (w.shape[0],)):
        return None
    attrs = tuple(sorted((k, repr(v)) for k, v in node.attrs.items()))
    return id(x), (w.shape[1], b is not None, attrs)


def _merge(graph: Graph, nodes: list[Node]) -> None:
    first = nodes[0]
    x = first.inputs[0]
    assert x is not None and x.spec.shape is not None
    weights = [const_tensor(n.inputs[1]) for n in nodes]
    widths = [int(w.shape[0]) for w in weights if w is not None]
    if all(w is not None and w.t().is_contiguous() for w in weights):
        # [N, K] views of [K, N] initializers (the linear rule keeps a MatMul's so):
        # joined along N in their own layout, a copy instead of a transpose.
        weight = torch.cat([w.t() for w in weights], 1).t()  # type: ignore[union-attr]
    else:
        weight = torch.cat(weights, 0).contiguous()  # type: ignore[arg-type]
    inputs: list[Value | None] = [x, new_const(graph, f"{first.name}.siblings.weight", weight)]
    if len(first.inputs) > 2 and first.inputs[2] is not None:
        biases = [const_tensor(n.inputs[2]) for n in nodes]
        inputs.append(new_const(graph, f"{first.name}.siblings.bias", torch.cat(biases)))  # type: ignore[arg-type]
    merged_out = Value(f"{first.outputs[0].name}.siblings",
                       TensorSpec(DType.FLOAT32, (*x.spec.shape[:-1], sum(widths))))
    merged = Node("FusedGemm", inputs, [merged_out], dict(first.attrs),
                  name=f"{first.name}+{len(nodes) - 1}", domain=FUSED_DOMAIN, opset=1)
    sizes = new_const(graph, f"{first.name}.siblings.split", torch.tensor(widths))
    parts = [Value(n.outputs[0].name, n.outputs[0].spec) for n in nodes]
    split = Node("Split", [merged_out, sizes], parts, {"axis": -1},
                 name=f"{first.name}.siblings.split", opset=13)
    graph.insert_before(first, merged)
    graph.insert_before(first, split)
    for node, part in zip(nodes, parts):
        graph.replace_all_uses(node.outputs[0], part)
        graph.remove(node)
