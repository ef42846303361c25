"""A run of direct libdnnl kernels replayed from recorded addresses: one Python call.

Generated code calls each direct convolution and pooling (``kernels/onednn/``)
in turn. Each call looks up its primitive by the input's sizes and strides, finds
its output in the run's arena, reads the tensors' addresses and executes: several
microseconds of Python per call, more right after a kernel has flushed the caches,
which adds up over a run of many small kernels (figures in docs/performance.md).

A :class:`DirectReplay` stands for such a run of consecutive nodes. Its first
calls run the ops as before; once a run has its arena block (``runtime/arena.py``)
and every primitive is built, it records, per node, the primitive and the
addresses its memories point at. A later call checks that the recording still
holds, and then only executes:

- the run's arena block is the recorded one (the arena hands each run the same
  block, with the same tensors, from run to run; a concurrent run has another);
- every input from outside the run is the recorded tensor, or has the recorded
  sizes, strides and dtype (a new feed), whose address is then written into the
  recording; weights and biases must be the recorded ones;
- nodes that cannot be replayed (an input staged into channels-last first, an
  activation run after the kernel, a fallback to torch) run as before, and must
  return the recorded tensor; one that does not ends the replay there, the rest
  of the run goes the usual way and the next run records again. A node whose
  output was not the run's planned storage when recorded ends the recording:
  it and the nodes after it always run the usual way.

A pooled linear tail right after the run (a Flatten at axis 1 of its last output,
the global pooling's, and a native linear over that, ``kernels/linear.py``) is part
of it: the Flatten's view of the pooled output is recorded like the outputs, and the
linear, prepared once, runs from its recorded arguments into a new result at every
call (the run's output, which the caller keeps), as the last step of the C call below
(``segflow_call_execute``), its result allocated before it: no Python between the
last pooling and the linear. A linear it cannot run so (an activation after the
kernel) runs the usual way, as do the steps after it.

A call the recording does not hold for runs the usual way; after two such calls
in a row (a new batch size) the run is recorded again, while two threads whose
runs alternate between two arena blocks leave the first recording in place.

Each execute still honours the op: its lock is held, and its memories are
re-pointed only where they point elsewhere (another path, such as a profiled run,
may have moved them). Where the native library loads (``kernels/native/build.py``),
each stretch of consecutive executes is one C call (``kernels/native/replay.c``)
under all of that stretch's op locks, taken without waiting; a lock held by
another thread's run sends the stretch through ``DirectOp.execute_at``, one op
at a time, as without the library. A Winograd convolution (``kernels/winograd.py``) is
such an execute too: its step calls the native kernel in place of libdnnl's
execute, and the stretch also takes the lock of the workspace it shares.
``SEGFLOW_ONEDNN_REPLAY=0`` turns the replay off, ``SEGFLOW_NATIVE=0`` its C loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from segflow.errors import ExecutionError, node_failed
from segflow.kernels.linear import NativeLinear
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.binary import DirectBinary
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.pool import DirectPool
from segflow.kernels.onednn.stretch import (
    IN_STRETCH,
    TAIL_LINEAR,
    VIEW,
    Addresses,
    DirectReplayOp,
    Entry,
    NativeStretch,
    ReplayStep,
    run_tail_linear,
    stretches,
)
from segflow.kernels.report import KernelReport, ReportFamily

if TYPE_CHECKING:
    from segflow.engine.counters import RunCounters

Tensor = torch.Tensor
# Calls in a row a recording must fail to hold for before the run is recorded again.
RECORD_AFTER_MISSES = 2
_Slot = tuple[Addresses, int]                  # (a step's addresses, position)
_Fed = tuple[int, tuple[object, ...], list[_Slot]]


class _Recording:
    """What one run looked like: its values, and per step how to redo it."""

    __slots__ = ("values", "probe", "fixed", "fed", "plan", "program", "rest", "transient")

    def __init__(self, values: list[Tensor | None], probe: tuple[DirectReplayOp, Tensor],
                 fixed: list[int], fed: list[_Fed], plan: list[Entry],
                 program: list[Entry | NativeStretch], rest: int) -> None:
        self.values = values
        self.probe = probe     # (an op, the output its destination gave): the arena block
        self.fixed = fixed     # outside inputs that must be the recorded tensors
        # Outside inputs read as data: (index, (sizes, strides, dtype), where the plan
        # holds their address: (a step's [src, dst, residual] list, position)).
        self.fed = fed
        # Per step: (step index, execute_at or None (run the op), call, addresses).
        self.plan = plan
        # What a replay runs: the plan, its stretches of executes each one native call
        # where the library loads.
        self.program = program
        # The steps from this one on run the usual way after the plan (the first of them
        # returned a new tensor, not the run's planned storage).
        self.rest = rest
        # Values dropped after each call, so that a recording never keeps a caller's
        # feed or a tensor a step allocated alive between runs: the inputs other than
        # weights, and the outputs of the steps after the plan.
        self.transient: list[int] = []


class DirectReplay:
    """``replay(*inputs) -> outputs``: a run of direct kernels (module docstring).

    ``inputs`` are the values the run reads from outside (``n_inputs`` of them);
    ``outputs`` the value indices it returns (those read after the run).
    """

    def __init__(self, steps: Sequence[ReplayStep], n_inputs: int, outputs: Sequence[int],
                 native: NativeLibrary | None = None,
                 native_why: str = "are off for this replay") -> None:
        self.steps = tuple(steps)
        # The library whose C loop runs each stretch of executes (None: Python calls
        # each execute, ``native_why`` says why); read when a run is recorded.
        self.native = native
        self.native_why = native_why
        self.n_inputs = n_inputs
        self.outputs = tuple(outputs)
        self._recording: _Recording | None = None
        self._misses = 0           # calls in a row the recording did not hold for
        self.replays = 0           # calls that replayed (counted for tests and explain)

    family = ReportFamily.DIRECT_REPLAY

    @property
    def label(self) -> str:
        """The run's first node (Node.label)."""
        return self.steps[0].label if self.steps else ""

    def counters(self) -> Mapping[str, int]:
        """The run's nodes, and the calls that replayed them."""
        return {"nodes": len(self.steps), "replays": self.replays}

    def parts(self) -> Sequence[KernelReport]:
        """Its kernels report through their own nodes."""
        return ()

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, DirectReplay]], limit: int = 8
                     ) -> list[str]:
        """``explain()`` lines: the replayed runs, their nodes, and what the last recording
        replays (nodes that run the usual way inside it, and where it stops)."""
        if not ops:
            return []
        replays = [r for _, r in ops]
        nodes = sum(len(r.steps) for r in replays)
        calls = sum(r.replays for r in replays)
        lines = [f"{cls.family.value}: {len(replays)} run{'s' if len(replays) > 1 else ''} "
                 f"of direct kernels, {nodes} nodes; {calls} calls replayed so far"]
        lines += [_describe_recording(r) for r in replays]
        return lines

    def __call__(self, *inputs: Tensor | None, counts: RunCounters | None = None
                 ) -> tuple[Tensor | None, ...]:
        """The run's outputs; its kernels (every step) and its calls into native code
        are counted in ``counts``."""
        recording = self._recording
        if recording is not None:
            if self._holds(recording, inputs):
                self._misses = 0
                return self._replay(recording, counts)
            self._misses += 1
        values: list[Tensor | None] = [*inputs, *([None] * len(self.steps))]
        calls = self._run_from(0, values)
        if counts is not None:
            counts.count_kernels(len(self.steps))
            counts.count_native_calls(calls)
        # Recorded again after a second call in a row it did not hold for: a new size
        # (another arena block) is replayed from its third run on, while two threads
        # running at once (two blocks) do not record over each other at every call.
        if recording is None or self._misses >= RECORD_AFTER_MISSES:
            self._recording = self._record(values)
            self._misses = 0
        return tuple(values[i] for i in self.outputs)

    def _run_from(self, first: int, values: list[Tensor | None]) -> int:
        """Run the steps from ``first`` on the usual way; the op calls made (a Flatten
        is a view, not a call)."""
        calls = 0
        for step in self.steps[first:]:
            try:
                values[step.output] = _call(step, values)
            except ExecutionError:
                raise
            except Exception as exc:
                raise node_failed(step.label, exc) from exc
            calls += step.op is not None
        return calls

    # -- replaying -------------------------------------------------------------------
    def _holds(self, rec: _Recording, inputs: Sequence[Tensor | None]) -> bool:
        op, out = rec.probe
        assert op.destination is not None
        if op.destination() is not out:
            return False             # another arena block (a concurrent run) or none
        values = rec.values
        for i in rec.fixed:
            if inputs[i] is not values[i]:
                return False
        for i, signature, slots in rec.fed:
            t = inputs[i]
            if t is values[i]:
                continue
            if t is None or (t.shape, t.stride(), t.dtype) != signature:
                return False
            address = t.data_ptr()
            for addresses, position in slots:   # the recording of this arena block's run
                addresses[position] = address
        values[:self.n_inputs] = inputs         # steps that run as before read them too
        return True

    def _result(self, values: list[Tensor | None], transient: Sequence[int]
                ) -> tuple[Tensor | None, ...]:
        result = tuple(values[i] for i in self.outputs)
        for i in transient:
            values[i] = None
        return result

    def _replay(self, rec: _Recording, counts: RunCounters | None
                ) -> tuple[Tensor | None, ...]:
        values = rec.values
        steps = self.steps
        if counts is not None:
            # Every step runs: replayed, the usual way, or as the recorded view.
            counts.count_kernels(len(steps))
        calls = 0  # calls into native code
        for entry in rec.program:
            if entry.__class__ is NativeStretch:
                calls += entry(values)      # type: ignore[operator]
                continue
            index, execute_at, call, (src, dst, res) = entry   # type: ignore[misc]
            step = steps[index]
            if execute_at is VIEW or execute_at is IN_STRETCH:
                continue                    # the recorded view; the linear the C call ran
            calls += 1
            try:
                if execute_at is TAIL_LINEAR:
                    values[step.output] = run_tail_linear(call)   # type: ignore[arg-type]
                    continue
                if execute_at is not None:
                    execute_at(call, src, dst, res)  # type: ignore[operator]
                    continue
                out = _call(step, values)
            except ExecutionError:
                raise
            except Exception as exc:
                raise node_failed(step.label, exc) from exc
            if out is not values[step.output]:
                # Not the recorded tensor: later addresses may be stale. The rest goes
                # the usual way, and the recording is dropped (made again next call).
                values = list(values)
                values[step.output] = out
                calls += self._run_from(index + 1, values)
                self._recording = None
                if counts is not None:
                    counts.count_native_calls(calls)
                return tuple(values[i] for i in self.outputs)
        if rec.rest < len(steps):
            calls += self._run_from(rec.rest, values)
        if counts is not None:
            counts.count_native_calls(calls)
        self.replays += 1
        return self._result(values, rec.transient)

    # -- recording -------------------------------------------------------------------
    def _record(self, values: list[Tensor | None]) -> _Recording | None:
        """The recording of the run that just made ``values``, or None where it cannot
        be replayed (no arena block, a primitive not built)."""
        probe = None
        n = self.n_inputs
        first = next((step.op for step in self.steps
                      if isinstance(step.op, DirectConv | DirectPool | DirectBinary)
                      and step.op.destination is not None), None)
        if first is None or first.destination() is None:   # type: ignore[misc]
            return None                 # no arena block in this run: nothing to record
        fixed: set[int] = set()
        fed: dict[int, list[_Slot]] = {}
        plan: list[Entry] = []
        replayed = 0
        rest = len(self.steps)
        for index, step in enumerate(self.steps):
            op = step.op
            args = [None if a is None else values[a] for a in step.args]
            x, out = args[0], values[step.output]
            source_arg = scale_arg = None
            if op is None or isinstance(op, NativeLinear):
                entry = self._tail_entry(index, step, args, fixed)
                if entry is None:
                    rest = index     # the tail runs as before
                    break
                plan.append(entry)
                continue
            given = op.destination() if op.destination is not None else None
            if given is not None and probe is None and given is out:
                probe = (op, given)
            if isinstance(op, DirectConv):
                w, b = args[1], args[2] if len(args) > 2 else None
                z = args[3] if len(args) > 3 else None
                if step.inplace and step.args[3] is not None and step.args[3] < n:
                    return None    # its output is a tensor from outside: not recordable
                for a in step.args[1:3]:
                    if a is not None and a < n:
                        fixed.add(a)       # the weight and bias a primitive was built for
                assert x is not None and w is not None
                call = op.call_for(x, z, step.inplace)
                target = z if step.inplace else given
                ok = (call is not None and call.source is w and call.bias is b
                      and call.in_format is None and op.after is None and out is target)
            elif isinstance(op, DirectBinary):
                # The big operand is the call's source, the scale its third memory; in
                # place, the source is also its destination.
                order = (0, 1) if op.broadcast_input == 1 else (1, 0)
                source_arg, scale_arg = (step.args[i] for i in order)
                x, z = (args[i] for i in order)
                assert x is not None and z is not None
                if step.inplace and source_arg is not None and source_arg < n:
                    return None    # its output is a tensor from outside: not recordable
                call = op.call_for(x, z)
                target = x if step.inplace else given
                ok = call is not None and out is target
            else:
                z = None
                assert x is not None
                call = op.call_for(x)
                target = given
                ok = call is not None and out is given
            if not ok or call is None or out is None:
                if out is None or out is not target:
                    rest = index     # a new tensor each run: the rest runs as before
                    break
                plan.append((index, None, None, (ctypes.c_size_t * 3)()))
                continue
            addresses = (ctypes.c_size_t * 3)(
                x.data_ptr(), out.data_ptr(),
                0 if call.residual is None or z is None else z.data_ptr())
            if isinstance(op, DirectBinary):
                residual = scale_arg
            else:
                source_arg = step.args[0]
                residual = step.args[3] if len(step.args) > 3 and call.residual is not None \
                    else None
            for position, a in ((0, source_arg), (2, residual)):
                if a is not None and a < n:      # from outside the run: may be a new tensor
                    fed.setdefault(a, []).append((addresses, position))
            plan.append((index, op.execute_at, call, addresses))
            replayed += 1
        if probe is None or not replayed:
            return None
        signatures: list[_Fed] = []
        for i, slots_of in fed.items():
            t = values[i]
            assert t is not None
            signatures.append((i, (t.shape, t.stride(), t.dtype), slots_of))
        kept = sorted(fixed - set(fed))
        program: list[Entry | NativeStretch] = list(plan) if self.native is None \
            else stretches(plan, self.steps, self.native)
        rec = _Recording(list(values), probe, kept, signatures, plan, program, rest)
        rec.transient = [i for i in range(n) if i not in fixed or i in fed] + \
            [step.output for step in self.steps[rest:]] + \
            [self.steps[entry[0]].output for entry in plan if entry[1] is TAIL_LINEAR]
        self._result(rec.values, rec.transient)
        return rec

    def _tail_entry(self, index: int, step: ReplayStep, args: Sequence[Tensor | None],
                          fixed: set[int]) -> Entry | None:
        """The plan entry of the tail after the run: its Flatten (the recorded
        view of the pooled output, whose storage is the arena block's) or its linear
        (prepared once; each replay runs it into a new result). None where the linear
        cannot run so (its fallback, an activation after it, a computed weight)."""
        empty = (ctypes.c_size_t * 3)()
        if step.op is None:
            return (index, VIEW, None, empty)
        n = self.n_inputs
        if step.args[0] is None or step.args[0] < n \
                or any(a is not None and a >= n for a in step.args[1:]):
            return None
        op = step.op
        assert isinstance(op, NativeLinear) and args[0] is not None and args[1] is not None
        call = op.prepare(args[0], args[1], args[2] if len(args) > 2 else None)
        if call is None or call.fields is None:
            return None
        fixed.update(a for a in step.args[1:] if a is not None)
        return (index, TAIL_LINEAR, call, empty)


