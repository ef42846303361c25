"""An NCHW input copied into a direct convolution's channels-last staging storage.

libdnnl has only reference kernels for an NCHW source with a channels-last
destination, so a direct convolution whose input arrives NCHW (a model's image feed,
read by the stem convolution) first copies it into channels-last storage
(``DirectConv._staged``, into the run's staging block). :class:`ChannelsLastStaging`
does that copy in native code (``kernels/native/staging.c``), the pixels split over the
OpenMP threads libdnnl uses: faster than torch's ``copy_`` for an image of a few
hundred pixels a side (docs/performance.md). Anything else (not float32, not a
contiguous 4-D NCHW tensor into a channels-last one of its size) goes through
``copy_``. It is an exact copy either way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import openmp_entry_points
from segflow.kernels.report import NativeOrTorch, ReportFamily, describe_native_calls

Tensor = torch.Tensor


class _Args(ctypes.Structure):
    """``segflow_staging_t`` of ``kernels/native/staging.c``."""

    _fields_ = [("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("c", ctypes.c_int64), ("hw", ctypes.c_int64), ("parallel", ctypes.c_void_p),
                ("thread_num", ctypes.c_void_p), ("num_threads", ctypes.c_void_p)]


class ChannelsLastStaging(NativeOrTorch):
    """``stage(x, out) -> out``: ``out.copy_(x)``, natively where ``x`` is a contiguous
    float32 NCHW tensor and ``out`` a channels-last one of its size. ``native_calls``,
    ``torch_calls`` and ``why_torch`` say how copies ran (``explain()``)."""

    family = ReportFamily.STAGING

    def __init__(self, library: NativeLibrary) -> None:
        super().__init__(library, "")
        fn = library.dll.segflow_to_channels_last
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p]
        self._fn = fn
        self._omp = openmp_entry_points() or (None, None, None)

    def __call__(self, x: Tensor, out: Tensor) -> Tensor:
        if (x.dtype is not torch.float32 or out.dtype is not torch.float32 or x.dim() != 4
                or not x.is_cpu or not out.is_cpu or x.shape != out.shape
                or not x.is_contiguous()
                or not out.is_contiguous(memory_format=torch.channels_last)):
            self.count_torch_call("not a contiguous float32 NCHW input into channels-last "
                                  "storage of its size")
            return out.copy_(x)
        n, c, h, w = x.shape
        args = _Args(x.data_ptr(), out.data_ptr(), n, c, h * w, *self._omp)
        self._fn(ctypes.byref(args))
        self.count_native_call()
        return out

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, ChannelsLastStaging]], limit: int = 8
                     ) -> list[str]:
        """``explain()`` lines for the convolutions that stage an NCHW input natively: how
        many, how their copies ran and why any went through torch."""
        return describe_native_calls(cls.family.value, ops, "", limit)
