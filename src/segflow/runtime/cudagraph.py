"""CUDA-graph segments: capture a bulk segment once per input-shape key, then replay it.

A captured segment costs one graph launch per run instead of one launch per
kernel. Capture needs static shapes and no host reads of device data, so
eligibility is decided per segment at bind time from its nodes and their
constant inputs (:func:`capture_decision`):

- only bulk ``SYNC`` segments on a device with streams are captured (LOCAL,
  COPY and ASYNC tasks run on the host or across devices);
- an op that reads an input's *values* on the host (the shape of Reshape,
  Expand, Slice starts/ends, Range bounds, ...: its row's ``OpDef.host_reads``)
  is capturable only when that input is a constant or a value fixed by the
  input shapes (a ``Shape``/``Size`` output, or a pure function of such values
  and constants): those values are baked into the graph, and the graph cache
  is keyed by input shapes;
- random ops are never captured.

At run time a key (shape, dtype, device of each external input) is first run
eagerly ``warmup`` times (lazy library initialisation must not happen inside a
capture), then captured on the pool's capture stream and replayed. Inputs are
copied into the graph's static input buffers and outputs cloned out of its
static output buffers, so runs never share memory. Keys live in a bounded LRU
cache (:class:`GraphCache`); a capture that fails (an op synchronizes with the
host) marks the segment uncaptured with the error as its reason.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from segflow.engine.base import ExecType
from segflow.engine.streams import GraphHandle, StreamBackend, StreamHandle
from segflow.errors import ExecutionError
from segflow.ir.graph import Node
from segflow.ops.registry import OpDef
from segflow.passes.segment import Segment
from segflow.runtime.binding import Step, node_reads, run_steps

Tensor = torch.Tensor
K = TypeVar("K")
V = TypeVar("V")

DEFAULT_CACHE_SIZE = 8
DEFAULT_WARMUP = 1


# -- which inputs an op reads on the host -----------------------------------------------
# Each op's row says (``OpDef.host_reads``, ``OpDef.host_read_inputs``).

RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                        "RandomUniformLike", "Multinomial", "Bernoulli"})
"""Ops whose output is not a function of their inputs: never captured."""

SHAPE_OPS = frozenset({"Shape", "Size"})


HOST_ARITHMETIC = frozenset({
    "Cast", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Reshape", "Identity",
    "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Max", "Min", "Floor", "Ceil",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or",
    "Where", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin",
})
"""Ops that keep computing on the host over host values (shape arithmetic): none of
them grows its input beyond the size of its inputs and constants."""


def host_values(nodes: Iterable[Node]) -> set[int]:
    """ids of the computed values that live in host memory whatever the device.

    ``Shape`` and ``Size`` give their result in host memory (a shape is known on
    the host; reading it back from the device would cost a synchronization), and
    shape arithmetic over such values and constants (:data:`HOST_ARITHMETIC`)
    stays there. ``nodes`` in topological order.
    """
    host: set[int] = set()
    for node in nodes:
        if node.domain not in ("", "ai.onnx") or node.subgraphs:
            continue
        if node.op_type in SHAPE_OPS:
            host.update(id(v) for v in node.outputs if v is not None)
        elif node.op_type in HOST_ARITHMETIC:
            reads = [v for v in node_reads(node) if v is not None]
            if any(id(v) in host for v in reads) and all(
                    v.is_const or id(v) in host for v in reads):
                host.update(id(v) for v in node.outputs if v is not None)
    return host


def _runs_on_host(node: Node, host: set[int]) -> bool:
    return any(v is not None and id(v) in host for v in node.outputs)


def host_data_inputs(node: Node, opdef: OpDef, host: set[int]) -> tuple[int, ...]:
    """Inputs of ``node`` that hold host values (:func:`host_values`) but that its
    kernel reads as device data: on a device, the executor uploads them first
    (``Div(sum, Cast(Shape(x)))`` on CUDA). ``opdef``: the node's row."""
    if _runs_on_host(node, host) or node.subgraphs or node.op_type in SHAPE_OPS:
        return ()
    on_host = set(opdef.host_read_inputs(node))
    return tuple(i for i, v in enumerate(node.inputs)
                 if v is not None and id(v) in host and i not in on_host)


