"""Reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare, ArgMax/ArgMin, CumSum.

Opset differences handled here: ``axes`` is an attribute until opset 12 for
ReduceSum and until opset 17 for the others, then an optional input; from
those versions ``noop_with_empty_axes=1`` turns an empty ``axes`` into "no
reduction" (the elementwise part of the op still applies, e.g. ReduceL1 -> Abs).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from segflow.errors import InvalidModel
from segflow.ir.graph import Node
from segflow.ops import gradients
from segflow.ops._common import always, ints
from segflow.ops.registry import BindContext, Kernel, OpDef, reads_on_host

Tensor = torch.Tensor
Dims = tuple[int, ...]


class Kind(enum.Enum):
    """The core reduction each Reduce* op performs after its elementwise prologue."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    LOGSUMEXP = "logsumexp"


@dataclass(frozen=True, slots=True)
class ReduceSpec:
    """One Reduce* op: prologue (per element), core reduction, epilogue, empty-input value."""

    kind: Kind
    pre: Callable[[Tensor], Tensor] | None = None
    post: Callable[[Tensor], Tensor] | None = None
    # Opset from which ``axes`` is an input rather than an attribute.
    axes_input_since: int = 18


def _core(kind: Kind, x: Tensor, dims: Dims, keep: bool) -> Tensor:
    if kind is Kind.SUM:
        return torch.sum(x, dim=dims, keepdim=keep)
    if kind is Kind.MEAN:
        return torch.mean(x, dim=dims, keepdim=keep)
    if kind is Kind.PROD:
        for d in sorted(dims, reverse=True):
            x = torch.prod(x, dim=d, keepdim=keep)
        return x
    if kind is Kind.MAX:
        return torch.amax(x, dim=dims, keepdim=keep)
    if kind is Kind.MIN:
        return torch.amin(x, dim=dims, keepdim=keep)
    return _logsumexp(x, dims, keep)


