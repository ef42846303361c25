"""Binding: nodes become straight-line steps over a slot array.

Every value of a graph gets a slot index; slot 0 always holds None (omitted
optional inputs). A :class:`Step` holds a node's bound kernel and the slots
it reads, writes and releases after its last use, so running a sequence of
steps needs no dictionary lookups and no attribute parsing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from segflow.engine.counters import RunCounters
from segflow.errors import ExecutionError, SegflowError, bind_failed, node_failed
from segflow.ir.graph import Graph, Node, Value, captured_inputs, node_reads
from segflow.kernels.choice import REFERENCE, KernelChoice, KernelChoices
from segflow.kernels.onednn.library import Destination
from segflow.kernels.registry import binder
from segflow.kernels.target import CpuTarget
from segflow.kernels.workspace import Workspace
from segflow.ops.registry import BindContext as KernelContext
from segflow.ops.registry import Kernel, OpDef, OpRegistry, SubgraphRunner
from segflow.runtime.arena import ArenaPool
from segflow.runtime.nonfinite import NonFinitePolicy

Tensor = torch.Tensor


@dataclass(slots=True)
class Step:
    node: Node
    kernel: Kernel
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    release: tuple[int, ...] = ()
    choice: KernelChoice = REFERENCE     # the kernel the plan chose (kernels/choice.py)


class UploadInputs:
    """A kernel that first moves the inputs it names to its device.

    Bound where a node on a device reads a host value as data (see
    :func:`segflow.runtime.cudagraph.host_data_inputs`): a shape turned into a
    count, say. The copy is asynchronous and the values are a few integers.
    """

    __slots__ = ("kernel", "indices", "device")

    def __init__(self, kernel: Kernel, indices: tuple[int, ...], device: torch.device) -> None:
        self.kernel = kernel
        self.indices = indices
        self.device = device

    def __call__(self, inputs: Sequence[Tensor | None]) -> Sequence[Tensor]:
        moved = list(inputs)
        for i in self.indices:
            tensor = moved[i]
            if tensor is not None and tensor.device != self.device:
                moved[i] = tensor.to(self.device, non_blocking=True)
        return self.kernel(moved)


def bind_kernel(opdef: OpDef, node: Node, ctx: KernelContext) -> Kernel:
    """The kernel ``node``'s choice names (``kernels/registry.py``), else ``opdef``'s
    reference kernel; a factory's error (an attribute or an input the op cannot take)
    names the node."""
    factory = binder(ctx.choice(node).kind)
    try:
        return (factory or opdef.bind)(node, ctx)
    except SegflowError:
        raise
    except Exception as exc:
        raise bind_failed(node.label, exc) from exc


def counts_own_calls(kernel: Kernel) -> bool:
    """Whether ``kernel`` counts the kernel calls it makes itself: it has a true
    ``counts_own_calls`` attribute and is called as ``kernel(inputs, counts)``, with
    the run's :class:`RunCounters` (or None). Any other kernel is one call."""
    return getattr(kernel, "counts_own_calls", False) is True


def run_steps(steps: Sequence[Step], env: list[Tensor | None],
              counts: RunCounters | None = None) -> None:
    """Run ``steps`` in order over ``env``; kernel errors name the node. Each kernel
    called is counted in ``counts`` (those that ran, when one fails)."""
    ran = 0
    try:
        for step in steps:
            kernel = step.kernel
            try:
                if counts_own_calls(kernel):
                    outs = kernel([env[i] for i in step.inputs], counts)  # type: ignore[call-arg]
                    ran -= 1
                else:
                    outs = kernel([env[i] for i in step.inputs])
            except ExecutionError:
                raise
            except Exception as exc:
                raise node_failed(step.node.label, exc) from exc
            ran += 1
            for slot, tensor in zip(step.outputs, outs):
                env[slot] = tensor
            for slot in step.release:
                env[slot] = None
    finally:
        if counts is not None:
            counts.count_kernels(ran)


class SlotMap:
    """Assigns each value a slot index (slot 0 is reserved for None)."""

    def __init__(self) -> None:
        self.slots: dict[Value, int] = {}

    def __getitem__(self, value: Value | None) -> int:
        if value is None:
            return 0
        slot = self.slots.get(value)
        if slot is None:
            slot = self.slots[value] = len(self.slots) + 1
        return slot

    def __len__(self) -> int:
        return len(self.slots) + 1