def host_only_constants(nodes: Iterable[Node], opdefs: Mapping[Node, OpDef],
                        computed_on_host: set[int] | None = None) -> set[int]:
    """ids of constants that every reader only reads on the host.

    The executor keeps these on the CPU even on a CUDA device: reading a shape
    from device memory is a hidden host synchronization per run (and illegal
    inside a capture), and shape arithmetic on the host (:func:`host_values`)
    must find its constants there. ``opdefs``: each node's row (a plan's);
    ``computed_on_host``: :func:`host_values` of ``nodes`` if the caller has it.
    """
    nodes = list(nodes)
    if computed_on_host is None:
        computed_on_host = host_values(nodes)
    host: set[int] = set()
    device: set[int] = set()
    for node in nodes:
        reads = node_reads(node)
        if _runs_on_host(node, computed_on_host):
            on_host = set(range(len(reads)))
        else:
            on_host = set(opdefs[node].host_read_inputs(node))
        for index, value in enumerate(reads):
            if value is None or not value.is_const:
                continue
            (host if index in on_host else device).add(id(value))
    return host - device


# -- eligibility ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CaptureDecision:
    """Whether a segment may be captured, and why (``explain`` prints ``reason``)."""

    segment: int
    eligible: bool
    reason: str


def capture_decision(segment: Segment, managed: bool, opdefs: Mapping[Node, OpDef]
                     ) -> CaptureDecision:
    """Decide from the nodes, their rows (``opdefs``, a plan's) and their constant inputs
    whether ``segment`` is capturable."""
    index = segment.index
    if segment.exec_type is not ExecType.SYNC:
        node = segment.first
        return CaptureDecision(index, False, f"{segment.exec_type.value} task {node.op_type} "
                                             f"[{node.name}] does not run as device kernels")
    if not managed:
        return CaptureDecision(index, False, f"device {segment.device} has no CUDA streams")
    static: set[int] = set()  # values fixed for a given input-shape key
    for node in segment.nodes:
        if node.op_type in RANDOM_OPS:
            return CaptureDecision(index, False, f"random op {node.op_type} [{node.name}]")
        if node.subgraphs:
            return CaptureDecision(index, False, f"control flow {node.op_type} [{node.name}]")
        for i in opdefs[node].host_read_inputs(node):
            value = node.inputs[i] if i < len(node.inputs) else None
            if value is None or value.is_const or id(value) in static:
                continue
            return CaptureDecision(index, False,
                                   f"{node.op_type} [{node.name}] reads computed input {i} "
                                   f"({value.name!r}) on the host")
        if node.op_type in SHAPE_OPS or all(
                v is None or v.is_const or id(v) in static for v in node_reads(node)):
            static.update(id(v) for v in node.outputs)
    return CaptureDecision(index, True, f"capturable ({len(segment.nodes)} nodes)")


# -- cache ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CaptureKey:
    """Shape, dtype and device of each external input of a segment, in slot order."""

    inputs: tuple[tuple[tuple[int, ...], str, str], ...]

    @classmethod
    def of(cls, tensors: Sequence[Tensor | None]) -> CaptureKey:
        return cls(tuple(((), "none", "-") if t is None else
                         (tuple(t.shape), str(t.dtype), str(t.device)) for t in tensors))

    def describe(self) -> str:
        return ", ".join(f"{dtype.removeprefix('torch.')}{list(shape)}"
                         for shape, dtype, _ in self.inputs) or "(no inputs)"


