"""DynamicQuantizeLinear on the CPU in two passes of native code.

onnxruntime's dynamic quantizer writes one DynamicQuantizeLinear before each group of
linears of a model (a transformer layer has four). Through torch it is eight kernel
calls, each a pass over the tensor or a dispatch on a scalar; the native kernel
(``kernels/native/quantize.c``) takes the range in one pass and quantizes in the second,
with the reference's float32 arithmetic, so its bytes, scale and zero point are the
reference's (``ops/quant.dynamic_quantize_u8``). An input it does not take (not
float32, not on the CPU, no native library) or one holding a NaN runs the reference,
counted, as ``explain()`` says.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from segflow.ir.graph import Node
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.report import NativeOrTorch, OpKernel, ReportFamily, describe_native_calls
from segflow.ops.quant import dynamic_quantize_u8
from segflow.ops.registry import BindContext

Tensor = torch.Tensor


class DynamicQuantize(NativeOrTorch):
    """``fn(x) -> (y uint8, scale, zero point)``: DynamicQuantizeLinear of ``x``."""

    family = ReportFamily.DYNAMIC_QUANTIZE

    def __init__(self, library: NativeLibrary | None, why_native: str) -> None:
        super().__init__(library, why_native)
        self._fn = None
        if library is not None:
            fn = library.dll.segflow_dynamic_quantize_u8
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p]
            self._fn = fn

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        fn = self._fn
        if fn is None or x.dtype is not torch.float32 or not x.is_cpu:
            self.count_torch_call("native kernels " + self.why_native if fn is None
                                  else "not float32 on the CPU")
            return dynamic_quantize_u8(x)
        x = x.contiguous()
        y = torch.empty(x.shape, dtype=torch.uint8)
        scale = torch.empty((), dtype=torch.float32)
        zero_point = torch.empty((), dtype=torch.uint8)
        if fn(x.data_ptr(), x.numel(), y.data_ptr(), scale.data_ptr(), zero_point.data_ptr()):
            self.count_torch_call("a NaN in the input")
            return dynamic_quantize_u8(x)
        self.count_native_call()
        return y, scale, zero_point

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, DynamicQuantize]], limit: int = 8
                     ) -> list[str]:
        """``explain()`` lines: the nodes, how their calls ran, why any went through torch."""
        return describe_native_calls(cls.family.value, ops, "", limit)


def bind_dynamic_quantize(node: Node, ctx: BindContext) -> OpKernel:
    """A DynamicQuantizeLinear node's kernel (through torch per call where it declines)."""
    library, why = ctx.target.native_for(ctx.device)
    return OpKernel(DynamicQuantize(library, why))
