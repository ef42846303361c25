"""DeformConv (2-D): bilinear sampling at learned offsets, then a grouped matmul.

The row lives in nn.py. Sampling is bilinear with each corner outside the image
counting as zero, as the ONNX reference (grid_sample, zeros padding) defines it;
it indexes pixels directly rather than through grid_sample's normalized
coordinates, whose float32 round trip costs more than ONNX's tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.ir.graph import Node
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor


def deform_conv(x: Tensor, w: Tensor, offset: Tensor, bias: Tensor | None, mask: Tensor | None,
                strides: Sequence[int], pads: Sequence[int], dilations: Sequence[int],
                group: int, offset_group: int) -> Tensor:
    """ONNX DeformConv over [N, C, H, W] input and [M, C/group, kH, kW] weights."""
    if x.dim() != 4:
        raise ValueError(f"DeformConv supports 2-D images, got input rank {x.dim()}")
    n, channels, height, width = x.shape
    out_c, _, kh, kw = w.shape
    oh, ow = offset.shape[2:]
    taps = kh * kw
    dev, dt = x.device, x.dtype
    off = offset.reshape(n, offset_group, kh, kw, 2, oh, ow)
    rows = torch.arange(oh, device=dev, dtype=dt) * strides[0] - pads[0]
    cols = torch.arange(ow, device=dev, dtype=dt) * strides[1] - pads[1]
    ky = torch.arange(kh, device=dev, dtype=dt) * dilations[0]
    kx = torch.arange(kw, device=dev, dtype=dt) * dilations[1]
    y = rows.reshape(1, 1, 1, 1, oh, 1) + ky.reshape(1, 1, kh, 1, 1, 1) + off[:, :, :, :, 0]
    xx = cols.reshape(1, 1, 1, 1, 1, ow) + kx.reshape(1, 1, 1, kw, 1, 1) + off[:, :, :, :, 1]
    y = y.reshape(n, offset_group, 1, -1)    # [n, G, 1, taps*oh*ow]
    xx = xx.reshape(n, offset_group, 1, -1)
    per_group = channels // offset_group
    flat = x.reshape(n, offset_group, per_group, height * width)
    y0, x0 = torch.floor(y), torch.floor(xx)
    sampled = torch.zeros((n, offset_group, per_group, y.shape[-1]), dtype=dt, device=dev)
    # Bilinear sampling; each corner outside the image contributes zero.
    for cy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for cx, wx in ((x0, 1 - (xx - x0)), (x0 + 1, xx - x0)):
            inside = (cy >= 0) & (cy <= height - 1) & (cx >= 0) & (cx <= width - 1)
            index = (cy.clamp(0, height - 1) * width + cx.clamp(0, width - 1)).to(torch.int64)
            values = flat.gather(3, index.expand(n, offset_group, per_group, -1))
            sampled = sampled + values * torch.where(inside, wy * wx, torch.zeros_like(wy))
    sampled = sampled.reshape(n, offset_group, per_group, taps, oh, ow)
    if mask is not None:
        sampled = sampled * mask.reshape(n, offset_group, 1, taps, oh, ow)
    columns = sampled.reshape(n, group, (channels // group) * taps, oh * ow)
    kernels = w.reshape(group, out_c // group, -1)
    out = torch.einsum("gok,ngkl->ngol", kernels, columns).reshape(n, out_c, oh, ow)
    if bias is not None:
        out = out + bias.reshape(1, -1, 1, 1)
    return out


def bind_deform_conv(node: Node, ctx: BindContext) -> Kernel:
    attrs = node.attrs
    strides = list(attrs.get("strides", [1, 1]))
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    dilations = list(attrs.get("dilations", [1, 1]))
    group = int(attrs.get("group", 1))
    offset_group = int(attrs.get("offset_group", 1))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w, offset = inputs[0], inputs[1], inputs[2]
        assert x is not None and w is not None and offset is not None
        bias = inputs[3] if len(inputs) > 3 else None
        mask = inputs[4] if len(inputs) > 4 else None
        return [deform_conv(x, w, offset, bias, mask, strides, pads, dilations, group,
                            offset_group)]
    return kernel
