"""The segmentation policy: which nodes run together as one engine task.

A pure function of the node sequence and the settings (see DESIGN.md):

- inference: bulk the whole graph; start a new segment only at a node that is
  not SYNC (that node runs as its own task) or where the device changes.
- training: forward and backward are segmented separately; a segment also ends
  when it reaches ``max_nodes`` and after a node that produces a parameter
  gradient, so gradient consumers can start early.
- bulking off: one task per node.

Every segment records why it ended (``Segment.reason``); ``explain`` prints it.
Graph inputs and constants are not nodes, so they never split a segment.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from segflow.engine.base import ExecType
from segflow.ir.graph import Node, Value
from segflow.ir.types import Device
from segflow.settings import BulkSettings


class Phase(enum.Enum):
    INFERENCE = "inference"
    FORWARD = "forward"
    BACKWARD = "backward"


class Boundary:
    """The reasons a segment ends, as ``explain`` prints them."""

    END = "end of graph"
    MAX_NODES = "max_nodes"
    GRADIENT = "gradient output"
    DISABLED = "bulking disabled"
    DEVICE = "device change"
    PHASE = "forward/backward split"

    @staticmethod
    def non_sync(node: Node, exec_type: ExecType) -> str:
        return f"non-sync op {node.op_type} ({exec_type.value}) [{node.name}]"


@dataclass(frozen=True, slots=True)
class Segment:
    """An ordered run of nodes pushed to the engine as one task."""

    index: int
    nodes: tuple[Node, ...]
    exec_type: ExecType
    device: Device | None
    phase: Phase
    reason: str

    @property
    def first(self) -> Node:
        return self.nodes[0]

    @property
    def last(self) -> Node:
        return self.nodes[-1]


def segment_nodes(nodes: Sequence[Node], exec_type_of: Callable[[Node], ExecType],
                  settings: BulkSettings, *, phase_of: Callable[[Node], Phase] | None = None,
                  gradient_outputs: frozenset[Value] = frozenset()) -> list[Segment]:
    """Group ``nodes`` (in execution order) into segments following the policy."""
    phase_of = phase_of or (lambda node: Phase.INFERENCE)
    segments: list[Segment] = []
    current: list[Node] = []

    def close(reason: str) -> None:
        if current:
            first = current[0]
            segments.append(Segment(len(segments), tuple(current), ExecType.SYNC, first.device,
                                    phase_of(first), reason))
            current.clear()

    for i, node in enumerate(nodes):
        kind = exec_type_of(node)
        phase = phase_of(node)
        next_node = nodes[i + 1] if i + 1 < len(nodes) else None
        if kind is not ExecType.SYNC:
            close(Boundary.non_sync(node, kind))
            segments.append(Segment(len(segments), (node,), kind, node.device, phase,
                                    Boundary.non_sync(node, kind)))
            continue
        if current and current[0].device != node.device:
            close(Boundary.DEVICE)
        if current and phase_of(current[0]) is not phase:
            close(Boundary.PHASE)
        current.append(node)
        bulk = settings.inference if phase is Phase.INFERENCE else settings.train
        if not bulk:
            close(Boundary.DISABLED)
            continue
        if phase is not Phase.INFERENCE:
            limit = settings.max_nodes_fwd if phase is Phase.FORWARD else settings.max_nodes_bwd
            if any(v in gradient_outputs for v in node.outputs):
                close(Boundary.GRADIENT)
            elif len(current) >= limit:
                close(Boundary.MAX_NODES)
        if next_node is None:
            close(Boundary.END)
        elif exec_type_of(next_node) is not ExecType.SYNC:
            close(Boundary.non_sync(next_node, exec_type_of(next_node)))
    close(Boundary.END)
    return segments

