"""A run of segflow's own kernels replayed from recorded arguments: one C call.

Generated code calls a transformer's native kernels one by one (``kernels/linear.py``,
``kernels/layer_norm.py``, ``kernels/attention.py``). Each call checks its
tensors, allocates its result and fills a ctypes structure in Python, which runs
cold right after a kernel has swept the caches: tens of microseconds a call, a few
percent of a run made of such kernels (figures in docs/performance.md).

A :class:`NativeReplay` stands for a run of consecutive steps that are such kernels
(ops with ``prepare`` and ``run_prepared``, :class:`Replayable`) or Splits of constant
sizes (views, ``runtime/compile.py``):

- its first call runs the steps as generated code would, and notes each result's
  sizes;
- the next call with inputs of the same sizes, strides and dtypes places the results
  that die inside the run in one block the replay owns (by their lifetimes in the
  run, with the memory plan's placement rule, ``ir/memory.place``), runs each step
  through ``prepare(..., out=)`` and ``run_prepared``, and records each kernel's
  argument structure;
- from then on a call whose inputs from outside the run have the recorded sizes,
  strides and dtypes, on as many threads, writes their addresses (and those of new
  tensors for the results read after the run) into the structures and runs them all
  in one C call (``kernels/native/replay.c``, ``segflow_replay_calls``).

Results read after the run are new tensors at every call; the block holds only what
dies inside it. Inputs a kernel reads at positions other than its data (weights,
biases, scales) must be constants: generated code passes the same tensors at every
call. A call that finds the block in use (another thread's run of the same segment)
runs the usual way, as does every call once a step could not be recorded (its
fallback ran, or it copied an input first; ``why_not`` says which). Calls that do not
fit the recording run the usual way; after two in a row the run is noted again and
recorded at the next call. ``SEGFLOW_ONEDNN_REPLAY=0`` turns this replay off with the
libdnnl one.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from segflow.errors import ExecutionError, node_failed
from segflow.ir.memory import Buffer, align, place
from segflow.kernels.report import KernelReport, ReportFamily

if TYPE_CHECKING:
    from segflow.engine.counters import RunCounters
    from segflow.kernels.native.build import NativeLibrary

Tensor = torch.Tensor
# Calls in a row a recording must fail to hold for before the run is noted again.
RECORD_AFTER_MISSES = 2
_Signature = tuple[torch.Size, tuple[int, ...], torch.dtype]
_Slot = tuple[Any, str]          # (an argument structure, the field holding an address)
_Shapes = tuple[tuple[torch.Size, torch.dtype], ...]    # a kernel step's outputs


@dataclass(slots=True)
class Prepared:
    """One kernel call, ready to run: ``fn(&args)`` (``fn``: the C entry point's address).

    ``fields`` pair each input position whose address ``args`` holds with the field
    holding it (None: it cannot be replayed, ``why_not`` says why: it copies an input
    first, or does more than its kernel); ``out_field`` holds ``output``'s address, and
    ``more`` pairs each further output (a kernel with several) with its field.
    ``keep``: what the pointers need kept alive (scratch, copies). ``op`` runs and counts
    it (``run_prepared``).
    """

    fn: int
    args: Any
    output: Tensor
    fields: tuple[tuple[int, str], ...] | None
    keep: tuple[object, ...]
    op: Replayable
    out_field: str = "y"
    why_not: str = "copies an input before its kernel reads it"   # where fields is None
    more: tuple[tuple[Tensor, str], ...] = ()

    @property
    def outputs(self) -> tuple[tuple[Tensor, str], ...]:
        """Every output with the field holding its address, in the op's order."""
        return ((self.output, self.out_field), *self.more)


class Replayable(Protocol):
    """An op a :class:`NativeReplay` can record: called as generated code calls it, or
    prepared (into ``out`` where given) and run."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor | tuple[Tensor, ...]: ...

    def prepare(self, *args: Any, **kwargs: Any) -> Prepared | None: ...

    def run_prepared(self, call: Prepared) -> None: ...

    native_calls: int


@dataclass(frozen=True, slots=True)
class NativeStep:
    """One step of a replayed run: ``op(*args)``, or (``op`` None) a Split of its one
    argument into ``sizes`` along ``axis``. ``args`` and ``outputs`` index the run's
    values (its inputs from outside first, then each step's outputs in order)."""

    op: Replayable | None
    args: tuple[int | None, ...]
    outputs: tuple[int, ...]
    label: str = ""
    sizes: tuple[int, ...] = ()
    axis: int = 0


class KernelCall(ctypes.Structure):
    """``segflow_call_t`` of ``kernels/native/replay.c``: ``fn(args)``, a recorded call of a
    segflow kernel (also the pooled linear tail of ``kernels/onednn/replay.py``'s C loop)."""

    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p)]


