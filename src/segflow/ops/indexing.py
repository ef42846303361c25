"""Index-driven ops: gathers, scatters, TopK, Unique, NonMaxSuppression, Compress, OneHot ...

Indices may be negative (counted from the end of their axis) everywhere ONNX
allows it; kernels normalize them before calling torch. Ops whose output shape
depends on tensor values (Unique, NonMaxSuppression, Compress, TopK with a
computed k) are LOCAL: they run on the host between bulk segments.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import torch

from segflow.engine.base import ExecType
from segflow.errors import InvalidModel
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.ops import gradients
from segflow.ops._common import ints, normalize_axis
from segflow.ops.registry import BindContext, Kernel, OpDef, reads_on_host

Tensor = torch.Tensor


class Reduction(enum.Enum):
    """How scatter ops combine an update with the value already there."""

    NONE = "none"
    ADD = "add"
    MUL = "mul"
    MAX = "max"
    MIN = "min"

    @classmethod
    def parse(cls, node: Node) -> Reduction:
        text = node.attrs.get("reduction", "none")
        try:
            return cls(text)
        except ValueError:
            raise InvalidModel(f"{node.label}: unknown reduction {text!r}; expected one of "
                               f"{', '.join(r.value for r in cls)}") from None

    @property
    def torch_name(self) -> str:
        return {Reduction.ADD: "sum", Reduction.MUL: "prod", Reduction.MAX: "amax",
                Reduction.MIN: "amin"}[self]


def _wrap(idx: Tensor, size: int | Tensor) -> Tensor:
    """Negative indices count from the end."""
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + size, idx)


# -- gathers -----------------------------------------------------------------------------

def _gather_elements(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, idx = inputs[0], inputs[1]
        assert x is not None and idx is not None
        a = normalize_axis(axis, x.dim())
        return [torch.gather(x, a, _wrap(idx, x.shape[a]))]
    return kernel


def gather_nd(x: Tensor, idx: Tensor, batch_dims: int) -> Tensor:
    """ONNX GatherND: index the first ``idx.shape[-1]`` dims after the batch dims."""
    batch_shape = list(x.shape[:batch_dims])
    depth = idx.shape[-1]
    batch = math.prod(batch_shape)
    rest = list(x.shape[batch_dims + depth:])
    middle = list(idx.shape[batch_dims:-1])
    data = x.reshape(batch, *x.shape[batch_dims:])
    flat = idx.reshape(batch, -1, depth).to(torch.int64)
    keys: list[Tensor] = [torch.arange(batch, device=x.device).reshape(batch, 1)]
    for k in range(depth):
        keys.append(_wrap(flat[..., k], x.shape[batch_dims + k]))
    out = data[tuple(keys)]
    return out.reshape(batch_shape + middle + rest)


def _gather_nd(node: Node, ctx: BindContext) -> Kernel:
    batch_dims = int(node.attrs.get("batch_dims", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, idx = inputs[0], inputs[1]
        assert x is not None and idx is not None
        return [gather_nd(x, idx, batch_dims)]
    return kernel


# -- scatters ----------------------------------------------------------------------------

def _scatter_elements(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", 0))
    reduction = Reduction.parse(node)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, idx, upd = inputs[0], inputs[1], inputs[2]
        assert x is not None and idx is not None and upd is not None
        a = normalize_axis(axis, x.dim())
        index = _wrap(idx, x.shape[a])
        upd = upd.to(x.dtype)
        if reduction is Reduction.NONE:
            return [x.clone().scatter_(a, index, upd)]
        return [x.clone().scatter_reduce_(a, index, upd, reduction.torch_name, include_self=True)]
    return kernel


def scatter_nd(x: Tensor, idx: Tensor, upd: Tensor, reduction: Reduction) -> Tensor:
    """ONNX ScatterND over the first ``idx.shape[-1]`` dims of ``x``."""
    depth = idx.shape[-1]
    lead = list(x.shape[:depth])
    rest = list(x.shape[depth:])
    flat_idx = idx.reshape(-1, depth).to(torch.int64)
    linear = torch.zeros(flat_idx.shape[0], dtype=torch.int64, device=x.device)
    for k, size in enumerate(lead):
        linear = linear * size + _wrap(flat_idx[:, k], size)
    out = x.clone().reshape(math.prod(lead), *rest)
    values = upd.to(x.dtype).reshape(flat_idx.shape[0], *rest)
    if reduction is Reduction.NONE:
        out[linear] = values
    else:
        index = linear.reshape(-1, *([1] * len(rest))).expand_as(values)
        out.scatter_reduce_(0, index, values, reduction.torch_name, include_self=True)
    return out.reshape(x.shape)


def _scatter_nd(node: Node, ctx: BindContext) -> Kernel:
    reduction = Reduction.parse(node)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, idx, upd = inputs[0], inputs[1], inputs[2]
        assert x is not None and idx is not None and upd is not None
        return [scatter_nd(x, idx, upd, reduction)]
    return kernel


def _tensor_scatter(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", -2))
    mode = node.attrs.get("mode", "linear")
    if mode not in ("linear", "circular"):
        raise InvalidModel(f"{node.label}: unknown mode {mode!r}; expected linear or circular")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        past, upd = inputs[0], inputs[1]
        assert past is not None and upd is not None
        write = inputs[2] if len(inputs) > 2 else None
        a = normalize_axis(axis, past.dim())
        batch = past.shape[0]
        starts = write.to(torch.int64) if write is not None else torch.zeros(
            batch, dtype=torch.int64, device=past.device)
        seq = torch.arange(upd.shape[a], device=past.device)
        pos = starts.reshape(batch, 1) + seq.reshape(1, -1)  # [batch, seq]
        if mode == "circular":
            pos = pos % past.shape[a]
        shape = [batch] + [1] * (past.dim() - 1)
        shape[a] = upd.shape[a]
        if a == 0:
            raise ValueError("TensorScatter: axis must not be the batch axis 0")
        index = pos.reshape(shape)
        return [past.clone().scatter_(a, index.expand_as(upd), upd.to(past.dtype))]
    return kernel


# -- selection ---------------------------------------------------------------------------

def topk(x: Tensor, k: int, axis: int, largest: bool) -> tuple[Tensor, Tensor]:
    """Top-k along ``axis``; ties go to the lower index, as ONNX's reference does."""
    if k > x.shape[axis] or k < 0:
        raise ValueError(f"TopK: k={k} is out of range for axis size {x.shape[axis]}")
    values, indices = torch.sort(x, dim=axis, descending=largest, stable=True)
    return values.narrow(axis, 0, k), indices.narrow(axis, 0, k)


