"""Quantization: (De)QuantizeLinear, DynamicQuantizeLinear and the integer/QLinear kernels.

Integer arithmetic follows ONNX's reference: operands are widened and zero
points subtracted before the product, products are accumulated exactly
(float64 holds every int32 sum these kernels produce), and requantization
rounds half to even and saturates to the output type.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from segflow.engine.base import ExecType
from segflow.errors import UnsupportedOp
from segflow.ir import lowbit
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.ops._common import has_input, normalize_axis, resolve_pads, torch_pad
from segflow.ops._integer_matmul import PreparedB, centered, integer_matmul
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def broadcast_param(param: Tensor, shape: Sequence[int], axis: int, block_size: int) -> Tensor:
    """Scale / zero point shaped to broadcast against ``shape``.

    Scalar or one element: per tensor. 1-D: per ``axis``. Same rank with
    ``block_size``: each entry covers ``block_size`` consecutive elements along ``axis``.
    """
    if param.dim() == 0 or param.numel() == 1 and not block_size:
        return param.reshape(())
    if not block_size:
        dims = [1] * len(shape)
        dims[axis] = param.numel()
        return param.reshape(dims)
    expanded = param.repeat_interleave(block_size, dim=axis)
    return expanded.narrow(axis, 0, shape[axis])


# The integer types QuantizeLinear saturates to, by value range.
_QUANT_RANGES: dict[DType, tuple[int, int]] = {
    DType.UINT8: (0, 255),
    DType.INT8: (-128, 127),
    DType.UINT16: (0, 65535),
    DType.INT16: (-32768, 32767),
    DType.INT32: (-(2**31), 2**31 - 1),
    DType.UINT4: (0, 15),
    DType.INT4: (-8, 7),
    DType.UINT2: (0, 3),
    DType.INT2: (-2, 1),
}
# The ordinary ones by torch dtype, for the integer kernels.
_INT_RANGES: dict[torch.dtype, tuple[int, int]] = {
    d.torch: r for d, r in _QUANT_RANGES.items() if not d.is_lowbit}
# The float types QuantizeLinear rounds to (ir/lowbit.py): float8 honours ``saturate``.
_QUANT_FLOATS = frozenset({DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2,
                           DType.FLOAT8E5M2FNUZ, DType.FLOAT4E2M1})


def _attr_dtype(node: Node, name: str, default: DType | None) -> DType | None:
    """An element-type attribute (0 or absent: ``default``)."""
    code = int(node.attrs.get(name, 0) or 0)
    if not code:
        return default
    try:
        return DType.from_onnx(code)
    except ValueError:
        raise UnsupportedOp(f"{node.label}: {name}={code} names an element type segflow "
                            "does not support") from None


def _saturate(values: Tensor, dtype: torch.dtype) -> Tensor:
    lo, hi = _INT_RANGES[dtype]
    return values.clamp(lo, hi).to(dtype)


def _declared(node: Node, index: int) -> DType | None:
    value = node.inputs[index] if len(node.inputs) > index else None
    return value.spec.dtype if value is not None else None


def _quantized_type(node: Node) -> DType | None:
    """QuantizeLinear's output type: its zero point's, else ``output_dtype``, else uint8."""
    zp_type = _declared(node, 2) if has_input(node, 2) else None
    return zp_type or _attr_dtype(node, "output_dtype", DType.UINT8)


def _quantize_exec(node: Node) -> ExecType:
    # Rounding to float8/float4 goes through the host (ir/lowbit.py): a LOCAL task.
    return ExecType.LOCAL if _quantized_type(node) in _QUANT_FLOATS else ExecType.SYNC


def _dequantize_exec(node: Node) -> ExecType:
    return ExecType.LOCAL if lowbit.on_host(_declared(node, 0), DType.FLOAT32) \
        else ExecType.SYNC


def _quantize_linear(node: Node, ctx: BindContext) -> Kernel:
    attrs = node.attrs
    axis_attr = int(attrs.get("axis", 1))
    block_size = int(attrs.get("block_size", 0))
    saturate = bool(int(attrs.get("saturate", 1)))
    has_zp = has_input(node, 2)
    zp_type = _declared(node, 2) if has_zp else None
    out_type = _quantized_type(node)
    compute = _attr_dtype(node, "precision", None)
    if out_type not in _QUANT_RANGES and out_type not in _QUANT_FLOATS:
        raise UnsupportedOp(f"{node.label}: QuantizeLinear to "
                            f"{out_type.onnx_name if out_type else '?'} is not supported")
    assert out_type is not None

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale = inputs[0], inputs[1]
        assert x is not None and scale is not None
        zp = inputs[2] if has_zp else None
        axis = normalize_axis(axis_attr, x.dim())
        s = broadcast_param(scale, x.shape, axis, block_size)
        if compute is not None:
            scaled = x.to(compute.torch) / s.to(compute.torch)
        else:
            scaled = x / s
        # A zero point of a type the graph does not declare is an ordinary one: its own.
        target = out_type if zp is None or zp_type is not None else DType.from_torch(zp.dtype)
        if target in _QUANT_FLOATS:
            return [_quantize_float(scaled, zp, target, saturate, axis, block_size)]
        q = torch.round(scaled).to(torch.int32)  # round half to even, like np.rint
        if zp is not None:
            q = q + broadcast_param(zp, x.shape, axis, block_size).to(torch.int32)
        lo, hi = _QUANT_RANGES[target]
        return [q.clamp(lo, hi).to(target.torch)]
    return kernel


def _quantize_float(scaled: Tensor, zp: Tensor | None, out_type: DType, saturate: bool,
                    axis: int, block_size: int) -> Tensor:
    """``x / scale`` rounded to a float8 or float4 type as ONNX's reference does: float8's
    zero point must be zero and is not added; float4's is."""
    source = DType.from_torch(scaled.dtype)
    if zp is not None and out_type is DType.FLOAT4E2M1:
        offset = lowbit.cast(zp, out_type, source)
        scaled = scaled + broadcast_param(offset, scaled.shape, axis, block_size)
    return lowbit.cast(scaled, source, out_type, saturate)


