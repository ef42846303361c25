"""Fuzz cases for segflow against onnxruntime, and the judge of each.

Shared by ``tests/test_fuzz.py`` and ``benchmarks/fuzz.py``. A case is made from
``(seed, index)`` alone, so ``case_id`` ``"7:123"`` is reproducible anywhere:

* ``valid``: a random valid graph (elementwise, Conv, pools, MatMul/Gemm, shape
  ops, reductions, Softmax, LayerNormalization, BatchNormalization; chains and
  DAGs, shapes consistent by construction) fed valid arrays, some with NaN, +Inf
  or -Inf at random positions;
* ``model:<mutation>``: such a graph broken one way (an attribute out of range, a
  wrong dtype, a dangling or duplicate name, a truncated initializer, no opset
  import, a wrong declared shape, ...) fed valid arrays;
* ``feed:<mutation>``: a valid graph fed something wrong (rank, dim, dtype, an
  unknown or missing name).

:func:`judge` runs a case through onnxruntime (the oracle) and segflow and names
its outcome (see :data:`OUTCOMES`); :func:`run_guarded` runs cases in a worker
process so that a crash or a hang is an outcome too.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Outputs equal within these (numpy.testing.assert_allclose), NaN/+Inf/-Inf masks exactly.
RTOL = 1e-3
ATOL = 1e-3

# Outcomes that are not failures, then failures.
PASSING = ("equal", "refused", "unsupported", "strict")
FAILING = ("wrong", "mask", "raw", "crash", "hang")
OUTCOMES = PASSING + FAILING
"""``equal``: outputs equal onnxruntime's. ``refused``: both refused, segflow with a
``SegflowError`` naming a node, value or input. ``unsupported``: segflow raised
UnsupportedOp for a model onnxruntime ran. ``strict``: segflow refused (naming the
culprit) a broken model or feed that onnxruntime ran anyway. ``wrong``: values,
shapes or dtypes differ, segflow ran what onnxruntime refused, or refused a valid
case. ``mask``: the NaN/+Inf/-Inf pattern differs. ``raw``: another exception type,
or a message naming nothing. ``crash``: the worker process died. ``hang``: timeout."""

# The share of each generator kind among the cases.
VALID_SHARE, MODEL_SHARE = 0.5, 0.3    # the rest: bad feeds
MAX_ELEMENTS = 2048                    # per tensor, so a case runs in milliseconds
NET_MAX_ELEMENTS = 32768               # ... in a "net" graph (_Graph.wide)
FLOAT = TensorProto.FLOAT


# ---------------------------------------------------------------------------------------
# Valid graphs


@dataclass
class _Graph:
    """A graph under construction: every value is float32 with a known concrete shape."""

    rng: random.Random
    data: np.random.Generator
    opset: int
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)   # value -> shape
    pool: list[str] = field(default_factory=list)                      # usable values
    count: int = 0
    # A "net": wider convolutions over larger images, so that the layout pass's kernels
    # (libdnnl's direct convolutions and pools, Winograd, the stem, dense chains) apply.
    wide: bool = False

    @property
    def limit(self) -> int:
        return NET_MAX_ELEMENTS if self.wide else MAX_ELEMENTS

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, array: Any, dtype: Any = np.float32) -> str:
        name = self.fresh("w")
        self.inits.append(numpy_helper.from_array(np.asarray(array, dtype), name))
        return name

    def floats(self, shape: Sequence[int], scale: float = 1.0) -> str:
        return self.const(self.data.standard_normal(tuple(shape)) * scale)

    def ints(self, values: Sequence[int]) -> str:
        return self.const(list(values), np.int64)

    def emit(self, op: str, inputs: Sequence[str], shapes: Sequence[tuple[int, ...]],
             pool: bool = True, **attrs: Any) -> list[str]:
        """Add a node with one output per shape; its outputs join the pool."""
        outs = [self.fresh("t") for _ in shapes]
        self.nodes.append(helper.make_node(op, list(inputs), outs,
                                           name=self.fresh(f"{op.lower()}_"), **attrs))
        for out, shape in zip(outs, shapes):
            self.shapes[out] = tuple(shape)
            if pool:
                self.pool.append(out)
        return outs

    def one(self, op: str, inputs: Sequence[str], shape: Sequence[int], pool: bool = True,
            **attrs: Any) -> str:
        return self.emit(op, inputs, [tuple(shape)], pool=pool, **attrs)[0]

    def pick(self, rank: int | None = None, min_rank: int = 0) -> str | None:
        choices = [v for v in self.pool if (rank is None or len(self.shapes[v]) == rank)
                   and len(self.shapes[v]) >= min_rank]
        return self.rng.choice(choices) if choices else None

    def same_shape(self, x: str) -> str | None:
        """Another (or the same) pooled value of ``x``'s shape."""
        choices = [v for v in self.pool if self.shapes[v] == self.shapes[x]]
        return self.rng.choice(choices)

    def scalar(self, value: float) -> str:
        return self.const(np.float32(value))


def _size(shape: Iterable[int]) -> int:
    return int(np.prod(list(shape), dtype=np.int64))


UNARY = ("Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Abs", "Neg", "LeakyRelu", "Clip")
BINARY = ("Add", "Mul", "Sub", "Div", "Max", "Min")


def _unary(g: _Graph) -> bool:
    x = g.pick()
    if x is None:
        return False
    op = g.rng.choice(UNARY)
    shape = g.shapes[x]
    # Keep values in the ops' domains, so that only injected non-finite values are
    # non-finite (values near a pole would compare as noise).
    if op in ("Log", "Sqrt"):
        x = g.one("Add", [g.one("Abs", [x], shape, pool=False), g.scalar(0.1)], shape, pool=False)
    elif op == "Exp":
        x = g.one("Clip", [x, g.scalar(-4.0), g.scalar(4.0)], shape, pool=False)
    if op == "LeakyRelu":
        g.one(op, [x], shape, alpha=g.rng.choice([0.01, 0.2, 1.5]))
    elif op == "Clip":
        low, high = sorted(g.rng.uniform(-1.5, 1.5) for _ in range(2))
        bounds = g.rng.choice([[g.scalar(low), g.scalar(high)], [g.scalar(low)],
                               ["", g.scalar(high)], []])
        g.one(op, [x, *bounds], shape)
    else:
        g.one(op, [x], shape)
    return True