class BindContext:
    """Gives kernel factories their device and a way to bind subgraphs."""

    def __init__(self, registry: OpRegistry, device: torch.device,
                 constants: ConstantCache, arena: ArenaPool | None = None,
                 nonfinite: NonFinitePolicy | None = None, *,
                 target: CpuTarget | None = None,
                 choices: KernelChoices | None = None) -> None:
        self.registry = registry
        self._device = device
        self._target = target if target is not None else CpuTarget.detect()
        self.choices = choices if choices is not None else KernelChoices()
        self.constants = constants
        self.arena = arena
        # Which kernels may lose NaN or Inf (runtime/nonfinite.py); None: any.
        self.nonfinite = nonfinite
        self._workspace: Workspace | None = None

    def allow_inexact(self, node: Node, reason: str) -> bool:
        """Whether ``node`` may bind a kernel that loses NaN or Inf (``reason``: how)."""
        return self.nonfinite is None or self.nonfinite.allow(node, reason)

    def destination(self, value: Value) -> Destination | None:
        """Where a kernel that takes given storage writes ``value`` in a run (None:
        allocate it; see runtime/arena.py)."""
        return self.arena.destination(value) if self.arena is not None else None

    def staging(self, node: Node) -> Destination | None:
        """Where ``node``'s kernel copies its input before reading it (None: allocate)."""
        return self.arena.staging(node) if self.arena is not None else None

    def workspace(self) -> Workspace:
        """Scratch memory this binding's kernels share, one at a time (made when first
        asked for)."""
        if self._workspace is None:
            self._workspace = Workspace()
        return self._workspace

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def target(self) -> CpuTarget:
        return self._target

    def choice(self, node: Node) -> KernelChoice:
        return self.choices[node]

    def reference(self, node: Node) -> Kernel:
        opdef = self.registry.resolve(node)
        try:
            return opdef.bind(node, self)
        except SegflowError:
            raise
        except Exception as exc:
            raise bind_failed(node.label, exc) from exc

    def captured(self, node: Node) -> list[Value]:
        return captured_inputs(node)

    def subgraph(self, graph: Graph) -> SubgraphRunner:
        return SubgraphProgram(graph, self)

    def bind_node(self, node: Node) -> Kernel:
        opdef = self.registry.resolve(node)
        return bind_kernel(opdef, node, self)


class ConstantCache:
    """Constants moved to a device once and shared by every binding on it."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, str], Tensor] = {}

    def get(self, value: Value, device: torch.device) -> Tensor:
        assert value.const is not None
        if not isinstance(value.const, Tensor):
            return value.const   # a string constant: a host array (ops/strings.py)
        key = (id(value), str(device))
        tensor = self._cache.get(key)
        if tensor is None:
            tensor = value.const.to(device)
            self._cache[key] = tensor
        return tensor


class SubgraphProgram:
    """A subgraph bound once; called with its inputs and the outer values it captures."""

    def __init__(self, graph: Graph, ctx: BindContext) -> None:
        self.graph = graph
        slots = SlotMap()
        self.input_slots = [slots[v] for v in graph.inputs]
        self.captured = graph.captured_values()
        self.captured_slots = [slots[v] for v in self.captured]
        self.steps = [Step(node, ctx.bind_node(node), tuple(slots[v] for v in node_reads(node)),
                           tuple(slots[v] for v in node.outputs)) for node in graph.nodes]
        self.output_slots = [slots[v] for v in graph.outputs]
        consts = [(slots[v], ctx.constants.get(v, ctx.device))
                  for v in _const_values(graph.nodes, graph.initializers.values())]
        self.template: list[Tensor | None] = [None] * len(slots)
        for slot, tensor in consts:
            self.template[slot] = tensor

    def __call__(self, inputs: Sequence[Tensor | None],
                 outer: Mapping[Value, Tensor | None]) -> list[Tensor]:
        env = list(self.template)
        for slot, tensor in zip(self.input_slots, inputs):
            env[slot] = tensor
        for slot, value in zip(self.captured_slots, self.captured):
            if value.is_const and value not in outer:
                env[slot] = value.const
            else:
                env[slot] = outer[value]
        run_steps(self.steps, env)
        return [env[s] for s in self.output_slots]  # type: ignore[misc]


def _const_values(nodes: Iterable[Node], initializers: Iterable[Value]) -> list[Value]:
    out = {id(v): v for v in initializers}
    for node in nodes:
        for v in node.inputs:
            if v is not None and v.is_const and v.producer is None and node.graph is not None \
                    and v.name in node.graph.initializers:
                out.setdefault(id(v), v)
    return list(out.values())


def check_binds(graph: Graph, registry: OpRegistry, device: torch.device,
                target: CpuTarget) -> None:
    """Bind every node of ``graph`` to its reference kernel and drop the kernels: the
    checks binding makes of a node's attributes and inputs (an unsupported mode, say),
    for a session whose plan is made later. Raises what binding the plan would raise,
    naming the node."""
    ctx = BindContext(registry, device, ConstantCache(), target=target)
    for node in graph.nodes:
        ctx.bind_node(node)
