"""Fusion and no-op elimination for inference graphs.

Rules, applied in this order (each a function over the graph, in ``RULES``):

1. ``noops``: drop Identity, inference Dropout, Cast to the same type,
   Reshape/Flatten/Squeeze/Unsqueeze whose static output shape equals the input's,
   identity Transposes; merge Transpose pairs.
2. ``batchnorm``: fold an inference BatchNormalization into the Conv or Gemm
   before it (new weight and bias constants).
3. ``linear``: Gemm, and MatMul (+ Add of a bias) with a constant 2-D weight,
   become ``segflow.FusedGemm`` (weight stored once in ``[N, K]`` layout).
4. ``gelu``: the exporter's erf pattern ``x * 0.5 * (1 + erf(x / sqrt 2))``
   becomes one Gelu.
5. ``conv``: Conv with a constant weight becomes ``segflow.FusedConv``; a
   following same-shape Add becomes its residual input.
6. ``activation``: a Relu / Clip / LeakyRelu / Sigmoid / Tanh / HardSigmoid /
   HardSwish / Gelu after a fused Conv or Gemm becomes its post-op.
7. ``attention``: ``softmax(Q @ Kt * s + M) @ V`` becomes ``segflow.Attention``.

A fused node takes the place of the last node it absorbs, so every input it
reads is computed before it, and keeps that node's output value name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import (
    bypass,
    can_bypass,
    const_scalar,
    new_const,
    remove_dead,
    replace_nodes,
)
from segflow.passes.result import PassResult

Rule = Callable[[Graph], int]


def fuse(graph: Graph, rules: Sequence[str] | None = None) -> PassResult:
    """Apply the fusion rules (all, or those named in ``rules``) to ``graph`` in place."""
    counts = run_rules(graph, rules)
    return PassResult(graph, any(counts.values()))


def run_rules(graph: Graph, rules: Sequence[str] | None = None) -> dict[str, int]:
    """Apply the rules in order; returns how many rewrites each made (for the pass log)."""
    unknown = set(rules or ()) - {name for name, _ in RULES}
    if unknown:
        raise ValueError(f"unknown fuse rules {sorted(unknown)}; known: "
                         f"{', '.join(name for name, _ in RULES)}")
    counts = {name: rule(graph) for name, rule in RULES if rules is None or name in rules}
    if any(counts.values()):
        remove_dead(graph)
        graph.opsets.setdefault(FUSED_DOMAIN, 1)
    return counts


# -- helpers ---------------------------------------------------------------------------
def _is(node: Node | None, op_type: str) -> bool:
    return node is not None and node.domain == "" and node.op_type == op_type


def _only_consumer(graph: Graph, value: Value) -> Node | None:
    """The single node reading ``value`` (once), if ``value`` is not a graph output."""
    if value in graph.outputs or len(value.uses) != 1:
        return None
    node = value.uses[0]
    return node if sum(1 for v in node.inputs if v is value) == 1 else None


def _float32(value: Value | None) -> bool:
    return value is not None and value.spec.dtype is DType.FLOAT32


def _const(value: Value | None) -> torch.Tensor | None:
    if value is None or value.const is None or value.const.is_mkldnn:
        return None
    return value.const


# -- 1. no-ops -------------------------------------------------------------------------
_VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})


def _noop_source(node: Node) -> Value | None:
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
    if op in _VIEW_OPS:
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
    if not (_is(node, "Transpose") and _is(inner, "Transpose")):
        return False
    assert inner is not None
    p, q = inner.attrs.get("perm"), node.attrs.get("perm")
    if p is None or q is None or len(p) != len(q):
        return False
    if _only_consumer(graph, inner.outputs[0]) is None:
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
    count = 0
    for node in list(graph.nodes):
        if node.graph is not graph:
            continue
        source = _noop_source(node)
        if source is not None and can_bypass(graph, node, source):
            bypass(graph, node, source)
            count += 1
        elif _merge_transposes(graph, node):
            count += 1
    return count


# -- 2. BatchNormalization into Conv / Gemm ----------------------------------------------
def _bn_affine(bn: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scale, shift) with BN(y) = y * scale + shift per channel, or None."""
    if bn.attrs.get("training_mode", 0) or len(bn.inputs) < 5:
        return None
    if any(v.uses or v in (bn.graph.outputs if bn.graph else []) for v in bn.outputs[1:]):
        return None
    params = [_const(v) for v in bn.inputs[1:5]]
    if any(p is None for p in params):
        return None
    gamma, beta, mean, var = (p.double() for p in params)  # type: ignore[union-attr]
    eps = float(bn.attrs.get("epsilon", 1e-5))
    scale = gamma / torch.sqrt(var + eps)
    return scale, beta - mean * scale


