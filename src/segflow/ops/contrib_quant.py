"""Quantized ``com.microsoft`` ops (opset 1): what onnxruntime's QOperator quantization writes.

Reference kernels, correct before fast: each follows the arithmetic onnxruntime's CPU
kernels do, in float32 where they compute in float32 (a fused multiply-add emulated in
float64, which holds the product of an 8-bit integer and a float32 exactly), so that
results agree to the integer, rounding edges included. Rounding is half to even; results
saturate to the output type.

- ``QLinearAdd`` / ``QLinearMul``: ``a`` and ``b`` dequantized, added / multiplied,
  requantized to ``c``'s scale and zero point.
- ``QLinearConcat(y_scale, y_zp, (x, x_scale, x_zp)...)``: each input requantized to the
  output's parameters, then concatenated along ``axis``.
- ``QLinearGlobalAveragePool`` (``channels_last``), ``QLinearAveragePool``: the mean over
  the window requantized.
- ``QLinearSigmoid``, ``QLinearLeakyRelu``: a 256-entry table of the function over every
  input value, as onnxruntime builds it.
- ``QLinearSoftmax``: onnxruntime's table of ``exp`` over the distance to the row's
  maximum, summed in float32, scaled by ``floor(1 / y_scale)``.
- ``QGemm``: integer Gemm plus the int32 ``C``, requantized (or scaled to float where no
  output zero point is given).
- ``DynamicQuantizeMatMul``, ``MatMulIntegerToFloat``: integer matmul scaled to float,
  plus a bias; the first quantizes its float ``A`` to uint8 itself.
- ``QuantizeLinear`` / ``DequantizeLinear``: the ONNX ops' kernels (``ops/quant.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from segflow.errors import UnsupportedOp
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.ops._common import normalize_axis
from segflow.ops._integer_matmul import centered, integer_matmul
from segflow.ops.nn import _avgpool
from segflow.ops.quant import (
    _INT_RANGES,
    _dequantize_linear,
    _quantize_linear,
    _saturate,
    constant_b,
)
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
MS_DOMAIN = "com.microsoft"


def _scalar(t: Tensor | None, what: str) -> np.float32:
    """A per-tensor scale as a float32 scalar, so later arithmetic rounds as float32 does."""
    if t is None:
        raise UnsupportedOp(f"the {what} scale is missing")
    if t.numel() != 1:
        raise UnsupportedOp(f"the {what} scale has {t.numel()} elements; this op takes a "
                            "per-tensor scale")
    return np.float32(t.reshape(()).to(torch.float32).item())


def _zero_point(t: Tensor | None) -> int:
    return 0 if t is None else int(t.reshape(-1)[0].item())


def _f32(t: Tensor) -> Tensor:
    """Round float64 values to float32 (one rounding of an exact float64 result)."""
    return t.to(torch.float32)


def _fma(x: Tensor, multiplier: np.float32, addend: Tensor | np.float32) -> Tensor:
    """float32 ``fma(x, multiplier, addend)`` for integer-valued ``x`` of 16 bits or less:
    the float64 product is exact, so the sum rounds once, as the instruction does."""
    add = addend.to(torch.float64) if isinstance(addend, Tensor) else float(addend)
    return _f32(x.to(torch.float64) * float(multiplier) + add)


def _int_range(dtype: torch.dtype) -> tuple[int, int]:
    if dtype not in (torch.uint8, torch.int8):
        raise UnsupportedOp(f"quantized type {dtype} is not supported (uint8 and int8 are)")
    return _INT_RANGES[dtype]


def _eight_bit(binder: Callable[[Node, BindContext], Kernel]
               ) -> Callable[[Node, BindContext], Kernel]:
    """``binder`` refusing, when the node is bound (at load), a quantized input 0 the
    model types as other than uint8 or int8 (onnxruntime also has some for uint16)."""
    def bind(node: Node, ctx: BindContext) -> Kernel:
        x = node.inputs[0] if node.inputs else None
        dtype = x.spec.dtype if x is not None else None
        if dtype is not None and dtype not in (DType.UINT8, DType.INT8):
            raise UnsupportedOp(f"{node.label}: quantized type {dtype.name.lower()} is not "
                                "supported (uint8 and int8 are)")
        return binder(node, ctx)
    return bind


def _round_saturate(values: Tensor, zero_point: int, dtype: torch.dtype) -> Tensor:
    """``saturate(round_half_even(values) + zero_point)`` to ``dtype``."""
    return _saturate(torch.round(values).to(torch.int32) + zero_point, dtype)


def _quantize(values: Tensor, scale: np.float32, zero_point: int, dtype: torch.dtype) -> Tensor:
    """MLAS's QuantizeLinear: ``values / scale`` in float32, rounded, plus the zero point."""
    return _round_saturate(values.to(torch.float32) / torch.tensor(scale), zero_point, dtype)


