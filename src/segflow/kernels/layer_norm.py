"""``segflow.AddLayerNorm``: LayerNormalization over the sum of two tensors, one kernel.

``AddLayerNorm(A, B?, Scale, Bias?) -> Y, S?`` is ``LayerNormalization(A + B, Scale,
Bias)`` over the last axis (``epsilon`` attribute; ``simplified`` 1: RMSNormalization,
no centring), what the fuse pass's ``layernorm`` rule makes of a transformer's residual
Add and the normalization after it (onnxruntime's SkipLayerNormalization and
SkipSimplifiedLayerNormalization). ``S``, where the node declares it, is the sum itself:
a pre-LN block's residual that the next Add reads again, written in the same pass. On
CPU, float32 ``A`` and ``B`` of one shape run through native code
(``kernels/native/layer_norm.c``): the sum, the statistics and the normalization in one
pass per row while it sits in L1, the rows split over the OpenMP threads libdnnl uses.
Anything else (broadcasting, other dtypes, another device, no native library) runs the
op's reference (``ops/fused.add_layer_norm``); ``explain()`` counts the calls each way.

Numerics: the native path sums each row in eight float32 lanes and takes the
variance about the mean in a second pass; it differs from torch's by float32
rounding (~1e-6 relative on 768-wide rows). The sum output is ``A + B`` rounded once,
bit for bit torch's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from segflow.ir.graph import Node
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import openmp_entry_points
from segflow.kernels.replay import Prepared
from segflow.kernels.report import NativeOrTorch, OpKernel, ReportFamily, describe_native_calls
from segflow.ops.fused import AddLayerNormSpec, add_layer_norm
from segflow.ops.registry import BindContext

Tensor = torch.Tensor


class _Args(ctypes.Structure):
    """``segflow_layer_norm_t`` of ``kernels/native/layer_norm.c``."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("gamma", ctypes.c_void_p),
                ("beta", ctypes.c_void_p), ("y", ctypes.c_void_p), ("sum", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("width", ctypes.c_int64), ("eps", ctypes.c_float),
                ("rms", ctypes.c_int32),
                ("parallel", ctypes.c_void_p), ("thread_num", ctypes.c_void_p),
                ("num_threads", ctypes.c_void_p), ("next", ctypes.c_int64)]