def fuse_batchnorm(graph: Graph) -> int:
    count = 0
    for bn in list(graph.nodes):
        if bn.graph is not graph or not _is(bn, "BatchNormalization"):
            continue
        y = bn.inputs[0]
        producer = y.producer if y is not None else None
        if y is None or producer is None or _only_consumer(graph, y) is not bn:
            continue
        affine = _bn_affine(bn)
        if affine is None:
            continue
        if _is(producer, "Conv"):
            done = _bn_into_conv(graph, producer, bn, *affine)
        elif _is(producer, "Gemm"):
            done = _bn_into_gemm(graph, producer, bn, *affine)
        else:
            done = False
        count += done
    return count


def _bn_into_conv(graph: Graph, conv: Node, bn: Node, scale: torch.Tensor,
                  shift: torch.Tensor) -> bool:
    weight = _const(conv.inputs[1])
    if weight is None or not weight.is_floating_point() or weight.shape[0] != scale.shape[0]:
        return False
    bias = _const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] is not None else None
    if len(conv.inputs) > 2 and conv.inputs[2] is not None and bias is None:
        return False
    shape = [-1] + [1] * (weight.dim() - 1)
    new_w = (weight.double() * scale.reshape(shape)).to(weight.dtype)
    old_b = bias.double() if bias is not None else torch.zeros_like(scale)
    new_b = (old_b * scale + shift).to(weight.dtype)
    w_value = new_const(graph, f"{conv.name}.weight_bn", new_w.contiguous())
    b_value = new_const(graph, f"{conv.name}.bias_bn", new_b.contiguous())
    x = conv.inputs[0]
    fused = Node("Conv", [x, w_value, b_value], [Value(bn.outputs[0].name)], dict(conv.attrs),
                 name=conv.name, opset=conv.opset)
    replace_nodes(graph, bn, [conv], fused)
    return True


def _bn_into_gemm(graph: Graph, gemm: Node, bn: Node, scale: torch.Tensor,
                  shift: torch.Tensor) -> bool:
    b = _const(gemm.inputs[1])
    c_value = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    c = _const(c_value)
    if b is None or b.dim() != 2 or (c_value is not None and c is None):
        return False
    trans_b = int(gemm.attrs.get("transB", 0))
    n = b.shape[0] if trans_b else b.shape[1]
    if n != scale.shape[0]:
        return False
    beta = float(gemm.attrs.get("beta", 1.0))
    if c is not None and c.numel() not in (1, n):
        return False
    c_vec = (c.double().reshape(-1).expand(n) * beta) if c is not None else torch.zeros(n).double()
    new_b = b.double() * (scale.reshape(-1, 1) if trans_b else scale.reshape(1, -1))
    new_c = c_vec * scale + shift
    attrs = dict(gemm.attrs)
    attrs["beta"] = 1.0
    b_value = new_const(graph, f"{gemm.name}.weight_bn", new_b.to(b.dtype).contiguous())
    c_new = new_const(graph, f"{gemm.name}.bias_bn", new_c.to(b.dtype).contiguous())
    fused = Node("Gemm", [gemm.inputs[0], b_value, c_new], [Value(bn.outputs[0].name)], attrs,
                 name=gemm.name, opset=gemm.opset)
    replace_nodes(graph, bn, [gemm], fused)
    return True


