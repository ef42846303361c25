"""``segflow.Attention``'s kernel: scaled dot-product attention, native on CPU.

The fuse pass's ``attention`` rule writes the node in one of two forms:

- ``Attention(Q, Kt, V, M?)`` (``heads`` 0 or absent): Q ``[..., Sq, D]``, Kt
  ``[..., D, Sk]`` (K transposed, as the graph's MatMul read it), V ``[..., Sk, Dv]``;
  the result ``[..., Sq, Dv]``.
- ``Attention(Xq, Xk, Xv, M?)`` with ``heads`` H: ``[B, S, H * D]`` activations as the
  projections wrote them; the rule has absorbed the Reshape/Transpose pairs that split
  them into heads and the pair that merged the heads back, so the result is
  ``[B, Sq, H * Dv]``.

Either way it is ``softmax(Q K^T * scale + M) V`` per batch and head, with M an
additive float mask broadcast to the scores; with ``nan_to_zero`` 1 a row of
probabilities holding a NaN (all scores -inf, a NaN or +inf score) is zeros instead
(the ``Where(IsNaN(p), 0, p)`` torch exports write after the softmax). On CPU,
float32 inputs with at most one batch dimension before the heads run through
``kernels/native/attention.c``: the heads are read in place through strides (no
copies to split or merge them), K and V are packed into panels and the softmax is
taken on a few rows of scores while they sit in L1. Anything else (other dtypes or
devices, more batch dimensions, batch dims that differ, a mask that would grow the
scores, no native library) runs torch's ``scaled_dot_product_attention``, or the
plain ops where that does not broadcast, counted with the reason for ``explain()``.

Numerics: the native path differs from torch's by float32 rounding (exp is a
polynomial within 1e-7 relative of exp over a softmax's range, as attention.c
says; ~1e-6 relative on heads of 64 over 128 keys).
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
from segflow.ops.fused import attention
from segflow.ops.registry import BindContext

Tensor = torch.Tensor

_Sizes = ctypes.c_int64 * 27      # segflow_attention's sizes (kernels/native/attention.c)


class _CallArgs(ctypes.Structure):
    """``segflow_attention_call_t`` of ``kernels/native/attention.c``, with the result's
    tensor, its ``[B, Sq, H, Dv]`` sizes and what its pointers must outlive."""

    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("mask", ctypes.c_void_p), ("y", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
                ("sizes", ctypes.c_void_p), ("scale", ctypes.c_float), ("flags", ctypes.c_int32),
                ("parallel", ctypes.c_void_p), ("thread_num", ctypes.c_void_p),
                ("num_threads", ctypes.c_void_p)]
    output: torch.Tensor
    shape: tuple[int, int, int, int]
    keep: tuple[object, ...]


_NAN_TO_ZERO = 1    # SEGFLOW_ATTENTION_NAN_TO_ZERO of kernels/native/attention.c

_Geometry = tuple[tuple[int, ...], ...]   # (shape, strides) of Q, K, V as [B, H, S, D]


class ScaledDotAttention(NativeOrTorch):
    """``fn(q, k, v, mask=None)``: a ``segflow.Attention`` node's computation.

    ``heads`` 0: ``k`` is K transposed (``[..., D, Sk]``); ``heads`` H: all three are
    ``[B, S, H * D]`` and so is the result. ``nan_to_zero``: rows of probabilities
    holding a NaN are zeros. ``exact``: calls through torch keep NaN and Inf where the
    unfused ops put them (the unfused ops rather than ``scaled_dot_product_attention``).
    ``library`` is the native library (None: always torch); ``why_native`` says why
    there is none. ``native_calls`` / ``torch_calls`` count how calls ran and
    ``why_torch`` why any went through torch.
    """

    family = ReportFamily.ATTENTION

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, ScaledDotAttention]], limit: int = 8
                     ) -> list[str]:
        """``explain()`` lines: how many Attention nodes, in which form, how their calls
        ran and why any went through torch."""
        split = sum(1 for _, op in ops if op.heads)
        return describe_native_calls(cls.family.value, ops,
                                     f" ({split} reading heads in place)" if split else "",
                                     limit)

    def __init__(self, scale: float, heads: int, library: NativeLibrary | None,
                 why_native: str, nan_to_zero: bool = False, exact: bool = True) -> None:
        super().__init__(library, why_native)
        self.scale = scale
        self.heads = heads
        self.nan_to_zero = nan_to_zero
        self.exact = exact
        self._fn = None
        self._address = 0
        self._scratch_floats = None
        if library is not None:
            self._fn = library.dll.segflow_attention_call
            self._fn.restype = ctypes.c_int
            self._fn.argtypes = [ctypes.c_void_p]
            self._address = ctypes.cast(self._fn, ctypes.c_void_p).value or 0
            self._scratch_floats = library.dll.segflow_attention_scratch
            self._scratch_floats.restype = ctypes.c_int64
            self._scratch_floats.argtypes = [ctypes.c_int64] * 3
        self._openmp = openmp_entry_points() or (None, None, None)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
                 ) -> Tensor:
        if q.stride(-1) != 1:
            q = q.contiguous()   # the kernel broadcasts Q's rows from contiguous memory
        why, geometry = self._geometry(q, k, v, mask)
        if why:
            return self._torch_call(why, q, k, v, mask)
        return self._native(q, k, v, mask, geometry)

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                out: Tensor | None = None) -> Prepared | None:
        """The native call of the heads form (``heads`` > 0) for these tensors, ready to
        run (None: another form, or torch's). ``out``: storage for the result where it
        has the result's shape (else a new tensor). ``fields`` None (not replayable,
        ``kernels/replay.py``) where Q had to be copied or the mask is read through
        a copy."""
        if not self.heads or self._fn is None:
            return None
        given = q
        if q.stride(-1) != 1:
            q = q.contiguous()
        why, geometry = self._geometry(q, k, v, mask)
        if why:
            return None
        call = self._call(q, k, v, mask, geometry, out)
        copied = q is not given or (mask is not None and call.mask != mask.data_ptr())
        fields = None if copied else ((0, "q"), (1, "k"), (2, "v"), (3, "mask"))
        keep = call.keep if q is given else (*call.keep, q)   # with Q's copy
        return Prepared(self._address, call, call.output, fields, keep, self)

    def run_prepared(self, call: Prepared) -> None:
        """Run a :meth:`prepare`d call and count it."""
        self._run(call.args)

    def _run(self, args: _CallArgs) -> None:
        assert self._fn is not None
        if self._fn(ctypes.byref(args)) != 0:
            raise RuntimeError("attention: a thread of the native kernel found no scratch")
        self.count_native_call()

    # -- the native path ----------------------------------------------------------------
    def _geometry(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
                  ) -> tuple[str, _Geometry]:
        """Q, K (untransposed) and V as ``[B, H, S, D]`` shapes and strides, worked out
        from the tensors' own (no views made); or why the native path does not take
        them."""
        if self._fn is None:
            return "native kernels " + self.why_native, ()
        f32 = torch.float32
        if q.dtype is not f32 or k.dtype is not f32 or v.dtype is not f32 \
                or not (q.is_cpu and k.is_cpu and v.is_cpu) \
                or (mask is not None and (mask.dtype is not f32 or not mask.is_cpu)):
            return "not all float32 on the CPU", ()
        h = self.heads
        if h:
            if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
                return f"inputs of rank {q.dim()}, {k.dim()}, {v.dim()}, not 3", ()
            if q.shape[2] % h or k.shape[2] % h or v.shape[2] % h:
                return (f"widths {q.shape[2]}, {k.shape[2]}, {v.shape[2]} not split by "
                        f"{h} heads"), ()
            (qn, qs), (kn, ks), (vn, vs) = (_heads(t, h) for t in (q, k, v))
        else:
            if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
                return f"ranks {q.dim()}, {k.dim()}, {v.dim()} (3 or 4 run native)", ()
            (qn, qs), (kn, ks), (vn, vs) = _four(q), _four(k, transposed=True), _four(v)
        if kn[:3] != vn[:3] or qn[:2] != kn[:2] or qn[3] != kn[3]:
            shapes = ", ".join(str(list(n if q.dim() == 4 or h else n[:1] + n[2:]))
                               for n in (qn, kn, vn))
            return f"shapes {shapes} do not pair up batch for batch", ()
        if 0 in qn[:3] or kn[2] == 0:
            return "empty queries or keys", ()
        if mask is not None:
            scores = (*qn[:3], kn[2]) if h or q.dim() == 4 else (qn[0], qn[2], kn[2])
            if mask.dim() > len(scores) or any(
                    m not in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores))):
                return f"a mask {list(mask.shape)} that does not broadcast to {list(scores)}", ()
        return "", (qn, qs, kn, ks, vn, vs)

    def _native(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                geometry: _Geometry) -> Tensor:
        call = self._call(q, k, v, mask, geometry)
        self._run(call)
        out = call.output
        if self.heads:
            return out
        batch, sq, heads, dv = call.shape
        y = out.view(batch, sq, heads, dv).transpose(1, 2)
        return y if q.dim() == 4 else y.squeeze(1)

    def _call(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
              geometry: _Geometry, out: Tensor | None = None) -> _CallArgs:
        """The kernel's arguments for these tensors, with the result's storage (``out``
        where it is ``[B, Sq, H * Dv]``, else new) and the scratch they point at."""
        qn, qs, kn, ks, vn, vs = geometry
        batch, heads, sq, d = qn
        sk, dv = kn[2], vn[3]
        # The result in [B, Sq, H, Dv] memory: for the heads form that is [B, Sq, H * Dv].
        shape = (batch, sq, heads * dv)
        if out is None or out.shape != shape or not out.is_contiguous():
            out = torch.empty(shape, dtype=torch.float32)
        ys = (sq * heads * dv, dv, heads * dv, 1)
        ms: tuple[int, ...] = (0, 0, 0, 0)
        given = mask
        if mask is not None:
            mask, ms = _mask_strides(mask, (batch, heads, sq, sk), heads_dim=bool(self.heads)
                                     or q.dim() == 4)
        # Each thread's packed K and V and a few rows of scores; at most this many threads.
        threads = torch.get_num_threads() if self._openmp[0] else 1
        scratch = torch.empty(threads * self._scratch_floats(sk, d, dv),  # type: ignore[misc]
                              dtype=torch.float32)
        sizes = _Sizes(batch, heads, sq, sk, d, dv, *qs, *ks, *vs, *ms, *ys, threads)
        call = _CallArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                         None if mask is None else mask.data_ptr(), out.data_ptr(),
                         scratch.data_ptr(), ctypes.addressof(sizes), self.scale,
                         _NAN_TO_ZERO if self.nan_to_zero else 0, *self._openmp)
        call.output = out
        call.shape = (batch, sq, heads, dv)
        # The mask as the kernel reads it, where that is a copy (the caller holds the rest).
        copied = mask is not None and given is not None and mask.data_ptr() != given.data_ptr()
        call.keep = (scratch, sizes, mask) if copied else (scratch, sizes)
        return call

    # -- through torch ------------------------------------------------------------------
    def _torch_call(self, why: str, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
                    ) -> Tensor:
        self.count_torch_call(why)
        return self.through_torch(q, k, v, mask)

    def through_torch(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
                      ) -> Tensor:
        """The node through torch alone: the op's reference (``ops/fused.py``)."""
        return attention(q, k, v, mask, self.scale, self.heads, self.nan_to_zero, self.exact)


