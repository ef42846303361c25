"""Element types and tensor specs: the typed vocabulary of the IR.

ONNX's integer dtype codes are parsed into :class:`DType` once, at the frontend
boundary; everything downstream speaks DType.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

Dim = int | str | None
"""One dimension: a fixed size, a symbolic name, or unknown (None)."""


class DType(enum.Enum):
    """Element type of a tensor. Values are ONNX TensorProto codes."""

    FLOAT32 = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    FLOAT64 = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23
    FLOAT8E8M0 = 24
    UINT2 = 25
    INT2 = 26

    @classmethod
    def from_onnx(cls, code: int) -> DType:
        try:
            return cls(code)
        except ValueError:
            raise ValueError(f"unsupported ONNX element type code {code}") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype | type) -> DType:
        key = np.dtype(dtype)
        member = _FROM_NUMPY.get(key)
        if member is not None:
            return member
        if not key.isnative:  # byte-swapped (">f4" on a little-endian host): same type
            member = _FROM_NUMPY.get(key.newbyteorder("="))
            if member is not None:
                return member
        if key.kind in ("U", "S", "O"):
            return cls.STRING
        raise ValueError(f"numpy dtype {key} has no segflow equivalent")

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        member = _FROM_TORCH.get(dtype)
        if member is not None:
            return member
        raise ValueError(f"torch dtype {dtype} has no segflow equivalent")

    @classmethod
    def from_container(cls, dtype: torch.dtype, declared: DType | None) -> DType:
        """The type of a tensor of torch ``dtype`` that a spec declares ``declared``.

        The sub-byte types are held one element per byte in a container that an
        ordinary type shares (int4 in int8, float4 as uint8 bit patterns), so the
        tensor alone cannot tell them apart; the declared type settles it.

        >>> DType.from_container(torch.int8, DType.INT4)
        <DType.INT4: 22>
        """
        if declared is not None and declared.is_lowbit and _TORCH[declared] == dtype:
            return declared
        return cls.from_torch(dtype)

    @property
    def torch(self) -> torch.dtype:
        try:
            return _TORCH[self]
        except KeyError:
            raise ValueError(f"{self.name} tensors are not supported by the torch kernels"
                             ) from None

    @property
    def numpy(self) -> np.dtype:
        if self is DType.STRING:
            return np.dtype(object)
        return _NUMPY[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)

    @property
    def is_lowbit(self) -> bool:
        """A float8, 4-bit or 2-bit type: converted on the host with ml_dtypes' rounding
        (``ir/lowbit.py``), never by torch's own casts."""
        return self.value in _LOWBIT_CODES

    @property
    def onnx_name(self) -> str:
        return _ONNX_NAMES.get(self, self.name.lower())


_TORCH: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT64: torch.float64,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
    DType.UINT8: torch.uint8,
    DType.INT8: torch.int8,
    DType.INT16: torch.int16,
    DType.INT32: torch.int32,
    DType.INT64: torch.int64,
    DType.UINT16: torch.uint16,
    DType.UINT32: torch.uint32,
    DType.UINT64: torch.uint64,
    DType.BOOL: torch.bool,
    DType.COMPLEX64: torch.complex64,
    DType.COMPLEX128: torch.complex128,
    DType.FLOAT8E4M3FN: torch.float8_e4m3fn,
    DType.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    DType.FLOAT8E5M2: torch.float8_e5m2,
    DType.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
    DType.FLOAT8E8M0: torch.float8_e8m0fnu,
    # Containers, one element a byte: the integer value itself, and float4's bit pattern.
    DType.INT4: torch.int8,
    DType.UINT4: torch.uint8,
    DType.INT2: torch.int8,
    DType.UINT2: torch.uint8,
    DType.FLOAT4E2M1: torch.uint8,
}