# -- 3. Gemm / MatMul (+ Add) -> FusedGemm ----------------------------------------------
def _bias_vector(value: Value | None, n: int, scale: float = 1.0) -> torch.Tensor | None:
    """A bias broadcast along the last axis as an ``[n]`` tensor, if it is one."""
    c = _const(value)
    if c is None or not c.is_floating_point():
        return None
    if c.numel() == 1:
        return (c.reshape(1) * scale).expand(n).contiguous()
    if c.shape[-1] == n and c.numel() == n:
        return (c.reshape(n) * scale).contiguous()
    return None


def fuse_linear(graph: Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if node.graph is not graph:
            continue
        if _is(node, "Gemm"):
            count += _gemm_to_fused(graph, node)
        elif _is(node, "MatMul"):
            count += _matmul_to_fused(graph, node)
    return count


def _gemm_to_fused(graph: Graph, gemm: Node) -> bool:
    b = _const(gemm.inputs[1])
    x = gemm.inputs[0]
    if (b is None or b.dim() != 2 or b.dtype != torch.float32 or not _float32(x)
            or gemm.attrs.get("transA", 0) or float(gemm.attrs.get("alpha", 1.0)) != 1.0):
        return False
    w = b if gemm.attrs.get("transB", 0) else b.t()
    n = w.shape[0]
    c_value = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    bias = None
    if c_value is not None:
        bias = _bias_vector(c_value, n, float(gemm.attrs.get("beta", 1.0)))
        if bias is None:
            return False
    inputs: list[Value | None] = [x, new_const(graph, f"{gemm.name}.weight_nk", w.contiguous())]
    if bias is not None:
        inputs.append(new_const(graph, f"{gemm.name}.bias", bias))
    fused = Node("FusedGemm", inputs, [Value(gemm.outputs[0].name)], {}, name=gemm.name,
                 domain=FUSED_DOMAIN, opset=1)
    replace_nodes(graph, gemm, [], fused)
    return True


def _matmul_to_fused(graph: Graph, mm: Node) -> bool:
    x = mm.inputs[0]
    b = _const(mm.inputs[1])
    if (b is None or b.dim() != 2 or b.dtype != torch.float32 or not _float32(x)
            or x is None or x.spec.rank is None or x.spec.rank < 2):
        return False
    n = b.shape[1]
    anchor, absorbed, bias = mm, [], None
    consumer = _only_consumer(graph, mm.outputs[0])
    if _is(consumer, "Add"):
        assert consumer is not None
        other = consumer.inputs[1] if consumer.inputs[0] is mm.outputs[0] else consumer.inputs[0]
        bias = _bias_vector(other, n)
        if bias is not None:
            anchor, absorbed = consumer, [mm]
    inputs: list[Value | None] = [x, new_const(graph, f"{mm.name}.weight_nk", b.t().contiguous())]
    if bias is not None:
        inputs.append(new_const(graph, f"{anchor.name}.bias", bias))
    fused = Node("FusedGemm", inputs, [Value(anchor.outputs[0].name)], {}, name=mm.name,
                 domain=FUSED_DOMAIN, opset=1)
    replace_nodes(graph, anchor, absorbed, fused)
    return True


# -- 4. Gelu ---------------------------------------------------------------------------
def _close(value: float | None, target: float) -> bool:
    return value is not None and abs(value - target) <= 1e-4 * abs(target)


def _other(node: Node, value: Value) -> Value | None:
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a


def fuse_gelu(graph: Graph) -> int:
    """``x * 0.5 * (1 + erf(x / sqrt2))`` (any association of the muls) -> Gelu."""
    count = 0
    for erf in list(graph.nodes):
        if erf.graph is not graph or not _is(erf, "Erf"):
            continue
        scaled = erf.inputs[0]
        pre = scaled.producer if scaled is not None else None
        if pre is None or _only_consumer(graph, scaled) is not erf:  # type: ignore[arg-type]
            continue
        x = pre.inputs[0]
        if _is(pre, "Div") and _close(const_scalar(pre.inputs[1]), math.sqrt(2.0)):
            pass
        elif _is(pre, "Mul") and x is not None and _close(
                const_scalar(_other(pre, x) if x.const is None else pre.inputs[0]),
                1 / math.sqrt(2.0)):
            x = pre.inputs[0] if pre.inputs[0] is not None and pre.inputs[0].const is None \
                else pre.inputs[1]
        else:
            continue
        match = _gelu_tail(graph, erf, x)
        if match is None or x is None:
            continue
        last, absorbed = match
        gelu = Node("Gelu", [x], [Value(last.outputs[0].name)], {"approximate": "none"},
                    name=erf.name, opset=erf.opset)
        replace_nodes(graph, last, [pre, erf, *absorbed], gelu)
        count += 1
    return count


def _gelu_tail(graph: Graph, erf: Node, x: Value | None) -> tuple[Node, list[Node]] | None:
    """Match ``+1``, ``* x`` and ``* 0.5`` after the Erf; returns (last node, the others)."""
    add = _only_consumer(graph, erf.outputs[0])
    if not _is(add, "Add") or x is None:
        return None
    assert add is not None
    if not _close(const_scalar(_other(add, erf.outputs[0])), 1.0):
        return None
    mul1 = _only_consumer(graph, add.outputs[0])
    if not _is(mul1, "Mul"):
        return None
    assert mul1 is not None
    partner = _other(mul1, add.outputs[0])
    if partner is x:
        # (x * (1 + erf)) * 0.5
        mul2 = _only_consumer(graph, mul1.outputs[0])
        if _is(mul2, "Mul") and _close(const_scalar(_other(mul2, mul1.outputs[0])), 0.5):  # type: ignore[arg-type]
            assert mul2 is not None
            return mul2, [add, mul1]
        return None
    # (x * 0.5) * (1 + erf)
    half = partner.producer if partner is not None else None
    if (_is(half, "Mul") and half is not None and x in half.inputs
            and _close(const_scalar(_other(half, x)), 0.5)
            and _only_consumer(graph, half.outputs[0]) is mul1):
        return mul1, [add, half]
    return None


# -- 5. Conv -> FusedConv (+ residual Add) -------------------------------------------------
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
    for conv in list(graph.nodes):
        if conv.graph is not graph or not _is(conv, "Conv"):
            continue
        weight = conv.inputs[1]
        if _const(weight) is None or weight is None or weight.spec.rank not in (3, 4, 5):
            continue
        bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        if bias is not None and _const(bias) is None:
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
    add = _only_consumer(graph, conv.outputs[0])
    if not _is(add, "Add"):
        return None
    assert add is not None
    z = _other(add, conv.outputs[0])
    y = conv.outputs[0]
    if z is None or z.const is not None or z.spec.shape is None or y.spec.shape is None:
        return None
    # Same shape and dtype (no broadcasting): the residual is added element for element.
    if z.spec != y.spec or any(d is None for d in z.spec.shape):
        return None
    return add, z


# -- 6. activations into FusedConv / FusedGemm ---------------------------------------------
def _activation(node: Node) -> tuple[str, list[float]] | None:
    """(name, params) of an activation node the fused ops can end with."""
    if node.domain != "" or len(node.inputs) < 1:
        return None
    op = node.op_type
    if op in ("Relu", "Sigmoid", "Tanh", "HardSwish"):
        return op, []
    if op == "LeakyRelu":
        return op, [float(node.attrs.get("alpha", 0.01))]
    if op == "HardSigmoid":
        return op, [float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5))]
    if op == "Gelu":
        return ("GeluTanh" if node.attrs.get("approximate", "none") == "tanh" else "Gelu"), []
    if op == "Clip":
        if node.opset < 11:
            lo, hi = node.attrs.get("min", -math.inf), node.attrs.get("max", math.inf)
        else:
            bounds: list[float | None] = []
            for i in (1, 2):
                v = node.inputs[i] if len(node.inputs) > i else None
                if v is None:
                    bounds.append(None)
                    continue
                scalar = const_scalar(v)
                if scalar is None:
                    return None
                bounds.append(scalar)
            lo = -math.inf if bounds[0] is None else bounds[0]
            hi = math.inf if bounds[1] is None else bounds[1]
        return "Clip", [float(lo), float(hi)]
    return None


