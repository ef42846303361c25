"""Large linears over segflow's own packed weight (``kernels/native/gemm.c``).

The kernel selection (``passes/select_kernels.py``) gives a large ``FusedGemm`` the
``NATIVE_LINEAR`` choice where :meth:`CpuTarget.native_linear_preferred` holds, and
the packing (``passes/pack_weights.py``) packs its weight ``W`` (``[N, K]``) into
panels of 24 output columns (:func:`pack`); its kernel is then a
:class:`NativeLinear`, which runs ``act(x @ W^T + b)`` in one native call split over
the OpenMP threads libdnnl and torch share. ReLU, LeakyReLU (slope 0 to 1), Clip and
erf-GELU are applied as the last block of each output is stored (GELU through the
kernel's own erf, within 1.2e-6 of the exact function); other activations run in place
after the call.

Why its own kernel: with AVX2 the packed-panel kernel ran 128-row linears of 768
and 3072 features faster than libdnnl 3.2's inner product over cache-cold weights,
and a one-row GEMV (1280 or 2048 inputs -> 1000) faster than torch's. An AVX-512
build's block is twice as wide (8 rows x 48 columns, panels of 48) and ran the same
128-row shapes faster than torch's (:func:`panel_width` says which block a build
has). The figures are in docs/performance.md.

Large linears (768 inputs, an even count, and 768 outputs or more; 32 rows or
more) can run as one level of Strassen over the same packing
(``kernels/native/strassen.c``): 7 half-size products for 8, ~0.93 of the classic
kernel's time at 128 rows of 768 and 3072 features. Its rounding errors are bounded by whole blocks
rather than by each output's own terms, so the layout pass allows it only for a
weight whose paired output columns (``j`` and ``j + n2``, ``n2`` about half) are
alike in scale (:func:`strassen_spread`, marking the node ``strassen_wmax``), and
each call checks that x's paired rows are alike, and finite, before it runs so;
otherwise that call runs the classic kernel. The few rows and outputs past the
halves' whole blocks are summed classically. By default only with the AVX2 build's
panels (:func:`strassen_preferred`); ``SEGFLOW_STRASSEN=0``
(``optimize={"layout.strassen": False}``) turns it off, ``=1`` on everywhere.

Input the kernel does not take (not float32, not on the CPU) runs ``F.linear``
over the weight unpacked once and kept. The packing is the only copy of the weight
a session holds until then.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F

from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import openmp_entry_points
from segflow.kernels.replay import Prepared
from segflow.kernels.report import NativeOrTorch, OpKernel, ReportFamily, describe_native_calls
from segflow.shape_cache import ShapeCache

Tensor = torch.Tensor


class _Args(ctypes.Structure):
    """``segflow_linear_t`` of ``kernels/native/gemm.c``."""

    _fields_ = [("x", ctypes.c_void_p), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("m", ctypes.c_int64), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("lda", ctypes.c_int64), ("act", ctypes.c_int64),
                ("slope", ctypes.c_float), ("lo", ctypes.c_float), ("hi", ctypes.c_float),
                ("pad_", ctypes.c_int32), ("parallel", ctypes.c_void_p),
                ("thread_num", ctypes.c_void_p), ("num_threads", ctypes.c_void_p),
                ("next", ctypes.c_int64), ("scratch", ctypes.c_void_p),
                ("scratch_threads", ctypes.c_int64), ("wmax", ctypes.c_double),
                ("arrived", ctypes.c_int64), ("spare", ctypes.c_int64),
                ("refused", ctypes.c_int32),
                ("strassen", ctypes.c_int32)]


def native_linear_preferred(library: NativeLibrary | None) -> bool:
    """Whether large linears should run through :class:`NativeLinear`: the native
    library loads and was built with AVX2 and FMA (its AVX2 4 x 24 or AVX-512 8 x 48
    register block; measured faster than libdnnl with either, see the module
    docstring)."""
    return library is not None and bool(library.dll.segflow_linear_vector_fma())


def strassen_preferred(library: NativeLibrary) -> bool:
    """Whether calls should run as Strassen where they may: where the library's panels
    are the AVX2 build's (24 columns). In an AVX-512 build the classic kernel reads its
    panel blocks from L1, and Strassen's sums cost what its products save (0.93-1.09
    of the classic kernel's time at 128 rows of 768 and 3072 features)."""
    return panel_width(library) == 24


