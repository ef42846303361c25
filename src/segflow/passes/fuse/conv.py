"""Rule ``conv``: Conv with a constant weight becomes ``segflow.FusedConv``; an Add
of a same-shape tensor right after it becomes its residual input.

``auto_pad`` is resolved into explicit pads (SAME needs static spatial dims).
The kernel adds the residual, through a oneDNN post-op (sum or binary add) where
it calls oneDNN.
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import replace_nodes
from segflow.passes.fuse._match import const_tensor, is_op, live_nodes, only_consumer, other_input


def _explicit_pads(conv: Node) -> list[int] | None:
    attrs = conv.attrs
    weight = conv.inputs[1]
    assert weight is not None
    spatial = (weight.spec.rank or 0) - 2
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", ""):
        return list(attrs.get("pads", [0] * (2 * spatial)))
    if auto_pad == "VALID":
        return [0] * (2 * spatial)
    x = conv.inputs[0]
    if x is None or x.spec.shape is None or not all(isinstance(d, int) for d in x.spec.shape[2:]):
        return None
    from segflow.ops._common import same_pads
    kernel = list(weight.spec.shape[2:])  # type: ignore[index]
    strides = list(attrs.get("strides", [1] * spatial))
    dilations = list(attrs.get("dilations", [1] * spatial))
    return same_pads(x.spec.shape[2:], kernel, strides, dilations,  # type: ignore[arg-type]
                     auto_pad == "SAME_UPPER")


def fuse_conv(graph: Graph) -> int:
    count = 0
    for conv in live_nodes(graph, "Conv"):
        if len(conv.inputs) < 2:   # malformed: its binding names it
            continue
        weight = conv.inputs[1]
        if const_tensor(weight) is None or weight is None or weight.spec.rank not in (3, 4, 5):
            continue
        bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        if bias is not None and const_tensor(bias) is None:
            continue
        pads = _explicit_pads(conv)
        if pads is None:
            continue
        attrs = {k: v for k, v in conv.attrs.items() if k != "auto_pad"}
        attrs["pads"] = pads
        inputs: list[Value | None] = [conv.inputs[0], weight, bias]
        anchor, absorbed = conv, []
        residual = _residual_add(graph, conv)
        if residual is not None:
            add, z = residual
            inputs.append(z)
            anchor, absorbed = add, [conv]
        fused = Node("FusedConv", inputs, [Value(anchor.outputs[0].name)], attrs,
                     name=conv.name, domain=FUSED_DOMAIN, opset=1)
        replace_nodes(graph, anchor, absorbed, fused)
        count += 1
    return count


def _residual_add(graph: Graph, conv: Node) -> tuple[Node, Value] | None:
    add = only_consumer(graph, conv.outputs[0])
    if not is_op(add, "Add"):
        return None
    assert add is not None
    z = other_input(add, conv.outputs[0])
    y = conv.outputs[0]
    if z is None or z.const is not None or z.spec.shape is None or y.spec.shape is None:
        return None
    # Same shape and dtype (no broadcasting): the residual is added element for element.
    if z.spec != y.spec or any(d is None for d in z.spec.shape):
        return None
    return add, z
