"""Rule ``noops``: drop nodes that pass their input through unchanged.

Identity, inference Dropout, a Cast to the same type, a Reshape / Flatten /
Squeeze / Unsqueeze whose static output shape equals its input's, and an
identity Transpose are bypassed; two Transposes in a row become one (or none,
when they cancel).
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node, Value
from segflow.ops import default_registry
from segflow.ops.registry import OpRegistry
from segflow.passes._rewrite import bypass, can_bypass, replace_nodes
from segflow.passes.fuse._match import is_op, live_nodes, only_consumer, reshapes


def _noop_source(node: Node, registry: OpRegistry) -> Value | None:
    """The input ``node`` merely passes through, when it is a no-op."""
    if node.domain != "" or not node.inputs or node.inputs[0] is None:
        return None
    x = node.inputs[0]
    op = node.op_type
    if op == "Identity":
        return x
    if op == "Dropout":
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if training is not None and (training.const is None or bool(training.const.any())):
            return None
        return x
    if op == "Cast":
        to = node.attrs.get("to")
        return x if x.spec.dtype is not None and to == x.spec.dtype.value else None
    if reshapes(node, registry):
        # With the same static shape, the node does nothing.
        out = node.outputs[0]
        return x if x.spec.is_static and out.spec.shape == x.spec.shape else None
    if op == "Transpose":
        perm = node.attrs.get("perm")
        if perm is not None and list(perm) == list(range(len(perm))):
            return x
    return None


def _merge_transposes(graph: Graph, node: Node) -> bool:
    """Transpose(Transpose(x, p), q) -> Transpose(x, p o q) (or x when that is identity)."""
    inner = node.inputs[0].producer if node.inputs and node.inputs[0] is not None else None
    if not (is_op(node, "Transpose") and is_op(inner, "Transpose")):
        return False
    assert inner is not None
    p, q = inner.attrs.get("perm"), node.attrs.get("perm")
    if p is None or q is None or len(p) != len(q):
        return False
    if only_consumer(graph, inner.outputs[0]) is None:
        return False
    x = inner.inputs[0]
    assert x is not None
    composed = [int(p[i]) for i in q]
    if composed == list(range(len(composed))) and can_bypass(graph, node, x):
        bypass(graph, node, x)
        graph.remove(inner)
        return True
    merged = Node("Transpose", [x], [Value(node.outputs[0].name)], {"perm": composed},
                  name=inner.name, opset=node.opset)
    replace_nodes(graph, node, [inner], merged)
    return True



def fuse_noops(graph: Graph) -> int:
    # The rules see only the graph; the rows of the ops segflow ships say which ops reshape.
    registry = default_registry()
    count = 0
    for node in live_nodes(graph):
        source = _noop_source(node, registry)
        if source is not None and can_bypass(graph, node, source):
            bypass(graph, node, source)
            count += 1
        elif _merge_transposes(graph, node):
            count += 1
    return count