def _topk(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", -1))
    largest = bool(int(node.attrs.get("largest", 1)))
    attr_k = int(node.attrs["k"]) if node.opset < 10 else None
    if node.opset < 10 and "k" not in node.attrs:
        raise InvalidModel(f"{node.label}: TopK-{node.opset} needs a 'k' attribute")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        k = attr_k if attr_k is not None else ints(inputs[1])[0]
        values, indices = topk(x, k, normalize_axis(axis, x.dim()), largest)
        return [values, indices]
    return kernel


def _topk_exec(node: Node) -> ExecType:
    if node.opset < 10:
        return ExecType.SYNC
    k = node.inputs[1] if len(node.inputs) > 1 else None
    return ExecType.SYNC if k is not None and k.is_const else ExecType.LOCAL


def _unique(node: Node, ctx: BindContext) -> Kernel:
    axis = node.attrs.get("axis")
    keep_sorted = bool(int(node.attrs.get("sorted", 1)))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if axis is None:
            data, dim = x.reshape(-1), 0
            values, inverse, counts = torch.unique(data, sorted=True, return_inverse=True,
                                                   return_counts=True)
        else:
            dim = normalize_axis(int(axis), x.dim())
            data = x
            values, inverse, counts = torch.unique(x, sorted=True, return_inverse=True,
                                                   return_counts=True, dim=dim)
        n = values.shape[dim]
        positions = torch.arange(inverse.numel(), device=x.device)
        first = torch.full((n,), inverse.numel(), dtype=torch.int64, device=x.device)
        first = first.scatter_reduce(0, inverse.reshape(-1), positions, "amin")
        if not keep_sorted:
            # Order by first occurrence instead of by value.
            order = torch.argsort(first)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(n, device=x.device)
            values = data.index_select(dim, first[order])
            first, counts, inverse = first[order], counts[order], rank[inverse]
        return [values, first, inverse.reshape(-1), counts]
    return kernel


def _compress(node: Node, ctx: BindContext) -> Kernel:
    axis = node.attrs.get("axis")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, cond = inputs[0], inputs[1]
        assert x is not None and cond is not None
        data = x.reshape(-1) if axis is None else x
        dim = 0 if axis is None else normalize_axis(int(axis), x.dim())
        keep = torch.nonzero(cond.reshape(-1)[: data.shape[dim]].to(torch.bool)).reshape(-1)
        return [data.index_select(dim, keep)]
    return kernel


def non_max_suppression(boxes: Tensor, scores: Tensor, max_per_class: int, iou_threshold: float,
                        score_threshold: float | None, center_point_box: bool) -> Tensor:
    """Greedy per-(batch, class) NMS; returns [num_selected, 3] (batch, class, box) rows."""
    rows: list[tuple[int, int, int]] = []
    if max_per_class <= 0:
        return torch.zeros((0, 3), dtype=torch.int64)
    b = boxes.to(torch.float64)
    if center_point_box:
        cx, cy, w, h = b.unbind(-1)
        x1, x2, y1, y2 = cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2
    else:
        y1, x1, y2, x2 = b.unbind(-1)
        x1, x2 = torch.minimum(x1, x2), torch.maximum(x1, x2)
        y1, y2 = torch.minimum(y1, y2), torch.maximum(y1, y2)
    area = (x2 - x1) * (y2 - y1)
    for batch in range(boxes.shape[0]):
        iw = (torch.minimum(x2[batch, :, None], x2[batch, None, :])
              - torch.maximum(x1[batch, :, None], x1[batch, None, :]))
        ih = (torch.minimum(y2[batch, :, None], y2[batch, None, :])
              - torch.maximum(y1[batch, :, None], y1[batch, None, :]))
        inter = torch.where((iw > 0) & (ih > 0), iw * ih, torch.zeros_like(iw))
        union = area[batch, :, None] + area[batch, None, :] - inter
        valid = (inter > 0) & (area[batch, :, None] > 0) & (area[batch, None, :] > 0) & (union > 0)
        iou = torch.where(valid, inter / torch.where(union > 0, union, torch.ones_like(union)),
                          torch.zeros_like(inter))
        suppress = (iou > iou_threshold).tolist()
        for cls in range(scores.shape[1]):
            s = scores[batch, cls].to(torch.float64)
            order = torch.sort(s, descending=True, stable=True).indices
            if score_threshold is not None:
                order = order[s[order] > score_threshold]
            chosen: list[int] = []
            for i in order.tolist():
                if len(chosen) >= max_per_class:
                    break
                if not any(suppress[i][j] for j in chosen):
                    chosen.append(i)
                    rows.append((batch, cls, i))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def _nms(node: Node, ctx: BindContext) -> Kernel:
    center = bool(int(node.attrs.get("center_point_box", 0)))

    def scalar(inputs: Sequence[Tensor | None], i: int) -> Tensor | None:
        t = inputs[i] if len(inputs) > i else None
        return None if t is None or t.numel() == 0 else t.reshape(-1)[0]

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        boxes, scores = inputs[0], inputs[1]
        assert boxes is not None and scores is not None
        max_t, iou_t, score_t = scalar(inputs, 2), scalar(inputs, 3), scalar(inputs, 4)
        out = non_max_suppression(
            boxes.cpu(), scores.cpu(), 0 if max_t is None else int(max_t),
            0.0 if iou_t is None else float(iou_t),
            None if score_t is None else float(score_t), center)
        return [out.to(boxes.device)]
    return kernel


# -- constructors ------------------------------------------------------------------------

def _one_hot(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", -1))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        idx, depth_t, values = inputs[0], inputs[1], inputs[2]
        assert idx is not None and depth_t is not None and values is not None
        depth = int(depth_t.reshape(-1)[0])
        a = normalize_axis(axis, idx.dim() + 1)
        work = idx if idx.is_floating_point() else idx.to(torch.int64)
        work = torch.where(work < 0, work + depth, work).unsqueeze(a)
        shape = [1] * (idx.dim() + 1)
        shape[a] = depth
        targets = torch.arange(depth, device=idx.device, dtype=work.dtype).reshape(shape)
        off, on = values.reshape(-1)[0], values.reshape(-1)[1]
        return [torch.where(targets == work, on, off)]
    return kernel


def _trilu(node: Node, ctx: BindContext) -> Kernel:
    upper = bool(int(node.attrs.get("upper", 1)))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        k = ints(inputs[1])[0] if len(inputs) > 1 and inputs[1] is not None else 0
        rows, cols = x.shape[-2], x.shape[-1]
        i = torch.arange(rows, device=x.device).reshape(-1, 1)
        j = torch.arange(cols, device=x.device).reshape(1, -1)
        keep = (j - i >= k) if upper else (j - i <= k)
        return [torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))]
    return kernel


