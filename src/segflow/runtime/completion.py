"""Completion strategies: how a finished task's device work becomes visible to others.

Why one module at ~600 lines: the two strategies implement one protocol over one task
plan (:class:`TaskPlan`, which task records, waits for and copies what), and most of it
is :class:`_StreamRun`, one run's streams, events and pinned copies, which must see all
of that run's events to count its synchronizations once.

Chosen once, at bind time, from the plan's devices and the sync mode:

- :class:`HostCompletion` when no device of the plan has streams (CPU): tasks
  run as they are; counters are exactly those of the executor alone.
- :class:`StreamCompletion` when some device has streams (CUDA, or the fake
  backend in tests). Each task runs with its pooled stream current: compute
  tasks on the device's compute stream, COPY tasks on a copy stream. At the
  end of a task:

  * ``sync_mode="stream"`` (the classic behaviour): SYNC and COPY tasks
    synchronize their stream, one host wait each;
  * ``sync_mode="event"``: the task records an event; dependants on another
    stream wait for it on the device, dependants on the host (LOCAL tasks,
    tasks on a CPU device) wait for it on the host, and the host otherwise
    waits only to hand the outputs back.

  Inputs go to the device through pinned memory on the copy stream (each task
  waits only for the inputs it reads), and :meth:`RunCompletion.finish`
  copies outputs back through pinned memory and waits once. Where one compute
  stream runs every task (one device, no cross-device copies), nothing could
  overlap with those copies: they go on the compute stream, without events.

``RunStats.syncs`` is counted, not planned: the engine counts the output wait
and the LOCAL tasks' waits for their inputs; the stream backend counts every
device synchronization made through it while a thread works for the run
(each task, with its kernels, and the output wait: :meth:`StreamBackend.count_into`).
A device wait that finishes a wait the engine counted (the outputs' event, a
LOCAL task's events) is marked joined, so that host wait counts once.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from segflow.engine.base import ExecType
from segflow.engine.counters import RunCounters
from segflow.engine.streams import (
    EventHandle,
    StreamBackend,
    StreamHandle,
    StreamPool,
    default_backend,
)
from segflow.errors import InvalidSetting
from segflow.ir.types import Device, DeviceKind
from segflow.passes.place import COPY_DOMAIN
from segflow.passes.segment import Segment
from segflow.runtime.binding import Step
from segflow.runtime.cudagraph import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_WARMUP,
    CaptureDecision,
    SegmentGraph,
    capture_decision,
    describe_decisions,
)
from segflow.runtime.feeds import feed_tensors
from segflow.runtime.plan import Plan

Tensor = torch.Tensor
TaskFn = Callable[..., None]


class SyncMode(enum.Enum):
    """How a SYNC task's completion is made visible on a device with streams."""

    EVENT = "event"    # record an event; dependants wait on the device
    STREAM = "stream"  # synchronize the stream at the end of every task (classic)

    @classmethod
    def parse(cls, value: str | SyncMode) -> SyncMode:
        if isinstance(value, SyncMode):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise InvalidSetting(f"sync_mode={value!r}: expected 'event' or 'stream'") from None


class End(enum.Enum):
    """What a task does when its body returns."""

    NOTHING = "nothing"          # host task: done means done
    SYNC_STREAM = "sync_stream"  # host waits for its stream
    RECORD_EVENT = "event"       # records an event for dependants and the output wait


class BoundTask(Protocol):
    """What the strategy reads of an executor's bound task."""

    segment: Segment
    steps: list[Step]
    reads: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TaskPlan:
    """A task's stream, waits and ending, fixed at bind time."""

    stream_device: Device | None  # whose pooled stream the task uses (None: host task)
    copy_stream: bool             # the copy stream rather than the compute stream
    end: End
    device_waits: tuple[int, ...]  # tasks whose events this task's stream waits for
    host_waits: tuple[int, ...]    # tasks whose events the host waits for first
    feed_waits: tuple[int, ...]    # graph inputs (indices) whose upload this task waits for
    slots: tuple[int, ...]         # COPY: slots used across streams (allocator safety)
    counted_syncs: int             # device waits it makes per run beyond the engine's (explain)