def panel_width(library: NativeLibrary) -> int:
    """Output columns per panel of the packing: 48 where the library was built for
    AVX-512, else 24 (``kernels/native/panel.h``)."""
    fn = library.dll.segflow_linear_panel_width
    fn.restype = ctypes.c_int64
    fn.argtypes = []
    return int(fn())


def packed_size(library: NativeLibrary, out_features: int, in_features: int) -> int:
    """Floats in the packing of an ``[out_features, in_features]`` weight."""
    fn = library.dll.segflow_linear_packed_size
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64]
    return int(fn(out_features, in_features))


def pack(library: NativeLibrary, dense: Tensor, top: Tensor | None = None) -> Tensor:
    """``dense`` (``[N, K]`` float32) as :class:`NativeLinear` reads it: 1-D float32,
    ``ceil(N / P)`` panels of ``[K, P]`` (``P``: :func:`panel_width`), the last one
    padded with zeros. With ``top`` (``N`` float32 values), each output's largest
    ``|W|`` is written there as well (NaN where it has one), for :func:`strassen_spread`."""
    if dense.dtype != torch.float32 or dense.dim() != 2 or dense.device.type != "cpu":
        raise ValueError(f"pack: need a 2-D float32 CPU weight, got {dense.dtype} "
                         f"{list(dense.shape)} on {dense.device.type}")
    n, k = (int(d) for d in dense.shape)
    if top is not None and (top.dtype != torch.float32 or top.numel() != n
                            or not top.is_contiguous()):
        raise ValueError(f"pack: top must hold {n} contiguous float32 values")
    out = torch.empty(packed_size(library, n, k), dtype=torch.float32)
    if dense.stride(-1) != 1 and dense.stride(0) == 1 and dense.stride(1) >= n:
        # The transpose of a row-major [K, N] (a MatMul's weight, kept as a view by the
        # fuse pass): panel rows are copied from it, where W's rows would be transposed.
        fn = library.dll.segflow_linear_pack_kn
        stride = dense.stride(1)
    else:
        dense = dense if dense.stride(-1) == 1 else dense.contiguous()
        fn = library.dll.segflow_linear_pack
        stride = dense.stride(0)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p]
    fn(dense.data_ptr(), n, k, stride, out.data_ptr(), None if top is None else top.data_ptr())
    return out


def strassen_spread(library: NativeLibrary, top: Tensor, out_features: int,
                    in_features: int) -> float | None:
    """The largest ``|W|`` of the weight whose outputs' largest ``|W|`` :func:`pack`
    wrote into ``top``, where one level of Strassen may run over it; None where it may
    not: the shape does not fit (768 or more inputs, an even count, and 768 or more
    outputs), or some output ``j`` and its partner ``j + n2`` (``n2``: half the outputs,
    rounded down to whole panels) differ in their largest ``|W|`` by more
    than the kernel's bound (16x), or the weight holds a NaN."""
    dll = library.dll
    fits = dll.segflow_linear_strassen_weight_fits
    fits.restype = ctypes.c_int
    fits.argtypes = [ctypes.c_int64, ctypes.c_int64]
    if not fits(out_features, in_features):
        return None
    spread = dll.segflow_linear_strassen_spread
    spread.restype = ctypes.c_double
    spread.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_double)]
    bound = dll.segflow_linear_strassen_max_spread
    bound.restype = ctypes.c_double
    wmax = ctypes.c_double(0.0)
    ratio = spread(top.data_ptr(), out_features, ctypes.byref(wmax))
    if not ratio <= bound() or not math.isfinite(wmax.value):    # NaN compares false
        return None
    return wmax.value


def unpack(library: NativeLibrary, packed: Tensor, out_features: int, in_features: int
           ) -> Tensor:
    """The ``[out_features, in_features]`` weight :func:`pack` made ``packed`` from."""
    if packed.numel() != packed_size(library, out_features, in_features):
        raise ValueError(f"unpack: {packed.numel()} floats are not the packing of a "
                         f"[{out_features}, {in_features}] weight")
    dense = torch.empty(out_features, in_features)
    fn = library.dll.segflow_linear_unpack
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn(packed.contiguous().data_ptr(), out_features, in_features, dense.data_ptr())
    return dense