def _eye_like(node: Node, ctx: BindContext) -> Kernel:
    k = int(node.attrs.get("k", 0))
    code = node.attrs.get("dtype")
    dtype = DType.from_onnx(int(code)).torch if code is not None else None

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if x.dim() not in (1, 2):
            raise ValueError(f"EyeLike needs a 1-D or 2-D input, got shape {list(x.shape)}")
        rows, cols = (x.shape[0], x.shape[0]) if x.dim() == 1 else (x.shape[0], x.shape[1])
        i = torch.arange(rows, device=x.device).reshape(-1, 1)
        j = torch.arange(cols, device=x.device).reshape(1, -1)
        return [(j - i == k).to(dtype or x.dtype)]
    return kernel


OPS: list[OpDef] = [
    OpDef("GatherElements", _gather_elements, grad=gradients.gather),
    OpDef("GatherND", _gather_nd, grad=gradients.recompute),
    OpDef("ScatterElements", _scatter_elements, grad=gradients.scatter),
    OpDef("Scatter", _scatter_elements, until=10, grad=gradients.scatter,
          doc="ScatterElements before opset 11"),
    OpDef("ScatterND", _scatter_nd, grad=gradients.scatter),
    OpDef("TensorScatter", _tensor_scatter, grad=gradients.recompute),
    OpDef("TopK", _topk, classify=_topk_exec, host_reads=reads_on_host(1, since=10),
          doc="LOCAL when k is computed: the output shape depends on it",
          grad=gradients.recompute),
    OpDef("Unique", _unique, exec_type=ExecType.LOCAL),
    OpDef("NonMaxSuppression", _nms, exec_type=ExecType.LOCAL),
    OpDef("Compress", _compress, exec_type=ExecType.LOCAL, grad=gradients.recompute),
    OpDef("OneHot", _one_hot, host_reads=reads_on_host(1)),
    OpDef("Trilu", _trilu, host_reads=reads_on_host(1), grad=gradients.recompute),
    OpDef("EyeLike", _eye_like),
]