def _logsumexp(x: Tensor, dims: Dims, keep: bool) -> Tensor:
    # Shift by the finite max only, so +-inf entries do not produce NaN.
    finite = torch.where(torch.isinf(x), torch.full_like(x, -math.inf), x)
    mx = torch.amax(finite, dim=dims, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    out = torch.log(torch.sum(torch.exp(x - mx), dim=dims, keepdim=True)) + mx
    return out if keep else out.squeeze(dims)


def _empty_fill(kind: Kind, dtype: torch.dtype) -> float | int | bool:
    """What a reduction over zero elements yields (ONNX reference semantics)."""
    if kind is Kind.MEAN:
        return math.nan if dtype.is_floating_point else 0  # 0 / 0
    if kind is Kind.SUM:
        return 0
    if kind is Kind.PROD:
        return 1
    if kind is Kind.LOGSUMEXP:
        return -math.inf
    if dtype == torch.bool:
        return kind is Kind.MIN
    if dtype.is_floating_point:
        return -math.inf if kind is Kind.MAX else math.inf
    info = torch.iinfo(dtype)
    return info.min if kind is Kind.MAX else info.max


def _reduced_shape(shape: Sequence[int], dims: Dims, keep: bool) -> list[int]:
    if keep:
        return [1 if i in dims else d for i, d in enumerate(shape)]
    return [d for i, d in enumerate(shape) if i not in dims]


def reduce_tensor(spec: ReduceSpec, x: Tensor, axes: Sequence[int] | None, keep: bool) -> Tensor:
    """Apply ``spec`` over ``axes`` (None: all axes; empty: no reduction)."""
    dtype = x.dtype
    rank = x.dim()
    if axes is None:
        dims: Dims = tuple(range(rank))
    else:
        dims = tuple(sorted({a + rank if a < 0 else a for a in axes}))
        if any(not 0 <= d < max(rank, 1) for d in dims):
            raise ValueError(f"reduce axes {list(axes)} out of range for rank {rank}")
    y = spec.pre(x) if spec.pre is not None else x
    if not dims or rank == 0:
        # Never the input itself: the memory plan counts a reduce's output as new storage
        # (plan_memory.FRESH_OUTPUT_OPS), which an in-place op after it may overwrite.
        out = y.clone() if y is x else y
    elif y.numel() == 0:
        fill = _empty_fill(spec.kind, dtype)
        shape = _reduced_shape(x.shape, dims, keep)
        out = torch.full(shape, fill, dtype=dtype, device=x.device)
    else:
        work = y
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if spec.kind is Kind.MEAN and integer:
            work = y.to(torch.float64)
        if spec.kind in (Kind.SUM, Kind.PROD) and dtype == torch.bool:
            work = y.to(torch.int64)
        out = _core(spec.kind, work, dims, keep)
        if spec.kind is Kind.MEAN and integer:
            out = torch.trunc(out)
    if spec.post is not None:
        out = spec.post(out.to(torch.float64) if not out.is_floating_point() else out)
    return out if out.dtype == dtype else out.to(dtype)


def _bind_reduce(spec: ReduceSpec) -> Callable[[Node, BindContext], Kernel]:
    def bind(node: Node, ctx: BindContext) -> Kernel:
        keep = bool(int(node.attrs.get("keepdims", 1)))
        noop = bool(int(node.attrs.get("noop_with_empty_axes", 0)))
        from_input = node.opset >= spec.axes_input_since
        if from_input and "axes" in node.attrs:
            raise InvalidModel(f"{node.label}: 'axes' is an input (not an attribute) "
                               f"in opset {node.opset}")
        attr_axes = None if from_input else node.attrs.get("axes")
        static_axes = None if attr_axes is None else [int(a) for a in attr_axes]

        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x = inputs[0]
            assert x is not None
            if from_input:
                axes_t = inputs[1] if len(inputs) > 1 else None
                axes = ints(axes_t) if axes_t is not None else []
                chosen: list[int] | None = axes if (axes or noop) else None
            else:
                chosen = static_axes if static_axes else None
            return [reduce_tensor(spec, x, chosen, keep)]
        return kernel

    return bind


def _square(x: Tensor) -> Tensor:
    return x * x


_SPECS: dict[str, ReduceSpec] = {
    "ReduceSum": ReduceSpec(Kind.SUM, axes_input_since=13),
    "ReduceMean": ReduceSpec(Kind.MEAN),
    "ReduceMax": ReduceSpec(Kind.MAX),
    "ReduceMin": ReduceSpec(Kind.MIN),
    "ReduceProd": ReduceSpec(Kind.PROD),
    "ReduceL1": ReduceSpec(Kind.SUM, pre=torch.abs),
    "ReduceL2": ReduceSpec(Kind.SUM, pre=_square, post=torch.sqrt),
    "ReduceSumSquare": ReduceSpec(Kind.SUM, pre=_square),
    "ReduceLogSum": ReduceSpec(Kind.SUM, post=torch.log),
    "ReduceLogSumExp": ReduceSpec(Kind.LOGSUMEXP),
}


# Element types torch's argmax/argmin kernels do not accept.
_NO_ARGMAX = (torch.bool, torch.uint16, torch.uint32, torch.uint64)


def _bind_arg(largest: bool) -> Callable[[Node, BindContext], Kernel]:
    def bind(node: Node, ctx: BindContext) -> Kernel:
        axis = int(node.attrs.get("axis", 0))
        keep = bool(int(node.attrs.get("keepdims", 1)))
        last = bool(int(node.attrs.get("select_last_index", 0)))
        pick = torch.argmax if largest else torch.argmin

        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x = inputs[0]
            assert x is not None
            a = axis + x.dim() if axis < 0 else axis
            if x.dtype in _NO_ARGMAX:
                x = x.to(torch.int64 if x.dtype != torch.uint64 else torch.float64)
            if last:
                # torch picks the first extremum on ties; flipping picks the last one.
                return [x.shape[a] - 1 - pick(x.flip(a), a, keepdim=keep)]
            return [pick(x, a, keepdim=keep)]
        return kernel

    return bind


def _cumsum(node: Node, ctx: BindContext) -> Kernel:
    exclusive = bool(int(node.attrs.get("exclusive", 0)))
    reverse = bool(int(node.attrs.get("reverse", 0)))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, axis_t = inputs[0], inputs[1]
        assert x is not None and axis_t is not None
        axis = int(axis_t.reshape(-1)[0])
        a = axis + x.dim() if axis < 0 else axis
        y = x.flip(a) if reverse else x
        out = torch.cumsum(y, dim=a)
        if exclusive:
            out = out - y
        if reverse:
            out = out.flip(a)
        return [out.to(x.dtype)]
    return kernel


def _cumprod(node: Node, ctx: BindContext) -> Kernel:
    exclusive = bool(int(node.attrs.get("exclusive", 0)))
    reverse = bool(int(node.attrs.get("reverse", 0)))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, axis_t = inputs[0], inputs[1]
        assert x is not None and axis_t is not None
        a = int(axis_t.reshape(-1)[0])
        a = a + x.dim() if a < 0 else a
        y = x.flip(a) if reverse else x
        if exclusive:
            # Shift right by one along the axis, filling with the multiplicative identity.
            ones = torch.ones_like(y.narrow(a, 0, min(1, y.shape[a])))
            y = torch.cat([ones, y.narrow(a, 0, max(0, y.shape[a] - 1))], dim=a)
        out = torch.cumprod(y, dim=a)
        if reverse:
            out = out.flip(a)
        return [out.to(x.dtype)]
    return kernel


# Gradient rules (segflow.ops.gradients) of the reductions with a closed form; the
# others (ReduceL2, ReduceLogSumExp, ReduceMax ...) recompute under autograd.
_GRADS = {"ReduceSum": gradients.reduce, "ReduceMean": gradients.reduce}

OPS: list[OpDef] = [
    *(OpDef(name, _bind_reduce(spec), doc=f"{spec.kind.value} reduction",
            grad=_GRADS.get(name, gradients.recompute),
            creates_nonfinite=always if name == "ReduceLogSum" else None,
            host_reads=reads_on_host(1))
      for name, spec in _SPECS.items()),
    OpDef("ArgMax", _bind_arg(largest=True)),
    OpDef("ArgMin", _bind_arg(largest=False)),
    OpDef("CumSum", _cumsum, grad=gradients.recompute),
    OpDef("CumProd", _cumprod, grad=gradients.recompute),
]