def _dequantize_linear(node: Node, ctx: BindContext) -> Kernel:
    attrs = node.attrs
    axis_attr = int(attrs.get("axis", 1))
    block_size = int(attrs.get("block_size", 0))
    out_type = _attr_dtype(node, "output_dtype", None)
    x_type = _declared(node, 0)
    # A float8 or float4 input's zero point is zero by definition: ONNX's reference reads
    # none (and float8's must be 0).
    has_zp = has_input(node, 2) and x_type not in _QUANT_FLOATS

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale = inputs[0], inputs[1]
        assert x is not None and scale is not None
        zp = inputs[2] if has_zp else None
        axis = normalize_axis(axis_attr, x.dim())
        # float32 arithmetic as the reference does; then the scale's (or requested) type.
        source = DType.from_container(x.dtype, x_type)
        dx = lowbit.cast(x, source, DType.FLOAT32) if source.is_lowbit \
            else x.to(torch.float32)
        if zp is not None:
            dx = dx - broadcast_param(zp, x.shape, axis, block_size).to(torch.float32)
        y = dx * broadcast_param(scale, x.shape, axis, block_size).to(torch.float32)
        return [y.to(out_type.torch if out_type else scale.dtype)]
    return kernel


def dynamic_quantize_u8(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """DynamicQuantizeLinear's ``(y, y_scale, y_zero_point)`` of ``x`` through torch
    (the reference; ``kernels/dynamic_quantize.py`` runs it natively)."""
    xf = x.to(torch.float32)
    zero = xf.new_zeros(())
    lo, hi = torch.aminmax(xf) if xf.numel() else (zero, zero)   # one pass over x
    hi = torch.maximum(zero, hi)
    lo = torch.minimum(zero, lo)
    # An all-zero input gets scale 1 (onnxruntime's choice; the spec leaves it undefined).
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255.0)
    zp = torch.round(torch.clamp(-lo / scale, 0.0, 255.0))
    # x / scale (not times its inverse: ties would round the other way), in place.
    y = torch.div(xf, scale).round_().add_(zp).clamp_(0.0, 255.0)
    return y.to(torch.uint8), scale.to(x.dtype), zp.to(torch.uint8)


