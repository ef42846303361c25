"""Elementwise arithmetic, comparison, logic and activation ops (with broadcasting)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from segflow.ir.graph import Node
from segflow.ops import _unsigned as u
from segflow.ops import gradients
from segflow.ops._common import (
    always,
    binary,
    computed_or_unsafe,
    gelu_erf,
    nonzero_finite,
    unary,
    whole_nonnegative,
    with_attrs,
)
from segflow.ops.registry import BindContext, InlineOp, Kernel, OpDef

Tensor = torch.Tensor


def _div(a: Tensor, b: Tensor) -> Tensor:
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return torch.div(a, b)
    return _int_div(a, b)


def _trunc_div(a: Tensor, b: Tensor) -> Tensor:
    return torch.div(a, b, rounding_mode="trunc")


_int_div = u.via_numpy(np.floor_divide, _trunc_div)
_remainder = u.via_numpy(np.mod, torch.remainder)
_fmod = u.via_numpy(np.fmod, torch.fmod)
_lshift = u.arith(torch.bitwise_left_shift)
_rshift = u.via_numpy(np.right_shift, torch.bitwise_right_shift)


def _mod(node: Node, ctx: BindContext) -> Kernel:
    fmod = int(node.attrs.get("fmod", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        return [_fmod(a, b) if fmod else _remainder(a, b)]
    return kernel


def _pow(a: Tensor, b: Tensor) -> Tensor:
    out = torch.pow(a, b.to(a.dtype) if a.dtype.is_floating_point else b)
    return out.to(a.dtype)


def _variadic(fn):  # type: ignore[no-untyped-def]
    def bind(node: Node, ctx: BindContext) -> Kernel:
        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            acc = inputs[0]
            assert acc is not None
            for t in inputs[1:]:
                assert t is not None
                acc = fn(acc, t)
            return [acc if len(inputs) > 1 else acc.clone()]
        return kernel
    return bind


def _mean(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        acc = inputs[0]
        assert acc is not None
        for t in inputs[1:]:
            assert t is not None
            acc = acc + t
        return [acc / len(inputs)]
    return kernel


def _clip(node: Node, ctx: BindContext) -> Kernel:
    # A bound left out is the type's lowest or highest value (ONNX, and onnxruntime):
    # an infinity comes back as the largest finite float, NaN stays NaN.
    if node.opset < 11:
        lo_attr = node.attrs.get("min")
        hi_attr = node.attrs.get("max")

        def kernel_attr(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x = inputs[0]
            assert x is not None
            lo, hi = _type_range(x)
            return [torch.clamp(x, lo if lo_attr is None else lo_attr,
                                hi if hi_attr is None else hi_attr)]
        return kernel_attr

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        lo = inputs[1] if len(inputs) > 1 else None
        hi = inputs[2] if len(inputs) > 2 else None
        low, high = _type_range(x)
        x = torch.maximum(x, lo.to(x.dtype)) if lo is not None else torch.clamp(x, min=low)
        x = torch.minimum(x, hi.to(x.dtype)) if hi is not None else torch.clamp(x, max=high)
        return [x]
    return kernel


def _type_range(x: Tensor) -> tuple[float | int, float | int]:
    """The lowest and highest value of ``x``'s element type."""
    info = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
    return info.min, info.max


def _hardsigmoid(x: Tensor, alpha: float, beta: float) -> Tensor:
    return torch.clamp(x * alpha + beta, 0.0, 1.0)


def _hardswish(x: Tensor) -> Tensor:
    return x * torch.clamp(x * (1.0 / 6.0) + 0.5, 0.0, 1.0)


def _gelu(x: Tensor, approximate: str) -> Tensor:
    return F.gelu(x, approximate="tanh") if approximate == "tanh" else gelu_erf(x)


def _leaky(x: Tensor, alpha: float) -> Tensor:
    return torch.where(x >= 0, x, x * alpha)


def _elu(x: Tensor, alpha: float) -> Tensor:
    return torch.where(x > 0, x, alpha * torch.expm1(x))


def _celu(x: Tensor, alpha: float) -> Tensor:
    return torch.clamp(x, min=0) + torch.clamp(alpha * torch.expm1(x / alpha), max=0)


def _selu(x: Tensor, alpha: float, gamma: float) -> Tensor:
    return gamma * torch.where(x > 0, x, alpha * torch.expm1(x))


def _thresholded(x: Tensor, alpha: float) -> Tensor:
    return torch.where(x > alpha, x, torch.zeros_like(x))


def _shrink(x: Tensor, bias: float, lambd: float) -> Tensor:
    return torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, torch.zeros_like(x)))


def _prelu(x: Tensor, slope: Tensor) -> Tensor:
    return torch.where(x >= 0, x, x * slope)


