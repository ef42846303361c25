"""Resize/Upsample interpolation: separable per-axis index and weight tables.

ONNX Resize is separable: every resized axis maps each output position to a
few input positions (1 for nearest, 2 for linear, 4 for cubic, more with
antialias) and a weight for each. :func:`axis_table` computes those tables
once per (input size, output size) following the ONNX reference
implementation exactly (edge padding = clamped indices, ties to the lower
index); :func:`resize` applies them axis by axis. Common cases take a fast
path through ``torch.nn.functional.interpolate`` that computes the same thing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class Mode(enum.Enum):
    NEAREST = "nearest"
    LINEAR = "linear"
    CUBIC = "cubic"


class Coord(enum.Enum):
    """coordinate_transformation_mode: output index -> input coordinate."""

    HALF_PIXEL = "half_pixel"
    HALF_PIXEL_SYMMETRIC = "half_pixel_symmetric"
    PYTORCH_HALF_PIXEL = "pytorch_half_pixel"
    ALIGN_CORNERS = "align_corners"
    ASYMMETRIC = "asymmetric"
    TF_HALF_PIXEL_FOR_NN = "tf_half_pixel_for_nn"
    TF_CROP_AND_RESIZE = "tf_crop_and_resize"


class Nearest(enum.Enum):
    """nearest_mode; SIMPLE is Resize-10/Upsample (floor, or ceil when downsampling)."""

    ROUND_PREFER_FLOOR = "round_prefer_floor"
    ROUND_PREFER_CEIL = "round_prefer_ceil"
    FLOOR = "floor"
    CEIL = "ceil"
    SIMPLE = "simple"


class AspectPolicy(enum.Enum):
    STRETCH = "stretch"
    NOT_LARGER = "not_larger"
    NOT_SMALLER = "not_smaller"


@dataclass(frozen=True, slots=True)
class ResizeConfig:
    """Every Resize attribute that changes the arithmetic, parsed once at bind."""

    mode: Mode = Mode.NEAREST
    coord: Coord = Coord.HALF_PIXEL
    nearest: Nearest = Nearest.ROUND_PREFER_FLOOR
    cubic_a: float = -0.75
    exclude_outside: bool = False
    extrapolation: float = 0.0
    antialias: bool = False
    policy: AspectPolicy = AspectPolicy.STRETCH


@dataclass(frozen=True, slots=True)
class AxisTable:
    """For one axis: input indices [out, taps], weights [out, taps], extrapolated mask."""

    index: Tensor
    weight: Tensor | None  # None: nearest (one tap, weight 1)
    outside: Tensor | None


def source_coords(cfg: ResizeConfig, in_size: int, out_size: int, scale: float,
                  roi: tuple[float, float]) -> Tensor:
    """Input coordinate of each output position (float64)."""
    y = torch.arange(out_size, dtype=torch.float64)
    out_f = scale * in_size
    c = cfg.coord
    if c is Coord.ALIGN_CORNERS:
        return torch.zeros_like(y) if out_f == 1 else y * (in_size - 1) / (out_f - 1)
    if c is Coord.ASYMMETRIC:
        return y / scale
    if c is Coord.TF_HALF_PIXEL_FOR_NN:
        return (y + 0.5) / scale
    if c is Coord.TF_CROP_AND_RESIZE:
        start, end = roi
        if out_f == 1:
            x = torch.full_like(y, (end - start) * (in_size - 1) / 2)
        else:
            x = y * (end - start) * (in_size - 1) / (out_f - 1)
        return x + start * (in_size - 1)
    if c is Coord.PYTORCH_HALF_PIXEL:
        return torch.full_like(y, -0.5) if out_f == 1 else (y + 0.5) / scale - 0.5
    if c is Coord.HALF_PIXEL_SYMMETRIC:
        adjustment = out_size / out_f
        offset = in_size / 2 * (1 - adjustment)
        return offset + (y + 0.5) / scale - 0.5
    return (y + 0.5) / scale - 0.5


def _taps(cfg: ResizeConfig, scale: float) -> int:
    if cfg.mode is Mode.NEAREST:
        return 2
    if not cfg.antialias:
        return 2 if cfg.mode is Mode.LINEAR else 4
    s = min(scale, 1.0)
    start = math.floor((-1 if cfg.mode is Mode.LINEAR else -2) / s) + 1
    return 2 - 2 * start


def _weights(cfg: ResizeConfig, ratio: Tensor, scale: float, taps: int) -> Tensor:
    """[out, taps] weights; tap k sits at offset (k + 1 - taps/2) from the base index."""
    offsets = torch.arange(taps, dtype=torch.float64) + 1 - taps // 2
    r = ratio.reshape(-1, 1)
    if cfg.mode is Mode.NEAREST:
        if cfg.nearest is Nearest.ROUND_PREFER_FLOOR:
            right = r > 0.5
        elif cfg.nearest is Nearest.ROUND_PREFER_CEIL:
            right = r >= 0.5
        elif cfg.nearest is Nearest.FLOOR:
            right = torch.zeros_like(r, dtype=torch.bool)
        else:
            right = torch.ones_like(r, dtype=torch.bool)
        right = right | (r == 1)  # an exact integer coordinate is the right tap
        return torch.cat([(~right).double(), right.double()], dim=1)
    s = min(scale, 1.0) if cfg.antialias else 1.0
    dist = (offsets.reshape(1, -1) - r).abs() * s
    if cfg.mode is Mode.LINEAR:
        w = (1 - dist).clamp(min=0)
    else:
        a = cfg.cubic_a
        near = ((a + 2) * dist - (a + 3)) * dist * dist + 1
        far = ((a * dist - 5 * a) * dist + 8 * a) * dist - 4 * a
        w = torch.where(dist <= 1, near, torch.where(dist < 2, far, torch.zeros_like(dist)))
    if cfg.antialias:
        w = w / w.sum(dim=1, keepdim=True)
    return w


def axis_table(cfg: ResizeConfig, in_size: int, out_size: int, scale: float,
               roi: tuple[float, float] = (0.0, 1.0)) -> AxisTable:
    """Index/weight table for one axis, per the ONNX reference semantics."""
    x = source_coords(cfg, in_size, out_size, scale, roi)
    outside = None
    if cfg.coord is Coord.TF_CROP_AND_RESIZE:
        outside = (x < 0) | (x > in_size - 1)
    if cfg.mode is Mode.NEAREST and cfg.nearest is Nearest.SIMPLE:
        idx = torch.ceil(x) if scale < 1 else torch.floor(x)
        index = idx.to(torch.int64).clamp(0, max(in_size - 1, 0)).reshape(-1, 1)
        return AxisTable(index, None, outside)
    base = torch.ceil(x) - 1  # the left neighbour; an integer x counts as ratio 1
    ratio = x - base
    taps = _taps(cfg, scale)
    weight = _weights(cfg, ratio, scale, taps)
    index = base.to(torch.int64).reshape(-1, 1) + torch.arange(taps) + 1 - taps // 2
    if cfg.exclude_outside:
        weight = torch.where((index < 0) | (index >= in_size), torch.zeros_like(weight), weight)
        total = weight.sum(dim=1, keepdim=True)
        weight = weight / torch.where(total == 0, torch.ones_like(total), total)
    index = index.clamp(0, max(in_size - 1, 0))
    if cfg.mode is Mode.NEAREST:
        pick = weight.argmax(dim=1, keepdim=True)
        return AxisTable(index.gather(1, pick), None, outside)
    return AxisTable(index, weight, outside)


def apply_axis(x: Tensor, axis: int, table: AxisTable, extrapolation: float) -> Tensor:
    """Resample ``x`` along ``axis`` with ``table`` (x is float, or any dtype for nearest)."""
    out_size, taps = table.index.shape
    index = table.index.to(x.device)
    gathered = x.index_select(axis, index.reshape(-1))
    if table.weight is None:
        y = gathered
    else:
        shape = list(x.shape)
        shape[axis: axis + 1] = [out_size, taps]
        gathered = gathered.reshape(shape)
        wshape = [1] * len(shape)
        wshape[axis], wshape[axis + 1] = out_size, taps
        weight = table.weight.to(device=x.device, dtype=x.dtype).reshape(wshape)
        y = (gathered * weight).sum(dim=axis + 1)
    if table.outside is not None and bool(table.outside.any()):
        mshape = [1] * y.dim()
        mshape[axis] = out_size
        mask = table.outside.to(x.device).reshape(mshape)
        y = torch.where(mask, torch.full((), extrapolation, dtype=y.dtype, device=y.device), y)
    return y


def plan_sizes(cfg: ResizeConfig, shape: Sequence[int], axes: Sequence[int],
               scales: Sequence[float] | None, sizes: Sequence[int] | None
               ) -> tuple[list[int], list[float]]:
    """Output sizes and scale factors for every axis of ``shape``."""
    rank = len(shape)
    out = list(shape)
    factor = [1.0] * rank
    if sizes is not None:
        for a, s in zip(axes, sizes):
            out[a] = int(s)
            factor[a] = s / shape[a] if shape[a] else 1.0
        if cfg.policy is not AspectPolicy.STRETCH:
            pick = min if cfg.policy is AspectPolicy.NOT_LARGER else max
            common = pick(factor[a] for a in axes)
            for a in axes:
                factor[a] = common
                out[a] = int(common * shape[a] + 0.5)
    else:
        assert scales is not None
        for a, scale in zip(axes, scales):
            factor[a] = float(scale)
            # float32 product, as onnxruntime computes it: 10 * 0.7f is 7, not 6.99...
            out[a] = int(np.floor(np.float32(scale) * np.float32(shape[a])))
    return out, factor


def _fast(x: Tensor, cfg: ResizeConfig, axes: Sequence[int], out: list[int],
          factor: list[float]) -> Tensor | None:
    """torch's interpolate where it computes exactly the ONNX result; None otherwise."""
    rank = x.dim()
    moved = [a for a in range(rank) if out[a] != x.shape[a] or factor[a] != 1.0]
    if cfg.coord is Coord.TF_CROP_AND_RESIZE or cfg.antialias or not 3 <= rank <= 5:
        return None
    if any(a < 2 for a in moved) or not moved or any(s == 0 for s in out):
        return None
    spatial = out[2:]
    if cfg.mode is Mode.NEAREST:
        ints = [factor[a] for a in range(2, rank)]
        if (cfg.coord is Coord.ASYMMETRIC and cfg.nearest in (Nearest.FLOOR, Nearest.SIMPLE)
                and all(f >= 1 and f == int(f) for f in ints)
                and all(o == x.shape[a] * int(factor[a]) for a, o in enumerate(out) if a >= 2)):
            return F.interpolate(x, size=spatial, mode="nearest") if x.is_floating_point() \
                else _repeat(x, [int(f) for f in ints])
        return None
    if x.dtype not in (torch.float32, torch.float64) or cfg.exclude_outside:
        return None
    if cfg.coord is Coord.ALIGN_CORNERS:
        # ONNX divides by (scale * in - 1), not (out - 1): equal only when out is exact.
        if any(factor[a] * x.shape[a] != out[a] for a in range(2, rank)):
            return None
        align = True
    elif cfg.coord is Coord.HALF_PIXEL or (cfg.coord is Coord.PYTORCH_HALF_PIXEL
                                           and all(s > 1 for s in spatial)):
        align = False
    else:
        return None
    if cfg.mode is Mode.CUBIC:
        if rank != 4 or cfg.cubic_a != -0.75:
            return None
        torch_mode = "bicubic"
    else:
        torch_mode = {3: "linear", 4: "bilinear", 5: "trilinear"}[rank]
    if align:
        return F.interpolate(x, size=spatial, mode=torch_mode, align_corners=True)
    scale = [factor[a] for a in range(2, rank)]
    return F.interpolate(x, size=spatial, scale_factor=None, mode=torch_mode,
                         align_corners=False) if _sizes_define_scale(x, out, scale) else \
        F.interpolate(x, scale_factor=scale, mode=torch_mode, align_corners=False,
                      recompute_scale_factor=False)


