"""Rule ``layernorm``: a LayerNormalization or RMSNormalization over the last axis of an
Add becomes one ``segflow.AddLayerNorm`` (a transformer's residual add and the
normalization after it; onnxruntime's SkipLayerNormalization and
SkipSimplifiedLayerNormalization).

The Add's two operands must have the same shape and dtype as each other (no
broadcasting; symbolic dimensions compare by name), and the normalization must
produce only its normalized output: its mean and inverse standard deviation outputs,
if declared, must be unused. Where the sum has readers besides the normalization (a
pre-LN block: ``h = x + f(x)`` feeds the norm and the next residual Add), the fused
node's second output is the sum, written in the same pass, and those readers read it.

An RMSNormalization not after such an Add becomes an AddLayerNorm without its second
addend: the op's reference is several torch calls, the native kernel one pass per
row. A LayerNormalization alone stays (``F.layer_norm`` is already one kernel).
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import replace_nodes
from segflow.passes.fuse._match import is_float32, is_op, live_nodes

_NORMS = ("LayerNormalization", "RMSNormalization")


def fuse_layernorm(graph: Graph) -> int:
    """``LayerNormalization(A + B)`` (last axis) -> ``AddLayerNorm(A, B, Scale, Bias)``,
    with the sum as a second output where it is read again; likewise RMSNormalization
    (``simplified``), also without an Add."""
    count = 0
    for norm in live_nodes(graph):
        if not any(is_op(norm, op) for op in _NORMS):
            continue
        x = norm.inputs[0]
        if x is None or not _last_axis(norm, x) \
                or any(out.uses or out in graph.outputs for out in norm.outputs[1:]):
            continue
        simplified = norm.op_type == "RMSNormalization"
        add = _same_shape_add(x)
        if add is None and not (simplified and is_float32(x)):
            continue
        scale_bias = list(norm.inputs[1:2] if simplified else norm.inputs[1:3])
        attrs = {"epsilon": float(norm.attrs.get("epsilon", 1e-5))}
        if simplified:
            attrs["simplified"] = 1
        if add is None:
            fused = Node("AddLayerNorm", [x, None, *scale_bias], [Value(norm.outputs[0].name)],
                         attrs, name=norm.name, domain=FUSED_DOMAIN, opset=1)
            replace_nodes(graph, norm, [], fused)
        elif x in graph.outputs or any(use is not norm for use in x.uses):
            anchor = _anchor_for_sum(graph, add, norm, x)
            if anchor is None:
                continue
            _fuse_keeping_sum(graph, add, norm, anchor, scale_bias, attrs)
        else:
            fused = Node("AddLayerNorm", [*add.inputs[:2], *scale_bias],
                         [Value(norm.outputs[0].name)], attrs, name=norm.name,
                         domain=FUSED_DOMAIN, opset=1)
            replace_nodes(graph, norm, [add], fused)
        count += 1
    return count


def _same_shape_add(x: Value) -> Node | None:
    """The Add producing ``x`` from two float32 operands of one known shape, else None."""
    add = x.producer
    if add is None or not is_op(add, "Add"):
        return None
    a, b = add.inputs[0], add.inputs[1]
    if a is None or b is None or not (is_float32(a) and is_float32(b)) \
            or a.spec.shape is None or a.spec != b.spec:
        return None
    return add


def _anchor_for_sum(graph: Graph, add: Node, norm: Node, x: Value) -> Node | None:
    """Where the fused node goes when it also writes the sum: at the Add where the
    norm's other inputs are computed before it (always so for constant weights), else at
    the norm where no other reader of the sum comes before it; None: neither."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    if all(v is None or v.producer is None or order[v.producer] < order[add]
           for v in norm.inputs[1:]):
        return add
    if all(order[use] > order[norm] for use in x.uses if use is not norm):
        return norm
    return None


def _fuse_keeping_sum(graph: Graph, add: Node, norm: Node, anchor: Node,
                      scale_bias: list[Value | None], attrs: dict[str, float | int]) -> None:
    """Replace ``add`` and ``norm`` by one AddLayerNorm at ``anchor`` whose outputs are the
    normalized tensor and the sum (each keeping its value's name and spec)."""
    x, y = add.outputs[0], norm.outputs[0]
    new_y, new_sum = Value(y.name, y.spec), Value(x.name, x.spec)
    fused = Node("AddLayerNorm", [*add.inputs[:2], *scale_bias], [new_y, new_sum], attrs,
                 name=norm.name, domain=FUSED_DOMAIN, opset=1)
    graph.insert_before(anchor, fused)
    graph.replace_all_uses(y, new_y)
    graph.replace_all_uses(x, new_sum)
    graph.remove(norm)
    graph.remove(add)


def _last_axis(norm: Node, x: Value) -> bool:
    """The normalization is over the last axis only."""
    axis = int(norm.attrs.get("axis", -1))
    rank = x.spec.rank
    return axis == -1 or (rank is not None and axis == rank - 1)