_NUMPY: dict[DType, np.dtype] = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.FLOAT16: np.dtype(np.float16),
    DType.UINT8: np.dtype(np.uint8),
    DType.INT8: np.dtype(np.int8),
    DType.INT16: np.dtype(np.int16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.UINT16: np.dtype(np.uint16),
    DType.UINT32: np.dtype(np.uint32),
    DType.UINT64: np.dtype(np.uint64),
    DType.BOOL: np.dtype(np.bool_),
    DType.COMPLEX64: np.dtype(np.complex64),
    DType.COMPLEX128: np.dtype(np.complex128),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),  # numpy has none; onnx's own choice
    DType.FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.FLOAT8E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    DType.FLOAT8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    DType.FLOAT8E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    DType.FLOAT8E8M0: np.dtype(ml_dtypes.float8_e8m0fnu),
    DType.INT4: np.dtype(ml_dtypes.int4),
    DType.UINT4: np.dtype(ml_dtypes.uint4),
    DType.INT2: np.dtype(ml_dtypes.int2),
    DType.UINT2: np.dtype(ml_dtypes.uint2),
    DType.FLOAT4E2M1: np.dtype(ml_dtypes.float4_e2m1fn),
}

_LOWBIT_CODES = frozenset(range(17, 27))

# Reverse lookups for the per-run feed checks (a dict hit instead of a scan).
# A container (torch.int8 of an int4) maps back to its ordinary type: from_container decides.
_IN_SHARED_CONTAINER = frozenset({DType.INT4, DType.UINT4, DType.INT2, DType.UINT2,
                                  DType.FLOAT4E2M1})
_FROM_TORCH: dict[torch.dtype, DType] = {
    t: d for d, t in _TORCH.items() if d not in _IN_SHARED_CONTAINER}
_FROM_NUMPY: dict[np.dtype, DType] = {n: d for d, n in _NUMPY.items()}

_ONNX_NAMES = {
    DType.FLOAT32: "float",
    DType.FLOAT64: "double",
    DType.FLOAT16: "float16",
    DType.BFLOAT16: "bfloat16",
    DType.BOOL: "bool",
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What is statically known about a tensor: element type and shape.

    ``shape`` is None when even the rank is unknown; a dim is an int (fixed),
    a str (symbolic, e.g. ``"batch"``) or None (unknown).
    """

    dtype: DType | None = None
    shape: tuple[Dim, ...] | None = None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    def describe(self) -> str:
        dtype = self.dtype.onnx_name if self.dtype else "?"
        if self.shape is None:
            return f"{dtype}[?]"
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{dtype}[{dims}]"


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """A sequence value: an ordered list of tensors, each described by ``elem``.

    At run time a sequence is a Python list of tensors (it may be empty).
    """

    elem: TensorSpec = TensorSpec()

    def describe(self) -> str:
        return f"seq({self.elem.describe()})"


@dataclass(frozen=True, slots=True)
class OptionalSpec:
    """An optional value: empty (None at run time) or one tensor or sequence."""

    elem: TensorSpec | SequenceSpec = TensorSpec()

    def describe(self) -> str:
        return f"optional({self.elem.describe()})"


ContainerSpec = SequenceSpec | OptionalSpec
"""The value kinds beyond tensors: what ``Value.container`` holds (None for a tensor)."""


def shape_window(start: int | None, end: int | None, rank: int) -> slice:
    """The axes ONNX ``Shape(start=, end=)`` returns for a rank-``rank`` input (clamped)."""
    def clamp(index: int | None) -> int | None:
        if index is None:
            return None
        index = int(index)
        return max(0, min(rank, index + rank if index < 0 else index))
    return slice(clamp(start), clamp(end))


class DeviceKind(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True, slots=True)
class Device:
    """A placement target. ``cpu:1`` is a second logical CPU device (own worker)."""

    kind: DeviceKind
    index: int = 0

    @classmethod
    def parse(cls, text: str | Device) -> Device:
        if isinstance(text, Device):
            return text
        name, _, index = str(text).partition(":")
        try:
            kind = DeviceKind(name.strip().lower())
        except ValueError:
            raise ValueError(f"unknown device {text!r}; expected 'cpu', 'cpu:N' or 'cuda:N'"
                             ) from None
        if index and not index.isdigit():
            raise ValueError(f"bad device index in {text!r}; expected 'cpu', 'cpu:N' or "
                             "'cuda:N' with N a number from 0")
        return cls(kind, int(index) if index else 0)

    @property
    def torch(self) -> torch.device:
        # Logical CPU devices all map to the one torch CPU device.
        if self.kind is DeviceKind.CPU:
            return torch.device("cpu")
        return torch.device("cuda", self.index)

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.index}"
