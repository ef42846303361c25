"""The C form of a replayed run of direct kernels (``kernels/onednn/replay.py``): its
steps, and each stretch of consecutive executes, with the pooled linear tail's linear
after the last of them, as one native call (``kernels/native/replay.c``).

A pooled linear tail is GlobalAveragePool -> Flatten -> linear: the Flatten at axis 1
of the run's last output (a view, recorded like the outputs) and a native linear over
it (``kernels/linear.py``), prepared once and run from its recorded arguments into a
new result at every call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from segflow.errors import ExecutionError, node_failed
from segflow.kernels.linear import NativeLinear
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.binary import DirectBinary
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.library import DnnlError
from segflow.kernels.onednn.op import Call, DirectOp
from segflow.kernels.onednn.pool import DirectPool
from segflow.kernels.replay import KernelCall, Prepared

Tensor = torch.Tensor
Addresses = ctypes.Array[ctypes.c_size_t]     # a step's [src, dst, residual] addresses
# A recording's plan entry: (step, execute_at or a marker below or None, call, addresses).
Entry = tuple[int, object, object, Addresses]
VIEW = "view"                # a plan entry whose value is the recorded view (Flatten)
TAIL_LINEAR = "tail linear"  # a plan entry whose prepared native linear runs afresh
IN_STRETCH = "in stretch"    # a program entry: that linear ran in the C call before it
# The direct kernels a replay runs as recorded executes.
DirectReplayOp = DirectConv | DirectPool | DirectBinary


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """One node of a replayed run: ``op(*args)`` (``op.inplace_call`` with ``inplace``).

    ``args`` index the run's values (the inputs from outside the run first, then each
    step's output in order; None: an absent optional input), ``output`` its output's.
    An error in a step names its node: ``ExecutionError("While executing <label>: ...")``,
    as generated code does for the nodes it calls one by one.
    """

    # A direct kernel; or, after the run's last one, the pooled linear tail: its Flatten
    # at axis 1 (None: a view of the pooled output) and its native linear
    # (kernels/linear.py).
    op: DirectReplayOp | NativeLinear | None
    inplace: bool
    args: tuple[int | None, ...]
    output: int
    label: str = ""         # the node, for errors (Node.label)


class _Execute(ctypes.Structure):
    """One step of a native stretch: ``segflow_execute_t`` in ``kernels/native/replay.c``."""

    _fields_ = [("primitive", ctypes.c_void_p), ("stream", ctypes.c_void_p),
                ("args", ctypes.c_void_p), ("nargs", ctypes.c_int64),
                ("memory", ctypes.c_void_p * 3), ("handles", ctypes.c_void_p),
                ("address", ctypes.c_void_p), ("run", ctypes.c_void_p)]


class NativeStretch:
    """Consecutive replayed executes run by one C call (module docstring), and the
    pooled linear tail's linear right after them where the recording has one: ``tail``
    (its output's value index, the prepared call, its label), run as the call's last
    step into a new result (``segflow_call_execute`` in ``kernels/native/replay.c``)."""

    __slots__ = ("entries", "labels", "locks", "tail", "_steps", "_call", "_args",
                 "_status", "_linear")

    def __init__(self, entries: Sequence[tuple[DirectOp, Call, Addresses]],
                 labels: Sequence[str], native: NativeLibrary,
                 tail: tuple[int, Prepared, str] | None = None) -> None:
        self.entries = tuple(entries)
        self.labels = tuple(labels)
        self.tail = tail
        # The ops' locks, then the workspaces their native kernels share (kernels/workspace.py).
        self.locks = tuple(dict.fromkeys(
            [op.lock for op, _, _ in self.entries]
            + [call.lock for _, call, _ in self.entries if call.lock is not None]))
        steps = (_Execute * (len(self.entries) + (tail is not None)))()
        for step, (op, call, addresses) in zip(steps, self.entries):
            step.primitive = call.primitive.value
            step.stream = op._stream.value if op._stream is not None else None
            step.args = ctypes.addressof(call.args)
            step.nargs = len(call.args)
            step.memory[0] = call.src.value
            step.memory[1] = call.dst.value
            step.memory[2] = call.residual.value if call.residual is not None else None
            step.handles = ctypes.addressof(call.handles)
            step.address = ctypes.addressof(addresses)
            if call.run is not None:
                step.run = ctypes.cast(call.run, ctypes.c_void_p).value
        self._linear: KernelCall | None = None
        if tail is not None:   # no memories to point: the C loop only calls it
            prepared = tail[1]
            self._linear = KernelCall(prepared.fn, ctypes.addressof(prepared.args))
            steps[-1].primitive = ctypes.addressof(self._linear)
            steps[-1].run = ctypes.cast(native.dll.segflow_call_execute, ctypes.c_void_p).value
        self._steps = steps
        self._status = ctypes.c_int(0)
        fn = native.dll.segflow_replay_executes
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int64
        dll = self.entries[0][0].lib._dll
        self._call = fn
        self._args = (ctypes.addressof(steps), len(steps),
                      ctypes.cast(dll.dnnl_primitive_execute, ctypes.c_void_p).value,
                      ctypes.cast(dll.dnnl_memory_set_data_handle, ctypes.c_void_p).value,
                      ctypes.addressof(self._status))

    def __call__(self, values: list[Tensor | None]) -> int:
        """Run the stretch; the calls into native code it made (1: the C loop)."""
        tail = self.tail
        locks = self.locks
        for taken, lock in enumerate(locks):
            if not lock.acquire(blocking=False):
                for held in locks[:taken]:   # another thread runs one of these ops now
                    held.release()
                break
        else:
            try:
                # The tail's new result, its address in the linear's arguments.
                out = fresh_output(tail[1]) if tail is not None else None
                done = self._call(*self._args)
            finally:
                for lock in locks:
                    lock.release()
            if done == len(self._steps):
                if tail is not None:
                    cast(NativeLinear, tail[1].op).count_native_call()
                    values[tail[0]] = out
                return 1
            if done == len(self.entries):    # the tail's linear (a status it returned)
                assert tail is not None
                raise node_failed(tail[2], RuntimeError(
                    f"native linear: status {self._status.value}"))
            op, call, _ = self.entries[done]
            raise node_failed(self.labels[done], DnnlError(
                f"{op.kind} ({call.impl}): oneDNN status {self._status.value}"))
        for (op, call, (src, dst, res)), label in zip(self.entries, self.labels, strict=True):
            try:
                op.execute_at(call, src, dst, res)
            except ExecutionError:
                raise
            except Exception as exc:
                raise node_failed(label, exc) from exc
        if tail is not None:
            index, prepared, label = tail
            try:
                values[index] = run_tail_linear(prepared)
            except Exception as exc:
                raise node_failed(label, exc) from exc
        return len(self.entries) + (tail is not None)


def stretches(plan: Sequence[Entry], steps: Sequence[ReplayStep],
               native: NativeLibrary) -> list[Entry | NativeStretch]:
    """``plan`` with each run of two or more consecutive executes made one native call,
    the tail's linear right after the last run (its Flatten a recorded view in
    between) the last step of that call."""
    program: list[Entry | NativeStretch] = []
    run: list[Entry] = []
    views: list[Entry] = []     # the Flatten after the run (nothing to do at a replay)

    def close(tail: Entry | None = None) -> None:
        if len(run) > 1:
            linear = None
            if tail is not None:
                index, _, call, _ = tail
                linear = (steps[index].output, cast(Prepared, call), steps[index].label)
            program.append(NativeStretch(
                [(cast(DirectOp, steps[index].op), cast(Call, call), addresses)
                 for index, _, call, addresses in run],
                [steps[index].label for index, _, _, _ in run], native, linear))
            program.extend(views)
            if tail is not None:
                program.append((tail[0], IN_STRETCH, None, tail[3]))
        else:
            program.extend(run + views + ([tail] if tail is not None else []))
        run.clear()
        views.clear()
    for entry in plan:
        if entry[1] is VIEW and run:
            views.append(entry)
        elif entry[1] is TAIL_LINEAR and run and in_c(cast(Prepared, entry[2])):
            close(entry)
        elif entry[1] is None or entry[1] is VIEW or entry[1] is TAIL_LINEAR:
            close()
            program.append(entry)
        else:
            run.append(entry)
    close()
    return program


def in_c(call: Prepared) -> bool:
    """Whether a prepared tail linear can run as a step of the C loop: its kernel
    needs nothing but its arguments (no Strassen scratch, which the op's lock guards)."""
    return not getattr(call.args, "scratch", None)




def fresh_output(call: Prepared) -> Tensor:
    """A new result tensor for a prepared tail linear, its address written into
    the call's arguments (the run's output: the caller keeps it)."""
    out = torch.empty(call.output.shape, dtype=call.output.dtype)
    setattr(call.args, call.out_field, out.data_ptr())
    return out


def run_tail_linear(call: Prepared) -> Tensor:
    """The tail's linear from its recorded arguments into a new result."""
    out = fresh_output(call)
    call.op.run_prepared(call)
    return out