class RunCompletion(Protocol):
    """Per-run state of a completion strategy."""

    def stage_inputs(self, feeds: Sequence[Tensor]) -> Sequence[Tensor]:
        ...

    def wrap(self, index: int, fn: TaskFn, profiled: bool = False) -> TaskFn:
        ...

    def finish(self, outputs: list[Tensor | None], host_outputs: bool,
               defer: bool = False) -> list[Tensor | None]:
        """The outputs, once the host has waited for them; with ``defer`` the wait is
        left to :meth:`wait` (counted all the same)."""
        ...

    def wait(self) -> None:
        """The output wait a deferred :meth:`finish` left (nothing otherwise)."""
        ...


class Completion(Protocol):
    sync_mode: SyncMode

    def start(self, env: list[Tensor | None], counts: RunCounters) -> RunCompletion:
        """One run's state; its device waits are counted into ``counts``."""
        ...

    def describe(self) -> list[str]:
        ...


# -- CPU: nothing to do ----------------------------------------------------------------------


class _HostRun:
    __slots__ = ()

    def stage_inputs(self, feeds: Sequence[Tensor]) -> Sequence[Tensor]:
        return feeds

    def wrap(self, index: int, fn: TaskFn, profiled: bool = False) -> TaskFn:
        return fn

    def finish(self, outputs: list[Tensor | None], host_outputs: bool,
               defer: bool = False) -> list[Tensor | None]:
        return outputs

    def wait(self) -> None:
        pass


class HostCompletion:
    """No device has streams: tasks complete when their function returns."""

    _RUN = _HostRun()

    def __init__(self, sync_mode: SyncMode, cuda_graphs: bool = False) -> None:
        self.sync_mode = sync_mode
        self.cuda_graphs = cuda_graphs

    def start(self, env: list[Tensor | None], counts: RunCounters) -> RunCompletion:
        return self._RUN

    def describe(self) -> list[str]:
        # Nothing to add on the CPU unless graphs were asked for and cannot apply.
        if not self.cuda_graphs:
            return []
        return [f"sync mode: {self.sync_mode.value} (no device streams: tasks complete "
                f"on return)", "cuda graphs: on, but no device of the plan has CUDA streams"]


# -- devices with streams ------------------------------------------------------------------