def _call(step: ReplayStep, values: Sequence[Tensor | None]) -> Tensor:
    """Run ``step``'s op the usual way on the run's ``values``."""
    args = [None if a is None else values[a] for a in step.args]
    op = step.op
    if op is None:
        assert args[0] is not None
        return args[0].flatten(1)
    fn: Callable[..., Tensor] = op.inplace_call if step.inplace else op  # type: ignore[union-attr]
    return fn(*args)


def _describe_recording(r: DirectReplay) -> str:
    """The ``explain()`` line of one replayed run's recording."""
    rec = r._recording
    if rec is None:
        return f"  {len(r.steps)} nodes: not recorded (yet)"
    executes = sum(1 for entry in rec.plan
                   if entry[1] is not None and entry[1] not in (VIEW, TAIL_LINEAR))
    tail = any(entry[1] is TAIL_LINEAR for entry in rec.plan)
    text = f"  {len(r.steps)} nodes: {executes} replayed"
    stretches = [e for e in rec.program if isinstance(e, NativeStretch)]
    if stretches:
        text += (f" ({sum(len(e.entries) for e in stretches)} of them in "
                 f"{len(stretches)} native call{'s' if len(stretches) > 1 else ''})")
    elif executes > 1 and r.native is None:
        text += f" (called from Python: native kernels {r.native_why})"
    if tail:
        joined = any(isinstance(e, NativeStretch) and e.tail is not None
                     for e in rec.program)
        text += (", the pooled linear tail native from recorded arguments"
                 + (" as the native call's last step" if joined else ""))
    before = len(rec.plan) - executes - (2 if tail else 0)
    if before:
        text += f", {before} run as before inside the replay"
    if rec.rest < len(r.steps):
        text += f", the last {len(r.steps) - rec.rest} after it"
    return text