def _sizes_define_scale(x: Tensor, out: list[int], scale: list[float]) -> bool:
    # torch derives the scale from the sizes; fine when that is the scale ONNX uses.
    return all(o / x.shape[2 + i] == s for i, (o, s) in enumerate(zip(out[2:], scale)))


def _repeat(x: Tensor, factors: list[int]) -> Tensor:
    for i, f in enumerate(factors):
        if f != 1:
            x = x.repeat_interleave(f, dim=2 + i)
    return x


def resize(x: Tensor, cfg: ResizeConfig, axes: Sequence[int], out: list[int],
           factor: list[float], roi: Sequence[float] | None) -> Tensor:
    """Resize ``x`` to ``out`` (all axes), following ONNX Resize semantics."""
    fast = _fast(x, cfg, axes, out, factor)
    if fast is not None:
        return fast
    rank = x.dim()
    integer = not (x.is_floating_point() or x.is_complex())
    nearest = cfg.mode is Mode.NEAREST
    work = x if nearest or not integer else x.to(torch.float64)
    for a in range(rank):
        span = (0.0, 1.0) if roi is None else (float(roi[a]), float(roi[a + rank]))
        if out[a] == work.shape[a] and math.isclose(factor[a], 1.0) and span == (0.0, 1.0):
            continue
        if out[a] == 0:
            shape = list(work.shape)
            shape[a] = 0
            work = work.new_empty(shape)
            continue
        table = axis_table(cfg, x.shape[a], out[a], factor[a], span)
        work = apply_axis(work, a, table, cfg.extrapolation)
    if work.dtype != x.dtype:
        info = torch.iinfo(x.dtype) if integer else None
        if info is not None:
            work = torch.round(work).clamp(info.min, info.max)
        work = work.to(x.dtype)
    return work
