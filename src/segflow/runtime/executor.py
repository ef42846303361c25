"""Executor: binds a Plan once, then runs it many times through an engine.

Binding turns every segment into a task function over a per-run slot array:
kernels are bound once, constants are placed on their devices once, and each
value's slot is released after its last use. A run pushes one task per
segment in plan order, with one engine Var per task: a task reads the Vars of
the tasks that produce its inputs and writes its own. The host then waits
once for the tasks that produce the outputs. Under the inline engine on host
devices, where every push would run its task at once and in order anyway, an
unprofiled run calls the task functions directly, counting each call as the
push it stands for.

A run's counters are counted where the work happens (:class:`RunCounters`):
the engine counts pushes and host waits, the completion strategy's stream
backend device synchronizations, the task functions the kernels they call.

Each run owns its slot array, Vars and counters, so one Executor can serve
many threads at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from segflow.engine.base import Engine, ExecType, Var
from segflow.engine.counters import RunCounters
from segflow.engine.inline import InlineEngine
from segflow.engine.streams import StreamBackend
from segflow.ir.graph import Node, Value
from segflow.ir.types import Device, DeviceKind
from segflow.kernels.choice import DIRECT_CONV_KINDS
from segflow.kernels.onednn.op import DirectKernel, ResidualInPlaceKernel
from segflow.kernels.report import reporting_ops
from segflow.kernels.target import CpuTarget
from segflow.ops.registry import OpRegistry
from segflow.passes.segment import Segment
from segflow.profiler.cuda import device_marker
from segflow.profiler.sink import EventSink
from segflow.runtime.aot_inductor import AotInductorSegment
from segflow.runtime.arena import ArenaPool
from segflow.runtime.binding import (
    BindContext,
    ConstantCache,
    SlotMap,
    Step,
    UploadInputs,
    bind_kernel,
    node_reads,
    run_steps,
)
from segflow.runtime.compile import SegmentCompiler, SegmentFn
from segflow.runtime.completion import HostCompletion, SyncMode, make_completion
from segflow.runtime.cudagraph import host_data_inputs, host_only_constants, host_values
from segflow.runtime.nonfinite import NonFinitePolicy
from segflow.runtime.onednn_graph import OneDnnGraphSegment
from segflow.runtime.plan import Plan
from segflow.runtime.prebuild import PrebuildReport, prebuild
from segflow.runtime.stats import RunStats

Tensor = torch.Tensor
_HOST = torch.device("cpu")


@dataclass(slots=True)
class _BoundTask:
    segment: Segment
    steps: list[Step]
    reads: tuple[int, ...]     # indices of the tasks this one depends on
    waits_on_host: bool        # a LOCAL task that must wait for device work first


class Executor:
    """Runs a :class:`Plan` on an :class:`Engine`."""

    def __init__(self, plan: Plan, registry: OpRegistry, engine: Engine,
                 settings_record: dict[str, object] | None = None, *,
                 sync_mode: str | SyncMode = SyncMode.EVENT, cuda_graphs: bool = False,
                 stream_backend: StreamBackend | None = None,
                 compiler: SegmentCompiler | None = None,
                 arena: ArenaPool | None = None,
                 nonfinite: NonFinitePolicy | None = None,
                 target: CpuTarget | None = None) -> None:
        self.plan = plan
        self.engine = engine
        self.settings_record = dict(settings_record or {})
        graph = plan.graph
        # Planned run storage (runtime/arena.py) needs the plan's node order to be the
        # order the nodes run in: tasks one after another on the calling thread.
        self.arena = arena if arena is not None and _runs_in_graph_order(plan, engine) else None
        self.slots = SlotMap()
        constants = ConstantCache()
        contexts: dict[Device, BindContext] = {}
        # One target for every context: the kernels of a plan are chosen for one CPU.
        self.target = target if target is not None else CpuTarget.detect()

        def context(device: Device | None) -> BindContext:
            dev = device or plan.default_device
            if dev not in contexts:
                contexts[dev] = BindContext(registry, dev.torch, constants, self.arena,
                                            nonfinite, target=self.target,
                                            choices=plan.choices)
            return contexts[dev]

        self.input_slots = [self.slots[v] for v in graph.inputs]
        producer_task: dict[Value, int] = {}
        self.tasks: list[_BoundTask] = []
        const_slots: list[tuple[int, Tensor]] = []
        # Shapes, axes and other constants read only on the host stay in host memory.
        host_vals = host_values(graph.nodes)  # shapes and shape arithmetic: host memory
        host_consts = host_only_constants(graph.nodes, plan.opdefs, host_vals)
        for seg in plan.segments:
            ctx = context(seg.device)
            steps = []
            deps: set[int] = set()
            for node in seg.nodes:
                reads = node_reads(node)
                for value in reads:
                    if value is None:
                        continue
                    if value.is_const:
                        where = _HOST if id(value) in host_consts else ctx.device
                        const_slots.append((self.slots[value], constants.get(value, where)))
                    elif value in producer_task and producer_task[value] != len(self.tasks):
                        deps.add(producer_task[value])
                kernel = bind_kernel(plan.opdefs[node], node, ctx)
                uploads = (host_data_inputs(node, plan.opdefs[node], host_vals)
                           if ctx.device.type != "cpu" else ())
                if uploads:
                    kernel = UploadInputs(kernel, uploads, ctx.device)
                steps.append(Step(node, kernel, tuple(self.slots[v] for v in reads),
                                  tuple(self.slots[v] for v in node.outputs),
                                  choice=ctx.choice(node)))
                for value in node.outputs:
                    producer_task[value] = len(self.tasks)
            waits = seg.exec_type is ExecType.LOCAL and bool(deps)
            self.tasks.append(_BoundTask(seg, steps, tuple(sorted(deps)), waits))
        self._assign_releases(graph.outputs)
        if compiler is not None and compiler.memory is not None:
            _residual_in_place(self.tasks, compiler.memory.inplace)
        # The kernels that report to explain() (kernels/report.py), found through their op.
        self.kernel_ops = reporting_ops((step.node.label, step.kernel) for task in self.tasks
                                        for step in task.steps)
        self.output_slots = [self.slots[v] for v in graph.outputs]
        self.output_tasks = sorted({producer_task[v] for v in graph.outputs if v in producer_task})
        self.template: list[Tensor | None] = [None] * len(self.slots)
        for slot, tensor in const_slots:
            self.template[slot] = tensor
        for value in graph.initializers.values():
            if value in self.slots.slots and self.template[self.slots[value]] is None:
                self.template[self.slots[value]] = constants.get(value, plan.default_device.torch)
        self._var_names = [t.segment.first.name for t in self.tasks]
        # Vars a task reads besides its producers' (e.g. parameters a training step updates).
        self.extra_reads: list[tuple[Var, ...]] = [() for _ in self.tasks]
        self.compute_nodes = plan.compute_nodes  # a scan of the plan: counted once
        self.copies_per_run = sum(1 for t in self.tasks if t.segment.exec_type is ExecType.COPY)
        # Streams, events and CUDA graphs on CUDA devices; a no-op on CPU devices.
        self.completion = make_completion(plan, self.tasks, self.input_slots, self.output_slots,
                                          self.output_tasks, sync_mode, cuda_graphs=cuda_graphs,
                                          backend=stream_backend)
        self.settings_record.setdefault("sync_mode", self.completion.sync_mode.value)
        self.settings_record.setdefault("cuda_graphs", cuda_graphs)
        # Compiled bulk segments (runtime/compile.py): one callable over the slot array each.
        self.compiled: list[SegmentFn | None] = (
            compiler.compile_tasks([(t.segment, t.steps) for t in self.tasks], self.template,
                                   self.output_slots)
            if compiler is not None else [None] * len(self.tasks))
        # Per task: ``fn(env, counts)``, which counts the kernels it calls.
        self._runners: list[TaskRunner] = [_runner(t.steps, fn)
                                           for t, fn in zip(self.tasks, self.compiled)]
        # The inline engine on host-only devices runs each task at push, in order: a run
        # needs no Vars, only the task functions (see _run_direct); with each, whether the
        # engine would make the host wait for its inputs first (a LOCAL task with some).
        self._direct: list[tuple[TaskRunner, bool]] | None = None
        if isinstance(engine, InlineEngine) and isinstance(self.completion, HostCompletion) \
                and all(t.segment.exec_type is not ExecType.ASYNC for t in self.tasks):
            self._direct = [(fn, t.waits_on_host) for t, fn in zip(self.tasks, self._runners)]

    def prebuild(self, dims: Mapping[str, int]) -> PrebuildReport:
        """Build the direct kernels' primitives for a first run at ``dims`` now
        (runtime/prebuild.py): those of the tasks that run their own steps, generated or
        interpreted, not another backend's compiled form."""
        steps = [step for task, fn in zip(self.tasks, self.compiled)
                 if not isinstance(fn, (AotInductorSegment, OneDnnGraphSegment))
                 for step in task.steps]
        return prebuild(steps, self.plan.graph.inputs, self.template, dims)

    def _assign_releases(self, outputs: Sequence[Value]) -> None:
        """Release each computed value after its last use when that is provably safe.

        Safe when every task that reads the value is the releasing task or one
        of its ancestors (so all other readers have finished before it runs).
        """
        ancestors: list[int] = []  # bitset of ancestor tasks, per task
        for task in self.tasks:
            bits = 0
            for dep in task.reads:
                bits |= (1 << dep) | ancestors[dep]
            ancestors.append(bits)
        keep = {id(v) for v in outputs}
        last_use: dict[int, tuple[int, int]] = {}  # slot -> (task, step)
        readers: dict[int, set[int]] = {}
        for t, task in enumerate(self.tasks):
            for s, step in enumerate(task.steps):
                for value, slot in zip(node_reads(step.node), step.inputs):
                    if value is None or value.is_const or id(value) in keep:
                        continue
                    if value.producer is None:  # graph input: owned by the caller
                        continue
                    last_use[slot] = (t, s)
                    readers.setdefault(slot, set()).add(t)
        releases: dict[tuple[int, int], list[int]] = {}
        for slot, (t, s) in last_use.items():
            if all(r == t or (ancestors[t] >> r) & 1 for r in readers[slot]):
                releases.setdefault((t, s), []).append(slot)
        for (t, s), slots in releases.items():
            self.tasks[t].steps[s].release = tuple(slots)

    # -- running -----------------------------------------------------------------------
    def run(self, feeds: Sequence[Tensor], sink: EventSink | None = None, *,
            host_outputs: bool = False, after_tasks: AfterTasks | None = None,
            dims: Mapping[str, int] | None = None) -> tuple[list[Tensor], RunStats]:
        """Run once on ``feeds`` (tensors in graph-input order, already validated).

        With a ``sink`` (an active profiler) every push, segment, node and host
        wait is recorded; without one the uninstrumented task functions run.
        ``host_outputs``: return outputs in host memory (copied back on the
        device's copy stream within the one output wait). ``after_tasks(run_vars,
        env, counts)`` pushes further tasks once the plan's are pushed (a training
        step's parameter updates), with the run's counts, so the engine counts them as
        pushes. ``dims``: the symbolic dims the feeds bind (sizes the run's arena;
        None: no arena).
        """
        outputs, stats, _ = self.start(feeds, sink, host_outputs=host_outputs,
                                       after_tasks=after_tasks, dims=dims, defer_wait=False)
        return outputs, stats

    def start(self, feeds: Sequence[Tensor], sink: EventSink | None = None, *,
              host_outputs: bool = False, after_tasks: AfterTasks | None = None,
              dims: Mapping[str, int] | None = None, defer_wait: bool = True
              ) -> tuple[list[Tensor], RunStats, Callable[[], None]]:
        """:meth:`run`, returning before the host waits for the device (``defer_wait``).

        The third value performs that wait (the run's one output wait, already counted
        in its stats); the outputs are not ready before it returns. Where nothing is
        left to wait for (host devices, profiled runs) it does nothing.
        """
        if self.arena is None or dims is None:
            return self._run(feeds, sink, host_outputs, after_tasks, defer_wait)
        arena = self.arena.acquire(dims)
        try:
            return self._run(feeds, sink, host_outputs, after_tasks, defer_wait)
        finally:
            self.arena.release(arena)

    def _run(self, feeds: Sequence[Tensor], sink: EventSink | None, host_outputs: bool,
             after_tasks: AfterTasks | None, defer_wait: bool
             ) -> tuple[list[Tensor], RunStats, Callable[[], None]]:
        if self._direct is not None and sink is None and after_tasks is None:
            outputs, stats = self._run_direct(feeds)
            return outputs, stats, _done
        start = time.perf_counter()
        env = list(self.template)
        counts = RunCounters()
        completion = self.completion.start(env, counts)
        for slot, tensor in zip(self.input_slots, completion.stage_inputs(feeds)):
            env[slot] = tensor
        engine = self.engine
        names = self._var_names
        run_vars = [Var(name) for name in names]
        run_t0 = time.perf_counter_ns() if sink is not None else 0
        pushed_at = [0]  # the current push's start, for a LOCAL task's host-wait span
        for index, task in enumerate(self.tasks):
            seg = task.segment
            fn = (partial(self._runners[index], env, counts) if sink is None
                  else _profiled_task(task, env, counts, sink, pushed_at))
            fn = completion.wrap(index, fn, sink is not None)
            t0 = pushed_at[0] = time.perf_counter_ns() if sink is not None else 0
            reads = [run_vars[d] for d in task.reads]
            extra = self.extra_reads[index]
            if extra:
                reads.extend(extra)
            engine.push(fn, reads, (run_vars[index],), seg.exec_type, seg.device,
                        names[index], counts)
            if sink is not None:
                sink.span("push", f"push {_task_name(task)}", t0, time.perf_counter_ns(),
                          device=str(seg.device), args={"segment": seg.index})
        if after_tasks is not None:
            after_tasks(run_vars, env, counts)
        if self.output_tasks:
            t0 = time.perf_counter_ns() if sink is not None else 0
            engine.wait(*[run_vars[index] for index in self.output_tasks], counts=counts)
            if sink is not None:
                sink.span("sync", "wait for outputs", t0, time.perf_counter_ns(),
                          device=str(self.plan.default_device))
        # A profiled run waits here: its spans must close inside the run.
        defer = defer_wait and sink is None
        results = completion.finish([env[s] for s in self.output_slots], host_outputs, defer)
        if sink is not None:
            sink.span("run", "run", run_t0, time.perf_counter_ns(),
                      device=str(self.plan.default_device),
                      args={"segments": len(self.tasks), "syncs": counts.syncs})
        stats = self._stats(counts, start)
        return results, stats, completion.wait if defer else _done  # type: ignore[return-value]

    def _run_direct(self, feeds: Sequence[Tensor]) -> tuple[list[Tensor], RunStats]:
        """:meth:`run` for the inline engine on the host: the same tasks in the same order,
        without the engine's bookkeeping (a few us a run, which is most of a small
        model's fixed cost). It counts what the inline engine would: a push per task
        function it calls, a host wait before a LOCAL task with inputs (satisfied at
        once: every earlier task has run) and the output wait."""
        start = time.perf_counter()
        env = list(self.template)
        for slot, tensor in zip(self.input_slots, feeds):
            env[slot] = tensor
        assert self._direct is not None
        counts = RunCounters()
        pushes = 0
        for fn, waits in self._direct:
            if waits:
                counts.count_wait()
            pushes += 1
            fn(env, counts)
        counts.count_push(pushes)
        if self.output_tasks:
            counts.count_wait()
        outputs = [env[s] for s in self.output_slots]
        return outputs, self._stats(counts, start)  # type: ignore[return-value]

    def _stats(self, counts: RunCounters, start: float) -> RunStats:
        """A run's stats: the plan's shape, and what ``counts`` counted."""
        return RunStats(
            nodes=self.compute_nodes,
            segments=len(self.tasks),
            pushes=counts.pushes,
            syncs=counts.syncs,
            kernels=counts.kernels,
            copies=self.copies_per_run,
            engine=self.engine.name,
            settings=self.settings_record,
            wall_time_s=time.perf_counter() - start,
            native_calls=counts.native_calls,
        )


