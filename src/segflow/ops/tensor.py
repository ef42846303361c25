"""Shape and data-movement ops: reshape, transpose, concat, slice, gather, cast ..."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from segflow.engine.base import ExecType
from segflow.errors import InvalidModel, UnsupportedOp
from segflow.ir import lowbit
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.ops import gradients
from segflow.ops._common import ints
from segflow.ops.registry import BindContext, Kernel, OpDef, ViewOfInput, reads_on_host

Tensor = torch.Tensor


def _reshape(node: Node, ctx: BindContext) -> Kernel:
    allowzero = int(node.attrs.get("allowzero", 0))
    attr_shape = list(node.attrs["shape"]) if node.opset < 5 else None

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        shape = attr_shape if attr_shape is not None else ints(inputs[1])
        if not allowzero:
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return [x.reshape(shape)]
    return kernel


def _transpose(node: Node, ctx: BindContext) -> Kernel:
    perm = node.attrs.get("perm")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        p = list(perm) if perm is not None else list(reversed(range(x.dim())))
        return [x.permute(p)]
    return kernel


def _concat(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs["axis"]) if "axis" in node.attrs else 1

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        parts = [t for t in inputs if t is not None]
        return [torch.cat(parts, dim=axis)]
    return kernel


def _split(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", 0))
    n_out = len(node.outputs)
    attr_split = node.attrs.get("split") if node.opset < 13 else None
    num_outputs = node.attrs.get("num_outputs")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        sizes = list(attr_split) if attr_split is not None else (
            ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None)
        dim = x.shape[axis]
        if not sizes:
            count = int(num_outputs) if num_outputs is not None else n_out
            chunk = -(-dim // count)
            sizes = [chunk] * (count - 1) + [dim - chunk * (count - 1)]
        return list(torch.split(x, sizes, dim=axis))
    return kernel


def _slice(node: Node, ctx: BindContext) -> Kernel:
    old = node.opset < 10
    attrs = node.attrs

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if old:
            starts, ends = list(attrs["starts"]), list(attrs["ends"])
            axes = list(attrs.get("axes", range(len(starts))))
            steps = [1] * len(starts)
        else:
            starts, ends = ints(inputs[1]), ints(inputs[2])
            axes = ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(
                range(len(starts)))
            steps = ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else [1] * len(
                starts)
        return [slice_tensor(x, starts, ends, axes, steps)]
    return kernel


def slice_tensor(x: Tensor, starts: list[int], ends: list[int], axes: list[int],
                 steps: list[int]) -> Tensor:
    """ONNX Slice semantics (clamping, negative indices and negative steps)."""
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = axis + x.dim() if axis < 0 else axis
        size = x.shape[axis]
        if step > 0:
            start = max(0, min(size, start + size if start < 0 else start))
            end = max(0, min(size, end + size if end < 0 else end))
            x = x.narrow(axis, start, max(0, end - start))
            if step != 1:
                x = x[(slice(None),) * axis + (slice(None, None, step),)]
        else:
            start = max(-1, min(size - 1, start + size if start < 0 else start))
            end = max(-1, min(size - 1, end + size if end < 0 else end))
            if start <= end:
                x = x.narrow(axis, 0, 0)
                continue
            idx = torch.arange(start, end, step, device=x.device)
            x = x.index_select(axis, idx)
    return x


def _gather(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", 0))
    index = node.inputs[1] if len(node.inputs) > 1 else None
    if index is not None and index.const is not None and index.const.dim() == 0:
        # A constant scalar index (Gather(Shape(x), k)): a Python int, so no tensor value
        # is read back on the host and graph tracers see no data-dependent index.
        k = int(index.const)

        def select(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x = inputs[0]
            assert x is not None
            a = axis + x.dim() if axis < 0 else axis
            size = x.shape[a]
            if not -size <= k < size:
                raise IndexError(f"Gather index {k} is out of range for axis {a} of size {size}")
            return [x.select(a, k + size if k < 0 else k)]
        return select

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, idx = inputs[0], inputs[1]
        assert x is not None and idx is not None
        a = axis + x.dim() if axis < 0 else axis
        given = idx
        idx = idx.to(torch.int64)
        out = None
        if idx.dim() and x.is_cpu and idx.is_cpu:
            # On the CPU index_select refuses negative indices (an IndexError along axis
            # 0, a RuntimeError along others): the common case (none) is one op, where
            # wrapping them first would take three more, mostly their Python (a large
            # embedding gather pays it on every run).
            try:
                out = x.index_select(a, idx.reshape(-1))
            except (IndexError, RuntimeError):
                out = None
        if out is None:
            idx = torch.where(idx < 0, idx + x.shape[a], idx)
            try:
                if idx.dim() == 0:
                    return [x.select(a, int(idx))]
                out = x.index_select(a, idx.reshape(-1))
            except (IndexError, RuntimeError) as exc:
                error = _out_of_range(given, x.shape[a], a)
                if error is None:
                    raise
                raise error from exc
        return [out.reshape(*x.shape[:a], *idx.shape, *x.shape[a + 1:])]
    return kernel


def _out_of_range(idx: Tensor, size: int, axis: int) -> IndexError | None:
    """The error for Gather indices outside ``[-size, size)``, naming the first of them
    (computed only once torch has refused them: the run's path does no extra pass);
    None where every index is inside (torch refused them for another reason)."""
    idx = idx.to(torch.int64).reshape(-1)
    bad = idx[(idx < -size) | (idx >= size)]
    if not bad.numel():
        return None
    first = int(bad[0])
    return IndexError(f"Gather index {first} is out of range for axis {axis} of size {size} "
                      f"({bad.numel()} of {idx.numel()} indices outside [{-size}, {size}))")


def _unsqueeze(node: Node, ctx: BindContext) -> Kernel:
    attr_axes = node.attrs.get("axes") if node.opset < 13 else None

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        axes = list(attr_axes) if attr_axes is not None else ints(inputs[1])
        rank = x.dim() + len(axes)
        shape = list(x.shape)
        for a in sorted(a + rank if a < 0 else a for a in axes):
            shape.insert(a, 1)
        return [x.reshape(shape)]
    return kernel


def _squeeze(node: Node, ctx: BindContext) -> Kernel:
    attr_axes = node.attrs.get("axes") if node.opset < 13 else None

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if attr_axes is not None:
            axes = list(attr_axes)
        elif len(inputs) > 1 and inputs[1] is not None:
            axes = ints(inputs[1])
        else:
            axes = [i for i, d in enumerate(x.shape) if d == 1]
        keep = {a + x.dim() if a < 0 else a for a in axes}
        return [x.reshape([d for i, d in enumerate(x.shape) if i not in keep])]
    return kernel


def _shape(node: Node, ctx: BindContext) -> Kernel:
    start = node.attrs.get("start")
    end = node.attrs.get("end")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        dims = list(x.shape)[start:end]
        return [torch.tensor(dims, dtype=torch.int64)]
    return kernel


def _size(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        return [torch.tensor(x.numel(), dtype=torch.int64)]
    return kernel


def _cast_target(node: Node) -> DType:
    code = int(node.attrs["to"])
    try:
        return DType.from_onnx(code)
    except ValueError:
        raise UnsupportedOp(f"{node.label}: Cast to element type {code}, which segflow "
                            "does not support") from None


def _cast(node: Node, ctx: BindContext) -> Kernel:
    return _cast_to(node, _cast_target(node))


def _like_type(node: Node) -> DType | None:
    like = node.inputs[1] if len(node.inputs) > 1 else None
    return like.spec.dtype if like is not None else None


def _casts_on_host(target: Callable[[Node], DType | None]) -> Callable[[Node], ExecType]:
    """LOCAL where the cast goes through the host (``lowbit.on_host``): the task then waits
    for its inputs as a counted synchronization, which a device kernel reading back
    to the host would hide."""
    def classify(node: Node) -> ExecType:
        x = node.inputs[0]
        source = x.spec.dtype if x is not None else None
        return ExecType.LOCAL if lowbit.on_host(source, target(node)) else ExecType.SYNC
    return classify


def _cast_to(node: Node, target: DType) -> Kernel:
    """Cast (and CastLike) to ``target``: torch's conversion, or ONNX's rounding and
    saturation (``ir/lowbit.py``) where either side is a float8, 4-bit or 2-bit type."""
    x_value = node.inputs[0]
    source = x_value.spec.dtype if x_value is not None else None
    if not target.is_lowbit and not (source is not None and source.is_lowbit):
        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x = inputs[0]
            assert x is not None
            return [x.to(target.torch)]
        return kernel
    saturate = bool(int(node.attrs.get("saturate", 1)))
    round_mode = str(node.attrs.get("round_mode", "up"))
    if round_mode not in lowbit.ROUND_MODES:
        raise InvalidModel(f"{node.label}: round_mode {round_mode!r} is not one of "
                           f"{', '.join(lowbit.ROUND_MODES)}")

    def lowbit_kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        got = DType.from_container(x.dtype, source)
        if got is target:
            return [x]
        return [lowbit.cast(x, got, target, saturate, round_mode)]
    return lowbit_kernel


def _bitcast(node: Node, ctx: BindContext) -> Kernel:
    target = DType.from_onnx(int(node.attrs["to"])).torch

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if x.element_size() != torch.empty((), dtype=target).element_size():
            raise ValueError(f"BitCast from {x.dtype} to {target} changes the element width")
        # view() of a 0-d tensor to another dtype is not allowed; go through 1-d.
        return [x.contiguous().reshape(-1).view(target).reshape(x.shape)]
    return kernel


def _cast_like(node: Node, ctx: BindContext) -> Kernel:
    like = _like_type(node)
    if like is not None:
        return _cast_to(node, like)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, like = inputs[0], inputs[1]
        assert x is not None and like is not None
        return [x.to(like.dtype)]
    return kernel


def _identity(node: Node, ctx: BindContext) -> Kernel:
    # Passes any value through: a tensor, a sequence (a list) or an empty optional (None).
    def kernel(inputs: Sequence[Any]) -> list[Any]:
        return [inputs[0]]
    return kernel


def _fills_nonfinite(node: Node) -> bool:
    value = node.attrs.get("value")
    return isinstance(value, Tensor) and value.is_floating_point() \
        and not bool(torch.isfinite(value).all())


def _constant_of_shape(node: Node, ctx: BindContext) -> Kernel:
    value = node.attrs.get("value")
    fill = value.reshape(-1)[0] if isinstance(value, Tensor) else torch.tensor(0.0)
    fill_value, fill_dtype, device = fill.item(), fill.dtype, ctx.device

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        shape = ints(inputs[0])
        return [torch.full(shape, fill_value, dtype=fill_dtype, device=device)]
    return kernel


def _range(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        start, limit, delta = inputs
        assert start is not None and limit is not None and delta is not None
        # All three are read on the host (host memory on every device: no device read
        # inside a CUDA-graph capture); the result lives on the session's device.
        first, step = start.item(), delta.item()
        n = max(0, math.ceil((limit.item() - first) / step))
        out = torch.arange(n, dtype=start.dtype, device=ctx.device)
        if step != 1:
            out = out.mul_(step)
        return [out.add_(first) if first != 0 else out]
    return kernel


def _expand(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        shape = ints(inputs[1])
        # ONNX Expand broadcasts both ways (a dim of 1 in `shape` keeps x's dim).
        rank = max(len(shape), x.dim())
        shape = [1] * (rank - len(shape)) + shape
        xs = [1] * (rank - x.dim()) + list(x.shape)
        target = [s if xd == 1 else xd for s, xd in zip(shape, xs)]
        return [x.reshape(xs).expand(target)]
    return kernel


def _tile(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        return [x.repeat(ints(inputs[1]))]
    return kernel


def _nonzero(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if x.dim() == 0:
            x = x.reshape(1)  # numpy's (and onnxruntime's) view of a scalar: [1, count]
        return [torch.nonzero(x).t().contiguous()]
    return kernel



def _scalar_index(node: Node) -> tuple[int, ...]:
    # Gather with a 0-d index selects with int(index): a host read of the index.
    index = node.inputs[1] if len(node.inputs) > 1 else None
    if index is None:
        return ()
    if index.is_const:
        assert index.const is not None
        return (1,) if index.const.dim() == 0 else ()
    shape = index.spec.shape if index.spec is not None else None
    return (1,) if shape is not None and len(shape) == 0 else ()


OPS: list[OpDef] = [
    OpDef("Reshape", _reshape, grad=gradients.reshape, host_reads=reads_on_host(1, since=5),
          view_of_input=ViewOfInput.RESHAPE),
    OpDef("Transpose", _transpose, grad=gradients.transpose, view_of_input=ViewOfInput.MAY_ALIAS),
    OpDef("Concat", _concat, grad=gradients.concat),
    OpDef("Split", _split, grad=gradients.split, host_reads=reads_on_host(1, since=13),
          view_of_input=ViewOfInput.MAY_ALIAS),
    OpDef("Slice", _slice, grad=gradients.slice_, host_reads=reads_on_host(1, 2, 3, 4, since=10),
          view_of_input=ViewOfInput.MAY_ALIAS),
    OpDef("Gather", _gather, grad=gradients.gather, host_reads=_scalar_index,
          view_of_input=ViewOfInput.MAY_ALIAS),
    OpDef("Unsqueeze", _unsqueeze, grad=gradients.reshape, host_reads=reads_on_host(1, since=13),
          view_of_input=ViewOfInput.RESHAPE),
    OpDef("Squeeze", _squeeze, grad=gradients.reshape, host_reads=reads_on_host(1, since=13),
          view_of_input=ViewOfInput.RESHAPE),
    OpDef("Shape", _shape),
    OpDef("Size", _size),
    OpDef("Cast", _cast, grad=gradients.cast, view_of_input=ViewOfInput.MAY_ALIAS,
          classify=_casts_on_host(_cast_target)),
    OpDef("BitCast", _bitcast, since=26),
    OpDef("CastLike", _cast_like, view_of_input=ViewOfInput.MAY_ALIAS, grad=gradients.recompute,
          classify=_casts_on_host(_like_type)),
    OpDef("Identity", _identity, grad=gradients.identity, view_of_input=ViewOfInput.MAY_ALIAS),
    OpDef("ConstantOfShape", _constant_of_shape, creates_nonfinite=_fills_nonfinite,
          host_reads=reads_on_host(0)),
    OpDef("Range", _range, host_reads=reads_on_host(0, 1, 2)),
    OpDef("Expand", _expand, grad=gradients.expand, host_reads=reads_on_host(1),
          view_of_input=ViewOfInput.MAY_ALIAS),
    OpDef("Tile", _tile, host_reads=reads_on_host(1), grad=gradients.recompute),
    OpDef("NonZero", _nonzero, exec_type=ExecType.LOCAL,
          doc="output shape depends on the data: runs on the host after a sync"),
]
