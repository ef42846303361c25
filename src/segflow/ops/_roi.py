"""Region-of-interest ops for detectors: RoiAlign and MaxRoiPool (rows live in image.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from segflow.errors import InvalidModel
from segflow.ir.graph import Node
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor
Inputs = Sequence[Tensor | None]


def _bilinear_axis(coords: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """RoiAlign's per-axis sampling: low/high index and weights (0 outside the map)."""
    valid = (coords >= -1.0) & (coords <= size)
    c = coords.clamp(min=0)
    low = c.floor().to(torch.int64)
    at_end = low >= size - 1
    low = torch.where(at_end, torch.full_like(low, size - 1), low)
    high = torch.where(at_end, low, low + 1)
    c = torch.where(at_end, low.to(c.dtype), c)
    frac = c - low
    zero = torch.zeros_like(frac)
    return low, high, torch.where(valid, 1 - frac, zero), torch.where(valid, frac, zero)


def roi_align(x: Tensor, rois: Tensor, batch: Tensor, out_h: int, out_w: int, ratio: int,
              scale: float, half_pixel: bool, use_max: bool) -> Tensor:
    """ONNX RoiAlign (avg or max over bilinear samples in each bin)."""
    _, channels, height, width = x.shape
    out = x.new_zeros((rois.shape[0], channels, out_h, out_w))
    offset = 0.5 if half_pixel else 0.0
    for n, (box, b) in enumerate(zip(rois.double().tolist(), batch.tolist())):
        x1, y1, x2, y2 = (v * scale - offset for v in box)
        roi_w, roi_h = x2 - x1, y2 - y1
        if not half_pixel:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / out_h, roi_w / out_w
        grid_h = ratio if ratio > 0 else math.ceil(roi_h / out_h)
        grid_w = ratio if ratio > 0 else math.ceil(roi_w / out_w)
        if grid_h <= 0 or grid_w <= 0:
            continue
        ys = (y1 + torch.arange(out_h, dtype=torch.float64).reshape(-1, 1) * bin_h
              + (torch.arange(grid_h, dtype=torch.float64) + 0.5) * bin_h / grid_h).reshape(-1)
        xs = (x1 + torch.arange(out_w, dtype=torch.float64).reshape(-1, 1) * bin_w
              + (torch.arange(grid_w, dtype=torch.float64) + 0.5) * bin_w / grid_w).reshape(-1)
        ylo, yhi, wy_lo, wy_hi = _bilinear_axis(ys, height)
        xlo, xhi, wx_lo, wx_hi = _bilinear_axis(xs, width)
        feat = x[int(b)]
        if not use_max:
            wy = torch.zeros(out_h, height, dtype=torch.float64)
            rows = torch.arange(ys.numel()) // grid_h
            wy.index_put_((rows, ylo), wy_lo, accumulate=True)
            wy.index_put_((rows, yhi), wy_hi, accumulate=True)
            wx = torch.zeros(out_w, width, dtype=torch.float64)
            cols = torch.arange(xs.numel()) // grid_w
            wx.index_put_((cols, xlo), wx_lo, accumulate=True)
            wx.index_put_((cols, xhi), wx_hi, accumulate=True)
            wy, wx = wy.to(feat.device, feat.dtype), wx.to(feat.device, feat.dtype)
            out[n] = torch.einsum("ph,chw,qw->cpq", wy, feat, wx) / (grid_h * grid_w)
            continue
        corners = []
        for yi, wy_ in ((ylo, wy_lo), (yhi, wy_hi)):
            for xi, wx_ in ((xlo, wx_lo), (xhi, wx_hi)):
                weight = (wy_.reshape(-1, 1) * wx_.reshape(1, -1)).to(feat.device, feat.dtype)
                corners.append(feat[:, yi.to(feat.device)][:, :, xi.to(feat.device)] * weight)
        best = torch.stack(corners).amax(dim=0)
        out[n] = best.reshape(channels, out_h, grid_h, out_w, grid_w).amax(dim=(2, 4))
    return out


def bind_roi_align(node: Node, ctx: BindContext) -> Kernel:
    use_max = str(node.attrs.get("mode", "avg")) == "max"
    if str(node.attrs.get("mode", "avg")) not in ("avg", "max"):
        raise InvalidModel(f"{node.label}: unsupported mode {node.attrs['mode']!r}")
    out_h = int(node.attrs.get("output_height", 1))
    out_w = int(node.attrs.get("output_width", 1))
    ratio = int(node.attrs.get("sampling_ratio", 0))
    scale = float(node.attrs.get("spatial_scale", 1.0))
    default_ctm = "half_pixel" if node.opset >= 16 else "output_half_pixel"
    ctm = str(node.attrs.get("coordinate_transformation_mode", default_ctm))
    if ctm not in ("half_pixel", "output_half_pixel"):
        raise InvalidModel(f"{node.label}: unsupported coordinate_transformation_mode {ctm!r}")

    def kernel(inputs: Inputs) -> list[Tensor]:
        x, rois, batch = inputs[0], inputs[1], inputs[2]
        assert x is not None and rois is not None and batch is not None
        return [roi_align(x, rois, batch, out_h, out_w, ratio, scale, ctm == "half_pixel",
                          use_max)]
    return kernel


def bind_max_roi_pool(node: Node, ctx: BindContext) -> Kernel:
    ph, pw = (int(v) for v in node.attrs["pooled_shape"])
    scale = float(node.attrs.get("spatial_scale", 1.0))

    def c_round(v: float) -> int:
        return int(math.floor(v + 0.5)) if v >= 0 else -int(math.floor(-v + 0.5))

    def kernel(inputs: Inputs) -> list[Tensor]:
        x, rois = inputs[0], inputs[1]
        assert x is not None and rois is not None
        _, channels, height, width = x.shape
        out = x.new_zeros((rois.shape[0], channels, ph, pw))
        for n, roi in enumerate(rois.double().tolist()):
            b = int(roi[0])
            x1, y1, x2, y2 = (c_round(v * scale) for v in roi[1:5])
            bin_h = max(y2 - y1 + 1, 1) / ph
            bin_w = max(x2 - x1 + 1, 1) / pw
            for i in range(ph):
                hs = min(max(math.floor(i * bin_h) + y1, 0), height)
                he = min(max(math.ceil((i + 1) * bin_h) + y1, 0), height)
                for j in range(pw):
                    ws = min(max(math.floor(j * bin_w) + x1, 0), width)
                    we = min(max(math.ceil((j + 1) * bin_w) + x1, 0), width)
                    if he > hs and we > ws:
                        out[n, :, i, j] = x[b, :, hs:he, ws:we].amax(dim=(1, 2))
        return [out]
    return kernel
