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
additive float mask broadcast to the scores. On CPU, float32 inputs with at most
one batch dimension before the heads run through ``ops/native/attention.c``: the
heads are read in place through strides (no copies to split or merge them), K and V
are packed into panels and the softmax is taken on a few rows of scores while they
sit in L1. Anything else (other dtypes or devices, more batch dimensions, batch
dims that differ, a mask that would grow the scores, no native library) runs
torch's ``scaled_dot_product_attention``, or the plain ops where that does not
broadcast, counted with the reason for ``explain()``.

Numerics: the native path differs from torch's by float32 rounding (exp is a
polynomial within 2 ulp; ~1e-6 relative on BERT-base's heads).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from segflow.ops._common import through_torch_lines
from segflow.ops.native_library import NativeLibrary
from segflow.ops.onednn_direct import openmp_entry_points

Tensor = torch.Tensor

_Strides = ctypes.c_int64 * 4


class _Args(ctypes.Structure):
    """``segflow_attention_t`` of ``ops/native/attention.c``."""

    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("mask", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("batch", ctypes.c_int64), ("heads", ctypes.c_int64), ("sq", ctypes.c_int64),
                ("sk", ctypes.c_int64), ("d", ctypes.c_int64), ("dv", ctypes.c_int64),
                ("qs", _Strides), ("ks", _Strides), ("vs", _Strides), ("ms", _Strides),
                ("ys", _Strides), ("scale", ctypes.c_float), ("pad_", ctypes.c_int32),
                ("parallel", ctypes.c_void_p), ("thread_num", ctypes.c_void_p),
                ("num_threads", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
                ("scratch_threads", ctypes.c_int64), ("next", ctypes.c_int64),
                ("status", ctypes.c_int32), ("pad2_", ctypes.c_int32)]


class ScaledDotAttention:
    """``fn(q, k, v, mask=None)``: a ``segflow.Attention`` node's computation.

    ``heads`` 0: ``k`` is K transposed (``[..., D, Sk]``); ``heads`` H: all three are
    ``[B, S, H * D]`` and so is the result. ``library`` is the native library (None:
    always torch); ``why_native`` says why there is none. ``native_calls`` /
    ``torch_calls`` count how calls ran and ``why_torch`` why any went through torch.
    """

    def __init__(self, scale: float, heads: int, library: NativeLibrary | None,
                 why_native: str) -> None:
        self.scale = scale
        self.heads = heads
        self.library = library
        self.why_native = why_native
        self.native_calls = 0
        self.torch_calls = 0
        self.why_torch: dict[str, int] = {}
        self._lock = threading.Lock()
        self._fn = None
        self._scratch_floats = None
        if library is not None:
            self._fn = library.dll.segflow_attention
            self._fn.restype = ctypes.c_int
            self._fn.argtypes = [ctypes.c_void_p]
            self._scratch_floats = library.dll.segflow_attention_scratch
            self._scratch_floats.restype = ctypes.c_int64
            self._scratch_floats.argtypes = [ctypes.c_int64] * 3
        self._openmp = openmp_entry_points() or (None, None, None)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
                 ) -> Tensor:
        if self.heads:
            split = self._split_heads(q, k, v)
            if isinstance(split, str):
                return self._torch_call(split, q, k, v, mask)
            qh, kh, vh = split
        else:
            qh, kh, vh = q, k.transpose(-2, -1), v
        why = self._why_not_native(qh, kh, vh, mask)
        if why:
            return self._torch_call(why, q, k, v, mask)
        return self._native(qh, kh, vh, mask)

    # -- the native path ----------------------------------------------------------------
    def _split_heads(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor] | str:
        """``[B, S, H*D]`` -> ``[B, H, S, D]`` views, or why they cannot be made."""
        h = self.heads
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return f"inputs of rank {q.dim()}, {k.dim()}, {v.dim()}, not 3"
        if q.shape[-1] % h or k.shape[-1] % h or v.shape[-1] % h:
            return f"widths {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]} not split by {h} heads"
        return tuple(t.unflatten(-1, (h, t.shape[-1] // h)).transpose(1, 2)  # type: ignore[return-value]
                     for t in (q, k, v))

    def _why_not_native(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> str:
        if self._fn is None:
            return "native kernels " + self.why_native
        tensors = (q, k, v) if mask is None else (q, k, v, mask)
        if any(t.dtype is not torch.float32 or not t.is_cpu for t in tensors):
            return "not all float32 on the CPU"
        if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
            return f"ranks {q.dim()}, {k.dim()}, {v.dim()} (3 or 4 run native)"
        if k.shape[:-1] != v.shape[:-1] or q.shape[:-2] != k.shape[:-2] \
                or q.shape[-1] != k.shape[-1]:
            return (f"shapes {list(q.shape)}, {list(k.shape)}, {list(v.shape)} do not pair "
                    "up batch for batch")
        if 0 in q.shape[:-1] or k.shape[-2] == 0:
            return "empty queries or keys"
        if mask is not None:
            scores = (*q.shape[:-1], k.shape[-2])
            if mask.dim() > len(scores) or any(
                    m not in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores))):
                return f"a mask {list(mask.shape)} that does not broadcast to {list(scores)}"
        return ""

    def _native(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        three = q.dim() == 3
        if three:                      # one head
            q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        batch, heads, sq, d = q.shape
        sk, dv = k.shape[2], v.shape[3]
        if q.stride(-1) != 1:
            q = q.contiguous()
        # The result in [B, Sq, H, Dv] memory: for the heads form that is [B, Sq, H * Dv].
        out = torch.empty((batch, sq, heads * dv), dtype=torch.float32)
        y = out.view(batch, sq, heads, dv).transpose(1, 2)
        m = None
        if mask is not None:   # [B, H, Sq, Sk] through strides (0 where it broadcasts)
            rank = 3 if three else 4
            m = mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape))
            m = (m.unsqueeze(1) if three else m).expand(batch, heads, sq, sk)
            if m.stride(-1) != 1:
                m = m.contiguous()
        # Each thread's packed K and V and a few rows of scores; at most this many threads.
        threads = torch.get_num_threads() if self._openmp[0] else 1
        scratch = torch.empty(threads * self._scratch_floats(sk, d, dv),  # type: ignore[misc]
                              dtype=torch.float32)
        args = _Args(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     None if m is None else m.data_ptr(), y.data_ptr(),
                     batch, heads, sq, sk, d, dv,
                     _Strides(*q.stride()), _Strides(*k.stride()), _Strides(*v.stride()),
                     _Strides(*(m.stride() if m is not None else (0, 0, 0, 0))),
                     _Strides(*y.stride()), self.scale, 0, *self._openmp,
                     scratch.data_ptr(), threads, 0, 0, 0)
        if self._fn(ctypes.byref(args)) != 0:   # type: ignore[misc]
            raise RuntimeError("attention: a thread of the native kernel found no scratch")
        self.native_calls += 1
        if self.heads:
            return out
        return y.squeeze(1) if three else y

    # -- through torch ------------------------------------------------------------------
    def _torch_call(self, why: str, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
                    ) -> Tensor:
        with self._lock:
            self.torch_calls += 1
            self.why_torch[why] = self.why_torch.get(why, 0) + 1
        return self.through_torch(q, k, v, mask)

    def through_torch(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
                      ) -> Tensor:
        """The node through torch alone (also its traceable form)."""
        if not self.heads:
            return self._sdpa(q, k.transpose(-2, -1), v, mask)
        h = self.heads
        b, sq = q.shape[0], q.shape[1]
        qh, kh, vh = (t.reshape(t.shape[0], t.shape[1], h, t.shape[2] // h).transpose(1, 2)
                      for t in (q, k, v))
        return self._sdpa(qh, kh, vh, mask).transpose(1, 2).reshape(b, sq, v.shape[2])

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        batch = q.shape[:-2]
        fits = k.shape[:-2] == batch and v.shape[:-2] == batch
        if mask is not None:
            if mask.dim() < 2:
                mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
            scores = (*batch, q.shape[-2], k.shape[-2])
            fits = fits and mask.dim() <= len(scores) and all(
                m in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores)))
        if not fits:
            # Broadcasting SDPA does not do (batch dims that differ, a mask that grows the
            # scores): the ops as the graph wrote them.
            y = torch.matmul(q, k.transpose(-2, -1)) * self.scale
            y = y + mask if mask is not None else y
            return torch.matmul(torch.softmax(y, dim=-1), v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


class AttentionKernel:
    """An Attention node's kernel: ``kernel(inputs) -> [op(q, k, v, mask)]``. The op stays
    reachable, so generated code calls it directly and ``explain()`` can count its calls."""

    __slots__ = ("op",)

    def __init__(self, op: ScaledDotAttention) -> None:
        self.op = op

    def __call__(self, inputs: Sequence[Tensor | None]) -> list[Tensor]:
        q, k, v = inputs[0], inputs[1], inputs[2]
        assert q is not None and k is not None and v is not None
        return [self.op(q, k, v, inputs[3] if len(inputs) > 3 else None)]


def describe_attentions(ops: Sequence[tuple[str, ScaledDotAttention]], limit: int = 8
                        ) -> list[str]:
    """``explain()`` lines: how many Attention nodes, in which form, how their calls ran
    and why any went through torch."""
    if not ops:
        return []
    native = sum(op.native_calls for _, op in ops)
    through_torch = sum(op.torch_calls for _, op in ops)
    split = sum(1 for _, op in ops if op.heads)
    form = f" ({split} reading heads in place)" if split else ""
    lines = [f"attention: {len(ops)} node{'s' if len(ops) > 1 else ''}{form}; {native} calls "
             f"native, {through_torch} through torch"]
    return lines + through_torch_lines(
        [(label, why, n) for label, op in ops for why, n in op.why_torch.items()], limit)