def _dequantize(x: Tensor, scale: np.float32, zero_point: int) -> Tensor:
    """``scale * (x - zero_point)`` in float32 (the difference is exact)."""
    return (x.to(torch.int32) - zero_point).to(torch.float32) * torch.tensor(scale)


def _inputs(inputs: Sequence[Tensor | None], count: int) -> list[Tensor | None]:
    return list(inputs) + [None] * (count - len(inputs))


# -- elementwise -----------------------------------------------------------------------
def _scalar_side(a: Sequence[int], b: Sequence[int]) -> str:
    """Which operand onnxruntime's broadcast loop hands its kernel as a scalar: ``"a"``,
    ``"b"`` or ``""`` (both spans). The loop walks the trailing dims that broadcast the
    same way; where one operand is 1 across them, it is a scalar within each span."""
    if int(np.prod(b)) == 1:
        return "b"
    if int(np.prod(a)) == 1:
        return "a"
    rank = max(len(a), len(b))
    pa = [1] * (rank - len(a)) + list(a)
    pb = [1] * (rank - len(b)) + list(b)
    for da, db in zip(reversed(pa), reversed(pb)):
        if da == db:
            if da == 1:
                continue
            return ""
        return "a" if da == 1 else "b"
    return ""


def _qlinear_add(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, a_s, a_zp, b, b_s, b_zp, c_s, c_zp = _inputs(inputs, 8)
        assert a is not None and b is not None
        _int_range(a.dtype)
        sa, sb, sc = _scalar(a_s, "A"), _scalar(b_s, "B"), _scalar(c_s, "C")
        za, zb, zc = _zero_point(a_zp), _zero_point(b_zp), _zero_point(c_zp)
        # onnxruntime's vector kernel: c = a * (sa/sc) + b * (sb/sc) + fixed, as two FMAs.
        ratio_a, ratio_b = sa / sc, sb / sc
        # Its constant part as compiled: zc - fma(ratio_a, za, ratio_b * zb).
        inner = _fma(torch.tensor(za), ratio_a, ratio_b * np.float32(zb)).item()
        fixed = np.float32(zc) - np.float32(inner)
        fold_a_first = _scalar_side(a.shape, b.shape) == "a"

        def combine(ai: Tensor, bi: Tensor) -> Tensor:
            # The kernel folds an operand that is a scalar in its span into the fixed
            # part first (a multiply-add as well), else b before a.
            if fold_a_first:
                y = _fma(bi, ratio_b, _fma(ai, ratio_a, fixed))
            else:
                y = _fma(ai, ratio_a, _fma(bi, ratio_b, fixed))
            return _round_saturate(y, 0, a.dtype)
        return [_pairwise(combine, a, b)]
    return kernel


def _qlinear_mul(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, a_s, a_zp, b, b_s, b_zp, c_s, c_zp = _inputs(inputs, 8)
        assert a is not None and b is not None
        _int_range(a.dtype)
        sa, sb, sc = _scalar(a_s, "A"), _scalar(b_s, "B"), _scalar(c_s, "C")
        ratio = torch.tensor(sa * sb / sc)
        za, zb, zc = _zero_point(a_zp), _zero_point(b_zp), _zero_point(c_zp)

        def combine(ai: Tensor, bi: Tensor) -> Tensor:
            product = (ai - za) * (bi - zb)
            return _round_saturate(product.to(torch.float32) * ratio, zc, a.dtype)
        return [_pairwise(combine, a, b)]
    return kernel


def _pairwise(combine: Callable[[Tensor, Tensor], Tensor], a: Tensor, b: Tensor) -> Tensor:
    """``combine`` (over int32 operands) broadcast over ``a`` and ``b``: through a table
    of its value for every pair of bytes where the result is larger than that table, so
    the float arithmetic runs over 65536 pairs, not every element."""
    shape = torch.broadcast_shapes(a.shape, b.shape)
    if int(np.prod(shape)) < 1 << 16:
        return combine(a.to(torch.int32), b.to(torch.int32)).expand(shape).contiguous()
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(a.dtype)
    values = values.to(a.device).to(torch.int32)
    table = combine(values[:, None], values[None, :]).reshape(-1)
    index = a.contiguous().view(torch.uint8).to(torch.int64) * 256 \
        + b.contiguous().view(torch.uint8).to(torch.int64)
    return table[index]


def _requantize_table(x_scale: np.float32, x_zp: int, y_scale: np.float32, y_zp: int,
                      dtype: torch.dtype, fn: object = None) -> Tensor:
    """onnxruntime's 256-entry table: every value of ``dtype`` dequantized, passed through
    ``fn`` (identity where None), quantized to the output's parameters; indexed by the
    input's byte."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    dequantized = _dequantize(values, x_scale, x_zp)
    out = dequantized if fn is None else fn(dequantized)  # type: ignore[operator]
    return _quantize(out, y_scale, y_zp, dtype)


def _lookup(x: Tensor, table: Tensor) -> Tensor:
    index = x.contiguous().view(torch.uint8).to(torch.int64)
    return table.to(x.device)[index]


def _table_op(fn_of_node):  # type: ignore[no-untyped-def]
    def bind(node: Node, ctx: BindContext) -> Kernel:
        fn = fn_of_node(node)

        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x, x_s, x_zp, y_s, y_zp = _inputs(inputs, 5)
            assert x is not None
            _int_range(x.dtype)
            table = _requantize_table(_scalar(x_s, "X"), _zero_point(x_zp), _scalar(y_s, "Y"),
                                      _zero_point(y_zp), x.dtype, fn)
            return [_lookup(x, table)]
        return kernel
    return bind


def _leaky_relu_fn(node: Node):  # type: ignore[no-untyped-def]
    alpha = torch.tensor(np.float32(node.attrs.get("alpha", 0.01)))
    return lambda v: torch.where(v >= 0, v, alpha * v)


def _sigmoid_fn(node: Node):  # type: ignore[no-untyped-def]
    return torch.sigmoid


def _qlinear_concat(node: Node, ctx: BindContext) -> Kernel:
    axis_attr = int(node.attrs["axis"])   # its inputs are checked at load (validate.py)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        y_scale, y_zp = _scalar(inputs[0], "Y"), _zero_point(inputs[1])
        parts = []
        for i in range(2, len(inputs), 3):
            x, x_s, x_zp = inputs[i], inputs[i + 1], inputs[i + 2]
            assert x is not None
            _int_range(x.dtype)
            scale, zp = _scalar(x_s, "X"), _zero_point(x_zp)
            if scale == y_scale and zp == y_zp:
                parts.append(x)
            else:
                parts.append(_lookup(x, _requantize_table(scale, zp, y_scale, y_zp, x.dtype)))
        return [torch.cat(parts, dim=normalize_axis(axis_attr, parts[0].dim()))]
    return kernel


# -- pooling -----------------------------------------------------------------------------
def _qlinear_global_average_pool(node: Node, ctx: BindContext) -> Kernel:
    channels_last = bool(node.attrs.get("channels_last", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, x_s, x_zp, y_s, y_zp = _inputs(inputs, 5)
        assert x is not None
        _int_range(x.dtype)
        dims = tuple(range(1, x.dim() - 1)) if channels_last else tuple(range(2, x.dim()))
        size = int(np.prod([x.shape[d] for d in dims]))
        # An int32 sum less the zero point's share, times x_scale / (y_scale * size).
        acc = x.to(torch.int64).sum(dim=dims, keepdim=True) - _zero_point(x_zp) * size
        scale = _scalar(x_s, "X") / (_scalar(y_s, "Y") * np.float32(size))
        y = acc.to(torch.float32) * torch.tensor(scale)
        return [_round_saturate(y, _zero_point(y_zp), x.dtype)]
    return kernel


def _qlinear_average_pool(node: Node, ctx: BindContext) -> Kernel:
    channels_last = bool(node.attrs.get("channels_last", 0))
    pool = _avgpool(node, ctx)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, x_s, x_zp, y_s, y_zp = _inputs(inputs, 5)
        assert x is not None
        _int_range(x.dtype)
        xf = _dequantize(x, _scalar(x_s, "X"), _zero_point(x_zp))
        if channels_last:
            xf = xf.movedim(-1, 1)
        mean = pool([xf])[0]
        if channels_last:
            mean = mean.movedim(1, -1)
        # onnxruntime rounds mean / y_scale + y_zero_point (in float32) to the integer.
        y = mean / torch.tensor(_scalar(y_s, "Y")) + float(_zero_point(y_zp))
        return [_round_saturate(y, 0, x.dtype).contiguous()]
    return kernel


# -- softmax -----------------------------------------------------------------------------
_FLOAT_MAX = float(np.finfo(np.float32).max)
# onnxruntime keeps the table's largest entry this many e-folds below float range, so
# that a row's sum stays finite.
_SOFTMAX_RESERVE = 5.0


def _qlinear_softmax(node: Node, ctx: BindContext) -> Kernel:
    opset = int(node.attrs.get("opset", 13))
    axis_attr = int(node.attrs.get("axis", 1 if opset < 13 else -1))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, x_s, _, y_s, y_zp = _inputs(inputs, 5)
        assert x is not None
        _int_range(x.dtype)
        axis = normalize_axis(axis_attr, x.dim())
        if opset < 13:
            shape = x.shape
            rows = x.reshape(int(np.prod(shape[:axis])), -1)
        else:
            moved = x.movedim(axis, -1)
            rows = moved.reshape(-1, moved.shape[-1])
        reduce_len = rows.shape[1]
        x_scale = float(_scalar(x_s, "X"))
        bit_shift = max(0.0, math.log(float(np.float32(_FLOAT_MAX / reduce_len))) -
                        _SOFTMAX_RESERVE) / x_scale
        xi = rows.to(torch.int64)
        distance = (xi - xi.amax(dim=1, keepdim=True)).to(torch.float64)
        exp = _f32(torch.exp((distance + bit_shift) * x_scale))
        total = torch.zeros(rows.shape[0], dtype=torch.float32, device=x.device)
        for j in range(reduce_len):   # onnxruntime's order: a float32 sum left to right
            total = total + exp[:, j]
        y_scale = torch.tensor(np.float32(np.floor(np.float32(1.0) / _scalar(y_s, "Y"))))
        q = torch.round(exp * y_scale / total[:, None]).to(torch.int32) + _zero_point(y_zp)
        out = _saturate(q, x.dtype)
        if opset < 13:
            return [out.reshape(x.shape)]
        moved_shape = list(x.movedim(axis, -1).shape)
        return [out.reshape(moved_shape).movedim(-1, axis).contiguous()]
    return kernel


# -- matrix products ---------------------------------------------------------------------
def _float_scale(t: Tensor) -> Tensor:
    return t.to(torch.float32).reshape(-1)


def _qgemm(node: Node, ctx: BindContext) -> Kernel:
    alpha = np.float32(node.attrs.get("alpha", 1.0))
    trans_a = bool(node.attrs.get("transA", 0))
    trans_b = bool(node.attrs.get("transB", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, a_s, a_zp, b, b_s, b_zp, c, y_s, y_zp = _inputs(inputs, 9)
        assert a is not None and b is not None and b_s is not None
        a_c = centered(a, a_zp)
        b_zp_cols = None if b_zp is None else b_zp.reshape(-1)
        b_c = b.to(torch.float64)
        if b_zp_cols is not None:
            b_c = b_c - (b_zp_cols.to(torch.float64)[:, None] if trans_b and b_zp_cols.numel() > 1
                         else b_zp_cols.to(torch.float64))
        acc = (a_c.T if trans_a else a_c) @ (b_c.T if trans_b else b_c)
        if c is not None:
            acc = acc + c.to(torch.float64)
        # alpha * a_scale * b_scale[n] (/ y_scale), formed in float32 as onnxruntime does.
        scales = (torch.tensor(alpha * _scalar(a_s, "A")) * _float_scale(b_s))
        if y_s is not None:
            scales = scales / torch.tensor(_scalar(y_s, "Y"))
        y = _f32(acc) * scales
        if y_zp is None:
            return [y]
        return [_round_saturate(y, _zero_point(y_zp), y_zp.dtype)]
    return kernel


def _scale_bias(acc: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    # Rounded as the unfused Cast, Mul and Add round (no fused multiply-add), in place.
    y = _f32(acc).mul_(scales)
    return y if bias is None else y.add_(bias.to(torch.float32))


def _matmul_integer_to_float(node: Node, ctx: BindContext) -> Kernel:
    prepared = constant_b(node, 1, 5)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b, a_s, b_s, a_zp, b_zp, bias = _inputs(inputs, 7)
        assert a is not None and b is not None and a_s is not None and b_s is not None
        acc = integer_matmul(a, b, a_zp, b_zp, prepared)
        scales = torch.tensor(_scalar(a_s, "A")) * _float_scale(b_s)
        return [_scale_bias(acc, scales, bias)]
    return kernel


def quantize_uint8_dynamic(x: Tensor) -> tuple[Tensor, np.float32, int]:
    """onnxruntime's dynamic uint8 quantization of a float tensor (its range widened to
    hold 0): the quantized tensor, its scale and its zero point."""
    xf = x.to(torch.float32)
    lo = min(np.float32(0.0), np.float32(xf.min().item())) if xf.numel() else np.float32(0)
    hi = max(np.float32(0.0), np.float32(xf.max().item())) if xf.numel() else np.float32(0)
    scale = np.float32(1.0) if hi == lo else np.float32((hi - lo) / np.float32(255.0))
    zero_point = int(np.rint(np.clip(np.float32(0.0) - lo / scale, 0.0, 255.0)))
    return _quantize(xf, scale, zero_point, torch.uint8), scale, zero_point


def _dynamic_quantize_matmul(node: Node, ctx: BindContext) -> Kernel:
    prepared = constant_b(node, 1, 3)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b, b_s, b_zp, bias = _inputs(inputs, 5)
        assert a is not None and b is not None and b_s is not None
        if a.device.type == "meta":   # shapes only (passes/static_shapes.py): no range
            return [torch.matmul(a, b.to(device=a.device, dtype=torch.float32))]
        qa, a_scale, a_zp = quantize_uint8_dynamic(a)
        acc = integer_matmul(qa, b, torch.tensor(a_zp, dtype=torch.int32), b_zp, prepared)
        scales = torch.tensor(a_scale) * _float_scale(b_s)
        return [_scale_bias(acc, scales, bias)]
    return kernel


OPS: list[OpDef] = [
    OpDef("QLinearAdd", _eight_bit(_qlinear_add), domain=MS_DOMAIN),
    OpDef("QLinearMul", _eight_bit(_qlinear_mul), domain=MS_DOMAIN),
    OpDef("QLinearConcat", _qlinear_concat, domain=MS_DOMAIN),
    OpDef("QLinearGlobalAveragePool", _eight_bit(_qlinear_global_average_pool), domain=MS_DOMAIN),
    OpDef("QLinearAveragePool", _eight_bit(_qlinear_average_pool), domain=MS_DOMAIN),
    OpDef("QLinearSigmoid", _eight_bit(_table_op(_sigmoid_fn)), domain=MS_DOMAIN),
    OpDef("QLinearLeakyRelu", _eight_bit(_table_op(_leaky_relu_fn)), domain=MS_DOMAIN),
    OpDef("QLinearSoftmax", _eight_bit(_qlinear_softmax), domain=MS_DOMAIN),
    OpDef("QGemm", _eight_bit(_qgemm), domain=MS_DOMAIN),
    OpDef("DynamicQuantizeMatMul", _dynamic_quantize_matmul, domain=MS_DOMAIN),
    OpDef("MatMulIntegerToFloat", _matmul_integer_to_float, domain=MS_DOMAIN),
    OpDef("QuantizeLinear", _quantize_linear, domain=MS_DOMAIN),
    OpDef("DequantizeLinear", _dequantize_linear, domain=MS_DOMAIN),
]