class AddLayerNorm(NativeOrTorch):
    """``fn(a, b, scale, bias=None) -> layer_norm(a + b)`` over the last axis (``b`` None:
    of ``a``); ``simplified``: RMSNormalization's; ``with_sum``: ``(y, a + b)``.

    ``library`` is the native library (None: always torch); ``why_native`` says why
    there is none. ``native_calls`` / ``torch_calls`` count how calls ran and
    ``why_torch`` why any went through torch.
    """

    family = ReportFamily.ADD_LAYER_NORM

    def __init__(self, epsilon: float, library: NativeLibrary | None, why_native: str,
                 simplified: bool = False, with_sum: bool = False) -> None:
        super().__init__(library, why_native)
        self.epsilon = epsilon
        self.simplified = simplified
        self.with_sum = with_sum
        self._fn = None
        self._address = 0
        if library is not None:
            self._fn = library.dll.segflow_add_layer_norm
            self._fn.restype = ctypes.c_int
            self._fn.argtypes = [ctypes.c_void_p]
            self._address = ctypes.cast(self._fn, ctypes.c_void_p).value or 0
        # _Args' fields after the sizes: epsilon, the form, the OpenMP runtime, the
        # kernel's chunk counter.
        self._tail = (epsilon, int(simplified), *(openmp_entry_points() or (None, None, None)),
                      0)

    def __call__(self, a: Tensor, b: Tensor | None, scale: Tensor, bias: Tensor | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        call = self.prepare(a, b, scale, bias)
        if call is None:
            return self._torch_call(a, b, scale, bias)
        self.run_prepared(call)
        return (call.output, call.more[0][0]) if self.with_sum else call.output

    def prepare(self, a: Tensor, b: Tensor | None, scale: Tensor, bias: Tensor | None = None,
                out: Tensor | Sequence[Tensor | None] | None = None) -> Prepared | None:
        """The native call for these tensors, ready to run (None: torch's). ``out``:
        storage for the result where it has the result's shape (else a new tensor); with
        ``with_sum``, a pair (the result's, the sum's). ``fields`` None (not replayable,
        ``kernels/replay.py``) where an input had to be copied first."""
        f32 = torch.float32
        if self._fn is None or a.dtype is not f32 or not a.is_cpu or a.dim() == 0 \
                or (b is not None and (b.dtype is not f32 or not b.is_cpu
                                       or a.shape != b.shape)) \
                or scale.dtype is not f32 or not scale.is_cpu \
                or (bias is not None and (bias.dtype is not f32 or not bias.is_cpu)):
            return None
        width = a.shape[-1]
        if scale.numel() != width or (bias is not None and bias.numel() != width):
            return None
        given = (a, b, scale, bias)
        a = a.contiguous()
        b = None if b is None else b.contiguous()
        scale = scale.contiguous()
        bias = None if bias is None else bias.contiguous()
        y_out, s_out = (out, None) if out is None or isinstance(out, Tensor) else tuple(out)
        y = y_out if y_out is not None and y_out.shape == a.shape else torch.empty_like(a)
        s = None
        if self.with_sum:
            s = s_out if s_out is not None and s_out.shape == a.shape else torch.empty_like(a)
        args = _Args(a.data_ptr(), None if b is None else b.data_ptr(), scale.data_ptr(),
                     None if bias is None else bias.data_ptr(), y.data_ptr(),
                     None if s is None else s.data_ptr(),
                     a.numel() // width if width else 0, width, *self._tail)
        copies = tuple(t for t, g in zip((a, b, scale, bias), given, strict=True)
                       if t is not g)     # what the structure points at that we made
        fields = ((0, "a"),) if b is None else ((0, "a"), (1, "b"))
        return Prepared(self._address, args, y, None if copies else fields, copies, self,
                        more=() if s is None else ((s, "sum"),))

    def run_prepared(self, call: Prepared) -> None:
        """Run a :meth:`prepare`d call and count it."""
        assert self._fn is not None
        self._fn(ctypes.byref(call.args))
        self.count_native_call()

    def _torch_call(self, a: Tensor, b: Tensor | None, scale: Tensor, bias: Tensor | None
                    ) -> Tensor | tuple[Tensor, Tensor]:
        self.count_torch_call(self._why_torch(a, b, scale, bias))
        return self.through_torch(a, b, scale, bias)

    def through_torch(self, a: Tensor, b: Tensor | None, scale: Tensor,
                      bias: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """The unfused ops, ``F.layer_norm(a + b)`` (or RMSNormalization's): the op's
        reference (``ops/fused.py``)."""
        y, s = add_layer_norm(a, b, scale, bias, self.epsilon, self.simplified)
        return (y, s) if self.with_sum else y

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, AddLayerNorm]], limit: int = 8
                     ) -> list[str]:
        """``explain()`` lines: how many AddLayerNorm nodes (how many in the RMS form, how
        many writing the sum too), how their calls ran and why any went through torch."""
        parts = [f"{n} {what}" for n, what in
                 ((sum(op.simplified for _, op in ops), "RMS"),
                  (sum(op.with_sum for _, op in ops), "writing the sum")) if n]
        return describe_native_calls(cls.family.value, ops,
                                     f" ({', '.join(parts)})" if parts else "", limit)

    def _why_torch(self, a: Tensor, b: Tensor | None, scale: Tensor, bias: Tensor | None
                   ) -> str:
        if self._fn is None:
            return "native kernels " + self.why_native
        tensors = [t for t in (a, b, scale, bias) if t is not None]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            return "not all float32 on the CPU"
        if b is not None and a.shape != b.shape:
            return f"the addends' shapes differ ({list(a.shape)} and {list(b.shape)})"
        if a.dim() == 0:
            return "scalar addends"
        return f"scale or bias not of the last axis' {a.shape[-1]} values"


class AddLayerNormKernel(OpKernel):
    """An AddLayerNorm node's kernel: ``kernel(inputs) -> [op(a, b, scale, bias)]``."""

    __slots__ = ()
    op: AddLayerNorm


def bind_add_layer_norm(node: Node, ctx: BindContext) -> AddLayerNormKernel:
    """The native add + layer norm (through torch per call where it declines, counted)."""
    library, why = ctx.target.native_for(ctx.device)
    spec = AddLayerNormSpec.of(node)
    return AddLayerNormKernel(AddLayerNorm(spec.epsilon, library, why, spec.simplified,
                                           spec.with_sum))
