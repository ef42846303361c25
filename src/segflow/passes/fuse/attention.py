"""Rule ``attention``: ``softmax(Q @ Kt * s + M) @ V`` becomes ``segflow.Attention``.

The scale may be a Mul or a Div by a constant, the mask an Add before the
softmax. Where Q, K and V are heads split out of ``[B, S, H*D]`` activations
(Reshape to ``[B, S, H, D]``, Transpose) and the result's heads are merged back the
same way, those eight nodes are absorbed too: the node gets ``heads`` H, reads the
activations and writes ``[B, S, H*Dv]`` (no copies to split or merge the heads).

Shapes known not to suit ``scaled_dot_product_attention`` (batch dims that differ,
a mask that grows the scores) are left alone; symbolic ones pass, and the kernel
checks at run time.
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import const_scalar, replace_nodes
from segflow.passes.fuse._match import is_float32, is_op, live_nodes, only_consumer


def fuse_attention(graph: Graph) -> int:
    count = 0
    for softmax in live_nodes(graph, "Softmax"):
        match = _attention_match(graph, softmax)
        if match is None:
            continue
        q, kt, v, mask, scale, first, absorbed, last = match
        attrs: dict[str, object] = {"scale": scale}
        heads = _heads_form(graph, q, kt, v, last)
        if heads is not None:   # read [B, S, H*D] as it is, write the heads merged back
            (q, kt, v), attrs["heads"], split, merge = heads
            absorbed = [*split, *absorbed, last, merge[0]]
            last = merge[1]
        inputs = [q, kt, v] + ([mask] if mask is not None else [])
        fused = Node("Attention", inputs, [Value(last.outputs[0].name)], attrs,
                     name=first.name, domain=FUSED_DOMAIN, opset=1)
        replace_nodes(graph, last, absorbed, fused)
        count += 1
    return count


def _heads_form(graph: Graph, q: Value, kt: Value, v: Value, out_mm: Node
                ) -> tuple[tuple[Value, Value, Value], int, list[Node], list[Node]] | None:
    """Where Q, Kt and V are heads split out of ``[B, S, H*D]`` activations by Reshape
    and Transpose, and the result's heads are merged back the same way (how exporters
    write multi-head attention): the activations, H, the split nodes and the two merge
    nodes (Transpose, Reshape). None if any part differs."""
    splits: list[tuple[Value, int, list[Node]]] = []
    for value, perm in ((q, (0, 2, 1, 3)), (kt, (0, 2, 3, 1)), (v, (0, 2, 1, 3))):
        split = _split_heads(graph, value, perm)
        if split is None or (splits and split[1] != splits[0][1]):
            return None
        splits.append(split)
    heads = splits[0][1]
    merge_t = only_consumer(graph, out_mm.outputs[0])
    if not is_op(merge_t, "Transpose") or merge_t is None \
            or tuple(merge_t.attrs.get("perm", ())) != (0, 2, 1, 3):
        return None
    merge_r = only_consumer(graph, merge_t.outputs[0])
    if not is_op(merge_r, "Reshape") or merge_r is None \
            or merge_r.inputs[0] is not merge_t.outputs[0] \
            or not _merges_heads(merge_t.outputs[0], merge_r.outputs[0], heads):
        return None
    xq, xk, xv = (x for x, _, _ in splits)
    return (xq, xk, xv), heads, [n for _, _, nodes in splits for n in nodes], [merge_t, merge_r]


def _split_heads(graph: Graph, value: Value, perm: tuple[int, ...]
                 ) -> tuple[Value, int, list[Node]] | None:
    """``value`` = Transpose(perm)(Reshape(x) to ``[B, S, H, D]``) with x ``[B, S, H*D]``,
    each read only by the next: (x, H, [reshape, transpose])."""
    transpose = value.producer
    if not is_op(transpose, "Transpose") or transpose is None \
            or tuple(transpose.attrs.get("perm", ())) != perm \
            or only_consumer(graph, value) is None:
        return None
    split = transpose.inputs[0]
    reshape = split.producer if split is not None else None
    if not is_op(reshape, "Reshape") or reshape is None or split is None \
            or only_consumer(graph, split) is not transpose:
        return None
    x = reshape.inputs[0]
    if x is None or not is_float32(x) or not _merges_heads(split, x, None):
        return None
    heads = split.spec.shape[2]  # type: ignore[index]
    assert isinstance(heads, int)   # _merges_heads checked it
    return x, heads, [reshape, transpose]


def _merges_heads(split: Value, merged: Value, heads: int | None) -> bool:
    """``split`` is ``[B, S, H, D]`` and ``merged`` ``[B, S, H*D]`` (the same B and S,
    known H and D; H is ``heads`` when given)."""
    a, b = split.spec.shape, merged.spec.shape
    if a is None or b is None or len(a) != 4 or len(b) != 3:
        return False
    h, d = a[2], a[3]
    return (all(isinstance(dim, int | str) for dim in (*a[:2], *b[:2])) and a[:2] == b[:2]
            and isinstance(h, int) and isinstance(d, int) and b[2] == h * d
            and (heads is None or h == heads))


def _attention_match(graph: Graph, softmax: Node):  # type: ignore[no-untyped-def]
    scores = softmax.inputs[0]
    if scores is None or scores.spec.rank is None or scores.spec.rank < 3:
        return None
    rank = scores.spec.rank
    axis = int(softmax.attrs.get("axis", -1 if softmax.opset >= 13 else 1))
    if axis not in (-1, rank - 1):
        return None
    absorbed: list[Node] = []
    mask = None
    node = scores.producer
    if is_op(node, "Add") and node is not None and only_consumer(graph, scores) is softmax:
        picked = _scores_operand(node)
        if picked is None:
            return None
        base, mask = picked
        if mask is None or not is_float32(mask) or (mask.spec.rank or 0) > rank:
            return None
        absorbed.append(node)
        node = base.producer if base is not None else None
        scores = base
    scale = 1.0
    if (is_op(node, "Div") or is_op(node, "Mul")) and node is not None:
        c = const_scalar(node.inputs[1])
        if c is None or c == 0 or only_consumer(graph, node.outputs[0]) is None:
            return None
        scale = 1.0 / c if node.op_type == "Div" else c
        absorbed.append(node)
        scores = node.inputs[0]
        node = scores.producer if scores is not None else None
    if not is_op(node, "MatMul") or node is None or only_consumer(graph, node.outputs[0]) is None:
        return None
    q, kt = node.inputs[0], node.inputs[1]
    absorbed.append(node)
    out_mm = only_consumer(graph, softmax.outputs[0])
    if not is_op(out_mm, "MatMul") or out_mm is None or out_mm.inputs[0] is not softmax.outputs[0]:
        return None
    v = out_mm.inputs[1]
    for t in (q, kt, v):
        if t is None or not is_float32(t) or t.spec.rank != rank:
            return None
    if not _sdpa_shapes(q, kt, v, mask, node.outputs[0]):  # type: ignore[arg-type]
        return None
    ordered = [*reversed(absorbed), softmax]
    return q, kt, v, mask, scale, node, ordered, out_mm


def _sdpa_shapes(q: Value, kt: Value, v: Value, mask: Value | None, scores: Value) -> bool:
    """Rule out shapes that are known not to suit scaled_dot_product_attention.

    Symbolic dims pass (the kernel checks at run time and falls back to the plain
    ops); fixed dims must show equal batch dims for Q, K, V and a mask that
    broadcasts to the scores without growing them.
    """
    def known_conflict(a: object, b: object, one_ok: bool) -> bool:
        if isinstance(a, int) and isinstance(b, int):
            return a != b and not (one_ok and a == 1)
        return False

    q_s, k_s, v_s, s_s = (t.spec.shape for t in (q, kt, v, scores))
    if q_s is None or k_s is None or v_s is None or s_s is None:
        return False
    for other in (k_s, v_s):
        if any(known_conflict(a, b, False) for a, b in zip(q_s[:-2], other[:-2])):
            return False
    if mask is None:
        return True
    m_s = mask.spec.shape
    if m_s is None or len(m_s) > len(s_s):
        return False
    return not any(known_conflict(m, s, True) for m, s in zip(reversed(m_s), reversed(s_s)))


def _scores_operand(add: Node) -> tuple[Value, Value | None] | None:
    """(scores, mask) of the Add before a softmax: scores come from a MatMul or its scaling."""
    a, b = add.inputs[0], add.inputs[1]
    for kinds in (("MatMul", "Div"), ("Mul",)):
        for base, mask in ((a, b), (b, a)):
            producer = base.producer if base is not None else None
            if base is not None and any(is_op(producer, k) for k in kinds):
                if kinds == ("Mul",) and const_scalar(producer.inputs[1]) is None:  # type: ignore[union-attr]
                    continue
                return base, mask
    return None