class StreamCompletion:
    """Tasks on devices with streams complete by stream sync or by event (see module doc)."""

    def __init__(self, plan: Plan, tasks: Sequence[BoundTask], input_slots: Sequence[int],
                 output_slots: Sequence[int], output_tasks: Sequence[int],
                 sync_mode: SyncMode, backend: StreamBackend, *, cuda_graphs: bool = False,
                 graph_cache_size: int = DEFAULT_CACHE_SIZE,
                 graph_warmup: int = DEFAULT_WARMUP) -> None:
        self.plan = plan
        self.sync_mode = sync_mode
        self.backend = backend
        self.pool = StreamPool(backend)
        self.cuda_graphs = cuda_graphs
        default = plan.default_device
        self.default_device = default
        self.stage = backend.manages(default)
        self.output_tasks = tuple(output_tasks)
        self.exec_types = [task.segment.exec_type for task in tasks]
        self.plans = _plan_tasks(plan, tasks, input_slots, sync_mode, backend)
        # One device, one compute stream and no cross-device copies: every task runs in
        # order on that stream, so a copy stream has nothing to overlap with (the first
        # task needs the feeds, the outputs come after the last). Feeds and outputs are
        # then copied on the compute stream itself, with no events between them.
        streams = {(p.stream_device, p.copy_stream) for p in self.plans
                   if p.stream_device is not None}
        self.io_on_compute = self.stage and self.pool.compute_streams == 1 \
            and streams <= {(default, False)}
        self.syncs_per_run = sum(p.counted_syncs for p in self.plans)
        producer = {slot: i for i, task in enumerate(tasks)
                    for step in task.steps for slot in step.outputs}
        # Where each output lives: a device with streams (copy it back), or the host.
        self.output_devices: list[Device | None] = []
        for slot in output_slots:
            t = producer.get(slot)
            device = self.plans[t].stream_device if t is not None else (
                default if self.stage else None)
            if t is not None and tasks[t].segment.exec_type is ExecType.COPY:
                target = tasks[t].segment.device
                device = target if target is not None and backend.manages(target) else None
            self.output_devices.append(device)
        self.decisions: list[CaptureDecision] = []
        self.graphs: dict[int, SegmentGraph] = {}
        if cuda_graphs:
            capture_lock = threading.Lock()
            read_later = _slots_read_after(tasks, output_slots)
            for i, task in enumerate(tasks):
                seg = task.segment
                managed = self.plans[i].stream_device is not None
                decision = capture_decision(seg, managed, plan.opdefs)
                self.decisions.append(decision)
                if decision.eligible:
                    graph = SegmentGraph(seg, task.steps, capacity=graph_cache_size,
                                         warmup=graph_warmup, capture_lock=capture_lock)
                    graph.bind_outputs(read_later[i])
                    self.graphs[i] = graph

    # CaptureHost
    def capture_stream(self, segment: Segment) -> StreamHandle:
        return self.pool.capture(segment.device or self.default_device)

    def stream_of(self, index: int) -> StreamHandle | None:
        task = self.plans[index]
        if task.stream_device is None:
            return None
        if task.copy_stream:
            return self.pool.copy(task.stream_device)
        return self.pool.compute(task.stream_device)

    def start(self, env: list[Tensor | None], counts: RunCounters) -> RunCompletion:
        return _StreamRun(self, env, counts)

    def describe(self) -> list[str]:
        devices = sorted({str(p.stream_device) for p in self.plans if p.stream_device})
        ending = ("a stream synchronize after every SYNC/COPY task" if
                  self.sync_mode is SyncMode.STREAM else
                  "events between streams, one host wait for the outputs")
        lines = [f"sync mode: {self.sync_mode.value} on {', '.join(devices) or '-'} "
                 f"({self.backend.name} streams: {ending}; "
                 f"{self.syncs_per_run} host waits per run at task ends)"]
        lines.append("copies: feeds and outputs through pinned memory on the " + (
            "compute stream (one stream runs every task: nothing to overlap)"
            if self.io_on_compute else "copy stream"))
        if self.cuda_graphs:
            eligible = sum(1 for d in self.decisions if d.eligible)
            lines.append(f"cuda graphs: {eligible} of {len(self.decisions)} segments "
                         f"capturable")
            lines += describe_decisions(self.decisions, self.graphs)
        return lines


def _plan_tasks(plan: Plan, tasks: Sequence[BoundTask], input_slots: Sequence[int],
                sync_mode: SyncMode, backend: StreamBackend) -> list[TaskPlan]:
    default = plan.default_device
    feed_of = {slot: i for i, slot in enumerate(input_slots)}
    value_device: dict[int, Device] = {}  # slot -> device of its producing task
    plans: list[TaskPlan] = []
    streams: list[tuple[Device, bool] | None] = []
    for task in tasks:
        seg = task.segment
        device = seg.device or default
        kind = seg.exec_type
        stream_device: Device | None = device if backend.manages(device) else None
        copy_stream = False
        if kind is ExecType.COPY:
            copy_stream = True
            if stream_device is None:
                # A copy to the host runs on the copy stream of its source device.
                source = _copy_source(task, value_device, default)
                stream_device = source if backend.manages(source) else None
        if stream_device is None:
            end = End.NOTHING
        elif sync_mode is SyncMode.STREAM and kind in (ExecType.SYNC, ExecType.COPY):
            end = End.SYNC_STREAM
        else:
            end = End.RECORD_EVENT
        stream = (stream_device, copy_stream) if stream_device is not None else None
        event_deps = tuple(d for d in task.reads if plans[d].end is End.RECORD_EVENT)
        on_host = stream_device is None or kind is ExecType.LOCAL
        host_waits = event_deps if on_host else ()
        device_waits = () if on_host else tuple(d for d in event_deps if streams[d] != stream)
        reads = {slot for step in task.steps for slot in step.inputs}
        feeds = tuple(sorted(feed_of[s] for s in reads if s in feed_of)) \
            if stream_device is not None and backend.manages(default) else ()
        slots = tuple(sorted(reads | {s for step in task.steps for s in step.outputs})) \
            if kind is ExecType.COPY and stream_device is not None else ()
        counted = 1 if end is End.SYNC_STREAM else 0
        # A LOCAL task's wait is counted by the engine; on a device with streams its
        # events are joined into that one wait, on the host each event is one more wait.
        if host_waits and stream_device is None:
            counted += len(host_waits) - (1 if kind is ExecType.LOCAL else 0)
        plans.append(TaskPlan(stream_device, copy_stream, end, device_waits, host_waits,
                              feeds, slots, counted))
        streams.append(stream)
        for step in task.steps:
            for slot in step.outputs:
                value_device[slot] = device
    return plans


