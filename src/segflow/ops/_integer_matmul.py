"""``(A - a_zp) @ (B - b_zp)`` of 8-bit integers, exact in int32: the one place that
decides how MatMulInteger, QLinearMatMul, MatMulIntegerToFloat and DynamicQuantizeMatMul
multiply.

On the CPU, with B a matrix, the product runs as one int8 GEMM (``torch._int_mm``,
oneDNN's VNNI kernels where the CPU has them; 7x a float32 GEMM of the same size on an
AVX-512 VNNI core, 14x the float64 one): each operand is moved to int8 (a uint8 value
``u`` is ``(u - 128) + 128``), and the zero points and that shift come back as
rank-one corrections::

    (a8 + ca) @ (b8 + cb) = a8 @ b8 + ca * colsum(b8) + rowsum(a8) * cb + K * ca * cb

with ``ca = shift_a - a_zp``, ``cb = shift_b - b_zp``; every term is an exact integer
and for ``K`` up to ``_MAX_K`` their sum stays inside int32. A constant B is prepared
once (:class:`PreparedB`). Anything else (batched B, a vector, another device, a zero
point of another shape) takes the reference: operands widened to float64, which holds
every such sum exactly.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

_EIGHT_BIT = (torch.int8, torch.uint8)
# |a8 @ b8| + |ca * colsum| + |rowsum * cb| + |K ca cb| <= K (128*128 + 2*255*128 + 255*255)
# must stay below 2**31.
_MAX_K = (2**31 - 1) // (128 * 128 + 2 * 255 * 128 + 255 * 255)


def _to_int8(t: Tensor) -> tuple[Tensor, int]:
    """``t`` as int8 and the shift that restores it (``t = int8 + shift``)."""
    if t.dtype == torch.uint8:
        return torch.bitwise_xor(t, 128).view(torch.int8), 128
    return t, 0


def centered(t: Tensor, zp: Tensor | None, row_axis: int | None = None) -> Tensor:
    """``t - zp`` widened to float64 (exact for these integer ranges); with ``row_axis``,
    a 1-D zero point of several values is one per row of A ``[.., M, K]``."""
    out = t.to(torch.float64)
    if zp is None:
        return out
    z = zp.to(torch.float64)
    if row_axis is not None and z.dim() == 1 and z.numel() > 1:
        z = z.reshape(-1, 1)
    return out - z


def _reference(a: Tensor, b: Tensor, a_zp: Tensor | None, b_zp: Tensor | None) -> Tensor:
    # B's zero point is per tensor or per column ([N]): it broadcasts along B's last axis.
    return torch.matmul(centered(a, a_zp, row_axis=-2), centered(b, b_zp)).to(torch.int32)


class PreparedB:
    """B as the int8 GEMM reads it: int8 ``[K, N]``, its column sums and ``cb``
    (``[N]`` or one value); ``None`` fields where B does not qualify."""

    __slots__ = ("b", "b8", "colsum", "cb")

    def __init__(self, b: Tensor, b_zp: Tensor | None) -> None:
        self.b = b
        self.b8: Tensor | None = None
        self.colsum: Tensor | None = None
        self.cb: Tensor | None = None
        n = int(b.shape[-1]) if b.dim() else 0
        if b.dim() != 2 or b.dtype not in _EIGHT_BIT or b.device.type != "cpu" \
                or int(b.shape[0]) > _MAX_K:
            return
        if b_zp is not None and not (b_zp.numel() == 1 or b_zp.shape == (n,)):
            return
        b8, shift = _to_int8(b)
        zp = torch.zeros((), dtype=torch.int32) if b_zp is None else \
            b_zp.to(torch.int32).reshape(-1 if b_zp.numel() > 1 else ())
        self.b8 = b8.contiguous()
        self.colsum = b8.sum(0, dtype=torch.int32)
        self.cb = shift - zp


def integer_matmul(a: Tensor, b: Tensor, a_zp: Tensor | None = None,
                   b_zp: Tensor | None = None, prepared: PreparedB | None = None) -> Tensor:
    """``(a - a_zp) @ (b - b_zp)`` as int32 (numpy matmul broadcasting); ``prepared``:
    B made ready once (it must be ``PreparedB(b, b_zp)``)."""
    if prepared is None or prepared.b is not b:
        prepared = PreparedB(b, b_zp)
    b8, colsum, cb = prepared.b8, prepared.colsum, prepared.cb
    if b8 is None or colsum is None or cb is None or a.dim() < 2 \
            or a.dtype not in _EIGHT_BIT or a.device.type != "cpu" \
            or (a_zp is not None and a_zp.numel() != 1):
        return _reference(a, b, a_zp, b_zp)
    k, n = (int(d) for d in b8.shape)
    a8, shift = _to_int8(a)
    ca = shift - (torch.zeros((), dtype=torch.int32) if a_zp is None
                  else a_zp.to(torch.int32).reshape(()))
    rows = a8.reshape(-1, k)
    acc = torch._int_mm(rows, b8)
    # The corrections, each skipped where its factor is zero (a symmetric int8 B: cb 0).
    if bool((ca != 0).any()):
        acc += ca * colsum
    if bool((cb != 0).any()):
        acc += rows.sum(1, dtype=torch.int32).unsqueeze(1) * cb
        acc += k * ca * cb
    return acc.reshape(*a.shape[:-1], n)
