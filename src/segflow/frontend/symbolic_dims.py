"""Name the dims ONNX shape inference leaves anonymous, when the graph says what they are.

ONNX's shape inference gives a fresh symbol (``unk__0``, ``unk__1``, ...) to
a dim it cannot tie to a known one: a transformer's position ids
``Range(0, Shape(ids)[1], 1)`` get ``unk__0`` instead of ``seq``, and the
``Add`` of ``[batch, seq, 768]`` word embeddings and ``[unk__0, 768]``
position embeddings gets ``unk__1``. Everything downstream inherits the
anonymous name (all of the hidden states), so the memory planner cannot
size them from the input dims, and specs that should be equal compare unequal.

:func:`unify_dims` walks the nodes in order and recomputes two kinds of
output dims from the (already renamed) input specs: the length of
``Range(0, Gather(Shape(x), k), 1)`` -- a transformer's position ids -- is
dim ``k`` of ``x``; the output of a multidirectional broadcasting op (Add,
Mul, Where, ...) has the broadcast dims where they are determined (equal dims,
a dim against 1, a symbol against a fixed size > 1); a window op (Conv, MaxPool,
AveragePool) of stride 1 whose pads cover its dilated kernel's extent keeps its
input's spatial dims (ONNX gives a 3x3 convolution with pads 1 fresh symbols over a
symbolic height and width). Where ONNX left an
anonymous symbol there, the symbol is renamed in every value spec of the
graph and its subgraphs. It never renames a symbol the model's inputs (or a
subgraph's) declare, so two input dims are never merged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import Dim, TensorSpec, shape_window

# ONNX ops with multidirectional (numpy-style) broadcasting of all their inputs.
BROADCASTING_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where",
    "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor",
    "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "PRelu",
})


# Ops sliding a window over the spatial dims (axes 2...) of input 0.
WINDOW_OPS = frozenset({"Conv", "MaxPool", "AveragePool", "LpPool"})


def unify_dims(graph: Graph) -> dict[str, Dim]:
    """Rename anonymous dims of ``graph`` (in place); returns old symbol -> new dim."""
    declared = {d for g in _graphs(graph) for v in g.inputs for d in (v.spec.shape or ())
                if isinstance(d, str)}
    renames: dict[str, Dim] = {}

    def resolve(dim: Dim) -> Dim:
        while isinstance(dim, str) and dim in renames:
            dim = renames[dim]
        return dim

    for node in graph.walk():
        if node.domain != "" or len(node.outputs) != 1:
            continue
        out = node.outputs[0].spec.shape
        if out is None:
            continue
        if node.op_type == "Range":
            length = _range_length(node)
            result = None if length is None else [resolve(length)]
        elif node.op_type in WINDOW_OPS:
            result = _same_window(node, resolve)
        elif node.op_type in BROADCASTING_OPS:
            shapes = [v.spec.shape for v in node.inputs if v is not None]
            if not shapes or any(s is None for s in shapes):
                continue
            result = _broadcast([tuple(resolve(d) for d in s) for s in shapes if s is not None])
        else:
            continue
        if result is None or len(result) != len(out):
            continue
        for have, want in zip(out, result):
            have = resolve(have)
            if (isinstance(have, str) and have not in declared and want is not None
                    and want != have):
                renames[have] = want
    if renames:
        final = {symbol: resolve(symbol) for symbol in renames}
        for value in _all_values(graph):
            value.spec = _renamed(value.spec, final)
        return final
    return {}


def _same_window(node: Node, resolve: Callable[[Dim], Dim]) -> list[Dim] | None:
    """A window op's output shape where stride 1 and its pads keep every spatial dim
    (batch and channels left None: ONNX gives those already), else None."""
    x = node.inputs[0] if node.inputs else None
    if x is None or x.spec.shape is None or len(x.spec.shape) < 3:
        return None
    spatial = len(x.spec.shape) - 2
    kernel = node.attrs.get("kernel_shape")
    if kernel is None and node.op_type == "Conv" and len(node.inputs) > 1:
        w = node.inputs[1]
        kernel = None if w is None or w.spec.shape is None else list(w.spec.shape[2:])
    if kernel is None or len(kernel) != spatial or not all(isinstance(k, int) for k in kernel):
        return None
    strides = list(node.attrs.get("strides", [1] * spatial))
    dilations = list(node.attrs.get("dilations", [1] * spatial))
    extents = [d * (int(k) - 1) for k, d in zip(kernel, dilations)]
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if any(int(s) != 1 for s in strides):
        return None
    if auto_pad == "VALID":
        keeps = all(e == 0 for e in extents)
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        keeps = True
    else:
        pads = list(node.attrs.get("pads", [0] * 2 * spatial))
        keeps = all(pads[i] + pads[i + spatial] == e for i, e in enumerate(extents))
    if not keeps:
        return None
    return [None, None, *(resolve(d) for d in x.spec.shape[2:])]


def _range_length(node: Node) -> Dim:
    """The length of ``Range(0, Gather(Shape(x), k), 1)``: dim ``k`` of ``x`` (else None)."""
    start, limit, delta = (list(node.inputs) + [None, None, None])[:3]
    if not _is_scalar(start, 0) or not _is_scalar(delta, 1) or limit is None:
        return None
    gather = limit.producer
    if (gather is None or gather.op_type != "Gather" or gather.domain != ""
            or int(gather.attrs.get("axis", 0)) != 0 or len(gather.inputs) != 2):
        return None
    data, index = gather.inputs
    shape_of = data.producer if data is not None else None
    if (index is None or index.const is None or index.const.dim() != 0
            or shape_of is None or shape_of.op_type != "Shape" or shape_of.domain != ""):
        return None
    source = shape_of.inputs[0]
    if source is None or source.spec.shape is None:
        return None
    window = source.spec.shape[shape_window(shape_of.attrs.get("start"),
                                            shape_of.attrs.get("end"), len(source.spec.shape))]
    k = int(index.const.item())
    return window[k] if -len(window) <= k < len(window) else None


def _is_scalar(value: Value | None, expected: int) -> bool:
    if value is None or value.const is None or value.const.numel() != 1:
        return False
    return bool(value.const.item() == expected)


def _broadcast(shapes: Sequence[tuple[Dim, ...]]) -> list[Dim] | None:
    """The broadcast shape, a dim None where the specs do not determine it."""
    rank = max(len(s) for s in shapes)
    result: list[Dim] = []
    for axis in range(rank):
        dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
        result.append(_broadcast_dim(dims))
    return result


def _broadcast_dim(dims: Sequence[Dim]) -> Dim:
    if any(d is None for d in dims):
        return None
    fixed = {d for d in dims if isinstance(d, int) and d != 1}
    symbols = {d for d in dims if isinstance(d, str)}
    if len(fixed) == 1:
        return fixed.pop()   # a symbol broadcast against n > 1 must be n (or 1)
    if fixed:
        return None          # inconsistent; leave it to the kernel to complain
    if len(symbols) == 1:
        return symbols.pop()  # equal symbols, or a symbol against 1
    return 1 if not symbols else None


def _graphs(graph: Graph) -> Iterator[Graph]:
    yield graph
    for node in graph.nodes:
        for sub in node.subgraphs.values():
            yield from _graphs(sub)


def _all_values(graph: Graph) -> Iterator[Value]:
    for g in _graphs(graph):
        yield from g.values()
        yield from g.outputs


def _renamed(spec: TensorSpec, renames: dict[str, Dim]) -> TensorSpec:
    if spec.shape is None or not any(isinstance(d, str) and d in renames for d in spec.shape):
        return spec
    shape = tuple(renames.get(d, d) if isinstance(d, str) else d for d in spec.shape)
    return TensorSpec(spec.dtype, shape)