def _copy_source(task: BoundTask, value_device: dict[int, Device], default: Device) -> Device:
    for step in task.steps:
        if step.node.domain == COPY_DOMAIN and step.inputs:
            return value_device.get(step.inputs[0], default)
    return default


def _slots_read_after(tasks: Sequence[BoundTask], output_slots: Sequence[int]
                      ) -> list[list[int]]:
    """Per task: the slots it produces that a later task or the caller reads."""
    read_by_other: dict[int, set[int]] = {}
    for i, task in enumerate(tasks):
        for step in task.steps:
            for slot in step.inputs:
                read_by_other.setdefault(slot, set()).add(i)
    outputs = set(output_slots)
    result: list[list[int]] = []
    for i, task in enumerate(tasks):
        produced = [slot for step in task.steps for slot in step.outputs]
        result.append([s for s in produced
                       if s in outputs or read_by_other.get(s, set()) - {i}])
    return result


class _StreamRun:
    """One run's events and counters under a :class:`StreamCompletion`."""

    __slots__ = ("owner", "env", "counts", "events", "feed_events", "_deferred")

    def __init__(self, owner: StreamCompletion, env: list[Tensor | None],
                 counts: RunCounters) -> None:
        self.owner = owner
        self.env = env
        self.counts = counts
        self.events: list[EventHandle | None] = [None] * len(owner.plans)
        self.feed_events: list[EventHandle | None] = []
        self._deferred: list[EventHandle] = []

    # -- inputs ------------------------------------------------------------------------------
    def stage_inputs(self, feeds: Sequence[Tensor]) -> Sequence[Tensor]:
        owner = self.owner
        if not owner.stage:
            return feeds
        device = owner.default_device
        compute = owner.pool.compute(device)
        staged: list[Any] = []
        for feed in feeds:
            if feed is None or not isinstance(feed, Tensor | list):
                # An empty optional, or a string feed: a host array only host tasks
                # read (ops/strings.py).
                staged.append(feed)
                self.feed_events.append(None)
            elif isinstance(feed, list):
                # A sequence: its tensors staged one by one, one event for them all.
                pairs = [self._stage(t, device, compute) for t in feed]
                staged.append([moved for moved, _ in pairs])
                self.feed_events.append(self._joined([e for _, e in pairs], compute))
            else:
                moved, event = self._stage(feed, device, compute)
                staged.append(moved)
                self.feed_events.append(event)
        return staged

    def _stage(self, tensor: Tensor, device: Device, compute: StreamHandle
               ) -> tuple[Tensor, EventHandle | None]:
        """One feed tensor on ``device``, and the event the tasks reading it wait for."""
        owner, backend = self.owner, self.owner.backend
        upload = backend.needs_upload(tensor, device)
        if upload and owner.io_on_compute:
            # On the stream of every task that reads it: ordered without an event.
            return backend.to_device(tensor, device, compute), None
        if upload:
            copy_stream = owner.pool.copy(device)
            moved = backend.to_device(tensor, device, copy_stream)
            event = backend.record_event(copy_stream)
        else:
            # Already on the device: order after whatever the caller queued for it.
            moved = tensor
            event = backend.record_event(backend.current_stream(device))
        backend.record_stream(moved, compute)
        return moved, event

    # -- tasks -------------------------------------------------------------------------------
    def wrap(self, index: int, fn: TaskFn, profiled: bool = False) -> TaskFn:
        owner = self.owner
        plan = owner.plans[index]
        graph = None if profiled else owner.graphs.get(index)
        counts = self.counts
        if plan.stream_device is None:
            if not plan.host_waits:
                return fn
            backend = owner.backend
            local = owner.exec_types[index] is ExecType.LOCAL

            def host_task(*args: Any) -> None:
                previous = backend.count_into(counts)
                try:
                    for d in plan.host_waits:
                        backend.synchronize_event(self.events[d])
                    if local:  # its first event wait is the wait the engine counted
                        counts.count_joined()
                    fn(*args)
                finally:
                    backend.count_into(previous)
            return host_task

        stream = owner.stream_of(index)
        if owner.exec_types[index] is ExecType.ASYNC:
            return self._wrap_async(index, fn, stream)
        env = self.env

        kernels = len(graph.steps) if graph is not None else 0

        def body() -> None:
            if graph is None:
                fn()
            elif graph.run(env, owner, _counted_by_backend, fn):
                # A replay launches the captured kernels in one call, none from Python.
                counts.count_kernels(kernels)
                counts.count_native_calls()

        def task() -> None:
            backend = owner.backend
            previous = backend.count_into(counts)
            try:
                if plan.host_waits:
                    self._host_wait(stream, plan.host_waits)
                with backend.use_stream(stream):
                    self._device_waits(stream, plan)
                    body()
                self._end(index, plan, stream)
            finally:
                backend.count_into(previous)
        return task

    def _wrap_async(self, index: int, fn: TaskFn, stream: StreamHandle) -> TaskFn:
        plan = self.owner.plans[index]

        backend, counts = self.owner.backend, self.counts

        def task(on_complete: Callable[[BaseException | None], None]) -> None:
            previous = backend.count_into(counts)
            try:
                if plan.host_waits:
                    self._host_wait(stream, plan.host_waits)

                def done(error: BaseException | None = None) -> None:
                    if error is None:
                        self._end(index, plan, stream)
                    on_complete(error)

                with backend.use_stream(stream):
                    self._device_waits(stream, plan)
                    fn(done)
            finally:
                backend.count_into(previous)
        return task

    def _device_waits(self, stream: StreamHandle, plan: TaskPlan) -> None:
        backend = self.owner.backend
        for d in plan.device_waits:
            backend.wait_event(stream, self.events[d])
        for i in plan.feed_waits:
            event = self.feed_events[i] if i < len(self.feed_events) else None
            if event is not None:
                backend.wait_event(stream, event)

    def _host_wait(self, stream: StreamHandle, deps: Sequence[int]) -> None:
        """One host wait for several events: join them on ``stream`` first. Only a LOCAL
        task waits so on a device with streams: the engine counted this wait."""
        event = self._joined([self.events[d] for d in deps], stream)
        if event is not None:
            self.owner.backend.synchronize_event(event)
            self.counts.count_joined()

    def _joined(self, events: Sequence[EventHandle | None], stream: StreamHandle
                ) -> EventHandle | None:
        """One event for several: ``stream`` waits for them all, then records it."""
        backend = self.owner.backend
        pending = [e for e in events if e is not None]
        if len(pending) <= 1:
            return pending[0] if pending else None
        for event in pending:
            backend.wait_event(stream, event)
        return backend.record_event(stream)

    def _end(self, index: int, plan: TaskPlan, stream: StreamHandle) -> None:
        backend = self.owner.backend
        if plan.slots:
            # A copy reads on one stream what another allocated, and the other way round.
            other = self.owner.pool.compute(plan.stream_device)  # type: ignore[arg-type]
            for slot in plan.slots:
                for tensor in feed_tensors([self.env[slot]]):   # a sequence's one by one
                    if backend.on_device(tensor):
                        backend.record_stream(tensor, stream)
                        backend.record_stream(tensor, other)
        if plan.end is End.SYNC_STREAM:
            backend.synchronize_stream(stream)
        elif plan.end is End.RECORD_EVENT:
            self.events[index] = backend.record_event(stream)

    # -- outputs -----------------------------------------------------------------------------
    def finish(self, outputs: list[Tensor | None], host_outputs: bool,
               defer: bool = False) -> list[Tensor | None]:
        """Wait once for the outputs (copying them to pinned host memory when asked);
        with ``defer``, leave that wait to :meth:`wait`."""
        owner = self.owner
        backend = owner.backend
        events = [self.events[t] for t in owner.output_tasks if self.events[t] is not None]
        final: list[EventHandle] = []  # what the host waits for
        waits = 0
        on_device = [(i, d) for i, d in enumerate(owner.output_devices)
                     if d is not None and host_outputs and isinstance(outputs[i], Tensor | list)]
        if on_device:
            outputs = list(outputs)
            # On the compute stream, the tasks' work is already ahead of the copies.
            pending = [] if owner.io_on_compute else events
            pending += [e for e in self.feed_events if e is not None]
            for device in dict.fromkeys(d for _, d in on_device):
                stream = owner.pool.compute(device) if owner.io_on_compute else \
                    owner.pool.copy(device)
                for event in pending:
                    backend.wait_event(stream, event)
                for i, d in on_device:
                    if d == device:
                        out: Any = outputs[i]
                        # A sequence output (a list) comes back tensor by tensor.
                        back: Any = [backend.to_host(t, stream) for t in out] \
                            if isinstance(out, list) else backend.to_host(out, stream)
                        outputs[i] = back
                final.append(backend.record_event(stream))
                waits += 1
        elif events:
            joined = self._joined(events, owner.pool.compute(_first_device(owner)))
            final.append(joined)
            waits = 1
        # The engine counted one output wait if any task produces an output: the first
        # device wait finishes it.
        joined = 1 if owner.output_tasks and waits else 0
        self._deferred = final
        if defer:
            # The run's stats go back before these waits are made: they are counted
            # now, when the run hands them to the caller (who makes them, uncounted).
            if final:
                self.counts.count_device_sync(len(final))
                self.counts.count_joined(joined)
            return outputs
        previous = backend.count_into(self.counts)
        try:
            self.wait()
        finally:
            backend.count_into(previous)
        if joined:
            self.counts.count_joined(joined)
        return outputs

    def wait(self) -> None:
        events, self._deferred = self._deferred, []
        for event in events:
            self.owner.backend.synchronize_event(event)


