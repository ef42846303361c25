"""What a kernel reports to ``explain()`` and the counters: the :class:`KernelReport`
protocol every kernel op implements, the families ``explain()`` prints in order, and
the helpers the families share (calls that ran native code or went through torch)."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch


class ReportFamily(enum.Enum):
    """The kernel families ``explain()`` reports, one row each, in the order it prints
    them. A new kernel adds its row here and implements :class:`KernelReport`."""

    DIRECT = "direct kernels (libdnnl)"
    INT8 = "int8 convolutions (libdnnl)"
    DENSE_CHAIN = "dense chains"
    STAGING = "NCHW input staged into channels-last"
    NATIVE_LINEAR = "native linears"
    ADD_LAYER_NORM = "add + layer norm"
    ATTENTION = "attention"
    DYNAMIC_QUANTIZE = "dynamic quantization"
    DIRECT_REPLAY = "replayed runs (libdnnl)"
    NATIVE_REPLAY = "replayed runs (native kernels)"


@runtime_checkable
class KernelReport(Protocol):
    """What a kernel op tells ``explain()`` and the counters.

    ``family`` says whose lines it joins; ``describe_all`` (a classmethod, defined once
    per family) gives the ``explain()`` lines of all of a session's ops of that family,
    as ``(node label, op)`` pairs; ``counters`` counts this op's calls (native, through
    torch, layouts built, fallbacks, ...); ``parts`` are the reporting kernels the op
    owns (a convolution's staging copy), reported in their own families.
    """

    family: ReportFamily

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, Any]], limit: int = 8) -> list[str]: ...

    def counters(self) -> Mapping[str, int]: ...

    def parts(self) -> Sequence[KernelReport]: ...


def reporting_ops(kernels: Iterable[tuple[str, object]]) -> list[tuple[str, KernelReport]]:
    """The ``(label, op)`` of each node kernel (``(label, kernel)``) whose ``op`` reports,
    followed by the parts it owns, under the same label."""
    found: list[tuple[str, KernelReport]] = []
    for label, kernel in kernels:
        op = getattr(kernel, "op", None)
        if isinstance(op, KernelReport):
            found.append((label, op))
            found.extend((label, part) for part in op.parts())
    return found


def describe_families(ops: Sequence[tuple[str, KernelReport]], limit: int = 8
                      ) -> list[tuple[ReportFamily, list[str]]]:
    """Each family's ``explain()`` lines over ``ops``, in :class:`ReportFamily` order
    (families without ops, or without lines, left out)."""
    grouped: dict[ReportFamily, list[tuple[str, KernelReport]]] = {}
    for label, op in ops:
        grouped.setdefault(op.family, []).append((label, op))
    described = []
    for family in ReportFamily:
        group = grouped.get(family)
        if group:
            lines = type(group[0][1]).describe_all(group, limit)
            if lines:
                described.append((family, lines))
    return described


def short_label(label: str) -> str:
    """A node's label (``%y = Conv(%x, %w) [conv1]``, :attr:`Node.label`) cut to its name
    and op, ``conv1 (Conv)``, or ``%y (Conv)`` for an unnamed node: a fused node's label
    lists every input, hundreds of characters for one report line."""
    outputs, _, call = label.partition(" = ")
    op, _, rest = call.partition("(")
    name = rest.rpartition(") [")[2].removesuffix("]") if rest.endswith("]") else ""
    return f"{name or outputs} ({op})" if op else label


def through_torch_lines(reasons: Sequence[tuple[str, str, int]], limit: int = 8) -> list[str]:
    """``explain()`` lines for the calls a native kernel sent through torch:
    ``(node label, why, calls)`` each, at most ``limit`` of them and a count of the rest."""
    lines = [f"  through torch: {short_label(label)}, {n} calls: {why}"
             for label, why, n in reasons[:limit]]
    if len(reasons) > limit:
        lines.append(f"  ... and {len(reasons) - limit} more")
    return lines


def declined(what: str, reasons: Sequence[tuple[str, Mapping[tuple[object, ...], str]]],
             limit: int) -> list[str]:
    """A line per input layout a native kernel declined (``reasons``: per op, its node
    label and why it declined each layout key), ``limit`` at most."""
    found = [(label, key, why) for label, of in reasons for key, why in of.items()]
    return [f"  not {what}: {label} at {list(key[0])}: {why}"  # type: ignore[call-overload]
            for label, key, why in found[:limit]]


class NativeOrTorch:
    """What an op that runs native code, or torch where it cannot, keeps for
    ``explain()``: the library (None: always torch), why there is none, how many calls
    ran each way and why any went through torch (:func:`describe_native_calls`).
    Subclasses name their ``family`` and ``describe_all``."""

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

    def counters(self) -> Mapping[str, int]:
        """Calls that ran native code, and calls that went through torch."""
        return {"native_calls": self.native_calls, "torch_calls": self.torch_calls}

    def parts(self) -> Sequence[KernelReport]:
        """No kernels of its own."""
        return ()


class OpKernel:
    """A fused node's kernel over an op object that counts how its calls ran:
    ``kernel(inputs) -> [op(*inputs)]`` (the op's outputs, where it returns a tuple of
    them). The op stays reachable, so generated code calls it directly and ``explain()``
    can count its calls (:func:`reporting_ops`)."""

    __slots__ = ("op",)

    def __init__(self, op: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]) -> None:
        self.op = op

    def __call__(self, inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        out = self.op(*inputs)
        return list(out) if isinstance(out, tuple) else [out]


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