AfterTasks = Callable[[list[Var], list[Tensor | None], RunCounters], None]
TaskRunner = Callable[[list[Tensor | None], RunCounters], None]
"""A task's function over the run's slot array, counting its kernels into the counts."""


def _runner(steps: list[Step], compiled: SegmentFn | None) -> TaskRunner:
    """How a task runs: its steps one by one, its generated function (which counts its
    own kernel calls), or another backend's compiled form (AOTInductor, oneDNN Graph),
    whose kernels Python does not see: it counts the task's nodes when it has run."""
    if compiled is None:
        return partial(run_steps, steps)
    if isinstance(compiled, (AotInductorSegment, OneDnnGraphSegment)):
        return partial(_run_opaque, compiled, len(steps))
    return compiled


def _run_opaque(compiled: SegmentFn, nodes: int, env: list[Tensor | None],
                counts: RunCounters) -> None:
    compiled(env)
    counts.count_kernels(nodes)


def _task_name(task: _BoundTask) -> str:
    seg = task.segment
    if len(seg.nodes) == 1:
        return f"{seg.first.op_type} [{seg.first.name}]"
    return f"segment {seg.index} ({len(seg.nodes)} nodes)"


def _profiled_task(task: _BoundTask, env: list[Tensor | None], counts: RunCounters,
                   sink: EventSink, pushed_at: list[int]) -> Callable[[], None]:
    """The task function with a span per node and one for the whole task.

    A LOCAL task that waits on the host also records that wait (from its push
    to its start) as a sync span. On CUDA the task and its nodes also get NVTX
    ranges, and each node a device span timed by CUDA events.
    """
    seg = task.segment
    device = str(seg.device)
    category = {ExecType.COPY: "copy", ExecType.LOCAL: "local"}.get(seg.exec_type, "segment")
    clock = time.perf_counter_ns
    marker = device_marker(sink, seg.device)
    name = _task_name(task)

    def run() -> None:
        start = clock()
        if task.waits_on_host:
            sink.span("sync", f"wait for inputs of {name}", pushed_at[0], start,
                      device=device, args={"segment": seg.index})
        if marker is not None:
            marker.push_range(name)
        try:
            for step in task.steps:
                args = {"op": step.node.op_type, "segment": seg.index}
                mark = marker.begin(step.node.name) if marker is not None else None
                t0 = clock()
                run_steps((step,), env, counts)
                t1 = clock()
                if marker is not None:
                    marker.end(mark, "device", step.node.name, args)
                sink.span("node", step.node.name, t0, t1, device=device, args=args)
        finally:
            if marker is not None:
                marker.pop_range()
            sink.span(category, name, start, clock(), device=device,
                      args={"segment": seg.index, "nodes": len(seg.nodes),
                            "reason": seg.reason})
    return run