def _broadcast_const(g: _Graph, shape: tuple[int, ...], positive: bool) -> str:
    """A constant that broadcasts to ``shape``: some dims 1, maybe fewer leading dims."""
    dims = [d if g.rng.random() < 0.5 else 1 for d in shape]
    dims = dims[g.rng.randint(0, len(dims)):] if g.rng.random() < 0.3 else dims
    values = g.data.standard_normal(dims)
    if positive:     # a divisor away from zero
        values = np.sign(values + 1e-3) * (np.abs(values) + 0.5)
    return g.const(values)


def _binary(g: _Graph) -> bool:
    x = g.pick()
    if x is None:
        return False
    op = g.rng.choice(BINARY)
    shape = g.shapes[x]
    if g.rng.random() < 0.5:
        y = g.same_shape(x)
        if op == "Div":
            y = g.one("Add", [g.one("Abs", [y], shape, pool=False), g.scalar(0.5)], shape,
                      pool=False)
    else:
        y = _broadcast_const(g, shape, positive=op == "Div")
    pair = [x, y] if g.rng.random() < 0.5 or op == "Div" else [y, x]
    if op in ("Max", "Min") and g.rng.random() < 0.3:
        pair.append(g.same_shape(x))     # variadic
    g.one(op, pair, shape)
    return True


def _window(g: _Graph, size: int, max_kernel: int, pool: bool, dilate: bool = True
            ) -> tuple[int, int, int, int, int, int]:
    """(kernel, stride, dilation, pad_begin, pad_end, out) for one spatial axis."""
    for _ in range(20):
        kernel = g.rng.randint(1, max_kernel)
        stride = g.rng.choice([1, 1, 2])
        dilation = g.rng.choice([1, 1, 2]) if kernel > 1 and dilate else 1
        # Pools need pads smaller than the kernel (onnxruntime checks it).
        pad_max = kernel - 1 if pool else 1
        begin, end = g.rng.randint(0, pad_max), g.rng.randint(0, pad_max)
        span = (kernel - 1) * dilation + 1
        if span <= size + begin + end:
            return kernel, stride, dilation, begin, end, (size + begin + end - span) // stride + 1
    return 1, 1, 1, 0, 0, size


