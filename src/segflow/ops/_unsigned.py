"""Exact uint16/uint32/uint64 arithmetic for the elementwise kernels.

torch has tensors of these types but few kernels for them (add, compare,
max, shift ... raise NotImplementedError on CPU). uint16/uint32 values fit in
int64, so we compute there and cast back (the cast wraps modulo 2**n, as
unsigned arithmetic does). uint64 is reinterpreted as int64: add/sub/mul and
bitwise ops give the same bits; ordering flips the sign bit first; division,
remainder and right shifts go through numpy, which has true uint64 kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

Tensor = torch.Tensor
Binary = Callable[[Tensor, Tensor], Tensor]

UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_SIGN_BIT = -(2**63)


def _as_u64(t: Tensor) -> Tensor:
    return t if t.dtype == torch.uint64 else t.to(torch.uint64)


def arith(fn: Binary) -> Binary:
    """For ops whose result bits do not depend on signedness (add, sub, mul, and, or, xor)."""

    def run(a: Tensor, b: Tensor) -> Tensor:
        if a.dtype not in UNSIGNED:
            return fn(a, b)
        if a.dtype == torch.uint64:
            return fn(a.view(torch.int64), _as_u64(b).view(torch.int64)).view(torch.uint64)
        return fn(a.to(torch.int64), b.to(torch.int64)).to(a.dtype)
    return run


def ordered(fn: Binary) -> Binary:
    """For comparisons and max/min (bool result, or a value of the input type)."""

    def run(a: Tensor, b: Tensor) -> Tensor:
        if a.dtype not in UNSIGNED:
            return fn(a, b)
        if a.dtype == torch.uint64:
            # Flipping the sign bit maps unsigned order onto signed order.
            sa = a.view(torch.int64) ^ _SIGN_BIT
            sb = _as_u64(b).view(torch.int64) ^ _SIGN_BIT
            out = fn(sa, sb)
            return out if out.dtype == torch.bool else (out ^ _SIGN_BIT).view(torch.uint64)
        out = fn(a.to(torch.int64), b.to(torch.int64))
        return out if out.dtype == torch.bool else out.to(a.dtype)
    return run


def via_numpy(np_fn: Callable[[np.ndarray, np.ndarray], np.ndarray], fn: Binary) -> Binary:
    """For uint64 ops that depend on signedness (div, mod, right shift); else int64 / fn."""

    def run(a: Tensor, b: Tensor) -> Tensor:
        if a.dtype not in UNSIGNED:
            return fn(a, b)
        if a.dtype == torch.uint64:
            out = np_fn(a.cpu().numpy(), _as_u64(b).cpu().numpy())
            return torch.from_numpy(np.ascontiguousarray(out)).to(a.device)
        return fn(a.to(torch.int64), b.to(torch.int64)).to(a.dtype)
    return run


def bitwise_not(x: Tensor) -> Tensor:
    if x.dtype == torch.uint64:
        return torch.bitwise_not(x.view(torch.int64)).view(torch.uint64)
    if x.dtype in UNSIGNED:
        return torch.bitwise_not(x.to(torch.int64)).to(x.dtype)
    return torch.bitwise_not(x)
