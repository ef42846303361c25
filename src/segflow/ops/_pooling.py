"""Pooling-shaped image ops: MaxUnpool and LpPool (rows live in image.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from segflow.ir.graph import Node
from segflow.ops._common import ints, resolve_pads, torch_pad
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor
Inputs = Sequence[Tensor | None]


def _opt(inputs: Inputs, i: int) -> Tensor | None:
    t = inputs[i] if len(inputs) > i else None
    return None if t is None or t.numel() == 0 else t


def bind_max_unpool(node: Node, ctx: BindContext) -> Kernel:
    kshape = [int(k) for k in node.attrs["kernel_shape"]]
    n = len(kshape)
    strides = [int(s) for s in node.attrs.get("strides", [1] * n)]
    pads = [int(p) for p in node.attrs.get("pads", [0] * 2 * n)]

    def kernel(inputs: Inputs) -> list[Tensor]:
        x, idx = inputs[0], inputs[1]
        assert x is not None and idx is not None
        spatial = [(s - 1) * st + k - pads[i] - pads[i + n]
                   for i, (s, st, k) in enumerate(zip(x.shape[2:], strides, kshape))]
        inferred = [x.shape[0], x.shape[1], *spatial]
        out = x.new_zeros(math.prod(inferred))
        out.scatter_(0, idx.reshape(-1).to(torch.int64), x.reshape(-1))
        out = out.reshape(inferred)
        shape_t = _opt(inputs, 2)
        if shape_t is None or ints(shape_t) == inferred:
            return [out]
        # Indices address the inferred shape; a larger output_shape pads after them.
        shape = ints(shape_t)
        full = x.new_zeros(shape)
        region = tuple(slice(0, min(a, b)) for a, b in zip(inferred, shape))
        full[region] = out[region]
        return [full]
    return kernel


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def bind_lp_pool(node: Node, ctx: BindContext) -> Kernel:
    kshape = [int(k) for k in node.attrs["kernel_shape"]]
    n = len(kshape)
    p = float(node.attrs.get("p", 2))
    strides = [int(s) for s in node.attrs.get("strides", [1] * n)]
    dilations = [int(d) for d in node.attrs.get("dilations", [1] * n)]
    auto_pad = str(node.attrs.get("auto_pad", "NOTSET"))
    attr_pads = [int(v) for v in node.attrs.get("pads", [0] * 2 * n)]
    ceil_mode = bool(int(node.attrs.get("ceil_mode", 0)))

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        pads = resolve_pads(auto_pad, attr_pads, x.shape[2:], kshape, strides, dilations)
        begin, end = list(pads[:n]), list(pads[n:])
        if ceil_mode:
            for i in range(n):
                size = x.shape[2 + i] + begin[i] + end[i]
                eff = (kshape[i] - 1) * dilations[i] + 1
                out = -(-(size - eff) // strides[i]) + 1
                if (out - 1) * strides[i] >= x.shape[2 + i] + begin[i]:
                    out -= 1
                end[i] += max(0, (out - 1) * strides[i] + eff - size)
        powered = F.pad(x.abs() ** p, torch_pad(begin + end))
        weight = torch.ones((x.shape[1], 1, *kshape), dtype=x.dtype, device=x.device)
        total = _CONV[n](powered, weight, None, strides, 0, dilations, x.shape[1])
        return [total ** (1.0 / p)]
    return kernel