def _heads(t: Tensor, h: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``[B, S, H*D]`` read as ``[B, H, S, D]``: shape and strides."""
    b, s, c = t.shape
    sb, ss, sc = t.stride()
    return (b, h, s, c // h), (sb, (c // h) * sc, ss, sc)


def _four(t: Tensor, transposed: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A 4-D (or 3-D: one head) tensor as ``[B, H, S, D]``; ``transposed``: it is
    ``[B, H, D, S]`` (K as the graph's MatMul read it)."""
    shape, strides = tuple(t.shape), tuple(t.stride())
    if t.dim() == 3:
        shape, strides = (shape[0], 1, *shape[1:]), (strides[0], 0, *strides[1:])
    if transposed:
        shape = (*shape[:2], shape[3], shape[2])
        strides = (*strides[:2], strides[3], strides[2])
    return shape, strides


def _mask_strides(mask: Tensor, scores: tuple[int, int, int, int], heads_dim: bool
                  ) -> tuple[Tensor, tuple[int, ...]]:
    """The mask and its strides as ``[B, H, Sq, Sk]`` (0 where it broadcasts). Its last
    dimension must be read contiguously; a mask broadcast along the keys, or strided
    there, is expanded into a contiguous copy first. ``heads_dim``: the mask
    broadcasts to 4-D scores (else to ``[B, Sq, Sk]``, one head)."""
    rank = 4 if heads_dim else 3
    shape = (1,) * (rank - mask.dim()) + tuple(mask.shape)
    strides = (0,) * (rank - mask.dim()) + tuple(mask.stride())
    if not heads_dim:
        shape, strides = (shape[0], 1, *shape[1:]), (strides[0], 0, *strides[1:])
    if scores[3] > 1 and (shape[3] != scores[3] or strides[3] != 1):
        mask = mask.reshape(shape).expand(scores).contiguous()
        shape, strides = scores, tuple(mask.stride())
    return mask, tuple(0 if n == 1 else st for n, st in zip(shape, strides))


class AttentionKernel(OpKernel):
    """An Attention node's kernel: ``kernel(inputs) -> [op(q, k, v, mask)]``."""

    __slots__ = ()
    op: ScaledDotAttention


def bind_attention(node: Node, ctx: BindContext) -> AttentionKernel:
    """The native attention (through torch per call where it declines, counted).

    Without the native library every call goes through torch, and there torch's
    ``scaled_dot_product_attention`` (which gives 0 for a NaN row) runs only where the
    node may lose NaN (``ctx.allow_inexact``); with it, the rare calls it declines run
    the unfused ops."""
    library, why = ctx.target.native_for(ctx.device)
    exact = library is not None or not ctx.allow_inexact(
        node, "torch's scaled_dot_product_attention gives 0 for a row with a NaN score")
    return AttentionKernel(ScaledDotAttention(float(node.attrs["scale"]),
                                              int(node.attrs.get("heads", 0)), library, why,
                                              bool(node.attrs.get("nan_to_zero", 0)), exact))
