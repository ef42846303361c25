"""Plan: the immutable result of planning a graph (passes, placement, segments)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from segflow.engine.base import ExecType
from segflow.ir.graph import Graph, Node
from segflow.ir.types import Device
from segflow.kernels.choice import KernelChoices
from segflow.ops.registry import OpDef, OpRegistry
from segflow.passes.place import COPY_DOMAIN, COPY_OP, place
from segflow.passes.plan_memory import MemoryPlan, PlansBySize
from segflow.passes.segment import Phase, Segment, segment_nodes
from segflow.settings import BulkSettings


@dataclass(frozen=True, slots=True)
class Plan:
    """Ordered segments over a placed graph, with each node's OpDef resolved."""

    graph: Graph
    segments: tuple[Segment, ...]
    opdefs: Mapping[Node, OpDef]
    settings: BulkSettings
    default_device: Device
    pass_log: tuple[str, ...] = field(default=())
    # The memory plan the pipeline made (None: that pass was off), and the same plan
    # re-sized for the symbolic dims runs bind. The compiler's in-place decisions, the
    # activation arena and RunStats read these; nothing plans the graph again.
    memory: MemoryPlan | None = None
    memory_by_size: PlansBySize | None = field(default=None, compare=False, repr=False)
    # Which kernel runs each node (passes/select_kernels.py; absent: the reference).
    choices: KernelChoices = field(default_factory=KernelChoices)

    @property
    def compute_nodes(self) -> int:
        # Fused ops share the segflow domain with Copy; only Copy nodes are not compute.
        return sum(1 for s in self.segments for n in s.nodes
                   if not (n.domain == COPY_DOMAIN and n.op_type == COPY_OP))

    @property
    def copy_tasks(self) -> int:
        return sum(1 for s in self.segments if s.exec_type is ExecType.COPY)


def resolve_opdefs(graph: Graph, registry: OpRegistry) -> dict[Node, OpDef]:
    return {node: registry.resolve(node)
            for node in graph.nodes}


def make_plan(graph: Graph, registry: OpRegistry, settings: BulkSettings,
              default_device: Device, placement: Mapping[str, str | Device] | None = None,
              pass_log: tuple[str, ...] = (), memory: MemoryPlan | None = None,
              choices: KernelChoices | None = None) -> Plan:
    """Place the graph's nodes, resolve their OpDefs and segment them for inference.

    ``memory``: the pipeline's memory plan, kept with the plan (with its re-sizing);
    ``choices``: the kernel selection's choices.
    """
    graph.validate()
    place(graph, default_device, placement)
    opdefs = resolve_opdefs(graph, registry)

    def exec_type_of(node: Node) -> ExecType:
        return opdefs[node].exec_type_of(node)

    segments = segment_nodes(graph.nodes, exec_type_of, settings,
                             phase_of=lambda node: Phase.INFERENCE)
    by_size = PlansBySize(graph, memory) if memory is not None else None
    return Plan(graph, tuple(segments), opdefs, settings, default_device, pass_log,
                memory=memory, memory_by_size=by_size,
                choices=choices if choices is not None else KernelChoices())