def _counted_by_backend() -> None:
    """A graph capture's device synchronize: the backend counts it (``capture``)."""


def _first_device(owner: StreamCompletion) -> Device:
    for t in owner.output_tasks:
        device = owner.plans[t].stream_device
        if device is not None:
            return device
    return owner.default_device


def make_completion(plan: Plan, tasks: Sequence[BoundTask], input_slots: Sequence[int],
                    output_slots: Sequence[int], output_tasks: Sequence[int],
                    sync_mode: str | SyncMode = SyncMode.EVENT, *, cuda_graphs: bool = False,
                    backend: StreamBackend | None = None,
                    graph_cache_size: int = DEFAULT_CACHE_SIZE) -> Completion:
    """The strategy for ``plan``: streams if a device of the plan has them, else host."""
    mode = SyncMode.parse(sync_mode)
    devices = {seg.device or plan.default_device for seg in plan.segments}
    devices.add(plan.default_device)
    if backend is None:
        if not any(d.kind is DeviceKind.CUDA for d in devices):
            return HostCompletion(mode, cuda_graphs)
        backend = default_backend()
    if not any(backend.manages(d) for d in devices):
        return HostCompletion(mode, cuda_graphs)
    return StreamCompletion(plan, tasks, input_slots, output_slots, output_tasks, mode, backend,
                            cuda_graphs=cuda_graphs, graph_cache_size=graph_cache_size)
