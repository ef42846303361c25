"""What a kernel reports to ``explain()`` and the counters: how many calls ran native
code and how many went through torch, and why."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


def through_torch_lines(reasons: Sequence[tuple[str, str, int]], limit: int = 8) -> list[str]:
    """``explain()`` lines for the calls a native kernel sent through torch:
    ``(node label, why, calls)`` each, at most ``limit`` of them and a count of the rest."""
    lines = [f"  through torch: {label}, {n} calls: {why}" for label, why, n in reasons[:limit]]
    if len(reasons) > limit:
        lines.append(f"  ... and {len(reasons) - limit} more")
    return lines


class NativeOrTorch:
    """What an op that runs native code, or torch where it cannot, keeps for
    ``explain()``: the library (None: always torch), why there is none, how many calls
    ran each way and why any went through torch (:func:`describe_native_calls`)."""

    def __init__(self, library: Any, why_native: str) -> None:
        self.library = library
        self.why_native = why_native
        self.native_calls = 0
        self.torch_calls = 0
        self.why_torch: dict[str, int] = {}
        self._lock = threading.Lock()

    def count_native_call(self) -> None:
        """Count a call that ran native code."""
        with self._lock:
            self.native_calls += 1

    def count_torch_call(self, why: str) -> None:
        """Count a call that goes through torch, and why (threads may share the op)."""
        with self._lock:
            self.torch_calls += 1
            self.why_torch[why] = self.why_torch.get(why, 0) + 1


class OpKernel:
    """A fused node's kernel over an op object that counts how its calls ran:
    ``kernel(inputs) -> [op(*inputs)]`` (an absent optional input is not passed). The
    op stays reachable, so generated code calls it directly and ``explain()`` can
    count its calls. Subclasses name the op type, for the executor to find them."""

    __slots__ = ("op",)

    def __init__(self, op: Callable[..., torch.Tensor]) -> None:
        self.op = op

    def __call__(self, inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        return [self.op(*inputs)]


def describe_native_calls(what: str, ops: Sequence[tuple[str, Any]], form: str = "",
                          limit: int = 8) -> list[str]:
    """``explain()`` lines for nodes whose ops count ``native_calls``, ``torch_calls``
    and ``why_torch``: ``what: N nodes<form>; X calls native, Y through torch``, then
    why any went through torch."""
    if not ops:
        return []
    native = sum(op.native_calls for _, op in ops)
    through_torch = sum(op.torch_calls for _, op in ops)
    lines = [f"{what}: {len(ops)} node{'s' if len(ops) > 1 else ''}{form}; {native} calls "
             f"native, {through_torch} through torch"]
    return lines + through_torch_lines(
        [(label, why, n) for label, op in ops for why, n in op.why_torch.items()], limit)