def _done() -> None:
    """The wait of a run that has nothing left to wait for."""


def _residual_in_place(tasks: Sequence[_BoundTask], inplace: Mapping[Node, int]) -> None:
    """Give each direct residual convolution that the memory plan lets overwrite its
    residual (input 3) the in-place kernel, where that residual dies at this step (no
    other task still reads it): the same rule generated code follows. The step's choice
    says which steps run a direct convolution; their bound kernel holds its op."""
    for task in tasks:
        for index, step in enumerate(task.steps):
            if step.choice.kind not in DIRECT_CONV_KINDS or inplace.get(step.node) != 3 \
                    or len(step.inputs) != 4 or step.inputs[3] not in step.release:
                continue
            kernel = step.kernel
            if type(kernel) is not DirectKernel:   # bound to its fallback (no libdnnl)
                continue
            task.steps[index] = dataclasses.replace(step, kernel=ResidualInPlaceKernel(kernel.op))


def _runs_in_graph_order(plan: Plan, engine: Engine) -> bool:
    """Whether every run executes the graph's nodes in its node order on the calling
    thread: the inline engine, host devices only, segments in node order."""
    if not isinstance(engine, InlineEngine):
        return False
    if any(seg.exec_type is ExecType.ASYNC or (seg.device or plan.default_device).kind
           is not DeviceKind.CPU for seg in plan.segments):
        return False
    order = [node for seg in plan.segments for node in seg.nodes]
    return len(order) == len(plan.graph.nodes) and all(
        a is b for a, b in zip(order, plan.graph.nodes))
