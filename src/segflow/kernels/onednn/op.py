"""What every direct libdnnl kernel shares: a primitive built once per input layout
(``Call``), the op that owns them (``DirectOp``) and the node kernels over an op."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from segflow.kernels.onednn.library import (
    ARG_BIAS,
    ARG_DST,
    ARG_SRC,
    ARG_WEIGHTS,
    Destination,
    DnnlError,
    ExecArg,
    Library,
    Pointer,
    Tensor,
)
from segflow.kernels.report import KernelReport, ReportFamily


@dataclass(frozen=True, slots=True)
class Call:
    """A built primitive for one input layout: execute after pointing the memories."""

    primitive: Pointer
    src: Pointer
    dst: Pointer
    residual: Pointer | None              # a convolution's binary-add source, or None
    args: ctypes.Array[ExecArg]
    in_format: torch.memory_format | None   # convert the input to this first (None: as is)
    out_shape: tuple[int, ...]
    out_format: torch.memory_format
    source: Tensor | None            # the weight constant a convolution was built for
    bias: Tensor | None
    impl: str
    # The addresses the src, dst and residual memories point at now (0: none yet):
    # a run's arena block keeps its addresses from run to run, so most calls need
    # no ctypes call to re-point them. Read and written under the op's lock, here or
    # by a native replay (kernels/onednn/replay.py), hence a C array.
    handles: ctypes.Array[ctypes.c_size_t] = field(
        default_factory=lambda: (ctypes.c_size_t * 3)())
    # Where a native kernel stands for the primitive (``kernels/winograd.py``,
    # ``kernels/stem.py``): what executes ``primitive`` (dnnl_primitive_execute's
    # signature), the lock of the workspace it shares with other kernels, held while it
    # runs (None: it shares none), and what must outlive the call.
    run: Any = None
    lock: threading.Lock | None = None
    keep: object = None


class DirectOp:
    """What the direct convolution and pooling share: one primitive per input layout
    (``calls``, at most ``max_shapes``; None where the fallback serves it, ``why_not``
    says why), a lock and a stream per op, and the oneDNN objects it owns."""

    kind = "primitive"
    family = ReportFamily.DIRECT
    max_copies = 0        # own repacked copies of a weight an op may keep (ops with weights)

    def __init__(self, lib: Library, fallback: Callable[..., Tensor], max_shapes: int,
                 destination: Destination | None) -> None:
        self.lib = lib
        self.fallback = fallback
        self.max_shapes = max_shapes
        # Storage the run planned for the output (runtime/arena.py); None: allocate it.
        self.destination = destination
        self.calls: dict[tuple[object, ...], Call | None] = {}
        self.why_not: dict[tuple[object, ...], str] = {}
        # Of the calls, how many were built while the session loaded (runtime/prebuild.py).
        self.built_at_load = 0
        self.lock = threading.Lock()
        self._stream: Pointer | None = None
        # oneDNN objects this op created, destroyed with it (JIT code included).
        self._owned: list[tuple[str, Pointer]] = []
        weakref.finalize(self, lib.destroy, self._owned)

    @property
    def direct_layouts(self) -> int:
        """How many input layouts run through libdnnl (the rest fall back)."""
        return sum(1 for call in self.calls.values() if call is not None)

    def counters(self) -> Mapping[str, int]:
        """Input layouts built through libdnnl (``built_at_load`` of them while the session
        loaded) and those that fell back to torch."""
        return {"layouts_built": self.direct_layouts, "built_at_load": self.built_at_load,
                "fallbacks": len(self.why_not)}

    def parts(self) -> Sequence[KernelReport]:
        """No kernels of its own (a convolution's staging copy is one)."""
        return ()

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, Any]], limit: int = 8) -> list[str]:
        """``explain()`` lines for a session's direct ops (``(node label, op)``): how many,
        the input layouts built through libdnnl, each fallback with its reason, and what
        each kind's own strategies did (:meth:`describe_strategies`)."""
        if not ops:
            return []
        kinds: dict[str, int] = {}
        for _, op in ops:
            kinds[op.kind] = kinds.get(op.kind, 0) + 1
        what = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in kinds.items())
        strategies = [line for kind in dict.fromkeys(type(op) for _, op in ops)
                      for line in kind.describe_strategies(ops, limit)]
        built = sum(op.direct_layouts for _, op in ops)
        fallbacks = [(label, key, why) for label, op in ops for key, why in op.why_not.items()]
        if not built and not fallbacks:
            return [f"direct kernels (libdnnl): {what}; no input layout built yet (each is "
                    "built at its first run)", *strategies]
        lines = [f"direct kernels (libdnnl): {what}; {built} input layout"
                 f"{'s' if built != 1 else ''} built, {len(fallbacks)} fell back to torch"]
        for label, key, why in fallbacks[:limit]:
            shape, dtype = key[0], key[2]   # the input's sizes and dtype (the layout key)
            lines.append(f"  fallback: {label} at {list(shape)} {dtype}: {why}")
        if len(fallbacks) > limit:
            lines.append(f"  ... and {len(fallbacks) - limit} more")
        return lines + strategies

    @classmethod
    def describe_strategies(cls, ops: Sequence[tuple[str, Any]], limit: int) -> list[str]:
        """Lines for what this kind's native strategies did among ``ops`` (a session's
        direct ops, of every kind): none by default."""
        return []

    def _output(self, call: Call) -> Tensor:
        """The planned storage when the run has it at this size, else a new tensor."""
        given = self.destination() if self.destination is not None else None
        if given is not None and given.shape == call.out_shape:
            return given
        return torch.empty(call.out_shape, memory_format=call.out_format)

    def _run(self, call: Call, x: Tensor, y: Tensor, z: Tensor | None = None) -> None:
        res = 0 if call.residual is None else z.data_ptr()  # type: ignore[union-attr]
        self.execute_at(call, x.data_ptr(), y.data_ptr(), res)

    def execute_at(self, call: Call, src: int, dst: int, res: int) -> None:
        """Execute ``call`` with its source, destination and residual memories at these
        addresses (``res`` 0: no residual); what a call does once it has its tensors.
        ``kernels/onednn/replay.py`` calls it with addresses it recorded."""
        lib = self.lib
        with self.lock:
            handles = call.handles
            if handles[0] != src:
                lib.set_handle(call.src, src)
                handles[0] = src
            if handles[1] != dst:
                lib.set_handle(call.dst, dst)
                handles[1] = dst
            if res and handles[2] != res:
                lib.set_handle(call.residual, res)
                handles[2] = res
            run = call.run
            if run is None:
                status = lib.execute(call.primitive, self._stream, len(call.args), call.args)
            elif call.lock is None:
                status = run(call.primitive, self._stream, len(call.args), call.args)
            else:
                with call.lock:
                    status = run(call.primitive, self._stream, len(call.args), call.args)
        if status != 0:
            raise DnnlError(f"{self.kind} ({call.impl}): oneDNN status {status}")

    def stream(self) -> Pointer:
        """The op's oneDNN stream (made at its first primitive)."""
        if self._stream is None:
            self._stream = self.lib.stream()
            self._owned.append(("stream", self._stream))
        return self._stream

    def _build(self, key: tuple[object, ...], make: Callable[[], tuple[Call | None, str]]
               ) -> Call | None:
        call: Call | None = None
        why = f"more than {self.max_shapes} input layouts"
        if len(self.calls) < self.max_shapes:
            try:
                call, why = make()
            except DnnlError as exc:
                why = str(exc)
        if call is None:
            self.why_not[key] = why
        self.calls[key] = call
        return call

    def _prebuilt(self, key: tuple[object, ...], make: Callable[[], tuple[Call | None, str]]
                  ) -> Call | None:
        """The call for ``key``, built now (counted in ``built_at_load``) if no run has."""
        if key in self.calls:
            return self.calls[key]
        call = self._build(key, make)
        if call is not None:
            self.built_at_load += 1
        return call

    def _weight(self, w: Tensor, weights_md: Pointer) -> int | None:
        """The address of ``w``'s values in the format ``weights_md`` (None: over the
        op's cap on own copies). Ops with weights define it."""
        raise NotImplementedError

    def _weight_args(self, prim: Pointer, impl: str, w: Tensor, weights_md: Pointer,
                     b: Tensor | None,
                     bias_md: Pointer | None) -> tuple[list[tuple[int, Pointer]] | None, str]:
        """The weights (and bias) arguments of a built primitive; or None and why not,
        the primitive then destroyed (a reference kernel, or no copy of the weight left)."""
        lib = self.lib
        if impl.startswith("ref"):
            lib.destroy([("primitive", prim)])
            return None, f"only a reference implementation ({impl})"
        weight_ptr = self._weight(w, weights_md)
        if weight_ptr is None:
            lib.destroy([("primitive", prim)])
            return None, f"a weight format beyond {self.max_copies} own copies ({impl})"
        weights = lib.memory(weights_md, weight_ptr)
        self._owned.append(("memory", weights))
        extra = [(ARG_WEIGHTS, weights)]
        if b is not None and bias_md is not None:
            bias = lib.memory(bias_md, b.data_ptr())
            self._owned.append(("memory", bias))
            extra.append((ARG_BIAS, bias))
        return extra, ""

    def _finish(self, prim: Pointer, src_md: Pointer, dst_md: Pointer,
                extra: Sequence[tuple[int, Pointer]],
                **fields: Any) -> Call:
        """Own ``prim`` and memories for src/dst (set per call) and ``extra`` args."""
        lib, owned = self.lib, self._owned
        owned.append(("primitive", prim))
        self.stream()
        src = lib.memory(src_md)
        dst = lib.memory(dst_md)
        owned.extend(("memory", m) for m in (src, dst))
        args = [ExecArg(ARG_SRC, src), ExecArg(ARG_DST, dst),
                *(ExecArg(arg, memory) for arg, memory in extra)]
        return Call(prim, src, dst, args=(ExecArg * len(args))(*args), **fields)


class DirectKernel:
    """A node's kernel over a direct op: ``kernel(inputs) -> [op(*inputs)]``. The op
    stays reachable, so generated code calls the same op (one set of primitives per
    node) and ``explain()`` can say which layouts fell back and why."""

    __slots__ = ("op",)

    def __init__(self, op: DirectOp) -> None:
        self.op = op

    def __call__(self, inputs: Sequence[Tensor | None]) -> list[Tensor]:
        return [self.op(*inputs)]  # type: ignore[operator]


class ResidualInPlaceKernel(DirectKernel):
    """A residual convolution's kernel where the memory plan lets its output overwrite
    the residual (input 3, which dies here): ``[op.inplace_call(x, w, b, z)]``, oneDNN's
    in-place sum post-op, as generated code calls it. The interpreter and profiled
    runs then run the kernel the default backend runs. The sum post-op writes each
    output once where a binary-add post-op reads a third tensor (the figures are in
    docs/performance.md)."""

    __slots__ = ()

    def __call__(self, inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w, b, z = inputs
        assert x is not None and w is not None and z is not None
        return [self.op.inplace_call(x, w, b, z)]  # type: ignore[attr-defined]
