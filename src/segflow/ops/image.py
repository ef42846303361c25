"""Image and spatial ops: Resize/Upsample, Pad, DepthToSpace/SpaceToDepth, GridSample,
AffineGrid, LpNormalization, MeanVarianceNormalization, CenterCropPad, Col2Im; plus the
rows of RoiAlign/MaxRoiPool (kernels in _roi.py) and MaxUnpool/LpPool (in _pooling.py).

Attributes are parsed into enums at bind, so an unknown mode fails when the
model loads, naming the node, instead of mid-run.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from segflow.errors import InvalidModel
from segflow.ir.graph import Node
from segflow.ops import _pooling, _roi, gradients
from segflow.ops._common import ints, normalize_axis, pads_over_axes
from segflow.ops._resize import (
    AspectPolicy,
    Coord,
    Mode,
    Nearest,
    ResizeConfig,
    plan_sizes,
    resize,
)
from segflow.ops.registry import BindContext, Kernel, OpDef, reads_on_host

Tensor = torch.Tensor
Inputs = Sequence[Tensor | None]


def _enum(node: Node, cls: type[enum.Enum], name: str, default: str,
          aliases: dict[str, str] | None = None) -> enum.Enum:
    """Parse a string attribute into ``cls``; an unknown value fails at bind."""
    text = str(node.attrs.get(name, default))
    text = (aliases or {}).get(text, text)
    try:
        return cls(text)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise InvalidModel(f"{node.label}: unsupported {name} {text!r} "
                           f"(expected one of {allowed})") from None


def _opt(inputs: Inputs, i: int) -> Tensor | None:
    """Optional input ``i``; an empty tensor counts as omitted (ONNX convention)."""
    t = inputs[i] if len(inputs) > i else None
    return None if t is None or t.numel() == 0 else t


# -- Resize / Upsample -------------------------------------------------------------------

def _resize_config(node: Node) -> ResizeConfig:
    old = node.opset < 11
    mode = _enum(node, Mode, "mode", "nearest", {"bilinear": "linear", "trilinear": "linear",
                                                "bicubic": "cubic"})
    coord = Coord.ASYMMETRIC if old or node.op_type == "Upsample" else _enum(
        node, Coord, "coordinate_transformation_mode", "half_pixel")
    nearest = Nearest.SIMPLE if old or node.op_type == "Upsample" else _enum(
        node, Nearest, "nearest_mode", "round_prefer_floor")
    if nearest is Nearest.SIMPLE and not (old or node.op_type == "Upsample"):
        raise InvalidModel(f"{node.label}: unsupported nearest_mode 'simple'")
    antialias = bool(int(node.attrs.get("antialias", 0)))
    if antialias and mode is Mode.NEAREST:
        raise InvalidModel(f"{node.label}: antialias is not defined for mode 'nearest'")
    return ResizeConfig(
        mode=mode,  # type: ignore[arg-type]
        coord=coord,  # type: ignore[arg-type]
        nearest=nearest,  # type: ignore[arg-type]
        cubic_a=float(node.attrs.get("cubic_coeff_a", -0.75)),
        exclude_outside=bool(int(node.attrs.get("exclude_outside", 0))),
        extrapolation=float(node.attrs.get("extrapolation_value", 0.0)),
        antialias=antialias,
        policy=_enum(node, AspectPolicy, "keep_aspect_ratio_policy",  # type: ignore[arg-type]
                     "stretch"),
    )


def _resize(node: Node, ctx: BindContext) -> Kernel:
    cfg = _resize_config(node)
    old = node.opset < 11
    attr_axes = node.attrs.get("axes")

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        rank = x.dim()
        if old:
            roi, scales, sizes = None, _opt(inputs, 1), None
        else:
            roi, scales, sizes = _opt(inputs, 1), _opt(inputs, 2), _opt(inputs, 3)
        if scales is None and sizes is None:
            raise ValueError("Resize needs either 'scales' or 'sizes'")
        axes = [normalize_axis(int(a), rank) for a in attr_axes] if attr_axes else list(
            range(rank))
        out, factor = plan_sizes(cfg, x.shape, axes,
                                 None if scales is None else scales.double().tolist(),
                                 None if sizes is None else ints(sizes))
        full_roi = None
        if roi is not None and cfg.coord is Coord.TF_CROP_AND_RESIZE:
            values = roi.double().tolist()
            full_roi = [0.0] * rank + [1.0] * rank
            for i, a in enumerate(axes):
                full_roi[a], full_roi[rank + a] = values[i], values[len(axes) + i]
        return [resize(x, cfg, axes, out, factor, full_roi)]
    return kernel


def _upsample(node: Node, ctx: BindContext) -> Kernel:
    cfg = _resize_config(node)
    attr_scales = node.attrs.get("scales") if node.opset < 9 else None
    if node.opset < 9 and attr_scales is None:
        raise InvalidModel(f"{node.label}: Upsample-{node.opset} needs a 'scales' attribute")

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        scales = list(attr_scales) if attr_scales is not None else \
            inputs[1].double().tolist()  # type: ignore[union-attr]
        axes = list(range(x.dim()))
        out, factor = plan_sizes(cfg, x.shape, axes, scales, None)
        return [resize(x, cfg, axes, out, factor, None)]
    return kernel


# -- Pad ---------------------------------------------------------------------------------

class PadMode(enum.Enum):
    CONSTANT = "constant"
    REFLECT = "reflect"
    EDGE = "edge"
    WRAP = "wrap"


def _pad_index(mode: PadMode, size: int, begin: int, end: int, device: torch.device) -> Tensor:
    """Source index of every output position along one axis."""
    pos = torch.arange(-begin, size + end, device=device)
    if mode is PadMode.EDGE:
        return pos.clamp(0, size - 1)
    if mode is PadMode.WRAP:
        return pos % size
    if size == 1:
        return torch.zeros_like(pos)
    period = 2 * (size - 1)
    pos = pos.abs() % period
    return torch.where(pos >= size, period - pos, pos)


def pad_tensor(x: Tensor, pads: Sequence[int], mode: PadMode, value: float | int | bool) -> Tensor:
    """ONNX Pad; ``pads`` is [begin_0..begin_n, end_0..end_n]; negative pads crop."""
    rank = x.dim()
    begins, ends = list(pads[:rank]), list(pads[rank:])
    for a in range(rank):
        if begins[a] < 0 or ends[a] < 0:
            start = max(0, -begins[a])
            stop = x.shape[a] - max(0, -ends[a])
            x = x.narrow(a, start, max(0, stop - start))
    begins = [max(0, b) for b in begins]
    ends = [max(0, e) for e in ends]
    if mode is PadMode.CONSTANT:
        shape = [s + b + e for s, b, e in zip(x.shape, begins, ends)]
        out = torch.full(shape, value, dtype=x.dtype, device=x.device)
        out[tuple(slice(b, b + s) for b, s in zip(begins, x.shape))] = x
        return out
    for a in range(rank):
        if begins[a] or ends[a]:
            if x.shape[a] == 0:
                raise ValueError(f"Pad mode {mode.value!r} cannot pad the empty axis {a}")
            x = x.index_select(a, _pad_index(mode, x.shape[a], begins[a], ends[a], x.device))
    return x


def _pad(node: Node, ctx: BindContext) -> Kernel:
    mode: PadMode = _enum(node, PadMode, "mode", "constant")  # type: ignore[assignment]
    old = node.opset < 11
    attr_pads = list(node.attrs.get("pads", node.attrs.get("paddings", []))) if old else None
    attr_value = float(node.attrs.get("value", 0.0))

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        rank = x.dim()
        if attr_pads is not None:
            pads, value = attr_pads, attr_value
        else:
            pads = ints(inputs[1])
            cv = _opt(inputs, 2)
            value = cv.reshape(-1)[0].item() if cv is not None else 0
            axes_t = _opt(inputs, 3)
            if axes_t is not None:
                pads = pads_over_axes(pads, ints(axes_t), rank)
        if len(pads) != 2 * rank:
            raise ValueError(f"Pad: {len(pads)} pads for a rank-{rank} input "
                             f"(expected {2 * rank})")
        return [pad_tensor(x, pads, mode, value)]
    return kernel


# -- DepthToSpace / SpaceToDepth ---------------------------------------------------------

class _BlockMode(enum.Enum):
    DCR = "DCR"
    CRD = "CRD"


def _depth_to_space(node: Node, ctx: BindContext) -> Kernel:
    b = int(node.attrs["blocksize"])
    crd = _enum(node, _BlockMode, "mode", "DCR") is _BlockMode.CRD

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        n, c, h, w = x.shape
        if crd:
            y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
        else:
            y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
        return [y.reshape(n, c // (b * b), h * b, w * b)]
    return kernel


def _space_to_depth(node: Node, ctx: BindContext) -> Kernel:
    b = int(node.attrs["blocksize"])
    crd = _enum(node, _BlockMode, "mode", "DCR") is _BlockMode.CRD

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        n, c, h, w = x.shape
        y = x.reshape(n, c, h // b, b, w // b, b)
        y = y.permute(0, 1, 3, 5, 2, 4) if crd else y.permute(0, 3, 5, 1, 2, 4)
        return [y.reshape(n, c * b * b, h // b, w // b)]
    return kernel


# -- sampling: GridSample, AffineGrid ---------------------------------------------------

def _grid_sample(node: Node, ctx: BindContext) -> Kernel:
    mode = str(_enum(node, Mode, "mode", "bilinear" if node.opset < 20 else "linear",
                     {"bilinear": "linear", "bicubic": "cubic"}).value)
    torch_mode = {"linear": "bilinear", "cubic": "bicubic", "nearest": "nearest"}[mode]
    padding = str(node.attrs.get("padding_mode", "zeros"))
    if padding not in ("zeros", "border", "reflection"):
        raise InvalidModel(f"{node.label}: unsupported padding_mode {padding!r}")
    align = bool(int(node.attrs.get("align_corners", 0)))

    def kernel(inputs: Inputs) -> list[Tensor]:
        x, grid = inputs[0], inputs[1]
        assert x is not None and grid is not None
        if x.dim() not in (4, 5) or (x.dim() == 5 and torch_mode == "bicubic"):
            ranks = "4-D" if mode == "cubic" else "4-D and 5-D"
            raise ValueError(f"GridSample mode {mode!r} supports {ranks} inputs, "
                             f"got rank {x.dim()}")
        return [F.grid_sample(x, grid.to(x.dtype), mode=torch_mode, padding_mode=padding,
                              align_corners=align)]
    return kernel


def _affine_grid(node: Node, ctx: BindContext) -> Kernel:
    align = bool(int(node.attrs.get("align_corners", 0)))

    def kernel(inputs: Inputs) -> list[Tensor]:
        theta, size = inputs[0], inputs[1]
        assert theta is not None and size is not None
        return [F.affine_grid(theta, ints(size), align_corners=align)]
    return kernel


# -- normalizations ----------------------------------------------------------------------

def _lp_normalization(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", -1))
    p = int(node.attrs.get("p", 2))
    if p not in (1, 2):
        raise InvalidModel(f"{node.label}: LpNormalization supports p=1 or p=2, got {p}")

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        a = normalize_axis(axis, x.dim())
        norm = x.abs().sum(a, keepdim=True) if p == 1 else (x * x).sum(a, keepdim=True).sqrt()
        safe = torch.where(norm == 0, torch.ones_like(norm), norm)
        return [torch.where(norm == 0, torch.zeros_like(x), x / safe)]
    return kernel


def _mvn(node: Node, ctx: BindContext) -> Kernel:
    axes = [int(a) for a in node.attrs.get("axes", [0, 2, 3])]

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        dims = sorted({normalize_axis(a, x.dim()) for a in axes})
        mean = x.mean(dim=dims, keepdim=True)
        var = (x * x).mean(dim=dims, keepdim=True) - mean * mean
        return [(x - mean) / (var.clamp(min=0).sqrt() + 1e-9)]
    return kernel


# -- crops and folds ---------------------------------------------------------------------

def _center_crop_pad(node: Node, ctx: BindContext) -> Kernel:
    attr_axes = node.attrs.get("axes")

    def kernel(inputs: Inputs) -> list[Tensor]:
        x, shape_t = inputs[0], inputs[1]
        assert x is not None and shape_t is not None
        rank = x.dim()
        axes = [normalize_axis(int(a), rank) for a in attr_axes] if attr_axes else list(
            range(rank))
        target = list(x.shape)
        for a, size in zip(axes, ints(shape_t)):
            target[a] = size
        src = []
        dst = []
        for dim, want in zip(x.shape, target):
            if want <= dim:
                start = (dim - want) // 2
                src.append(slice(start, start + want))
                dst.append(slice(0, want))
            else:
                start = (want - dim) // 2
                src.append(slice(0, dim))
                dst.append(slice(start, start + dim))
        out = x.new_zeros(target)
        out[tuple(dst)] = x[tuple(src)]
        return [out]
    return kernel


def col2im(x: Tensor, image: Sequence[int], block: Sequence[int], dilations: Sequence[int],
           pads: Sequence[int], strides: Sequence[int]) -> Tensor:
    """ONNX Col2Im for any number of spatial dims: scatter-add columns into the image."""
    nd = len(image)
    padded = [image[i] + pads[i] + pads[i + nd] for i in range(nd)]
    counts = [(padded[i] - (dilations[i] * (block[i] - 1) + 1)) // strides[i] + 1
              for i in range(nd)]
    nblock = math.prod(block)
    batch, channels = x.shape[0], x.shape[1] // nblock
    k_lin = torch.zeros(nblock, dtype=torch.int64, device=x.device)
    l_lin = torch.zeros(math.prod(counts), dtype=torch.int64, device=x.device)
    k_grid = torch.meshgrid(*[torch.arange(b, device=x.device) for b in block], indexing="ij")
    l_grid = torch.meshgrid(*[torch.arange(c, device=x.device) for c in counts], indexing="ij")
    for i in range(nd):
        k_lin = k_lin * padded[i] + (k_grid[i] * dilations[i]).reshape(-1)
        l_lin = l_lin * padded[i] + (l_grid[i] * strides[i]).reshape(-1)
    target = (k_lin.reshape(-1, 1) + l_lin.reshape(1, -1)).reshape(-1)
    src = x.reshape(batch, channels, nblock * l_lin.numel())
    out = x.new_zeros((batch, channels, math.prod(padded)))
    out.scatter_add_(2, target.expand(batch, channels, -1), src)
    out = out.reshape(batch, channels, *padded)
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(nd))
    return out[(slice(None), slice(None), *crop)]


def _col2im(node: Node, ctx: BindContext) -> Kernel:
    attrs = node.attrs

    def kernel(inputs: Inputs) -> list[Tensor]:
        x, image_t, block_t = inputs[0], inputs[1], inputs[2]
        assert x is not None and image_t is not None and block_t is not None
        image, block = ints(image_t), ints(block_t)
        nd = len(image)
        return [col2im(x, image, block, list(attrs.get("dilations", [1] * nd)),
                       list(attrs.get("pads", [0] * 2 * nd)),
                       list(attrs.get("strides", [1] * nd)))]
    return kernel


OPS: list[OpDef] = [
    OpDef("Resize", _resize, since=10, host_reads=reads_on_host(1, 2, 3),
          grad=gradients.recompute),
    OpDef("Upsample", _upsample, doc="deprecated since opset 10; Resize semantics",
          host_reads=reads_on_host(1, since=9), grad=gradients.recompute),
    OpDef("Pad", _pad, host_reads=reads_on_host(1, 2, 3, since=11), grad=gradients.pad),
    OpDef("DepthToSpace", _depth_to_space, grad=gradients.recompute),
    OpDef("SpaceToDepth", _space_to_depth, grad=gradients.recompute),
    OpDef("GridSample", _grid_sample, grad=gradients.recompute),
    OpDef("AffineGrid", _affine_grid, host_reads=reads_on_host(1), grad=gradients.recompute),
    OpDef("RoiAlign", _roi.bind_roi_align, grad=gradients.recompute),
    OpDef("MaxRoiPool", _roi.bind_max_roi_pool, grad=gradients.recompute),
    OpDef("MaxUnpool", _pooling.bind_max_unpool, host_reads=reads_on_host(2),
          grad=gradients.recompute),
    OpDef("LpPool", _pooling.bind_lp_pool, grad=gradients.recompute),
    OpDef("LpNormalization", _lp_normalization, grad=gradients.recompute),
    OpDef("MeanVarianceNormalization", _mvn, grad=gradients.recompute),
    OpDef("CenterCropPad", _center_crop_pad, host_reads=reads_on_host(1),
          grad=gradients.recompute),
    OpDef("Col2Im", _col2im, host_reads=reads_on_host(1, 2), grad=gradients.recompute),
]
