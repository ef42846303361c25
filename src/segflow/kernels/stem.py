"""A stem convolution read from the NCHW image in place, by segflow's own kernel.

A model's image feed arrives NCHW, and libdnnl has only reference kernels for an
NCHW source with a channels-last destination: the direct stem convolution first
copied the image into channels-last storage (``kernels/staging.py``), then ran
libdnnl's kernel, whose vectors mostly idle over three input channels.
``kernels/native/stem.c`` instead reads the image where it is and writes the
channels-last output: per output row, each tap's output-channel weights times a
broadcast input value, for a block of pixels at a time (the module docstring there).

With AVX-512 the kernel takes less time than the staging copy and libdnnl's
convolution together, for a 3x3 stride-2 stem to 32 channels and a 7x7 one to 64
(figures in docs/performance.md).

:class:`NativeStem` builds a :class:`~segflow.kernels.onednn.conv.DirectConv`'s call
whose primitive is the kernel's plan and whose ``run`` is the kernel
(``segflow_stem_execute``, dnnl_primitive_execute's signature), as
``kernels/winograd.py`` does: a replayed run (``kernels/onednn/replay.py``) runs the stem in
its C loop like any other kernel, with the feed's address written in at each call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.geometry import ConvGeometry
from segflow.kernels.onednn.library import ARG_DST, ARG_SRC, ExecArg, openmp_entry_points
from segflow.kernels.onednn.op import Call
from segflow.kernels.report import declined
from segflow.kernels.winograd import clamp_activation

if TYPE_CHECKING:
    from segflow.kernels.onednn.conv import DirectConv

Tensor = torch.Tensor

# Input channels the kernel takes: an image's (grey, RGB, RGBA). Its inner loop runs
# over the taps, one broadcast per input value; many channels are a job for libdnnl.
MAX_IN_CHANNELS = 4
# The largest output a call writes through the kernel; a larger one (a large batch) is
# staged for libdnnl, whose kernel was faster for a 25.7 MB output and slower up to
# 12.8 MB (the figures are in docs/performance.md).
MAX_OUTPUT_BYTES = 16 << 20


class _Plan(ctypes.Structure):
    """``segflow_stem_t`` of ``kernels/native/stem.c``."""

    _fields_ = [("n", ctypes.c_int64), ("c", ctypes.c_int64), ("h", ctypes.c_int64),
                ("w", ctypes.c_int64), ("k", ctypes.c_int64), ("oh", ctypes.c_int64),
                ("ow", ctypes.c_int64), ("kh", ctypes.c_int64), ("kw", ctypes.c_int64),
                ("sh", ctypes.c_int64), ("sw", ctypes.c_int64), ("pt", ctypes.c_int64),
                ("pl", ctypes.c_int64), ("act", ctypes.c_int64), ("slope", ctypes.c_float),
                ("lo", ctypes.c_float), ("hi", ctypes.c_float), ("pad_", ctypes.c_int32),
                ("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("handles", ctypes.c_void_p), ("parallel", ctypes.c_void_p),
                ("thread_num", ctypes.c_void_p), ("num_threads", ctypes.c_void_p)]


def vector_width(native: NativeLibrary) -> int:
    """Floats per vector of the kernel's build: output channels must be a multiple."""
    fn = native.dll.segflow_stem_vector_width
    fn.restype = ctypes.c_int
    return int(fn())


def unfit(spec: ConvGeometry, in_channels: int, width: int,
          eltwise: tuple[int, float, float] | None) -> str | None:
    """Why a convolution is not one the kernel runs (None: it is), given the build's
    vector ``width``. Padding may be asymmetric: the kernel takes the top and left pads
    and the output size, and checks each tap against both edges of the image."""
    if len(spec.weight_dims) != 4 or len(spec.kernel) != 2:
        return "not an ungrouped 2-D convolution"
    if in_channels > MAX_IN_CHANNELS:
        return f"more than {MAX_IN_CHANNELS} input channels"
    if spec.dilations != (1, 1):
        return "dilated"
    if spec.out_channels % width:
        return f"output channels not a multiple of {width}"
    if any(p < 0 for p in spec.pads_begin + spec.pads_end):
        return "negative padding"
    if eltwise is not None and clamp_activation(eltwise) is None:
        return "an activation other than ReLU, LeakyReLU (slope 0 to 1) or Clip"
    return None


