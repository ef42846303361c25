"""3x3 convolutions as Winograd F(4x4, 3x3): a native kernel beside libdnnl's.

oneDNN 3.2 has Winograd convolutions only for AVX-512. On an AVX2 CPU a
stride-1 3x3 convolution runs as a direct convolution, 9 multiply-adds per
output and input channel. Winograd's F(4x4, 3x3) needs 36 per 4x4 tile of
outputs, 2.25 per output: 4x fewer. The layout pass marks the convolutions
that qualify (``winograd``; ``SEGFLOW_WINOGRAD=0`` turns it off), and their
:class:`~segflow.kernels.onednn.conv.DirectConv` builds a call through
:class:`Winograd` instead of a oneDNN convolution:

- once, when the session is made, the layout pass transforms the weight
  (``U = G g G^T``, in float64; :func:`transform_weight`) into 36 matrices
  ``[C, K]`` for a batched libdnnl matmul. ``U`` *is* the convolution's weight
  constant from then on: 4x the weight's bytes, and no packed copy beside it.
  A call that cannot run as Winograd (a layout it declines) goes to torch's
  convolution with the plain weight recovered from ``U``
  (:func:`inverse_transform`, made on first use);
- at each call ``kernels/native/winograd.c`` goes through the output's 4x4 tiles a
  chunk at a time (:func:`chunk_tiles`): it transforms their 6x6 input windows
  into the session's shared :class:`~segflow.kernels.workspace.Workspace` (V ``[36,
  chunk, C]``), runs the matmul (M = V x U), and transforms M back into the
  output, adding the bias and a residual and applying ReLU, LeakyReLU or Clip
  on the way. A chunk
  fits the caches, and the workspace stays ~1 MiB at any batch size.

The call has the shape of a oneDNN one: a replayed run executes it from its C
loop like a primitive, with the workspace's lock taken with the ops' locks.

Accuracy: the transforms use the points 0, +-1, +-2, whose matrices are exact in
float32; the result differs from a direct convolution by a few float32 ulps per
input channel (relative error ~1e-5 at 512 channels, the direct one's ~1e-6).

The figures behind it (one convolution + ReLU at batch 1, AVX2) are in
docs/performance.md.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.geometry import ConvGeometry
from segflow.kernels.onednn.library import (
    ARG_DST,
    ARG_SRC,
    ARG_WEIGHTS,
    ExecArg,
    onednn_eltwise,
    openmp_entry_points,
)
from segflow.kernels.onednn.op import Call
from segflow.kernels.report import declined
from segflow.kernels.workspace import Workspace

if TYPE_CHECKING:
    from segflow.kernels.onednn.conv import DirectConv

Tensor = torch.Tensor
TILE = 4            # outputs per tile side: F(4x4, 3x3) reads 6x6 windows
_WINDOW = TILE + 2
_POINTS = _WINDOW * _WINDOW
_LANES = 8          # channels the native transforms handle at once
# oneDNN's eltwise algorithms the output transform applies: ReLU (alpha: LeakyReLU's
# slope) and clip_v2 (Clip, ReLU6) (onednn_direct._ELTWISE).
_RELU_ALGORITHM = onednn_eltwise("relu", (0.0,), "")[0]          # type: ignore[index]
_CLIP_ALGORITHM = onednn_eltwise("hardtanh", (0.0, 6.0), "")[0]  # type: ignore[index]
# A chunk's V and M together: within a 512 KiB L2 and a small share of the L3.
CHUNK_BYTES = 1 << 20
MIN_CHUNK = 32

# G of F(4x4, 3x3) with the points 0, 1, -1, 2, -2 (and infinity), Lavin & Gray 2016.
_G = torch.tensor([[1 / 4, 0, 0],
                   [-1 / 6, -1 / 6, -1 / 6],
                   [-1 / 6, 1 / 6, -1 / 6],
                   [1 / 24, 1 / 12, 1 / 6],
                   [1 / 24, -1 / 12, 1 / 6],
                   [0, 0, 1]], dtype=torch.float64)


def unfit(spec: ConvGeometry, in_channels: int,
          eltwise: tuple[int, float, float] | None) -> str | None:
    """Why a convolution cannot run as Winograd (None: it can)."""
    if spec.kernel != (3, 3) or spec.strides != (1, 1) or spec.dilations != (1, 1):
        return "not a 3x3 stride-1 undilated convolution"
    if len(spec.weight_dims) != 4:
        return "grouped"
    if not spec.symmetric:
        # Its fallback, torch's oneDNN op, takes one pad per dim; 3x3 stride-1 "same"
        # padding is symmetric anyway.
        return "asymmetric padding"
    if spec.out_channels % _LANES or in_channels % _LANES:
        return f"channels not a multiple of {_LANES}"
    if eltwise is not None and clamp_activation(eltwise) is None:
        return "an activation other than ReLU, LeakyReLU (slope 0 to 1) or Clip"
    return None


def clamp_activation(eltwise: tuple[int, float, float]) -> tuple[float, float, float] | None:
    """``(slope, lo, hi)`` of ``min(max(max(v, slope v), lo), hi)``, the activation
    ``winograd.c`` (and ``stem.c``) applies, for a oneDNN eltwise; None where it is not
    one of those."""
    algorithm, alpha, beta = eltwise
    if algorithm == _RELU_ALGORITHM and 0.0 <= alpha <= 1.0:
        return alpha, -math.inf, math.inf
    if algorithm == _CLIP_ALGORITHM:
        return 1.0, alpha, beta
    return None


def transform_weight(dense: Tensor) -> Tensor:
    """``U = G g G^T`` of a ``[K, C, 3, 3]`` weight: 36 matrices ``[C, K]``, a row-major
    float32 ``[36, C, K]`` tensor. It is computed in float64 as one product with
    ``G (x) G`` (``[36, 9]``) over the weight read as ``[9, C, K]``, 16 input
    channels at a time: each block's product is already in the result's layout
    (no transposition after), and its float64 temporaries stay small (2.4 MiB at
    512 output channels): a model's transforms cost a fraction of a second of its
    load."""
    k, c = dense.shape[:2]
    kron = torch.kron(_G, _G)                             # [36, 9]: (i, j) <- (a, b)
    out = torch.empty(_POINTS, c, k)
    columns = dense.reshape(k, c, 9).permute(2, 1, 0)     # [9, C, K], strided
    for first in range(0, c, 16):
        block = columns[:, first:first + 16, :].double().reshape(9, -1)
        out[:, first:first + 16, :] = (kron @ block).view(_POINTS, -1, k)
    return out


def inverse_transform(u: Tensor) -> Tensor:
    """The float32 ``[K, C, 3, 3]`` weight whose :func:`transform_weight` is ``u``
    (``[36, C, K]``): ``g = P U P^T`` with ``P`` the pseudo-inverse of ``G``, in
    float64, as :func:`transform_weight` runs backwards (``(P (x) P) [9, 36]`` over
    ``U``, 16 input channels at a time, into the weight read as ``[9, C, K]``).
    ``U`` was rounded to float32, so ``g`` comes back within a few float32 ulps of
    the original (``G`` has full column rank: the least-squares inverse over all 36
    points is exact up to that rounding). Only a fallback reads it."""
    points, c, k = u.shape
    if points != _POINTS:
        raise ValueError(f"a Winograd weight has {_POINTS} points, not {points}")
    pinv = torch.linalg.pinv(_G)                          # [3, 6]
    back = torch.kron(pinv, pinv)                         # [9, 36]: (a, b) <- (i, j)
    out = torch.empty(k, c, 3, 3)
    columns = out.view(k, c, 9).permute(2, 1, 0)          # [9, C, K], strided
    for first in range(0, c, 16):
        block = u[:, first:first + 16, :].double().reshape(_POINTS, -1)
        columns[:, first:first + 16, :] = (back @ block).view(9, -1, k)
    return out


class _Matmul(ctypes.Structure):
    """``segflow_matmul_t`` in ``kernels/native/winograd.c``."""

    _fields_ = [("primitive", ctypes.c_void_p), ("args", ctypes.c_void_p),
                ("nargs", ctypes.c_int64), ("src", ctypes.c_void_p), ("dst", ctypes.c_void_p)]


class _Plan(ctypes.Structure):
    """``segflow_winograd_t`` in ``kernels/native/winograd.c``."""

    _fields_ = [
        ("n", ctypes.c_int64), ("h", ctypes.c_int64), ("w", ctypes.c_int64),
        ("c", ctypes.c_int64), ("k", ctypes.c_int64), ("oh", ctypes.c_int64),
        ("ow", ctypes.c_int64), ("pt", ctypes.c_int64), ("pl", ctypes.c_int64),
        ("th", ctypes.c_int64), ("tw", ctypes.c_int64), ("act", ctypes.c_int64),
        ("residual", ctypes.c_int64), ("slope", ctypes.c_float), ("lo", ctypes.c_float),
        ("hi", ctypes.c_float), ("pad_", ctypes.c_int32),
        ("bias", ctypes.c_void_p), ("zeros", ctypes.c_void_p), ("workspace", ctypes.c_void_p),
        ("handles", ctypes.c_void_p), ("chunk", ctypes.c_int64), ("stream", ctypes.c_void_p),
        ("matmul", _Matmul * 2),
        ("execute", ctypes.c_void_p), ("set_handle", ctypes.c_void_p),
        ("parallel", ctypes.c_void_p), ("thread_num", ctypes.c_void_p),
        ("num_threads", ctypes.c_void_p)]


def chunk_tiles(tiles: int, c: int, k: int) -> int:
    """Tiles per matmul: V and M of a chunk take at most ``CHUNK_BYTES`` (they then stay
    in the caches between the transforms and the matmul, and the workspace stays small),
    but a chunk has at least ``MIN_CHUNK`` rows (fewer would stream U once per few rows);
    the chunks of a convolution are as even as that allows."""
    rows = max(MIN_CHUNK, CHUNK_BYTES // (_POINTS * 4 * (c + k)))
    if rows >= tiles:
        return tiles
    chunks = -(-tiles // rows)
    return -(-tiles // chunks)


class Winograd:
    """Builds one convolution's Winograd calls (one per input layout) from the native
    library's kernel, the workspace the binding's convolutions share
    (``BindContext.workspace``) and the convolution's weight constant, which the
    layout pass made the transformed ``U`` (:func:`transform_weight`): a call reads the
    session's weight in place and nothing is transformed while binding or running."""

    def __init__(self, native: NativeLibrary, workspace: Workspace, weight: Tensor) -> None:
        if weight.dim() != 3 or weight.shape[0] != _POINTS or weight.dtype != torch.float32 \
                or not weight.is_contiguous():
            raise ValueError(f"a Winograd weight is a row-major float32 [{_POINTS}, C, K] "
                             f"tensor, not {weight.dtype} {list(weight.shape)}")
        self.native = native
        self.workspace = workspace
        run = native.dll.segflow_winograd_execute
        run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        run.restype = ctypes.c_int
        self.run = run
        # [36, C, K], row-major: the matmul reads it as it is (measured as fast as
        # libdnnl's own packing, which would be a second copy).
        self.weight = weight

    @property
    def weight_bytes(self) -> int:
        """Bytes of the transformed weight (the session's constant, not a copy)."""
        return self.weight.numel() * 4

    @staticmethod
    def layouts_built(op: DirectConv) -> int:
        """How many of ``op``'s input layouts run as Winograd."""
        return sum(1 for call in op.calls.values() if call is not None and call.run is not None)

    @classmethod
    def describe_convs(cls, marked: Sequence[tuple[str, DirectConv]], limit: int) -> list[str]:
        """``explain()`` lines for the convolutions marked for Winograd (``(node label,
        op)``): what runs so, what it holds, what declined."""
        layouts = sum(cls.layouts_built(op) for _, op in marked)
        builders = [op.winograd for _, op in marked if op.winograd is not None]
        weights = sum(w.weight_bytes for w in builders)
        spaces = {id(w.workspace): w.workspace.nbytes for w in builders}
        return [f"  winograd F(4x4,3x3): {len(marked)} convolutions, {layouts} input "
                f"layout{'s' if layouts != 1 else ''} built; transformed weights "
                f"{weights / 2**20:.1f} MiB (the weights themselves), workspace "
                f"{sum(spaces.values()) / 2**20:.1f} MiB",
                *declined("winograd", [(label, op.winograd_not) for label, op in marked],
                          limit)]

    def make_call(self, op: DirectConv, x: Tensor, w: Tensor, b: Tensor | None,
                  z: Tensor | None, inplace: bool) -> tuple[Call | None, str]:
        """A call of ``op`` for ``x``'s layout that runs as Winograd, or None and why."""
        spec, lib = op.spec, op.lib
        why = unfit(spec, int(x.shape[1]), op.eltwise)
        if why is None and (x.dim() != 4 or x.dtype != torch.float32):
            why = "not a float32 image"
        if why is None and x.numel() == 0:
            why = "an empty input"          # no tiles to transform; the fallback's empty output
        if why is None and op.after is not None:
            why = "an activation after the kernel"
        if why is None and w is not self.weight:
            why = "a weight other than the transformed constant"
        out_shape = spec.output_size(x.shape)
        if why is None and z is not None and (tuple(z.shape) != out_shape
                                              or z.dtype != torch.float32 or not
                                              z.is_contiguous(memory_format=torch.channels_last)):
            why = "residual not the output's channels-last shape"
        if why is not None:
            return None, why
        in_format = None
        if not x.is_contiguous(memory_format=torch.channels_last):
            in_format = torch.channels_last         # the caller stages x first
            x = x.contiguous(memory_format=torch.channels_last)
        n, c, h, width = (int(d) for d in x.shape)
        k, oh, ow = out_shape[1], out_shape[2], out_shape[3]
        th, tw = -(-oh // TILE), -(-ow // TILE)
        tiles = n * th * tw
        chunk = chunk_tiles(tiles, c, k)
        weights_md = lib.plain_desc([_POINTS, c, k])
        owned = op._owned
        owned.append(("memory_desc", weights_md))
        weight = self.weight
        mm_weights = lib.memory(weights_md, weight.data_ptr())
        owned.append(("memory", mm_weights))
        matmuls = []
        impl = ""
        for rows in dict.fromkeys((chunk, tiles % chunk)):   # whole chunks, the last one
            if not rows:
                continue
            src_md = lib.plain_desc([_POINTS, rows, c])
            dst_md = lib.plain_desc([_POINTS, rows, k])
            owned.extend(("memory_desc", md) for md in (src_md, dst_md))
            prim, queried, impl = lib.matmul(src_md, weights_md, dst_md)
            assert prim is not None
            owned.extend((("primitive", prim), ("memory_desc", queried)))
            if impl.startswith("ref"):
                return None, f"only a reference matmul ({impl})"
            mm_src, mm_dst = lib.memory(src_md), lib.memory(dst_md)
            owned.extend(("memory", m) for m in (mm_src, mm_dst))
            mm_args = (ExecArg * 3)(ExecArg(ARG_SRC, mm_src),
                                     ExecArg(ARG_WEIGHTS, mm_weights),
                                     ExecArg(ARG_DST, mm_dst))
            matmuls.append((prim, mm_args, mm_src, mm_dst))
        stream = op.stream()
        # The convolution's own memories: the caller points them at x, y and z, and the
        # native kernel reads those addresses from the call's handles.
        example = z if z is not None and inplace else torch.empty(
            out_shape, memory_format=torch.channels_last)
        descs = [lib.memory_desc(t) for t in (x, example, z) if t is not None]
        owned.extend(("memory_desc", md) for md in descs)
        conv_src, conv_dst = lib.memory(descs[0]), lib.memory(descs[1])
        residual = lib.memory(descs[2]) if z is not None else None
        owned.extend(("memory", m) for m in (conv_src, conv_dst, residual) if m is not None)
        bias = b.detach().float().contiguous() if b is not None else None
        zeros = torch.zeros(c)
        self.workspace.reserve(_POINTS * chunk * (c + k))
        plan = _Plan(n=n, h=h, w=width, c=c, k=k, oh=oh, ow=ow, pt=spec.pads_begin[0],
                     pl=spec.pads_begin[1], th=th, tw=tw, residual=int(z is not None))
        if op.eltwise is not None:
            plan.act = 1
            plan.slope, plan.lo, plan.hi = clamp_activation(op.eltwise)  # type: ignore[misc]
        plan.bias = bias.data_ptr() if bias is not None else None
        plan.zeros = zeros.data_ptr()
        plan.workspace = ctypes.addressof(self.workspace.slot)
        plan.chunk, plan.stream = chunk, stream.value
        for slot, (prim, mm_args, mm_src, mm_dst) in zip(plan.matmul, matmuls):
            slot.primitive, slot.args, slot.nargs = prim.value, ctypes.addressof(mm_args), 3
            slot.src, slot.dst = mm_src.value, mm_dst.value
        dll = lib._dll
        plan.execute = ctypes.cast(dll.dnnl_primitive_execute, ctypes.c_void_p).value
        plan.set_handle = ctypes.cast(dll.dnnl_memory_set_data_handle, ctypes.c_void_p).value
        omp = openmp_entry_points()
        if omp is not None:
            plan.parallel, plan.thread_num, plan.num_threads = omp
        args = [ExecArg(ARG_SRC, conv_src), ExecArg(ARG_DST, conv_dst)]
        call = Call(ctypes.c_void_p(ctypes.addressof(plan)), conv_src, conv_dst, residual,
                     (ExecArg * len(args))(*args), in_format, tuple(out_shape),
                     torch.channels_last, w, b, f"winograd F(4x4,3x3) + {impl}",
                     run=self.run, lock=self.workspace.lock,
                     keep=(plan, weight, matmuls, bias, zeros))
        plan.handles = ctypes.addressof(call.handles)
        return call, ""