class GraphCache(Generic[K, V]):
    """A bounded LRU map: ``get`` refreshes a key, ``put`` evicts the least recently used."""

    def __init__(self, capacity: int = DEFAULT_CACHE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"graph cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry

    def put(self, key: K, value: V) -> list[K]:
        """Insert or replace ``key``; returns the keys evicted to stay within capacity."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        evicted = []
        while len(self._entries) > self.capacity:
            old, _ = self._entries.popitem(last=False)
            evicted.append(old)
        self.evictions += len(evicted)
        return evicted

    def keys(self) -> list[K]:
        """Least recently used first."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


# -- capture and replay -------------------------------------------------------------------


@dataclass(slots=True)
class _Warming:
    runs: int


@dataclass(slots=True)
class _Uncapturable:
    reason: str


@dataclass(slots=True)
class _Captured:
    graph: GraphHandle
    static_inputs: list[Tensor]
    env: list[Tensor | None]  # holds the static outputs after capture


_Entry = _Warming | _Uncapturable | _Captured


class CaptureHost(Protocol):
    """What a segment graph needs from its executor's streams."""

    backend: StreamBackend

    def capture_stream(self, segment: Segment) -> StreamHandle:
        ...


class SegmentGraph:
    """One capturable segment: its slots, its graph cache and its fallback state."""

    def __init__(self, segment: Segment, steps: Sequence[Step], *,
                 capacity: int = DEFAULT_CACHE_SIZE, warmup: int = DEFAULT_WARMUP,
                 capture_lock: threading.Lock | None = None) -> None:
        self.segment = segment
        self.steps = list(steps)
        self.warmup = warmup
        self.cache: GraphCache[CaptureKey, _Entry] = GraphCache(capacity)
        self.captures = 0
        self.replays = 0
        self.failure: str | None = None  # set once a capture failed: run uncaptured
        self.last_reason: str | None = None
        self._lock = threading.Lock()
        self._capture_lock = capture_lock or threading.Lock()
        produced: set[int] = set()
        inputs: dict[int, None] = {}
        consts: dict[int, None] = {}
        last_reader: dict[int, int] = {}
        for s, step in enumerate(self.steps):
            for value, slot in zip(node_reads(step.node), step.inputs):
                if value is None or slot in produced:
                    continue
                (consts if value.is_const else inputs)[slot] = None
                last_reader[slot] = s
            produced.update(step.outputs)
        self.input_slots = tuple(inputs)
        self.const_slots = tuple(consts)
        released = {slot for step in self.steps for slot in step.release}
        # External inputs this segment frees after their last use (kept in the graph's
        # own buffers, so the run's env drops them after a replay).
        self.released_inputs = tuple(s for s in self.input_slots if s in released)
        self._produced = produced
        self.output_slots: tuple[int, ...] = ()

    def bind_outputs(self, needed: Iterable[int]) -> None:
        """Declare which produced slots are read after this segment (clone these out)."""
        self.output_slots = tuple(s for s in dict.fromkeys(needed) if s in self._produced)

    def state(self) -> str:
        """One line for ``explain``: captured keys, replays, or why it runs uncaptured."""
        if self.failure is not None:
            return f"not captured: {self.failure}"
        text = (f"captured {self.captures}x, {len(self.cache)} cached shape(s) "
                f"(max {self.cache.capacity}), {self.replays} replays, "
                f"{self.cache.evictions} evictions")
        if self.last_reason:
            text += f"; last uncaptured key: {self.last_reason}"
        return text

    def run(self, env: list[Tensor | None], host: CaptureHost,
            on_host_wait: Callable[[], None],
            eager: Callable[[], None] | None = None) -> bool:
        """Run the segment over ``env``: eager, capture-then-replay, or replay.

        ``eager``: the segment's uncaptured form over ``env`` (its generated function);
        by default its steps one by one. True where a captured graph was replayed
        (its kernels were launched by the graph, not by ``eager``).
        """
        if eager is None:
            def eager() -> None:
                run_steps(self.steps, env)
        if self.failure is not None:
            eager()
            return False
        inputs = [env[s] for s in self.input_slots]
        key = CaptureKey.of(inputs)
        with self._lock:
            entry = self.cache.get(key)
            if entry is None:
                entry = self._first_sight(inputs, host)
                self.cache.put(key, entry)
            if isinstance(entry, _Uncapturable):
                self.last_reason = f"{key.describe()}: {entry.reason}"
                eager()
                return False
            if isinstance(entry, _Warming):
                if entry.runs < self.warmup:
                    entry.runs += 1
                    eager()
                    return False
                try:
                    captured = self._capture(inputs, env, host, on_host_wait)
                except Exception as exc:  # noqa: BLE001 - any capture error means "don't"
                    self.failure = f"capture failed: {_root_cause(exc)}"
                    eager()
                    return False
                self.cache.put(key, captured)
                entry = captured
            self._replay(entry, inputs, env, host)
        return True

    def _first_sight(self, inputs: Sequence[Tensor | None], host: CaptureHost) -> _Entry:
        backend = host.backend
        for slot, tensor in zip(self.input_slots, inputs):
            if tensor is None:
                return _Uncapturable(f"input slot {slot} is missing")
            if not backend.on_device(tensor):
                return _Uncapturable(f"input slot {slot} is on the host ({tensor.device})")
        return _Warming(0)

    def _capture(self, inputs: Sequence[Tensor | None], env: list[Tensor | None],
                 host: CaptureHost, on_host_wait: Callable[[], None]) -> _Captured:
        backend = host.backend
        # Filled now so a backend that executes while capturing sees real data.
        static_inputs = [t.clone(memory_format=torch.contiguous_format)
                         for t in inputs if t is not None]
        consts = [(slot, env[slot]) for slot in self.const_slots]
        graph_env: list[Tensor | None] = [None] * len(env)
        steps, input_slots = self.steps, self.input_slots

        def body() -> None:
            # Re-seat inputs each time: the steps release them after their last use.
            for slot, tensor in zip(input_slots, static_inputs):
                graph_env[slot] = tensor
            for slot, const in consts:
                graph_env[slot] = const
            run_steps(steps, graph_env)

        with self._capture_lock:
            on_host_wait()  # a capture begins with a device synchronize
            graph = backend.capture(body, host.capture_stream(self.segment))
        self.captures += 1
        return _Captured(graph, static_inputs, graph_env)

    def _replay(self, entry: _Captured, inputs: Sequence[Tensor | None],
                env: list[Tensor | None], host: CaptureHost) -> None:
        for static, tensor in zip(entry.static_inputs, inputs):
            static.copy_(tensor)  # type: ignore[arg-type]
        host.backend.replay(entry.graph)
        self.replays += 1
        for slot in self.output_slots:
            out = entry.env[slot]
            # Clone: the next replay rewrites the static outputs in place.
            env[slot] = out.clone() if out is not None else None
        for slot in self.released_inputs:
            env[slot] = None


def _root_cause(exc: BaseException) -> str:
    """The error that broke a capture, named by its node where a kernel raised it.

    A kernel's illegal call (a host read, a pageable copy) raises inside the
    capture; ending the capture then raises again ("operation failed due to a
    previous error during capture") with the first error as its context.
    """
    chain = [exc]
    while chain[-1].__context__ is not None and len(chain) < 8:
        chain.append(chain[-1].__context__)
    named = next((e for e in chain if isinstance(e, ExecutionError)), None)
    first = named or chain[-1]
    text = f"{type(first).__name__}: {_first_line(first)}" if named is None else \
        _first_line(first)
    return text[:300]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def describe_decisions(decisions: Sequence[CaptureDecision],
                       graphs: Mapping[int, SegmentGraph]) -> list[str]:
    """``explain`` lines: per segment, captured state or why it is not captured."""
    lines = []
    for decision in decisions:
        graph = graphs.get(decision.segment)
        if graph is not None:
            lines.append(f"  segment {decision.segment}: {graph.state()}")
        elif decision.eligible:
            lines.append(f"  segment {decision.segment}: {decision.reason}")
        else:
            lines.append(f"  segment {decision.segment}: not captured: {decision.reason}")
    return lines