def _conv(g: _Graph) -> bool:
    x = g.pick(rank=4)
    if x is None:
        return False
    n, c, h, w = g.shapes[x]
    groups = [d for d in range(1, c + 1) if c % d == 0]
    group = g.rng.choice(groups) if g.rng.random() < 0.4 else 1
    m = group * g.rng.randint(1, max(1, 8 // group))
    if g.wide:        # dense or depthwise, as networks have them
        group = c if g.rng.random() < 0.3 else 1
        m = c if group > 1 else g.rng.choice([8, 16, 32])
    attrs: dict[str, Any] = {}
    if g.rng.random() < 0.15:          # auto_pad: SAME_UPPER / SAME_LOWER, no dilation
        kh, kw = g.rng.randint(1, 3), g.rng.randint(1, 3)
        stride = g.rng.choice([1, 2])
        attrs["auto_pad"] = g.rng.choice(["SAME_UPPER", "SAME_LOWER"])
        attrs["strides"] = [stride, stride]
        oh, ow = -(-h // stride), -(-w // stride)
    else:
        kh, sh, dh, pt, pb, oh = _window(g, h, 3, pool=False)
        kw, sw, dw, pl, pr, ow = _window(g, w, 3, pool=False)
        attrs.update(strides=[sh, sw], dilations=[dh, dw], pads=[pt, pl, pb, pr])
    if g.rng.random() < 0.5:
        attrs["kernel_shape"] = [kh, kw]
    if group > 1 or g.rng.random() < 0.2:
        attrs["group"] = group
    if _size((n, m, oh, ow)) > g.limit:
        return False
    fan_in = (c // group) * kh * kw
    inputs = [x, g.floats((m, c // group, kh, kw), scale=fan_in ** -0.5)]
    if g.rng.random() < 0.6:
        inputs.append(g.floats((m,), scale=0.1))
    g.one("Conv", inputs, (n, m, oh, ow), **attrs)
    return True


def _pool(g: _Graph) -> bool:
    x = g.pick(rank=4)
    if x is None:
        return False
    n, c, h, w = g.shapes[x]
    op = g.rng.choice(["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"])
    if op.startswith("Global"):
        g.one(op, [x], (n, c, 1, 1))
        return True
    # AveragePool's dilations are newer than some opsets: MaxPool's only.
    dilate = op == "MaxPool"
    kh, sh, dh, pt, pb, oh = _window(g, h, 3, pool=True, dilate=dilate)
    kw, sw, dw, pl, pr, ow = _window(g, w, 3, pool=True, dilate=dilate)
    attrs: dict[str, Any] = {"kernel_shape": [kh, kw], "strides": [sh, sw],
                             "pads": [pt, pl, pb, pr]}
    if dh > 1 or dw > 1:
        attrs["dilations"] = [dh, dw]
    # ceil_mode where the last window cannot start in the padding (its rule differs).
    if pt == pb == pl == pr == 0 and sh <= kh and sw <= kw and g.rng.random() < 0.3:
        attrs["ceil_mode"] = 1
        eh, ew = (kh - 1) * dh + 1, (kw - 1) * dw + 1
        oh, ow = -(-(h - eh) // sh) + 1, -(-(w - ew) // sw) + 1
    if op == "AveragePool" and g.rng.random() < 0.5:
        attrs["count_include_pad"] = 1
    g.one(op, [x], (n, c, oh, ow), **attrs)
    return True


def _matmul(g: _Graph) -> bool:
    x = g.pick(min_rank=1)
    if x is None:
        return False
    shape = g.shapes[x]
    k = shape[-1]
    if g.rng.random() < 0.5 and len(shape) == 2:      # Gemm
        trans_a, trans_b = g.rng.random() < 0.3, g.rng.random() < 0.5
        rows, k = (shape[1], shape[0]) if trans_a else shape
        n = g.rng.randint(1, 8)
        b = g.floats((n, k) if trans_b else (k, n), scale=k ** -0.5)
        inputs = [x, b]
        if g.rng.random() < 0.7:
            c_shape = g.rng.choice([(n,), (1, n), (rows, n), (rows, 1), ()])
            inputs.append(g.floats(c_shape))
        attrs: dict[str, Any] = {"transA": int(trans_a), "transB": int(trans_b)}
        if g.rng.random() < 0.3:
            attrs.update(alpha=g.rng.choice([0.5, 2.0]), beta=g.rng.choice([0.0, 0.5, 1.5]))
        g.one("Gemm", inputs, (rows, n), **attrs)
        return True
    n = g.rng.randint(1, 8)
    if g.rng.random() < 0.15:             # a vector: the last dim goes away
        g.one("MatMul", [x, g.floats((k,), scale=k ** -0.5)], shape[:-1])
        return True
    if len(shape) == 1:
        g.one("MatMul", [x, g.floats((k, n), scale=k ** -0.5)], (n,))
        return True
    out = (*shape[:-1], n)
    if _size(out) > g.limit:
        return False
    if g.rng.random() < 0.3:              # the constant on the left: [n, M] @ [..., M, K]
        left = (*shape[:-2], n, shape[-1])
        if _size(left) <= g.limit:
            g.one("MatMul", [g.floats((n, shape[-2]), scale=shape[-2] ** -0.5), x], left)
            return True
    g.one("MatMul", [x, g.floats((k, n), scale=k ** -0.5)], out)
    return True


def _factor(g: _Graph, total: int) -> list[int]:
    """Random dims whose product is ``total``."""
    rank = g.rng.randint(1, 4)
    dims = [1] * rank
    rest = total
    p = 2
    while rest > 1:
        while rest % p:
            p += 1
        rest //= p
        dims[g.rng.randrange(rank)] *= p
    return dims


def _reshape(g: _Graph) -> bool:
    x = g.pick(min_rank=1)
    if x is None:
        return False
    shape = g.shapes[x]
    op = g.rng.choice(["Reshape", "Reshape", "Flatten", "Transpose", "Concat", "Split", "Slice"])
    rank = len(shape)
    if op == "Reshape":
        dims = _factor(g, _size(shape))
        target = list(dims)
        for i, d in enumerate(dims):
            if i < rank and shape[i] == d and g.rng.random() < 0.3:
                target[i] = 0
        if g.rng.random() < 0.5:
            target[g.rng.randrange(len(target))] = -1
        g.one(op, [x, g.ints(target)], dims)
    elif op == "Flatten":
        axis = g.rng.randint(-rank, rank)
        a = axis + rank if axis < 0 else axis
        g.one(op, [x], (_size(shape[:a]), _size(shape[a:])), axis=axis)
    elif op == "Transpose":
        perm = list(range(rank))
        g.rng.shuffle(perm)
        if g.rng.random() < 0.2:
            g.one(op, [x], shape[::-1])
        else:
            g.one(op, [x], tuple(shape[p] for p in perm), perm=perm)
    elif op == "Concat":
        parts = [x] + [g.same_shape(x) for _ in range(g.rng.randint(1, 2))]
        axis = g.rng.randint(-rank, rank - 1)
        out = list(shape)
        out[axis] *= len(parts)
        if _size(out) > g.limit:
            return False
        g.one(op, parts, out, axis=axis)
    elif op == "Split":
        axes = [a for a in range(rank) if shape[a] >= 2]
        if not axes:
            return False
        axis = g.rng.choice(axes)
        cut = g.rng.randint(1, shape[axis] - 1)
        sizes = [cut, shape[axis] - cut]
        outs = [tuple(s if i != axis else part for i, s in enumerate(shape)) for part in sizes]
        g.emit(op, [x, g.ints(sizes)], outs, axis=axis - rank if g.rng.random() < 0.3 else axis)
    else:
        axis = g.rng.randrange(rank)
        dim = shape[axis]
        step = g.rng.choice([1, 1, 2, -1, -2])
        start = g.rng.randint(-dim, dim - 1)
        end = g.rng.choice([g.rng.randint(-dim, dim), 1 << 40, -(1 << 40)])
        length = len(range(dim)[slice(start, end, step)])
        if length == 0:
            return False
        out = list(shape)
        out[axis] = length
        inputs = [x, g.ints([start]), g.ints([end]), g.ints([axis])]
        if step != 1 or g.rng.random() < 0.5:
            inputs.append(g.ints([step]))
        g.one(op, inputs, out)
    return True


def _reduce(g: _Graph) -> bool:
    x = g.pick(min_rank=1)
    if x is None:
        return False
    shape = g.shapes[x]
    rank = len(shape)
    op = g.rng.choice(["ReduceMean", "ReduceSum", "ReduceMax"])
    axes = sorted(g.rng.sample(range(rank), g.rng.randint(1, rank)))
    keep = g.rng.random() < 0.5
    out = tuple(1 if i in axes else d for i, d in enumerate(shape)) if keep else \
        tuple(d for i, d in enumerate(shape) if i not in axes)
    written = [a - rank if g.rng.random() < 0.3 else a for a in axes]
    as_input = op == "ReduceSum" or g.opset >= 18
    attrs: dict[str, Any] = {"keepdims": int(keep)}
    if as_input:
        g.one(op, [x, g.ints(written)], out, **attrs)
    else:
        g.one(op, [x], out, axes=written, **attrs)
    return True


def _normalize(g: _Graph) -> bool:
    x = g.pick(min_rank=1)
    if x is None:
        return False
    shape = g.shapes[x]
    rank = len(shape)
    op = g.rng.choice(["Softmax", "LayerNormalization", "BatchNormalization"])
    if op == "Softmax":
        g.one(op, [x], shape, axis=g.rng.randint(-rank, rank - 1))
    elif op == "LayerNormalization":
        if g.opset < 17:
            return False
        axis = g.rng.randint(-rank, rank - 1)
        inner = shape[axis:]
        inputs = [x, g.floats(inner, 0.5)]
        if g.rng.random() < 0.6:
            inputs.append(g.floats(inner, 0.1))
        g.one(op, inputs, shape, axis=axis, epsilon=g.rng.choice([1e-5, 1e-3]))
    else:
        if rank < 2:
            return False
        c = shape[1]
        variance = g.const(g.data.random(c) + 0.5)
        g.one(op, [x, g.floats((c,), 0.5), g.floats((c,), 0.1), g.floats((c,), 0.1), variance],
              shape, epsilon=g.rng.choice([1e-5, 1e-3]))
    return True


OP_GENERATORS: tuple[tuple[Callable[[_Graph], bool], int], ...] = (
    (_unary, 4), (_binary, 4), (_conv, 4), (_pool, 3), (_matmul, 3), (_reshape, 4),
    (_reduce, 2), (_normalize, 3))


NET_GENERATORS = ((_conv, 8), (_pool, 3), (_unary, 3), (_binary, 3), (_normalize, 2),
                  (_reshape, 1))


def _head(g: _Graph) -> None:
    """Global pooling, then 1-3 dense layers with an activation or none (a dense chain)."""
    x = g.pick(rank=4)
    if x is None:
        return
    n, c = g.shapes[x][:2]
    y = g.one("Flatten", [g.one(g.rng.choice(["GlobalAveragePool", "GlobalMaxPool"]), [x],
                                (n, c, 1, 1))], (n, c))
    width = c
    for _ in range(g.rng.randint(1, 3)):
        out = g.rng.choice([16, 32, 64])
        if g.rng.random() < 0.5:
            y = g.one("Gemm", [y, g.floats((out, width), width ** -0.5), g.floats((out,), 0.1)],
                      (n, out), transB=1)
        else:
            y = g.one("Add", [g.one("MatMul", [y, g.floats((width, out), width ** -0.5)],
                                    (n, out), pool=False), g.floats((out,), 0.1)], (n, out))
        act = g.rng.choice(["Relu", "Tanh", "Sigmoid", "LeakyRelu", None])
        if act is not None:
            y = g.one(act, [y], (n, out))
        width = out


@dataclass(frozen=True)
class GraphSpec:
    """A valid model and what a valid feed for it is."""

    model: onnx.ModelProto
    inputs: dict[str, tuple[int, ...]]          # input -> the shape its feed has
    symbolic: dict[str, tuple[bool, ...]]       # input -> which dims are dim_params
    shapes: dict[str, tuple[int, ...]]          # every value's shape at that feed


def make_graph(rng: random.Random, data: np.random.Generator, name: str) -> GraphSpec:
    g = _Graph(rng, data, opset=rng.choice([13, 17, 17, 18, 21]))
    batch = rng.randint(1, 2)
    if rng.random() < 0.6:
        first: tuple[int, ...] = (batch, rng.randint(1, 6), rng.randint(3, 8), rng.randint(3, 8))
    elif rng.random() < 0.5:
        first = (batch, rng.randint(2, 5), rng.randint(2, 8))
    else:
        first = (batch, rng.randint(2, 8))
    if rng.random() < 0.25:
        g.wide = True
        side = rng.choice([8, 12, 16, 24])
        first = (batch, rng.choice([3, 8, 16, 32]), side, side)
    inputs = {"x": first}
    if rng.random() < 0.3:
        inputs["y"] = first if rng.random() < 0.6 else (batch, rng.randint(2, 6))
    symbolic_batch = rng.random() < 0.4
    symbolic = {k: tuple(symbolic_batch and i == 0 for i in range(len(s)))
                for k, s in inputs.items()}
    for k, s in inputs.items():
        g.shapes[k] = s
        g.pool.append(k)
    weights = [gen for gen, weight in (NET_GENERATORS if g.wide else OP_GENERATORS)
               for _ in range(weight)]
    for _ in range(rng.randint(1, 8)):
        for _ in range(5):         # a generator may not apply to what the pool holds
            if rng.choice(weights)(g):
                break
    if g.wide and rng.random() < 0.6:
        _head(g)
    produced = [out for node in g.nodes for out in node.output]
    if not produced:
        _unary(g)
        produced = [out for node in g.nodes for out in node.output]
    outputs = [produced[-1]] + [o for o in produced[:-1] if rng.random() < 0.15]
    declare = rng.random() < 0.5 and not symbolic_batch

    def info(value: str, dims: tuple[int, ...], sym: tuple[bool, ...] | None = None
             ) -> onnx.ValueInfoProto:
        shape = [("N" if sym and sym[i] else d) for i, d in enumerate(dims)]
        return helper.make_tensor_value_info(value, FLOAT, shape)

    graph = helper.make_graph(
        g.nodes, name, [info(k, s, symbolic[k]) for k, s in inputs.items()],
        [info(o, g.shapes[o]) if declare else helper.make_tensor_value_info(o, FLOAT, None)
         for o in outputs], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", g.opset)])
    model.ir_version = 8 if g.opset <= 17 else 9 if g.opset <= 20 else 10
    return GraphSpec(model, inputs, symbolic, dict(g.shapes))


def valid_feeds(spec: GraphSpec, rng: random.Random, data: np.random.Generator,
                non_finite: bool = True) -> dict[str, np.ndarray]:
    feeds = {k: data.standard_normal(s).astype(np.float32) for k, s in spec.inputs.items()}
    if non_finite and rng.random() < 0.5:
        target = feeds[rng.choice(sorted(feeds))]
        flat = target.reshape(-1)
        for _ in range(rng.randint(1, 3)):
            flat[rng.randrange(flat.size)] = rng.choice([np.nan, np.inf, -np.inf])
    if rng.random() < 0.1:         # a strided view: onnxruntime accepts it
        k = rng.choice(sorted(feeds))
        a = feeds[k]
        feeds[k] = np.asfortranarray(a) if a.ndim > 1 else a
    return feeds


# ---------------------------------------------------------------------------------------
# Mutations of a valid model; each returns False where it does not apply.

Mutation = Callable[[onnx.ModelProto, GraphSpec, random.Random], bool]


def _nodes(model: onnx.ModelProto, ops: Sequence[str]) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type in ops]


def _set_attr(node: onnx.NodeProto, name: str, value: Any) -> None:
    for i, attr in enumerate(node.attribute):
        if attr.name == name:
            del node.attribute[i]
            break
    node.attribute.append(helper.make_attribute(name, value))


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto | None:
    return next((t for t in model.graph.initializer if t.name == name), None)


def _rank(spec: GraphSpec, value: str) -> int:
    return len(spec.shapes[value])


def _strides_zero(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    nodes = _nodes(model, ["Conv", "MaxPool", "AveragePool"])
    if not nodes:
        return False
    node = rng.choice(nodes)
    strides = list(_attr(node, "strides", [1, 1]))
    strides[rng.randrange(len(strides))] = 0
    _set_attr(node, "strides", strides)
    return True


def _negative_pads(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    nodes = [n for n in _nodes(model, ["Conv", "MaxPool", "AveragePool"])
             if _attr(n, "auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")]
    if not nodes:
        return False
    node = rng.choice(nodes)
    pads = list(_attr(node, "pads", [0, 0, 0, 0]))
    pads[rng.randrange(len(pads))] = -rng.randint(1, 2)
    _set_attr(node, "pads", pads)
    return True


def _bad_group(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    nodes = _nodes(model, ["Conv"])
    if not nodes:
        return False
    node = rng.choice(nodes)
    channels = spec.shapes[node.input[0]][1]
    _set_attr(node, "group", rng.choice([0, -1, channels + 1, 2 * channels + 1]))
    return True


def _bad_kernel_shape(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    nodes = _nodes(model, ["Conv", "MaxPool", "AveragePool"])
    if not nodes:
        return False
    node = rng.choice(nodes)
    h = spec.shapes[node.input[0]][2]
    if node.op_type == "Conv" and rng.random() < 0.5:   # contradicting the weight
        kernel = list(_attr(node, "kernel_shape", []) or
                      _initializer(model, node.input[1]).dims[2:])  # type: ignore[union-attr]
        kernel[0] += 1
    else:                                              # larger than the padded input
        kernel = [h + 4, h + 4]
    _set_attr(node, "kernel_shape", kernel)
    return True


def _axis_out_of_range(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    ops = ["Softmax", "Concat", "Flatten", "LayerNormalization", "Split", "ReduceMean",
           "ReduceSum", "ReduceMax", "Slice"]
    nodes = _nodes(model, ops)
    if not nodes:
        return False
    node = rng.choice(nodes)
    rank = _rank(spec, node.input[0])
    bad = rng.choice([rank + 1, rank + 3, -rank - 1, -rank - 2])
    if node.op_type == "Flatten":
        bad = rng.choice([rank + 1, -rank - 1])
    axes_input = {"ReduceSum": 1, "Slice": 3}.get(node.op_type, 1)
    if node.op_type.startswith("Reduce") or node.op_type == "Slice":
        if len(node.input) > axes_input and node.input[axes_input]:
            init = _initializer(model, node.input[axes_input])
            assert init is not None
            values = numpy_helper.to_array(init).copy()
            values[0] = bad
            init.CopyFrom(numpy_helper.from_array(values, init.name))
        else:
            _set_attr(node, "axes", [bad])
    else:
        _set_attr(node, "axis", bad)
    return True


def _bad_perm(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    nodes = _nodes(model, ["Transpose"])
    if nodes:
        node = rng.choice(nodes)
    else:                            # none yet: a new one over an input, as an output
        node = helper.make_node("Transpose", [model.graph.input[0].name], ["transposed"],
                                name="transpose_added")
        model.graph.node.append(node)
        model.graph.output.append(helper.make_tensor_value_info("transposed", FLOAT, None))
        node = model.graph.node[-1]
    rank = _rank(spec, node.input[0])
    perm = list(range(rank))
    choice = rng.randrange(3)
    if choice == 0 and rank > 1:
        perm[0] = perm[1]                       # a repeated axis
    elif choice == 1:
        perm = perm + [rank]                    # one too many
    else:
        perm[rng.randrange(rank)] = rank + 2    # out of range
    _set_attr(node, "perm", perm)
    return True


def _int64_initializer(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    floats = [t for t in model.graph.initializer if t.data_type == FLOAT]
    if not floats:
        return False
    init = rng.choice(floats)
    values = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(np.round(values * 3).astype(np.int64), init.name))
    return True


def _value_info_dtype(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    outputs = {o.name for o in model.graph.output}
    values = [o for n in model.graph.node for o in n.output if o not in outputs]
    target = rng.choice(values) if values and rng.random() < 0.7 else None
    dtype = rng.choice([TensorProto.INT64, TensorProto.DOUBLE, TensorProto.INT32])
    if target is None:                           # a graph output's declared dtype
        out = rng.choice(list(model.graph.output))
        out.type.tensor_type.elem_type = dtype
        return True
    model.graph.value_info.append(helper.make_tensor_value_info(target, dtype,
                                                                list(spec.shapes[target])))
    return True


def _dangling_input(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    node = rng.choice(list(model.graph.node))
    slots = [i for i, name in enumerate(node.input) if name]
    node.input[rng.choice(slots)] = "ghost_value"
    return True


def _duplicate_name(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    nodes = list(model.graph.node)
    choice = rng.randrange(3)
    if choice == 0 and len(nodes) >= 2:          # two nodes write one name
        i, j = sorted(rng.sample(range(len(nodes)), 2))
        old, new = nodes[j].output[0], nodes[i].output[0]
        nodes[j].output[0] = new
        for node in nodes[j + 1:]:
            for k, name in enumerate(node.input):
                if name == old:
                    node.input[k] = new
        for out in model.graph.output:
            if out.name == old:
                out.name = new
        return True
    if choice == 1:                              # a node output named like a graph input
        node = rng.choice(nodes)
        old = node.output[0]
        node.output[0] = model.graph.input[0].name
        for other in nodes:
            for k, name in enumerate(other.input):
                if name == old:
                    other.input[k] = model.graph.input[0].name
        for out in model.graph.output:
            if out.name == old:
                out.name = model.graph.input[0].name
        return True
    model.graph.input.append(model.graph.input[0])   # a graph input declared twice
    return True


def _truncated_initializer(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    inits = [t for t in model.graph.initializer if _size(t.dims) >= 2]
    if not inits:
        return False
    init = rng.choice(inits)
    raw = numpy_helper.to_array(init).tobytes()
    init.ClearField("float_data")
    init.ClearField("int64_data")
    init.raw_data = raw[:rng.choice([len(raw) // 2, len(raw) - 4, len(raw) - 1, 0])]
    return True


def _no_opset(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    if rng.random() < 0.6:
        del model.opset_import[:]
    else:
        model.opset_import[0].version = rng.choice([99, 1000])
    return True


def _declared_shape(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    choice = rng.randrange(3)
    if choice == 0:                  # a graph output declared with the wrong dims
        out = rng.choice(list(model.graph.output))
        dims = list(spec.shapes[out.name])
        if not dims:
            return False
        dims[rng.randrange(len(dims))] += rng.choice([1, 2])
        out.CopyFrom(helper.make_tensor_value_info(out.name, FLOAT, dims))
    elif choice == 1:                # an intermediate value_info with the wrong dims
        values = [o for n in model.graph.node for o in n.output if spec.shapes.get(o)]
        if not values:
            return False
        target = rng.choice(values)
        dims = list(spec.shapes[target])
        dims[rng.randrange(len(dims))] += 1
        model.graph.value_info.append(helper.make_tensor_value_info(target, FLOAT, dims))
    else:                            # a negative declared input dim (not -1)
        dim = model.graph.input[0].type.tensor_type.shape.dim[0]
        dim.Clear()
        dim.dim_value = -rng.randint(2, 5)
    return True


def _minus_one_dim(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    """-1 as a declared input dim means "unknown" (exporters write it): still valid."""
    value = rng.choice(list(model.graph.input))
    dims = value.type.tensor_type.shape.dim
    dim = dims[rng.randrange(len(dims))]
    dim.Clear()
    dim.dim_value = -1
    return True


def _slice_step_zero(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    nodes = _nodes(model, ["Slice"])
    if not nodes:
        return False
    node = rng.choice(nodes)
    steps = helper.make_tensor(f"{node.name}_steps", TensorProto.INT64, [1], [0])
    model.graph.initializer.append(steps)
    while len(node.input) < 5:
        node.input.append("")
    node.input[4] = steps.name
    return True


def _inconsistent_const(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    """A weight whose dims cannot meet the other operand's (a rank or length off)."""
    nodes = [n for n in _nodes(model, ["Conv", "MatMul", "Gemm", "Add", "Mul", "BatchNormalization",
                                       "LayerNormalization"])
             if len(n.input) > 1 and _initializer(model, n.input[1]) is not None]
    if not nodes:
        return False
    node = rng.choice(nodes)
    init = _initializer(model, node.input[1])
    assert init is not None
    values = numpy_helper.to_array(init)
    if values.ndim and rng.random() < 0.6:
        shape = list(values.shape)
        shape[rng.randrange(len(shape))] += rng.choice([1, 2])
        changed = np.ones(shape, values.dtype)
    else:
        changed = np.ones((*values.shape, 3), values.dtype)
    init.CopyFrom(numpy_helper.from_array(changed, init.name))
    return True


def _missing_operand(model: onnx.ModelProto, spec: GraphSpec, rng: random.Random) -> bool:
    nodes = _nodes(model, ["Add", "Mul", "Sub", "Div", "Conv", "MatMul", "Gemm", "Reshape",
                           "BatchNormalization"])
    if not nodes:
        return False
    node = rng.choice(nodes)
    del node.input[1:]
    return True


MUTATIONS: dict[str, Mutation] = {
    "strides_zero": _strides_zero, "negative_pads": _negative_pads, "bad_group": _bad_group,
    "bad_kernel_shape": _bad_kernel_shape, "axis_out_of_range": _axis_out_of_range,
    "bad_perm": _bad_perm, "int64_initializer": _int64_initializer,
    "value_info_dtype": _value_info_dtype, "dangling_input": _dangling_input,
    "duplicate_name": _duplicate_name, "truncated_initializer": _truncated_initializer,
    "no_opset": _no_opset, "declared_shape": _declared_shape, "minus_one_dim": _minus_one_dim,
    "slice_step_zero": _slice_step_zero, "inconsistent_const": _inconsistent_const,
    "missing_operand": _missing_operand,
}


# ---------------------------------------------------------------------------------------
# Bad feeds; each returns False where it does not apply.

FeedMutation = Callable[[dict[str, Any], GraphSpec, random.Random], bool]


def _feed_rank(feeds: dict[str, Any], spec: GraphSpec, rng: random.Random) -> bool:
    name = rng.choice(sorted(feeds))
    a = feeds[name]
    feeds[name] = a[None] if rng.random() < 0.5 or a.ndim == 1 else a.reshape(-1, *a.shape[2:])
    return True


def _feed_dim(feeds: dict[str, Any], spec: GraphSpec, rng: random.Random) -> bool:
    fixed = [(k, i) for k, sym in spec.symbolic.items() for i, s in enumerate(sym) if not s]
    if not fixed:
        return False
    name, axis = rng.choice(fixed)
    shape = list(feeds[name].shape)
    shape[axis] += rng.choice([1, 2]) if shape[axis] == 1 or rng.random() < 0.5 else -1
    feeds[name] = np.ones(shape, np.float32)
    return True


def _feed_dtype(feeds: dict[str, Any], spec: GraphSpec, rng: random.Random) -> bool:
    name = rng.choice(sorted(feeds))
    dtype = rng.choice([np.float64, np.float16, np.int64, np.int32, np.bool_, np.uint8])
    with np.errstate(invalid="ignore"):     # NaN/Inf cast to an integer type
        feeds[name] = feeds[name].astype(dtype)
    return True


def _feed_unknown_name(feeds: dict[str, Any], spec: GraphSpec, rng: random.Random) -> bool:
    name = rng.choice(sorted(feeds))
    feeds["stray_feed"] = feeds[name].copy()
    if rng.random() < 0.5:
        del feeds[name]            # renamed, not added
    return True


def _feed_missing(feeds: dict[str, Any], spec: GraphSpec, rng: random.Random) -> bool:
    del feeds[rng.choice(sorted(feeds))]
    return True


def _feed_symbol_mismatch(feeds: dict[str, Any], spec: GraphSpec, rng: random.Random) -> bool:
    """Two inputs sharing the symbolic batch ``N`` fed different batches."""
    if len(feeds) < 2 or not all(sym and sym[0] for sym in spec.symbolic.values()):
        return False
    y = feeds["y"]
    feeds["y"] = np.concatenate([y, y])
    return True


FEED_MUTATIONS: dict[str, FeedMutation] = {
    "rank": _feed_rank, "dim": _feed_dim, "dtype": _feed_dtype,
    "unknown_name": _feed_unknown_name, "missing_name": _feed_missing,
    "symbol_mismatch": _feed_symbol_mismatch,
}


# ---------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    case_id: str
    kind: str                      # "valid", "model:<mutation>" or "feed:<mutation>"
    model: bytes
    feeds: dict[str, Any]
    names: frozenset[str]          # what a refusal may name: nodes, values, inputs, feeds

    @property
    def broken(self) -> bool:
        return self.kind != "valid"


def make_case(seed: int, index: int) -> Case:
    case_id = f"{seed}:{index}"
    rng = random.Random(case_id)
    data = np.random.default_rng([seed, index])
    spec = make_graph(rng, data, f"fuzz_{seed}_{index}")
    model = spec.model
    feeds: dict[str, Any] = valid_feeds(spec, rng, data)
    roll = rng.random()
    kind = "valid"
    if roll >= VALID_SHARE + MODEL_SHARE:
        names = list(FEED_MUTATIONS)
        rng.shuffle(names)
        for name in names:
            if FEED_MUTATIONS[name](feeds, spec, rng):
                kind = f"feed:{name}"
                break
    elif roll >= VALID_SHARE:
        names = list(MUTATIONS)
        rng.shuffle(names)
        for name in names:
            mutated = onnx.ModelProto()
            mutated.CopyFrom(model)
            if MUTATIONS[name](mutated, spec, rng):
                model, kind = mutated, f"model:{name}"
                break
    names_seen = {model.graph.name, *spec.inputs, *feeds, "ghost_value"}
    for node in model.graph.node:
        names_seen.update([node.name, *node.input, *node.output])
    names_seen.update(t.name for t in model.graph.initializer)
    names_seen.update(o.name for o in model.graph.output)
    names_seen.discard("")
    return Case(case_id, kind, model.SerializeToString(), feeds, frozenset(names_seen))


def case_ids(seed: int, count: int, start: int = 0) -> list[str]:
    return [f"{seed}:{i}" for i in range(start, start + count)]


def parse_case_id(case_id: str) -> tuple[int, int]:
    seed, _, index = case_id.partition(":")
    return int(seed), int(index)


# ---------------------------------------------------------------------------------------
# The judge


@dataclass(frozen=True)
class Result:
    case_id: str
    kind: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


MAX_REDUCTIONS = ("MaxPool", "GlobalMaxPool", "ReduceMax")


def nan_propagating(model: bytes) -> bytes:
    """``model`` with each max reduction made to follow IEEE max over its window.

    onnxruntime's MaxPool and GlobalMaxPool keep a NaN only when it is the window's
    last element, its ReduceMax only when it is the first: which outputs a NaN reaches
    then depends on its position. Its pools also start from the lowest float, so a
    window of -Inf alone gives -3.4e38. segflow (like torch and numpy) propagates the
    NaN and returns -Inf, so the oracle is onnxruntime on this rewrite::

        y = Where(op(IsNaN(x)) > 0, NaN, Where(op(x != -Inf) > 0, op(x), -Inf))
    """
    proto = onnx.load_from_string(model)
    if not any(n.op_type in MAX_REDUCTIONS for n in proto.graph.node):
        return model
    nodes: list[onnx.NodeProto] = []
    consts = {"oracle_nan": np.nan, "oracle_zero": 0.0, "oracle_neginf": -np.inf}
    proto.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.float32), k)
                                   for k, v in consts.items())

    def flagged(node: onnx.NodeProto, tag: str, flag_op: onnx.NodeProto) -> str:
        """``node`` applied to ``flag_op``'s boolean output as floats; returns "any" > 0."""
        flags = onnx.NodeProto()
        flags.CopyFrom(node)
        flags.input[0], flags.output[0], flags.name = tag + "f", tag + "any", tag + "any"
        nodes.extend([flag_op, helper.make_node("Cast", [flag_op.output[0]], [tag + "f"],
                                                to=FLOAT), flags,
                      helper.make_node("Greater", [tag + "any", "oracle_zero"], [tag + "hit"])])
        return tag + "hit"

    for i, node in enumerate(proto.graph.node):
        if node.op_type not in MAX_REDUCTIONS or len(node.output) != 1:
            nodes.append(node)
            continue
        x, tag = node.input[0], f"oracle{i}_"
        original = onnx.NodeProto()
        original.CopyFrom(node)
        original.output[0] = tag + "raw"
        nodes.append(original)
        nan_hit = flagged(node, tag + "nan_", helper.make_node("IsNaN", [x], [tag + "isnan"]))
        finite_hit = flagged(node, tag + "low_", helper.make_node(
            "Not", [tag + "isneginf"], [tag + "above"]))
        nodes.insert(-4, helper.make_node("IsInf", [x], [tag + "isneginf"], detect_positive=0))
        nodes.append(helper.make_node("Where", [finite_hit, tag + "raw", "oracle_neginf"],
                                      [tag + "low"]))
        nodes.append(helper.make_node("Where", [nan_hit, "oracle_nan", tag + "low"],
                                      [node.output[0]]))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return proto.SerializeToString()


def _run_onnxruntime(case: Case) -> tuple[list[np.ndarray] | None, str, str]:
    """(outputs, "", "") or (None, "load" | "run", the error's first line)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    try:
        # Whether onnxruntime takes the model is asked of the model itself; the values
        # come from the NaN-propagating rewrite of a model it takes.
        sess = ort.InferenceSession(case.model, options, providers=["CPUExecutionProvider"])
        rewritten = nan_propagating(case.model)
        if rewritten != case.model:
            sess = ort.InferenceSession(rewritten, options, providers=["CPUExecutionProvider"])
    except Exception as exc:   # noqa: BLE001 - any refusal is the oracle's answer
        return None, "load", _one_line(exc)
    try:
        return list(sess.run(None, case.feeds)), "", ""
    except Exception as exc:   # noqa: BLE001
        return None, "run", _one_line(exc)


def _names_something(message: str, names: Iterable[str]) -> bool:
    for name in names:
        if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message):
            return True
    return False


def _compare(got: Sequence[Any], want: Sequence[np.ndarray]) -> tuple[str, str]:
    if len(got) != len(want):
        return "wrong", f"{len(got)} outputs, onnxruntime {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        a = np.asarray(a)
        if a.shape != b.shape or a.dtype != b.dtype:
            return "wrong", f"output {i}: {a.dtype}{list(a.shape)}, onnxruntime " \
                            f"{b.dtype}{list(b.shape)}"
        if b.dtype.kind == "f":
            for mask in (np.isnan, np.isposinf, np.isneginf):
                ma, mb = mask(a), mask(b)
                if not np.array_equal(ma, mb):
                    return "mask", f"output {i}: {mask.__name__} at {int(ma.sum())} " \
                                   f"positions, onnxruntime {int(mb.sum())} " \
                                   f"({int((ma != mb).sum())} differ)"
        try:
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError:
            finite = np.isfinite(a) & np.isfinite(b)
            worst = float(np.max(np.abs(a[finite] - b[finite]))) if finite.any() else 0.0
            return "wrong", f"output {i}: values differ (max abs diff {worst:.3g})"
    return "equal", ""


def judge(case: Case) -> tuple[str, str]:
    """The case's outcome (one of :data:`OUTCOMES` but crash/hang) and what happened."""
    import segflow
    from segflow.errors import SegflowError, UnsupportedOp

    want, ort_stage, ort_error = _run_onnxruntime(case)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sess = segflow.InferenceSession(case.model)
            got = sess.run(None, case.feeds)
    except SegflowError as exc:
        message = str(exc)
        if "\n" in message.strip() or not _names_something(message, case.names):
            return "raw", f"{type(exc).__name__} naming nothing: {_one_line(exc)}"
        if want is None:
            return "refused", _one_line(exc)
        if isinstance(exc, UnsupportedOp):
            return "unsupported", _one_line(exc)
        if case.broken:
            return "strict", f"{_one_line(exc)} (onnxruntime ran it)"
        return "wrong", f"segflow refused a valid case onnxruntime ran: {_one_line(exc)}"
    except Exception as exc:   # noqa: BLE001 - the failure being looked for
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
        return "raw", f"{_one_line(exc)}{where}"
    if want is None:
        return "wrong", f"segflow ran it, onnxruntime refused at {ort_stage}: {ort_error}"
    return _compare(got, want)


def judge_case_id(case_id: str) -> Result:
    start = time.perf_counter()
    case = make_case(*parse_case_id(case_id))
    outcome, detail = judge(case)
    return Result(case_id, case.kind, outcome, detail, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------
# Guarded runs: a worker process, so a crash or a hang is an outcome


def _worker(conn: Any, ids: Sequence[str], env: Mapping[str, str]) -> None:
    os.environ.update(env)
    warnings.simplefilter("ignore")
    import segflow.runtime.session  # noqa: F401 - the import's time is not a case's

    conn.send(("ready", None))
    for case_id in ids:
        conn.send(("start", case_id))
        try:
            result = judge_case_id(case_id)
        except Exception as exc:  # noqa: BLE001 - a generator error is reported, not fatal
            result = Result(case_id, "?", "raw", f"the fuzz harness failed: {_one_line(exc)}")
        conn.send(("done", result))
    conn.close()


def run_guarded(ids: Sequence[str], *, timeout_s: float = 30.0,
                env: Mapping[str, str] | None = None,
                on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Judge ``ids`` in a worker process (restarted after a crash or a hang).

    ``env``: environment variables for the worker (``SEGFLOW_*`` switches)."""
    context = multiprocessing.get_context("spawn")
    results: list[Result] = []
    pending = list(ids)
    while pending:
        parent, child = context.Pipe(duplex=False)
        process = context.Process(target=_worker, args=(child, pending, dict(env or {})),
                                  daemon=True)
        process.start()
        child.close()
        current: str | None = None
        deadline = 120.0           # the first message waits for the imports
        try:
            while True:
                if not parent.poll(deadline):
                    outcome, detail = "hang", f"no answer in {deadline:.0f} s"
                    break
                tag, payload = parent.recv()
                deadline = timeout_s
                if tag == "start":
                    current = payload
                elif tag == "done":
                    results.append(payload)
                    if on_result:
                        on_result(payload)
                    pending.remove(payload.case_id)
                    current = None
                    if not pending:
                        break
        except (EOFError, ConnectionError):
            process.join(5)
            outcome, detail = "crash", f"worker died (exit code {process.exitcode})"
        if process.is_alive():
            process.kill()
        process.join(5)
        parent.close()
        if not pending:
            break
        if current is None:        # died between cases: blame the next one
            current = pending[0]
        result = Result(current, make_case(*parse_case_id(current)).kind, outcome, detail)
        results.append(result)
        if on_result:
            on_result(result)
        pending.remove(current)
    return results