@dataclass(slots=True)
class _Recording:
    """What a replay writes and runs: the structures' C array, the inputs from outside
    (index, signature, where their address goes), the results read after the run
    (index, sizes, dtype, where their address goes), and what must stay alive."""

    calls: ctypes.Array[KernelCall]
    status: ctypes.c_int
    fed: list[tuple[int, _Signature, list[_Slot]]]
    returned: list[tuple[int, torch.Size, torch.dtype, list[_Slot]]]
    threads: int
    ops: list[Replayable]
    labels: list[str]
    block: Tensor | None        # where the results that die inside the run live
    keep: list[object]


class NativeReplay:
    """``replay(*inputs) -> outputs``: a run of native kernels (module docstring).

    ``constants``: the input positions generated code fills with constants;
    ``outputs``: the value indices it returns (those read after the run).
    """

    def __init__(self, steps: Sequence[NativeStep], n_inputs: int, constants: Sequence[int],
                 outputs: Sequence[int], library: NativeLibrary) -> None:
        self.steps = tuple(steps)
        self.n_inputs = n_inputs
        self.constants = frozenset(constants)
        self.outputs = tuple(outputs)
        self.n_values = n_inputs + sum(len(step.outputs) for step in self.steps)
        self.kernels = sum(1 for step in self.steps if step.op is not None)
        fn = library.dll.segflow_replay_calls
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._run_calls = fn
        self._busy = threading.Lock()
        self._seen: tuple[list[_Signature | None], list[_Shapes]] | None = None
        self._recording: _Recording | None = None
        self._misses = 0
        self.why_not = ""        # why the run is never recorded (a step it cannot replay)
        self.replays = 0         # calls that replayed (counted for tests and explain)

    family = ReportFamily.NATIVE_REPLAY

    @property
    def label(self) -> str:
        """The run's first node (Node.label)."""
        return self.steps[0].label if self.steps else ""

    def counters(self) -> Mapping[str, int]:
        """The kernels of the run, and the calls that replayed them (one C call each)."""
        return {"kernels": self.kernels, "replays": self.replays}

    def parts(self) -> Sequence[KernelReport]:
        """Its kernels report through their own nodes."""
        return ()

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, NativeReplay]], limit: int = 8
                     ) -> list[str]:
        """``explain()`` lines: the replayed runs of native kernels, and any left
        unrecorded."""
        if not ops:
            return []
        replays = [r for _, r in ops]
        kernels = sum(r.kernels for r in replays)
        calls = sum(r.replays for r in replays)
        held = sum(r.block_bytes for r in replays) / (1 << 20)
        lines = [f"{cls.family.value}: {len(replays)} run"
                 f"{'s' if len(replays) > 1 else ''}, {kernels} kernels; {calls} calls "
                 f"replayed so far (one C call each; {held:.1f} MiB held for their results "
                 f"between runs)"]
        for r in replays:
            if r.why_not:
                lines.append(f"  {r.kernels} kernels: not replayed ({r.why_not})")
        return lines

    @property
    def block_bytes(self) -> int:
        """Bytes of the block the recording keeps for the run's results (0: none)."""
        rec = self._recording
        return rec.block.numel() if rec is not None and rec.block is not None else 0

    def __call__(self, *inputs: Tensor | None, counts: RunCounters | None = None
                 ) -> tuple[Tensor | None, ...]:
        """The run's outputs; its kernels (every step, Splits included) and its calls
        into native code (one for a replay, else one per kernel) counted in ``counts``."""
        if counts is not None:
            counts.count_kernels(len(self.steps))
        if not self._busy.acquire(blocking=False):
            if counts is not None:
                counts.count_native_calls(self.kernels)
            return self._usual(inputs)       # another thread's run holds the block
        try:
            rec = self._recording
            if rec is not None:
                if self._holds(rec, inputs):
                    self._misses = 0
                    if counts is not None:
                        counts.count_native_calls()
                    return self._replay(rec, inputs)
                self._misses += 1
                if self._misses < RECORD_AFTER_MISSES:
                    if counts is not None:
                        counts.count_native_calls(self.kernels)
                    return self._usual(inputs)
                self._recording = None
                self._seen = None
            if counts is not None:  # the usual way, or recording: kernel by kernel
                counts.count_native_calls(self.kernels)
            seen = self._seen
            if self.why_not or seen is None or seen[0] != self._signatures(inputs):
                return self._usual(inputs, note=not self.why_not)
            return self._record(inputs, seen[1])
        finally:
            self._busy.release()

    # -- the usual way ---------------------------------------------------------------
    def _usual(self, inputs: Sequence[Tensor | None], note: bool = False
               ) -> tuple[Tensor | None, ...]:
        values: list[Tensor | None] = [*inputs, *([None] * (self.n_values - self.n_inputs))]
        self._run_from(0, values)
        if note:
            shapes: list[_Shapes] = []
            for step in self.steps:
                if step.op is not None:
                    outs = [values[slot] for slot in step.outputs]
                    assert all(t is not None for t in outs)
                    shapes.append(tuple((t.shape, t.dtype) for t in outs))  # type: ignore[union-attr]
            self._seen = (self._signatures(inputs), shapes)
            self._misses = 0
        return tuple(values[i] for i in self.outputs)

    def _run_from(self, first: int, values: list[Tensor | None]) -> None:
        for step in self.steps[first:]:
            try:
                if step.op is None:
                    _split(step, values)
                else:
                    result = step.op(*[None if a is None else values[a] for a in step.args])
                    results = result if isinstance(result, tuple) else (result,)
                    for slot, tensor in zip(step.outputs, results, strict=True):
                        values[slot] = tensor
            except ExecutionError:
                raise
            except Exception as exc:
                raise node_failed(step.label, exc) from exc

    def _signatures(self, inputs: Sequence[Tensor | None]) -> list[_Signature | None]:
        return [None if t is None or i in self.constants else (t.shape, t.stride(), t.dtype)
                for i, t in enumerate(inputs)]

    # -- recording -------------------------------------------------------------------
    def _layout(self, shapes: Sequence[_Shapes]) -> tuple[Tensor | None, dict[int, Tensor]]:
        """One block for the kernels' results that die inside the run, and a view of it
        per such result (by value index)."""
        root: dict[int, int] = {}    # a split's parts -> the value they are views of
        end: dict[int, int] = {}     # root -> the last step reading it (or a part of it)
        made: dict[int, tuple[int, torch.Size, torch.dtype]] = {}
        kernel = 0
        for index, step in enumerate(self.steps):
            for a in step.args:
                if a is not None:
                    end[root.get(a, a)] = index
            if step.op is None:
                source = step.args[0]
                assert source is not None
                for slot in step.outputs:
                    root[slot] = root.get(source, source)
            else:
                for slot, (shape, dtype) in zip(step.outputs, shapes[kernel], strict=True):
                    made[slot] = (index, shape, dtype)
                kernel += 1
        returned = {root.get(i, i) for i in self.outputs}
        wanted = []
        for slot, (start, shape, dtype) in made.items():
            if slot in returned:
                continue
            nbytes = align(shape.numel() * dtype.itemsize)
            wanted.append((Buffer((str(slot),), nbytes, start, end.get(slot, start)),
                           slot, shape, dtype))
        if not wanted:
            return None, {}
        placed = place([buffer for buffer, _, _, _ in wanted])
        views = {}
        # Ordinary tensors even when this run is under inference_mode (``run``): a later
        # ``run_tensors`` replays outside it.
        with torch.inference_mode(False):
            block = torch.empty(max(b.offset + b.nbytes for b in placed), dtype=torch.uint8)
            for buffer, (_, slot, shape, dtype) in zip(placed, wanted, strict=True):
                span = block[buffer.offset:buffer.offset + shape.numel() * dtype.itemsize]
                views[slot] = span.view(dtype).view(shape)
        return block, views

    def _record(self, inputs: Sequence[Tensor | None],
                shapes: Sequence[_Shapes]) -> tuple[Tensor | None, ...]:
        """Run with the kernels' results in the block, recording each call."""
        block, views = self._layout(shapes)
        values: list[Tensor | None] = [*inputs, *([None] * (self.n_values - self.n_inputs))]
        calls: list[tuple[Prepared, NativeStep]] = []
        for index, step in enumerate(self.steps):
            if step.op is None:
                source = step.args[0]
                assert source is not None
                if source < self.n_inputs:
                    self.why_not = f"{step.label} splits a tensor from outside the run"
                    self._run_from(index, values)
                    return tuple(values[i] for i in self.outputs)
                _split(step, values)
                continue
            args = [None if a is None else values[a] for a in step.args]
            outs = [views.get(slot) for slot in step.outputs]
            try:
                call = step.op.prepare(*args, out=outs[0] if len(outs) == 1 else tuple(outs))
            except Exception as exc:
                raise node_failed(step.label, exc) from exc
            why = self._unfit(step, call, outs)
            if why:
                self.why_not = f"{step.label} {why}"
                self._run_from(index, values)
                return tuple(values[i] for i in self.outputs)
            assert call is not None
            try:
                step.op.run_prepared(call)
            except Exception as exc:
                raise node_failed(step.label, exc) from exc
            for slot, (tensor, _) in zip(step.outputs, call.outputs, strict=True):
                values[slot] = tensor
            calls.append((call, step))
        self._recording = self._recorded(inputs, values, calls, block)
        return tuple(values[i] for i in self.outputs)

    def _unfit(self, step: NativeStep, call: Prepared | None, outs: Sequence[Tensor | None]
               ) -> str:
        """Why ``call`` cannot be replayed ("" where it can); ``outs``: the storage given
        for each of the step's outputs."""
        if call is None:
            return "has no native call to record (its fallback runs, or a form it does not record)"
        if call.fields is None:
            return call.why_not
        if len(call.outputs) != len(step.outputs):
            return "returns another number of outputs than its node"
        if any(out is not None and made is not out
               for out, (made, _) in zip(outs, call.outputs, strict=True)):
            return "did not write into the run's storage"
        fields = {position for position, _ in call.fields}
        for position, a in enumerate(step.args):
            if a is not None and position not in fields and a not in self.constants:
                return f"reads a computed tensor as its input {position}"
        return ""

    def _recorded(self, inputs: Sequence[Tensor | None], values: Sequence[Tensor | None],
                  calls: Sequence[tuple[Prepared, NativeStep]], block: Tensor | None
                  ) -> _Recording:
        """The recording of the run that just made ``values`` through ``calls``."""
        readers: dict[int, list[_Slot]] = {}     # value index -> where its address goes
        for call, step in calls:
            assert call.fields is not None
            for position, field in call.fields:
                a = step.args[position] if position < len(step.args) else None
                if a is not None:
                    readers.setdefault(a, []).append((call.args, field))
        fed = []
        for i, t in enumerate(inputs):
            if t is not None and i not in self.constants and i in readers:
                fed.append((i, (t.shape, t.stride(), t.dtype), readers[i]))
        producer = {slot: (call.args, field) for call, step in calls
                    for slot, (_, field) in zip(step.outputs, call.outputs, strict=True)}
        returned = []
        for i in self.outputs:
            t = values[i]
            assert t is not None and i in producer
            returned.append((i, t.shape, t.dtype, [producer[i], *readers.get(i, [])]))
        array = (KernelCall * len(calls))()
        for entry, (call, _) in zip(array, calls, strict=True):
            entry.fn = call.fn
            entry.args = ctypes.addressof(call.args)
        keep: list[object] = [*(call.args for call, _ in calls),
                              *(k for call, _ in calls for k in call.keep)]
        # The views of the block that later calls' structures point at stay with it.
        keep += [v for i, v in enumerate(values) if i >= self.n_inputs and i not in self.outputs]
        return _Recording(array, ctypes.c_int(0), fed, returned, torch.get_num_threads(),
                          [call.op for call, _ in calls], [step.label for _, step in calls],
                          block, keep)

    # -- replaying -------------------------------------------------------------------
    def _holds(self, rec: _Recording, inputs: Sequence[Tensor | None]) -> bool:
        if torch.get_num_threads() != rec.threads:
            return False
        for i, signature, _ in rec.fed:
            t = inputs[i]
            if t is None or (t.shape, t.stride(), t.dtype) != signature:
                return False
        return True

    def _replay(self, rec: _Recording, inputs: Sequence[Tensor | None]
                ) -> tuple[Tensor | None, ...]:
        for i, _, slots in rec.fed:
            address = inputs[i].data_ptr()    # type: ignore[union-attr]
            for args, field in slots:
                setattr(args, field, address)
        results: dict[int, Tensor] = {}
        for i, shape, dtype, slots in rec.returned:
            t = results[i] = torch.empty(shape, dtype=dtype)
            address = t.data_ptr()
            for args, field in slots:
                setattr(args, field, address)
        done = self._run_calls(ctypes.addressof(rec.calls), len(rec.calls),
                               ctypes.addressof(rec.status))
        if done != len(rec.calls):
            self._recording = None
            raise node_failed(rec.labels[done], RuntimeError(
                f"native kernel status {rec.status.value}"))
        for op in rec.ops:        # unlocked: another thread's count may be lost, not a run
            op.native_calls += 1
        self.replays += 1
        return tuple(results.get(i) for i in self.outputs)


def _split(step: NativeStep, values: list[Tensor | None]) -> None:
    """A Split step: its argument's parts, views, into its outputs' values."""
    source = step.args[0]
    assert source is not None
    x = values[source]
    assert x is not None
    for slot, part in zip(step.outputs, x.split(list(step.sizes), step.axis), strict=True):
        values[slot] = part