class NativeStem:
    """Builds a :class:`~segflow.kernels.onednn.conv.DirectConv`'s call for an NCHW input
    as ``kernels/native/stem.c``'s kernel (module docstring)."""

    def __init__(self, native: NativeLibrary) -> None:
        run = native.dll.segflow_stem_execute
        run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        run.restype = ctypes.c_int
        self.run = run
        self.width = vector_width(native)

    @staticmethod
    def layouts_built(op: DirectConv) -> int:
        """How many of ``op``'s input layouts run through the stem kernel."""
        return sum(1 for call in op.calls.values()
                   if call is not None and call.impl.startswith("native stem"))

    @classmethod
    def describe_convs(cls, marked: Sequence[tuple[str, DirectConv]], limit: int) -> list[str]:
        """``explain()`` lines for the convolutions marked to run the stem kernel: the
        input layouts it runs, and those it declined (staged for libdnnl), with why."""
        layouts = sum(cls.layouts_built(op) for _, op in marked)
        return [f"  native stem (NCHW image read in place): {len(marked)} convolution"
                f"{'s' if len(marked) != 1 else ''}, {layouts} input "
                f"layout{'s' if layouts != 1 else ''} built",
                *declined("the native stem", [(label, op.stem_not) for label, op in marked],
                          limit)]

    @staticmethod
    def takes(x: Tensor, z: Tensor | None) -> bool:
        """Whether a call with this input is the kernel's to try: a float32 4-D NCHW
        (contiguous, not also channels-last) input and no residual."""
        return (z is None and x.dim() == 4 and x.dtype is torch.float32 and x.is_contiguous()
                and not x.is_contiguous(memory_format=torch.channels_last))

    def make_call(self, op: DirectConv, x: Tensor, w: Tensor, b: Tensor | None
                  ) -> tuple[Call | None, str]:
        """``op``'s call for ``x`` (see :meth:`takes`) as the native kernel, or None and
        why not (the caller then stages the input for libdnnl, as before)."""
        spec, lib = op.spec, op.lib
        n, c, h, width = (int(d) for d in x.shape)
        why = unfit(spec, c, self.width, op.eltwise)
        if why is None and op.after is not None:
            why = "an activation after the kernel"
        if why is not None:
            return None, why
        out_shape = spec.output_size(x.shape)
        k, oh, ow = out_shape[1], out_shape[2], out_shape[3]
        if n * k * oh * ow * 4 > MAX_OUTPUT_BYTES:
            return None, (f"an output of {n * k * oh * ow * 4 / 2**20:.1f} MiB, over the "
                          f"{MAX_OUTPUT_BYTES >> 20} MiB where libdnnl's kernel is faster")
        # [kh][kw][c][k]: a tap's output channels side by side, one load per vector.
        weight = op.dense_weight(w).permute(2, 3, 1, 0).contiguous()
        bias = b.detach().float().contiguous() if b is not None else None
        plan = _Plan(n=n, c=c, h=h, w=width, k=k, oh=oh, ow=ow, kh=spec.kernel[0],
                     kw=spec.kernel[1], sh=spec.strides[0], sw=spec.strides[1],
                     pt=spec.pads_begin[0], pl=spec.pads_begin[1])
        if op.eltwise is not None:
            plan.act = 1
            plan.slope, plan.lo, plan.hi = clamp_activation(op.eltwise)  # type: ignore[misc]
        plan.weight = weight.data_ptr()
        plan.bias = bias.data_ptr() if bias is not None else None
        omp = openmp_entry_points()
        if omp is not None:
            plan.parallel, plan.thread_num, plan.num_threads = omp
        # The convolution's own memories: the caller points them at x and y (their
        # handles are what the kernel reads); nothing else of libdnnl's runs.
        example = torch.empty(out_shape, memory_format=torch.channels_last)
        descs = [lib.memory_desc(t) for t in (x, example)]
        owned = op._owned
        owned.extend(("memory_desc", md) for md in descs)
        src, dst = lib.memory(descs[0]), lib.memory(descs[1])
        owned.extend(("memory", m) for m in (src, dst))
        op.stream()
        args = (ExecArg * 2)(ExecArg(ARG_SRC, src), ExecArg(ARG_DST, dst))
        call = Call(ctypes.c_void_p(ctypes.addressof(plan)), src, dst, None, args, None,
                     tuple(out_shape), torch.channels_last, w, b,
                     f"native stem {spec.kernel[0]}x{spec.kernel[1]}",
                     run=self.run, keep=(plan, weight, bias))
        plan.handles = ctypes.addressof(call.handles)
        return call, ""