# The kernel's activations (gemm.c's act_t): none, a clamp, or erf-GELU.
ACT_NONE = 0
ACT_CLAMP = 1
ACT_GELU = 2

KernelActivation = tuple[int, float, float, float]
"""``(act, slope, lo, hi)``: the activation ``gemm.c`` applies as it stores each output,
with the clamp's ``min(max(max(v, slope v), lo), hi)`` parameters."""


def kernel_activation(name: str, params: Sequence[float]) -> KernelActivation | None:
    """The activation the kernel fuses for a FusedGemm activation: ReLU, LeakyReLU with
    a slope in [0, 1] and Clip as a clamp, erf-GELU (``Gelu``, not its tanh form) as
    its own; None for any other (run after the kernel)."""
    if name == "Relu":
        return ACT_CLAMP, 0.0, -math.inf, math.inf
    if name == "LeakyRelu" and 0.0 <= params[0] <= 1.0:
        return ACT_CLAMP, float(params[0]), -math.inf, math.inf
    if name == "Clip":
        return ACT_CLAMP, 1.0, float(params[0]), float(params[1])
    if name == "Gelu":
        return ACT_GELU, 1.0, -math.inf, math.inf
    return None


class NativeLinear(NativeOrTorch):
    """``fn(x, w, b) -> act(x @ W^T + b)`` with ``w`` :func:`pack`'s packing of ``W``.

    ``fused`` is the activation the kernel applies (:func:`kernel_activation`),
    ``after`` one run in place on the output otherwise, ``apply`` the activation for
    the fallback path. ``strassen_wmax``: the weight's largest ``|W|`` where calls may
    run as Strassen (:func:`strassen_spread`), else None.
    ``native_calls`` and ``torch_calls`` count how calls ran, ``why_torch`` why any fell
    back (:class:`~segflow.kernels.report.NativeOrTorch`); of the native calls,
    ``strassen_calls`` ran as Strassen and ``strassen_refused`` were fit in shape but
    ran the classic kernel (x's paired rows unlike in scale, or not finite).
    """

    family = ReportFamily.NATIVE_LINEAR

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, NativeLinear]], limit: int = 8
                     ) -> list[str]:
        """``explain()`` lines for a session's native linears: how many, where the
        library came from, how their calls ran and why any fell back."""
        if not ops:
            return []
        lines = describe_native_calls(cls.family.value, ops,
                                      f" ({ops[0][1].library.describe()})", limit)
        allowed = [op for _, op in ops if op.strassen_wmax is not None]
        if allowed:
            ran = sum(op.strassen_calls for op in allowed)
            refused = sum(op.strassen_refused for op in allowed)
            lines.append(f"  strassen (one level: 7 half-size products for 8): {len(allowed)} "
                         f"of {len(ops)} nodes' weights allow it; {ran} calls ran so, "
                         f"{refused} ran the classic kernel (rows m/2 apart unlike in scale, "
                         f"or not finite)")
        return lines

    def counters(self) -> Mapping[str, int]:
        """Calls native and through torch; of the native, those that ran as Strassen and
        those that could have but ran the classic kernel."""
        return {**super().counters(), "strassen_calls": self.strassen_calls,
                "strassen_refused": self.strassen_refused}

    def __init__(self, library: NativeLibrary, in_features: int, out_features: int,
                 fused: KernelActivation | None,
                 after: Callable[[Tensor], Tensor] | None,
                 apply: Callable[[Tensor], Tensor],
                 strassen_wmax: float | None = None) -> None:
        super().__init__(library, "")
        self.in_features = in_features
        self.out_features = out_features
        self.after = after
        self.apply = apply
        self._dense: Tensor | None = None
        self._fn = library.dll.segflow_linear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p]
        self._address = ctypes.cast(self._fn, ctypes.c_void_p).value or 0
        omp = openmp_entry_points() or (None, None, None)
        # _Args' fields after the sizes: the activation, the padding, the OpenMP runtime,
        # the kernel's chunk counter.
        self._tail = (*(fused or (ACT_NONE, 1.0, -math.inf, math.inf)), 0, *omp, 0)
        self.strassen_wmax = strassen_wmax
        self.strassen_calls = 0
        self.strassen_refused = 0
        self._strassen_rows: ShapeCache[int, bool] = ShapeCache()   # row count -> fits Strassen
        if strassen_wmax is not None:
            dll = library.dll
            self._fits = dll.segflow_linear_strassen_fits
            self._fits.restype = ctypes.c_int
            self._fits.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
            self._scratch = dll.segflow_linear_strassen_scratch
            self._scratch.restype = ctypes.c_int64
            self._scratch.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        call = self.prepare(x, w, b)
        if call is None:
            return self._fallback(x, w, b)
        self.run_prepared(call)
        return call.output if self.after is None else self.after(call.output)

    def prepare(self, x: Tensor, w: Tensor, b: Tensor | None = None,
                out: Tensor | None = None) -> Prepared | None:
        """The native call for these tensors, ready to run (None: the fallback's).
        ``out``: storage for the result where it has the result's shape (else a new
        tensor). Its pointer fields are the given tensors' addresses unless ``x`` had to
        be copied first, or an activation runs after the kernel (``fields`` None: not
        replayable, ``kernels/replay.py``)."""
        k = self.in_features
        if x.dtype is not torch.float32 or not x.is_cpu or x.shape[-1] != k or (
                b is not None and (b.dtype is not torch.float32 or not b.is_cpu)):
            return None
        keep: tuple[Tensor, ...] = ()
        in_place = True
        if b is not None and not b.is_contiguous():
            b = b.contiguous()
            keep = (b,)
            in_place = False
        if x.is_contiguous():
            lda = k
        elif x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= k:
            lda = x.stride(0)           # rows of a wider tensor: read in place
        else:
            x = x.contiguous()
            lda = k
            in_place = False
            keep += (x,)        # the copy the structure points at
        shape = x.shape[:-1] + (self.out_features,)
        y = out if out is not None and out.shape == shape else torch.empty(shape)
        m = x.numel() // k if k else 0
        args = _Args(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(),
                     y.data_ptr(), m, self.out_features, k, lda, *self._tail)
        if self.strassen_wmax is not None and self._strassen_fits(m):
            threads = torch.get_num_threads()
            scratch = torch.empty(int(self._scratch(m, k, threads)))
            args.scratch = scratch.data_ptr()
            args.scratch_threads = threads
            args.wmax = self.strassen_wmax
            keep += (scratch,)
        if self.after is not None:
            return Prepared(self._address, args, y, None, keep, self,
                            why_not="applies its activation after the kernel")
        return Prepared(self._address, args, y, ((0, "x"),) if in_place else None, keep, self)

    def run_prepared(self, call: Prepared) -> None:
        """Run a :meth:`prepare`d call and count it."""
        args = cast(_Args, call.args)
        self._fn(ctypes.byref(args))
        if not args.scratch:
            self.count_native_call()
            return
        with self._lock:
            self.native_calls += 1
            if args.strassen:
                self.strassen_calls += 1
            else:
                self.strassen_refused += 1

    def _strassen_fits(self, m: int) -> bool:
        return self._strassen_rows.get_or_make(
            m, lambda: bool(self._fits(m, self.out_features, self.in_features)))

    def dense_weight(self, w: Tensor) -> Tensor:
        """``W`` unpacked from ``w`` (kept for later fallbacks)."""
        with self._lock:
            if self._dense is None:
                self._dense = unpack(self.library, w, self.out_features, self.in_features)
            return self._dense

    def _fallback(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"linear expects [..., {self.in_features}], got {list(x.shape)}")
        if x.dtype != torch.float32 or x.device.type != "cpu":
            why = f"input {x.dtype} on {x.device.type}"
        else:   # the input is the kernel's: the bias is what it does not take
            assert b is not None
            why = f"bias {b.dtype} on {b.device.type}"
        self.count_torch_call(why)
        weight = self.dense_weight(w).to(x.device, x.dtype)
        bias = None if b is None else b.to(x.device, x.dtype)
        return self.apply(F.linear(x, weight, bias))


class NativeLinearKernel(OpKernel):
    """A ``native_linear`` FusedGemm's kernel: ``kernel(inputs) -> [op(x, w, b)]``."""

    __slots__ = ()
    op: NativeLinear
