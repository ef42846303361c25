"""The low-bit element types (float8, int4/uint4, int2/uint2, float4e2m1) as torch tensors.

torch holds the float8 types in its own dtypes and the sub-byte ones in byte
containers, one element a byte as ml_dtypes holds them in numpy: int4/int2 as
their value in int8, uint4/uint2 in uint8, float4e2m1 as its 4-bit pattern in
uint8 (ONNX packs them only inside a TensorProto, which onnx.numpy_helper unpacks).

Casts to and from these types follow ONNX's Cast: ml_dtypes' conversions (round
to nearest even; integers wrap), with ``saturate`` clamping the four float8 types
to their finite range (NaN stays NaN), and float8e8m0's own round modes. They run
on the host through numpy: torch's own float8 casts treat overflow differently.

>>> x = torch.tensor([1.0, 500.0, float("nan")])
>>> to_numpy(cast(x, DType.FLOAT32, DType.FLOAT8E4M3FN, saturate=True), DType.FLOAT8E4M3FN)
array([1, 448, nan], dtype='float8_e4m3fn')
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from segflow.ir.types import DType

Tensor = torch.Tensor

# The float8 types whose Cast honours ``saturate`` (e8m0 has its own rule; float4 has no
# infinity or NaN, so ml_dtypes' conversion saturates it by itself).
_SATURATING = frozenset({DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2,
                         DType.FLOAT8E5M2FNUZ})
# Held as their bit patterns (viewed, never converted, between numpy and torch).
_BIT_PATTERNS = _SATURATING | {DType.FLOAT8E8M0, DType.FLOAT4E2M1}
ROUND_MODES = ("up", "down", "nearest")
NUMPY_DTYPES = frozenset(d.numpy for d in DType if d.is_lowbit)
"""The ml_dtypes types of the low-bit element types, for telling their arrays apart."""


def to_tensor(array: np.ndarray) -> Tensor:
    """A (CPU) tensor holding ``array`` of any dtype ``DType.from_numpy`` reads.

    >>> to_tensor(np.array([-8, 7], ml_dtypes.int4))
    tensor([-8,  7], dtype=torch.int8)
    """
    dtype = DType.from_numpy(array.dtype)
    array = np.ascontiguousarray(array)
    if dtype in _BIT_PATTERNS or dtype is DType.BFLOAT16:
        width = np.uint16 if dtype is DType.BFLOAT16 else np.uint8
        return torch.from_numpy(array.view(width).copy()).view(dtype.torch)
    if dtype.is_lowbit:   # the sub-byte integers: their value in the container
        return torch.from_numpy(array.astype(np.int8 if dtype.torch == torch.int8 else np.uint8))
    return torch.from_numpy(array.copy())


def to_numpy(tensor: Tensor, dtype: DType) -> np.ndarray:
    """``tensor`` (of ``dtype``, in its container for the sub-byte types) as numpy, the low-bit
    and bfloat16 types as ml_dtypes arrays (the arrays onnx and onnxruntime hand out)."""
    t = tensor.detach().cpu().contiguous()
    if dtype in _BIT_PATTERNS or dtype is DType.BFLOAT16:
        width = torch.uint16 if dtype is DType.BFLOAT16 else torch.uint8
        return t.view(width).numpy().view(dtype.numpy)
    if dtype.is_lowbit:
        return t.numpy().astype(dtype.numpy)
    return t.numpy()


def on_host(source: DType | None, target: DType | None) -> bool:
    """Whether :func:`cast` from ``source`` to ``target`` (None: not known) runs on the host,
    through ml_dtypes, rather than as a torch conversion: where either is a low-bit type,
    except a sub-byte integer's value read into an ordinary type (exact in torch).

    >>> on_host(DType.FLOAT32, DType.FLOAT8E4M3FN), on_host(DType.INT4, DType.FLOAT32)
    (True, False)
    """
    if target is not None and not target.is_lowbit and source is not None \
            and source.is_lowbit and source not in _BIT_PATTERNS:
        return False
    return any(t is not None and t.is_lowbit for t in (source, target))


def cast(tensor: Tensor, source: DType, target: DType, saturate: bool = True,
         round_mode: str = "up") -> Tensor:
    """ONNX's Cast from ``source`` to ``target`` where either is a low-bit type, on the
    device ``tensor`` is on (through the host where :func:`on_host` says so)."""
    if not on_host(source, target):
        return tensor.to(target.torch)
    array = to_numpy(tensor, source)
    if target is DType.FLOAT8E8M0:
        out = _to_e8m0(array, saturate, round_mode)
    else:
        if saturate and target in _SATURATING:
            info = ml_dtypes.finfo(target.numpy)
            array = np.clip(_widened(array), float(info.min), float(info.max))
        out = array.astype(target.numpy)
    return to_tensor(out).to(tensor.device)


def _widened(array: np.ndarray) -> np.ndarray:
    """``array`` in a numpy type np.clip computes in (ml_dtypes' floats widened exactly)."""
    if array.dtype.kind not in "biuf":
        return array.astype(np.float32)
    return array


def _to_e8m0(array: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """float32 values to float8e8m0 (a power of two, no sign): the float32 exponent, rounded
    up, down or to nearest by the mantissa; NaN and infinity become NaN (0xFF); with
    ``saturate``, rounding never carries the largest exponent into NaN."""
    bits = np.ascontiguousarray(_widened(array).astype(np.float32)).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint16)
    special = exponent == 0xFF
    if round_mode == "up":
        up = (bits & 0x7FFFFF) != 0
    elif round_mode == "nearest":
        # Half way (the guard bit alone) rounds up unless the exponent is 0, as ONNX's
        # reference does.
        guard = (bits & 0x400000) != 0
        up = guard & (((bits & 0x3FFFFF) != 0) | (exponent > 0))
    elif round_mode == "down":
        up = np.zeros(bits.shape, dtype=bool)
    else:
        raise ValueError(f"round_mode {round_mode!r} is not one of {', '.join(ROUND_MODES)}")
    up &= ~special
    if saturate:
        up &= exponent != 0xFE
    out = (exponent + up).astype(np.uint8)
    out[special] = 0xFF
    return out.view(ml_dtypes.float8_e8m0fnu)