def _dynamic_quantize_linear(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        return list(dynamic_quantize_u8(x))
    return kernel


def _requantize(acc: Tensor, multiplier: Tensor, zp: Tensor | None,
                like: torch.dtype) -> Tensor:
    """Scale an exact integer accumulator into the output's quantized type.

    As onnxruntime requantizes: the accumulator as float32 times the float32 multiplier,
    rounded half to even, then the zero point added (a float64 product rounds some ties
    the other way)."""
    out = torch.round(acc.to(torch.float32) * multiplier.to(torch.float32)).to(torch.float64)
    target = like
    if zp is not None:
        out = out + zp.to(torch.float64)
        target = zp.dtype
    lo, hi = _INT_RANGES[target]
    return out.clamp(lo, hi).to(target)


def constant_b(node: Node, b_index: int, zp_index: int) -> PreparedB | None:
    """B of an integer matmul node made ready for the int8 GEMM once, where B and its
    zero point (if any) are constants; None otherwise (each call prepares it)."""
    b_value = node.inputs[b_index] if len(node.inputs) > b_index else None
    b = b_value.const if b_value is not None else None
    zp_value = node.inputs[zp_index] if len(node.inputs) > zp_index else None
    zp = zp_value.const if zp_value is not None else None
    if b is None or (zp_value is not None and zp is None):
        return None
    return PreparedB(b, zp)


def _matmul_integer(node: Node, ctx: BindContext) -> Kernel:
    prepared = constant_b(node, 1, 3)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        a_zp = inputs[2] if len(inputs) > 2 else None
        b_zp = inputs[3] if len(inputs) > 3 else None
        return [integer_matmul(a, b, a_zp, b_zp, prepared)]
    return kernel


def _qlinear_matmul(node: Node, ctx: BindContext) -> Kernel:
    prepared = constant_b(node, 3, 5)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = list(inputs) + [None] * (
            8 - len(inputs))
        assert a is not None and b is not None
        assert a_scale is not None and b_scale is not None and y_scale is not None
        acc = integer_matmul(a, b, a_zp, b_zp, prepared)
        # The multiplier is formed in the scales' own type, as the reference does.
        multiplier = a_scale * b_scale / y_scale
        return [_requantize(acc, multiplier, y_zp, a.dtype)]
    return kernel


class _ConvGeometry:
    """Conv attributes (pads, strides, dilations, group) resolved per input shape."""

    def __init__(self, node: Node) -> None:
        attrs = node.attrs
        self.auto_pad = attrs.get("auto_pad", "NOTSET")
        self.pads = attrs.get("pads")
        self.strides = attrs.get("strides")
        self.dilations = attrs.get("dilations")
        self.kernel_shape = attrs.get("kernel_shape")
        self.group = int(attrs.get("group", 1))

    def run(self, x: Tensor, w: Tensor) -> Tensor:
        """Zero-padded convolution of float64 ``x`` by ``w``."""
        n = w.dim() - 2
        kernel = list(self.kernel_shape or w.shape[2:])
        strides = list(self.strides or [1] * n)
        dilations = list(self.dilations or [1] * n)
        pads = resolve_pads(self.auto_pad, self.pads, list(x.shape[2:]), kernel, strides,
                            dilations)
        x = F.pad(x, torch_pad(pads))
        return _CONV[n](x, w, None, strides, 0, dilations, self.group)


def _per_channel(zp: Tensor | None, rank: int) -> Tensor | None:
    """A weight zero point given per output channel ([M]) shaped to broadcast over W."""
    if zp is None or zp.dim() == 0 or zp.numel() == 1:
        return None if zp is None else zp.reshape(())
    return zp.reshape([-1] + [1] * (rank - 1))


def _conv_integer(node: Node, ctx: BindContext) -> Kernel:
    geometry = _ConvGeometry(node)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        x_zp = inputs[2] if len(inputs) > 2 else None
        w_zp = inputs[3] if len(inputs) > 3 else None
        # Subtract zero points before padding: padded positions contribute nothing.
        xc = centered(x, x_zp)
        wc = centered(w, _per_channel(w_zp, w.dim()))
        return [geometry.run(xc, wc).to(torch.int32)]
    return kernel


def _qlinear_conv(node: Node, ctx: BindContext) -> Kernel:
    geometry = _ConvGeometry(node)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = inputs[:8]
        bias = inputs[8] if len(inputs) > 8 else None
        assert x is not None and w is not None
        assert x_scale is not None and w_scale is not None and y_scale is not None
        acc = geometry.run(centered(x, x_zp), centered(w, _per_channel(w_zp, w.dim())))
        if bias is not None:
            acc = acc + bias.to(torch.float64).reshape([-1] + [1] * (acc.dim() - 2))
        ws = w_scale.reshape([-1] + [1] * (acc.dim() - 2)) if w_scale.numel() > 1 else w_scale
        multiplier = x_scale * ws / y_scale
        return [_requantize(acc, multiplier, y_zp, x.dtype)]
    return kernel


OPS: list[OpDef] = [
    OpDef("QuantizeLinear", _quantize_linear, since=10, classify=_quantize_exec),
    OpDef("DequantizeLinear", _dequantize_linear, since=10, classify=_dequantize_exec),
    OpDef("DynamicQuantizeLinear", _dynamic_quantize_linear, since=11),
    OpDef("MatMulInteger", _matmul_integer, since=10),
    OpDef("QLinearMatMul", _qlinear_matmul, since=10),
    OpDef("ConvInteger", _conv_integer, since=10),
    OpDef("QLinearConv", _qlinear_conv, since=10),
]