def _softplus(x: Tensor) -> Tensor:
    return F.softplus(x)


def _mish(x: Tensor) -> Tensor:
    return x * torch.tanh(F.softplus(x))


def _swish(x: Tensor, alpha: float) -> Tensor:
    return x * torch.sigmoid(alpha * x)


def _swiglu(a: Tensor, b: Tensor, alpha: float) -> Tensor:
    return a * torch.sigmoid(alpha * a) * b


def _bitshift(node: Node, ctx: BindContext) -> Kernel:
    left = node.attrs.get("direction", "LEFT") == "LEFT"

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        return [_lshift(a, b) if left else _rshift(a, b)]
    return kernel


def _isinf(node: Node, ctx: BindContext) -> Kernel:
    pos = int(node.attrs.get("detect_positive", 1))
    neg = int(node.attrs.get("detect_negative", 1))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if pos and neg:
            return [torch.isinf(x)]
        if pos:
            return [torch.isposinf(x)]
        if neg:
            return [torch.isneginf(x)]
        return [torch.zeros_like(x, dtype=torch.bool)]
    return kernel


def _where(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        c, a, b = inputs
        assert c is not None and a is not None and b is not None
        return [torch.where(c, a, b)]
    return kernel


def _round(x: Tensor) -> Tensor:
    return torch.round(x)  # torch rounds half to even, as ONNX requires


def _sign(x: Tensor) -> Tensor:
    return torch.sign(x)


# -- the direct calls codegen emits for the core ops (OpDef.inline) ----------------------
def _inline_unary(fn: Callable[..., Tensor], method_: str, float_only: bool = False
                  ) -> InlineOp:
    # In place as a method call: ``x.relu_()`` parses fewer arguments than ``torch.relu_(x)``
    # (0.65 vs 0.82 us a call, measured), which shows on chains of tiny layers.
    return InlineOp("{f}({in0})", {0: "{in0}." + method_ + "()"}, float_only, {"f": fn})


def _inline_binary(fn: Callable[..., Tensor], method_: Callable[..., Tensor],
                   commutative: bool) -> InlineOp:
    inplace = {0: "{f_}({in0}, {in1})"}
    if commutative:
        inplace[1] = "{f_}({in1}, {in0})"
    return InlineOp("{f}({in0}, {in1})", inplace, True, {"f": fn, "f_": method_})


OPS: list[OpDef] = [
    OpDef("Add", binary(u.arith(torch.add)), grad=gradients.binary,
          inline=_inline_binary(torch.add, Tensor.add_, True)),
    OpDef("Sub", binary(u.arith(torch.sub)), grad=gradients.binary,
          inline=_inline_binary(torch.sub, Tensor.sub_, False)),
    OpDef("Mul", binary(u.arith(torch.mul)), grad=gradients.binary,
          inline=_inline_binary(torch.mul, Tensor.mul_, True)),
    OpDef("Div", binary(_div), grad=gradients.binary,
          creates_nonfinite=computed_or_unsafe(1, nonzero_finite),
          inline=_inline_binary(torch.div, Tensor.div_, False)),
    OpDef("Mod", _mod, grad=gradients.recompute,
          creates_nonfinite=computed_or_unsafe(1, nonzero_finite)),
    OpDef("Pow", binary(_pow), grad=gradients.binary,
          creates_nonfinite=computed_or_unsafe(1, whole_nonnegative)),
    OpDef("Sum", _variadic(u.arith(torch.add)), grad=gradients.variadic_sum),
    OpDef("Max", _variadic(u.ordered(torch.maximum)), grad=gradients.extremum),
    OpDef("Min", _variadic(u.ordered(torch.minimum)), grad=gradients.extremum),
    OpDef("Mean", _mean, grad=gradients.variadic_sum),
    OpDef("Equal", binary(torch.eq)),
    OpDef("Greater", binary(u.ordered(torch.gt))),
    OpDef("GreaterOrEqual", binary(u.ordered(torch.ge))),
    OpDef("Less", binary(u.ordered(torch.lt))),
    OpDef("LessOrEqual", binary(u.ordered(torch.le))),
    OpDef("And", binary(torch.logical_and)),
    OpDef("Or", binary(torch.logical_or)),
    OpDef("Xor", binary(torch.logical_xor)),
    OpDef("Not", unary(torch.logical_not)),
    OpDef("BitwiseAnd", binary(u.arith(torch.bitwise_and))),
    OpDef("BitwiseOr", binary(u.arith(torch.bitwise_or))),
    OpDef("BitwiseXor", binary(u.arith(torch.bitwise_xor))),
    OpDef("BitwiseNot", unary(u.bitwise_not)),
    OpDef("BitShift", _bitshift),
    OpDef("Where", _where, grad=gradients.where),
    OpDef("Neg", unary(torch.neg), grad=gradients.neg,
          inline=_inline_unary(torch.neg, "neg_")),
    OpDef("Abs", unary(torch.abs), grad=gradients.unary),
    OpDef("Sign", unary(_sign), grad=gradients.recompute),
    OpDef("Reciprocal", unary(torch.reciprocal),
          grad=gradients.unary, grad_reads_output=True, creates_nonfinite=always),
    OpDef("Floor", unary(torch.floor), grad=gradients.recompute),
    OpDef("Ceil", unary(torch.ceil), grad=gradients.recompute),
    OpDef("Round", unary(_round), grad=gradients.recompute),
    OpDef("Sqrt", unary(torch.sqrt),
          grad=gradients.unary, grad_reads_output=True, creates_nonfinite=always,
          inline=_inline_unary(torch.sqrt, "sqrt_", float_only=True)),
    OpDef("Exp", unary(torch.exp),
          grad=gradients.unary, grad_reads_output=True, creates_nonfinite=always,
          inline=_inline_unary(torch.exp, "exp_", float_only=True)),
    OpDef("Log", unary(torch.log), grad=gradients.unary, creates_nonfinite=always),
    OpDef("Erf", unary(torch.erf), grad=gradients.unary,
          inline=_inline_unary(torch.erf, "erf_", float_only=True)),
    OpDef("Sin", unary(torch.sin), grad=gradients.unary),
    OpDef("Cos", unary(torch.cos), grad=gradients.unary),
    OpDef("Tan", unary(torch.tan), creates_nonfinite=always, grad=gradients.recompute),
    OpDef("Asin", unary(torch.asin), creates_nonfinite=always, grad=gradients.recompute),
    OpDef("Acos", unary(torch.acos), creates_nonfinite=always, grad=gradients.recompute),
    OpDef("Atan", unary(torch.atan), grad=gradients.recompute),
    OpDef("Sinh", unary(torch.sinh), creates_nonfinite=always, grad=gradients.recompute),
    OpDef("Cosh", unary(torch.cosh), creates_nonfinite=always, grad=gradients.recompute),
    OpDef("Asinh", unary(torch.asinh), grad=gradients.recompute),
    OpDef("Acosh", unary(torch.acosh), creates_nonfinite=always, grad=gradients.recompute),
    OpDef("Atanh", unary(torch.atanh), creates_nonfinite=always, grad=gradients.recompute),
    OpDef("IsNaN", unary(torch.isnan)),
    OpDef("IsInf", _isinf),
    OpDef("Relu", unary(torch.relu), grad=gradients.unary, grad_reads_output=True,
          inline=_inline_unary(torch.relu, "relu_")),
    OpDef("Sigmoid", unary(torch.sigmoid), grad=gradients.unary, grad_reads_output=True,
          inline=_inline_unary(torch.sigmoid, "sigmoid_")),
    OpDef("Tanh", unary(torch.tanh), grad=gradients.unary, grad_reads_output=True,
          inline=_inline_unary(torch.tanh, "tanh_")),
    OpDef("Softplus", unary(_softplus), grad=gradients.unary),
    OpDef("Softsign", unary(F.softsign), grad=gradients.recompute),
    OpDef("Mish", unary(_mish), grad=gradients.recompute),
    OpDef("Swish", with_attrs(_swish, alpha=1.0), since=24, grad=gradients.recompute),
    OpDef("SwiGLU", with_attrs(_swiglu, alpha=1.0), since=28, grad=gradients.recompute),
    OpDef("HardSwish", unary(_hardswish), grad=gradients.recompute),
    OpDef("Clip", _clip, grad=gradients.unary),
    OpDef("HardSigmoid", with_attrs(_hardsigmoid, alpha=0.2, beta=0.5), grad=gradients.recompute),
    OpDef("LeakyRelu", with_attrs(_leaky, alpha=0.01), grad=gradients.unary),
    OpDef("Elu", with_attrs(_elu, alpha=1.0), grad=gradients.recompute),
    OpDef("Celu", with_attrs(_celu, alpha=1.0), grad=gradients.recompute),
    OpDef("Selu", with_attrs(_selu, alpha=1.6732632423543772, gamma=1.0507009873554805),
          grad=gradients.recompute),
    OpDef("ThresholdedRelu", with_attrs(_thresholded, alpha=1.0), grad=gradients.recompute),
    OpDef("Shrink", with_attrs(_shrink, bias=0.0, lambd=0.5), grad=gradients.recompute),
    OpDef("Gelu", with_attrs(_gelu, approximate="none"), grad=gradients.unary),
    OpDef("PRelu", binary(_prelu), grad=gradients.recompute),
]
