"""The training plan and its executor: forward and backward segments, then update tasks.

``make_training_plan`` segments a differentiated graph with the training policy;
``TrainingExecutor`` runs it with each task also reading the state Vars its values
alias, and pushes the session's update tasks (gradient store, optimizer, running
statistics) after the plan's tasks (``runtime/training.py`` builds them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from segflow.engine.base import Engine, ExecType, Var
from segflow.engine.counters import RunCounters
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import Device
from segflow.ops.registry import OpRegistry
from segflow.passes.place import place
from segflow.passes.segment import Phase, segment_nodes
from segflow.profiler.sink import active_sink
from segflow.runtime.executor import AfterTasks, Executor
from segflow.runtime.plan import Plan, resolve_opdefs
from segflow.runtime.stats import RunStats
from segflow.settings import BulkSettings

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class Update:
    """An engine task pushed after the step's segments (gradient store, optimizer, stats)."""

    after: int | None                 # the task producing what it reads (None: nothing)
    slots: tuple[int, ...]            # env slots it reads
    apply: Callable[[list[Tensor]], None]
    writes: tuple[Var, ...]
    name: str
    # Further Vars it waits for (a gradient bucket's all-reduce), and where its inputs
    # come from when not the env slots (that bucket's reduced gradients).
    reads: tuple[Var, ...] = ()
    values: Callable[[list[Tensor | None]], list[Tensor]] | None = None


def make_training_plan(graph: Graph, registry: OpRegistry, settings: BulkSettings,
                       device: Device, backward: frozenset[Node],
                       gradient_outputs: frozenset[Value],
                       pass_log: tuple[str, ...] = ("autodiff",)) -> Plan:
    """Segment a forward+backward graph with the training policy (see DESIGN.md)."""
    graph.validate()
    place(graph, device, None)
    opdefs = resolve_opdefs(graph, registry)

    def exec_type_of(node: Node) -> ExecType:
        return opdefs[node].exec_type_of(node)

    def phase_of(node: Node) -> Phase:
        return Phase.BACKWARD if node in backward else Phase.FORWARD

    segments = segment_nodes(graph.nodes, exec_type_of, settings, phase_of=phase_of,
                             gradient_outputs=gradient_outputs)
    return Plan(graph, tuple(segments), opdefs, settings, device, pass_log)


class TrainingExecutor(Executor):
    """An Executor whose tasks also read state Vars, followed by update tasks."""

    def __init__(self, plan: Plan, registry: OpRegistry, engine: Engine,
                 settings_record: dict[str, object], aliases: Mapping[Value, frozenset[Var]]
                 ) -> None:
        super().__init__(plan, registry, engine, settings_record)
        self.task_of: dict[Node, int] = {}
        for index, task in enumerate(self.tasks):
            found: set[Var] = set()
            for step in task.steps:
                self.task_of[step.node] = index
                for value in step.node.inputs:
                    if value is not None:
                        found.update(aliases.get(value, ()))
            self.extra_reads[index] = tuple(sorted(found, key=lambda v: v.name))
        self._direct = None  # runs order against parameter updates through the engine's Vars
        self.phase_counts = {phase: sum(1 for s in plan.segments if s.phase is phase)
                             for phase in (Phase.FORWARD, Phase.BACKWARD)}

    def run_step(self, feeds: Sequence[Tensor], updates: Sequence[Update],
                 communicate: AfterTasks | None = None) -> tuple[list[Tensor], RunStats]:
        """One forward+backward run, with ``updates`` pushed after the plan's tasks
        (and after the tasks ``communicate`` pushes, which updates may read)."""
        engine, device = self.engine, self.plan.default_device

        def push_updates(run_vars: list[Var], env: list[Tensor | None],
                         counts: RunCounters) -> None:
            if communicate is not None:
                communicate(run_vars, env, counts)
            for update in updates:
                reads = [] if update.after is None else [run_vars[update.after]]
                reads.extend(update.reads)
                engine.push(_update_fn(update, env), reads, update.writes, ExecType.SYNC,
                            device, update.name, counts)

        outputs, stats = self.run(feeds, active_sink(), after_tasks=push_updates)
        return outputs, replace(stats, forward_segments=self.phase_counts[Phase.FORWARD],
                                backward_segments=self.phase_counts[Phase.BACKWARD],
                                updates=len(updates))


def _update_fn(update: Update, env: list[Tensor | None]) -> Callable[[], None]:
    def task() -> None:
        if update.values is not None:
            update.apply(update.values(env))
        else:
            update.apply([env[s] for s in update.slots])  # type: ignore[misc]
    return task
