"""Rule ``attention``: ``softmax(Q @ Kt * s + M) @ V`` becomes ``segflow.Attention``.

Matched by its dataflow, the way exporters write it:

- the scores are a MatMul of Q and Kt, scaled by constants anywhere on the way: on Q,
  on Kt (torch's exporters apply ``sqrt(1 / sqrt(D))`` to each) or on the scores, as
  Mul or Div; the factors multiply into the node's ``scale``;
- an optional additive mask (an Add before the softmax; a constant mask of zeros is
  dropped), then Softmax over the last axis;
- an optional safe softmax, ``Where(IsNaN(p), 0, p)`` or ``Where(Not(IsNaN(p)), p, 0)``,
  which becomes ``nan_to_zero`` 1: a row of probabilities holding a NaN (all scores
  -inf, a NaN or a +inf score makes every probability of its row NaN) is zeros;
- then a MatMul with V.

Where Q, Kt and V are heads split out of ``[B, S, H*D]`` activations by reshapes and
transposes (with scalings of Q and K among them), and the result's heads are merged
back to ``[B, Sq, H*Dv]`` the same way, those nodes are absorbed too: the node gets
``heads`` H, reads the activations and writes the merged result (no copies to split or
merge the heads). Which chains of Reshape, Transpose, Squeeze, Unsqueeze and Flatten do
that is decided by running them on an index tensor of the source's shape (symbolic
dims stand in for distinct primes), so every exporter's spelling is one test: the
chain must move each element where the head split would. Otherwise the node takes Q,
Kt and V as the MatMuls read them (the plain form); a Kt that a chain makes from some K
by swapping its last two axes is read as one Transpose of that K (a view).

Shapes known not to suit ``scaled_dot_product_attention`` (batch dims that differ,
a mask that grows the scores) are left alone; symbolic ones pass, and the kernel
checks at run time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import const_scalar, replace_nodes
from segflow.passes.fuse._match import const_tensor, is_float32, is_op, live_nodes, only_consumer

# Ops that only move elements: a chain of them is checked by running it on indices.
_MOVES = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"})
_MAX_CHAIN = 8                 # nodes a split or merge chain may have
_MAX_SIMULATED = 1 << 23       # elements of an index tensor a check may build
_SYMBOL_SIZES = (7, 11, 13, 17, 19, 23, 29, 31)   # what symbolic dims stand for in a check

Dims = tuple[int, ...]


@dataclass(slots=True)
class _Chain:
    """``target`` computed from ``source`` by ``nodes`` (source first): moves and, where
    allowed, scalings by constants (their product ``scale``)."""

    source: Value
    nodes: list[Node] = field(default_factory=list)
    scale: float = 1.0

    @property
    def moves(self) -> list[Node]:
        return [n for n in self.nodes if n.op_type in _MOVES]


@dataclass(slots=True)
class _Match:
    q: Value
    kt: Value
    v: Value
    mask: Value | None
    scale: float
    nan_to_zero: bool
    scores_mm: Node
    out_mm: Node
    absorbed: list[Node]


def fuse_attention(graph: Graph) -> int:
    count = 0
    for softmax in live_nodes(graph, "Softmax"):
        match = _attention_match(graph, softmax)
        if match is None:
            continue
        attrs: dict[str, object] = {"nan_to_zero": 1} if match.nan_to_zero else {}
        symbols: dict[str, int] = {}
        heads = _heads_form(graph, match, symbols)
        last = match.out_mm
        absorbed = list(match.absorbed)
        if heads is not None:   # read [B, S, H*D] as it is, write the heads merged back
            (q, kt, v), attrs["heads"], split, merge = heads
            absorbed += [*split, last, *merge[:-1]]
            last = merge[-1]
        else:
            q, kt, v = _plain_operands(graph, match, absorbed, symbols)
        attrs["scale"] = match.scale   # with the scalings the form found in the chains
        inputs = [q, kt, v] + ([match.mask] if match.mask is not None else [])
        fused = Node("Attention", inputs, [Value(last.outputs[0].name)], attrs,
                     name=match.scores_mm.name, domain=FUSED_DOMAIN, opset=1)
        order = {node: i for i, node in enumerate(graph.nodes)}
        replace_nodes(graph, last, sorted(set(absorbed), key=order.__getitem__), fused)
        count += 1
    return count


# -- the pattern ----------------------------------------------------------------------
def _attention_match(graph: Graph, softmax: Node) -> _Match | None:
    scores = softmax.inputs[0]
    if scores is None or scores.spec.rank is None or scores.spec.rank < 3 \
            or only_consumer(graph, scores) is not softmax:
        return None
    rank = scores.spec.rank
    axis = int(softmax.attrs.get("axis", -1 if softmax.opset >= 13 else 1))
    if axis not in (-1, rank - 1):
        return None
    absorbed: list[Node] = [softmax]
    mask = None
    add = scores.producer
    if is_op(add, "Add") and add is not None:
        picked = _scores_and_mask(graph, add)
        if picked is None:
            return None
        scores, mask = picked
        absorbed.append(add)
        if mask is None or not is_float32(mask) or (mask.spec.rank or 0) > rank:
            return None
        zeros = const_tensor(mask)
        if zeros is not None and mask.spec.shape is not None and scores.spec.shape is not None \
                and _broadcasts_within(mask.spec.shape, scores.spec.shape) \
                and not bool(zeros.any()):
            mask = None     # adding zeros changes nothing, NaN and Inf included
    reached = _through_scalings(graph, scores)
    scores_mm = reached.source.producer
    if not is_op(scores_mm, "MatMul") or scores_mm is None:
        return None
    absorbed += [*reached.nodes, scores_mm]
    probs, nan_to_zero, safe = _safe_softmax(graph, softmax.outputs[0])
    absorbed += safe
    out_mm = only_consumer(graph, probs)
    if not is_op(out_mm, "MatMul") or out_mm is None or out_mm.inputs[0] is not probs:
        return None
    q, kt, v = scores_mm.inputs[0], scores_mm.inputs[1], out_mm.inputs[1]
    for t in (q, kt, v):
        if t is None or not is_float32(t) or t.spec.rank != rank:
            return None
    assert q is not None and kt is not None and v is not None
    if not _sdpa_shapes(q, kt, v, mask, scores_mm.outputs[0]):
        return None
    return _Match(q, kt, v, mask, reached.scale, nan_to_zero, scores_mm, out_mm, absorbed)


def _scores_and_mask(graph: Graph, add: Node) -> tuple[Value, Value | None] | None:
    """(scores, mask) of the Add before a softmax: the scores are the operand that is a
    MatMul, or its scaling by constants."""
    a, b = add.inputs[0], add.inputs[1]
    for base, mask in ((a, b), (b, a)):
        if base is None or only_consumer(graph, base) is not add:
            continue
        if is_op(_through_scalings(graph, base).source.producer, "MatMul"):
            return base, mask
    return None


def _scaling(node: Node | None) -> tuple[Value, float] | None:
    """Where ``node`` multiplies a tensor by a finite, non-zero constant without changing
    its shape (Mul by it, Div by it): (that tensor, the factor)."""
    if node is None or not (is_op(node, "Mul") or is_op(node, "Div")):
        return None
    a, b = node.inputs[0], node.inputs[1]
    pairs = [(a, b), (b, a)] if node.op_type == "Mul" else [(a, b)]
    for x, c in pairs:
        factor = const_scalar(c)
        if x is None or x.is_const or factor is None or factor == 0 \
                or not math.isfinite(factor):
            continue
        if x.spec.shape is None or x.spec.shape != node.outputs[0].spec.shape:
            return None
        return x, (factor if node.op_type == "Mul" else 1.0 / factor)
    return None


def _through_scalings(graph: Graph, value: Value) -> _Chain:
    """``value`` back through its scalings by constants (each read only by the next)."""
    chain = _Chain(value)
    while only_consumer(graph, chain.source) is not None \
            and (step := _scaling(chain.source.producer)) is not None:
        chain.nodes.insert(0, chain.source.producer)  # type: ignore[arg-type]
        chain.source, chain.scale = step[0], chain.scale * step[1]
    return chain


def _safe_softmax(graph: Graph, p: Value) -> tuple[Value, bool, list[Node]]:
    """The probabilities the second MatMul reads: ``Where(IsNaN(p), 0, p)`` (or
    ``Where(Not(IsNaN(p)), p, 0)``) when that is what follows the softmax, with True and
    its nodes; else ``p``, False, none."""
    if p in graph.outputs or len(p.uses) != 2:
        return p, False, []
    isnan = next((n for n in p.uses if is_op(n, "IsNaN")), None)
    where = next((n for n in p.uses if is_op(n, "Where")), None)
    if isnan is None or where is None:
        return p, False, []
    flag, nodes = isnan.outputs[0], [isnan]
    negate = only_consumer(graph, flag)
    if is_op(negate, "Not") and negate is not None:
        flag, nodes = negate.outputs[0], [isnan, negate]
    if only_consumer(graph, flag) is not where or where.inputs[0] is not flag:
        return p, False, []
    zero, kept = (where.inputs[1], where.inputs[2]) if len(nodes) == 1 else \
        (where.inputs[2], where.inputs[1])
    if kept is not p or const_scalar(zero) != 0.0 \
            or where.outputs[0].spec.shape != p.spec.shape:
        return p, False, []
    return where.outputs[0], True, [*nodes, where]


def _broadcasts_within(small: tuple[object, ...], big: tuple[object, ...]) -> bool:
    return len(small) <= len(big) and all(
        m == 1 or m == s for m, s in zip(reversed(small), reversed(big)))


# -- the heads form -------------------------------------------------------------------
def _heads_form(graph: Graph, match: _Match, symbols: dict[str, int]
                ) -> tuple[tuple[Value, Value, Value], int, list[Node], list[Node]] | None:
    """Where Q, Kt and V are heads split out of ``[B, S, H*D]`` activations and the
    result's heads are merged back the same way: the activations, H, the split nodes
    (with their scalings, folded into ``match.scale``) and the merge nodes (the last
    one's output is the merged result). None if any part differs."""
    found = []
    for value, perm, scaled in ((match.q, (0, 2, 1, 3), True), (match.kt, (0, 2, 3, 1), True),
                                (match.v, (0, 2, 1, 3), False)):
        split = _split_heads(graph, value, perm, scaled, symbols)
        if split is None:
            return None
        found.append(split)
    (cq, bq, hq), (ck, bk, hk), (cv, bv, hv) = found
    out = match.out_mm.outputs[0]
    out_dims = _dims(out, symbols)
    q_dims, k_dims, v_dims = (_dims(c.source, symbols) for c in (cq, ck, cv))
    if out_dims is None or q_dims is None or k_dims is None or v_dims is None \
            or not (bq == bk == bv) or not (hq == hk == hv) or k_dims[1] != v_dims[1]:
        return None
    b, h, sq, dv = bq, hq, q_dims[1], out_dims[-1]
    if match.mask is not None:
        scores = _dims(match.scores_mm.outputs[0], symbols)
        m = match.mask.spec.shape
        if scores is None or m is None or (scores != (b, h, sq, k_dims[1])
                                           and any(d != 1 for d in m[:-2])):
            return None   # the mask would broadcast differently over [B, H, Sq, Sk]
    merge = _merge_heads(graph, out, out_dims, (b, h, sq, dv), symbols)
    if merge is None:
        return None
    match.scale *= cq.scale * ck.scale
    return (cq.source, ck.source, cv.source), h, [*cq.nodes, *ck.nodes, *cv.nodes], merge


def _split_heads(graph: Graph, value: Value, perm: Dims, scaled: bool,
                 symbols: dict[str, int]) -> tuple[_Chain, int, int] | None:
    """The furthest ``[B, S, H*D]`` float32 activation that ``value`` is the heads of,
    read through ``perm`` (``[B, H, S, D]`` for Q and V, ``[B, H, D, S]`` for Kt) and
    reshaped to ``value``'s shape: its chain, B and H."""
    target = _dims(value, symbols)
    if target is None:
        return None
    d = target[-2] if perm == (0, 2, 3, 1) else target[-1]
    for chain in reversed(_chains(graph, value, scaled)):
        src = _dims(chain.source, symbols)
        if src is None or len(src) != 3 or not chain.moves or not is_float32(chain.source) \
                or d <= 0 or src[2] % d:
            continue
        b, s, h = src[0], src[1], src[2] // d

        def split(x: torch.Tensor, b: int = b, s: int = s, h: int = h) -> torch.Tensor:
            return x.reshape(b, s, h, d).permute(*perm).reshape(target)
        if _moves_like(chain.moves, src, symbols, split):
            return chain, b, h
    return None


def _merge_heads(graph: Graph, out: Value, out_dims: Dims, bhsd: Dims,
                 symbols: dict[str, int]) -> list[Node] | None:
    """The moves after the second MatMul that merge its ``[B, H, Sq, Dv]`` heads (as
    ``out_dims``) into ``[B, Sq, H*Dv]``; the first chain that gets there."""
    b, h, sq, dv = bhsd
    nodes: list[Node] = []
    value = out
    while len(nodes) < _MAX_CHAIN:
        node = only_consumer(graph, value)
        if node is None or node.domain or node.op_type not in _MOVES \
                or node.inputs[0] is not value:
            return None
        nodes.append(node)
        value = node.outputs[0]
        if not is_float32(value) or _dims(value, symbols) != (b, sq, h * dv):
            continue

        def merged(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(b, h, sq, dv).permute(0, 2, 1, 3).reshape(b, sq, h * dv)
        if _moves_like(nodes, out_dims, symbols, merged):
            return nodes
    return None


# -- the plain form -------------------------------------------------------------------
def _plain_operands(graph: Graph, match: _Match, absorbed: list[Node],
                    symbols: dict[str, int]) -> tuple[Value, Value, Value]:
    """Q and Kt as the scores' MatMul reads them, less their scalings by constants
    (folded into ``match.scale``, their nodes into ``absorbed``); a Kt that moves make
    from a K by swapping its last two axes, as one Transpose of that K."""
    q, kt = _through_scalings(graph, match.q), _through_scalings(graph, match.kt)
    match.scale *= q.scale * kt.scale
    absorbed += [*q.nodes, *kt.nodes]
    target = _dims(kt.source, symbols)
    rank = len(target) if target is not None else 0
    swap = (*range(rank - 2), rank - 1, rank - 2)
    for chain in reversed(_chains(graph, kt.source, scaled=True)):
        src = _dims(chain.source, symbols)
        if target is None or src is None or len(src) != rank or len(chain.moves) < 2 \
                or not is_float32(chain.source):
            continue
        if _moves_like(chain.moves, src, symbols, lambda x: x.permute(*swap)):
            transpose = Node("Transpose", [chain.source],
                             [Value(kt.source.name + "/k_transposed", kt.source.spec)],
                             {"perm": list(swap)}, name=kt.source.name + "/k_transposed",
                             opset=match.scores_mm.opset)
            graph.insert_before(match.scores_mm, transpose)
            match.scale *= chain.scale
            absorbed += chain.nodes
            return q.source, transpose.outputs[0], match.v
    return q.source, kt.source, match.v


# -- checking moves on indices --------------------------------------------------------
def _chains(graph: Graph, value: Value, scaled: bool) -> list[_Chain]:
    """``value`` and the chains it is computed by from further up, nearest first: each
    node a move (or, with ``scaled``, a scaling by a constant) whose output only the next
    reads."""
    chains = [_Chain(value)]
    while len(chains) <= _MAX_CHAIN:
        last = chains[-1]
        node = last.source.producer
        if node is None or only_consumer(graph, last.source) is None:
            break
        scaling = _scaling(node) if scaled else None
        if scaling is not None:
            source, factor = scaling
        elif not node.domain and node.op_type in _MOVES and node.inputs[0] is not None:
            source, factor = node.inputs[0], 1.0
        else:
            break
        chains.append(_Chain(source, [node, *last.nodes], last.scale * factor))
    return chains


def _dims(value: Value, symbols: dict[str, int]) -> Dims | None:
    """``value``'s shape with each symbolic dim as the size it stands for in checks."""
    shape = value.spec.shape
    if shape is None:
        return None
    dims = []
    for dim in shape:
        if isinstance(dim, str):
            if dim not in symbols:
                if len(symbols) == len(_SYMBOL_SIZES):
                    return None
                symbols[dim] = _SYMBOL_SIZES[len(symbols)]
            dim = symbols[dim]
        if not isinstance(dim, int):
            return None
        dims.append(dim)
    return tuple(dims)


def _moves_like(nodes: list[Node], source: Dims, symbols: dict[str, int],
                expected: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``nodes`` (moves, source first) take every element of a ``source``-shaped
    tensor where ``expected`` does: both run on an index tensor."""
    numel = math.prod(source)
    if not 0 < numel <= _MAX_SIMULATED:
        return False
    index = torch.arange(numel, dtype=torch.int32).reshape(source)
    x = index
    try:
        for node in nodes:
            out = _dims(node.outputs[0], symbols)
            if out is None:
                return False
            if node.op_type == "Transpose":
                perm = node.attrs.get("perm") or list(reversed(range(x.dim())))
                x = x.permute(*perm)
            else:
                x = x.reshape(out)
            if tuple(x.shape) != out:
                return False
        want = expected(index)
    except RuntimeError:   # a shape that does not fit: not this layout
        return False
    return tuple(x.shape) == tuple(want.shape) and bool(torch.equal(x, want))


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