def fuse_activation(graph: Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if node.graph is not graph or node.domain != FUSED_DOMAIN:
            continue
        if node.op_type not in ("FusedConv", "FusedGemm") or node.attrs.get("activation"):
            continue
        consumer = _only_consumer(graph, node.outputs[0])
        act = _activation(consumer) if consumer is not None else None
        if consumer is None or act is None or consumer.inputs[0] is not node.outputs[0]:
            continue
        attrs = dict(node.attrs)
        attrs["activation"], attrs["activation_params"] = act
        fused = Node(node.op_type, node.inputs, [Value(consumer.outputs[0].name)], attrs,
                     name=node.name, domain=FUSED_DOMAIN, opset=node.opset)
        replace_nodes(graph, consumer, [node], fused)
        count += 1
    return count


# -- 7. attention -----------------------------------------------------------------------
def fuse_attention(graph: Graph) -> int:
    count = 0
    for softmax in list(graph.nodes):
        if softmax.graph is not graph or not _is(softmax, "Softmax"):
            continue
        match = _attention_match(graph, softmax)
        if match is None:
            continue
        q, kt, v, mask, scale, first, absorbed, last = match
        inputs = [q, kt, v] + ([mask] if mask is not None else [])
        fused = Node("Attention", inputs, [Value(last.outputs[0].name)], {"scale": scale},
                     name=first.name, domain=FUSED_DOMAIN, opset=1)
        replace_nodes(graph, last, absorbed, fused)
        count += 1
    return count


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
    if _is(node, "Add") and node is not None and _only_consumer(graph, scores) is softmax:
        picked = _scores_operand(node)
        if picked is None:
            return None
        base, mask = picked
        if mask is None or not _float32(mask) or (mask.spec.rank or 0) > rank:
            return None
        absorbed.append(node)
        node = base.producer if base is not None else None
        scores = base
    scale = 1.0
    if (_is(node, "Div") or _is(node, "Mul")) and node is not None:
        c = const_scalar(node.inputs[1])
        if c is None or c == 0 or _only_consumer(graph, node.outputs[0]) is None:
            return None
        scale = 1.0 / c if node.op_type == "Div" else c
        absorbed.append(node)
        scores = node.inputs[0]
        node = scores.producer if scores is not None else None
    if not _is(node, "MatMul") or node is None or _only_consumer(graph, node.outputs[0]) is None:
        return None
    q, kt = node.inputs[0], node.inputs[1]
    absorbed.append(node)
    out_mm = _only_consumer(graph, softmax.outputs[0])
    if not _is(out_mm, "MatMul") or out_mm is None or out_mm.inputs[0] is not softmax.outputs[0]:
        return None
    v = out_mm.inputs[1]
    for t in (q, kt, v):
        if t is None or not _float32(t) or t.spec.rank != rank:
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
            if base is not None and any(_is(producer, k) for k in kinds):
                if kinds == ("Mul",) and const_scalar(producer.inputs[1]) is None:  # type: ignore[union-attr]
                    continue
                return base, mask
    return None


RULES: tuple[tuple[str, Rule], ...] = (
    ("noops", fuse_noops),
    ("batchnorm", fuse_batchnorm),
    ("linear", fuse_linear),
    ("gelu", fuse_gelu),
    ("conv", fuse_conv),
    ("activation", fuse_activation),
    ("attention", fuse_attention),
)
