"""The activation arena: planned storage for the outputs of kernels that can take it.

The memory plan (``passes/plan_memory.py``, held by the Plan) gives every
computed value a lifetime and an offset in one arena. Most kernels are torch ops that
allocate their own outputs, but a kernel whose choice calls libdnnl
(``KernelChoices.calls_libdnnl``: ``kernels/onednn/``) writes wherever it is told. Those
outputs are
carved out of one block per run instead of coming from malloc:

- a run's storage is one ``torch.empty`` block, allocated at the first
  direct kernel that asks (a run whose kernels all fell back, or were
  compiled by another backend, allocates nothing) and kept for the next run;
- each planned output is a channels-last view at its planned offset. Outputs
  that live until the end of the run (graph outputs, and anything sharing
  their storage) are never placed here: the caller keeps them after the block
  is reused;
- the offsets are re-planned for only these outputs (the block is no larger
  than the plan's peak), once per set of symbolic dims a run binds (batch size).

Why: glibc spreads a run's freed activations over the heap, and the pages a
run touches above its live peak are what it costs in memory: a run faulted in
about three times its planned peak above the loaded session (docs/performance.md,
"Activation arena"). A block that a run fills by plan touches only its own pages.

Safety rests on the plan's order being the order nodes run in. The pool is
only built for an executor that runs its tasks one after another, in the
graph's node order, on the calling thread (the inline engine on the host);
concurrent runs of one session each take their own block from the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from segflow.ir.graph import Node, Value
from segflow.ir.memory import Buffer, align, block_bytes, place
from segflow.kernels.choice import KernelChoices
from segflow.kernels.onednn.geometry import channels_last_strides
from segflow.kernels.onednn.library import Destination
from segflow.passes.plan_memory import PlansBySize, nbytes, static_sizes
from segflow.shape_cache import ShapeCache

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class Placed:
    """One view of a run's block: what it holds, where, and while which nodes run."""

    index: int                       # the pool's view index (a value, or a node's staging)
    name: str
    offset: int                      # bytes into the block
    sizes: tuple[int, ...]
    strides: tuple[int, ...]         # channels-last: the layout direct kernels write
    dtype: torch.dtype
    start: int                       # first and last node (plan order) that use it
    end: int

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.sizes:
            count *= d
        return count * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    """Where each planned output sits in a run's block, at one set of symbolic dims."""

    nbytes: int
    entries: tuple[Placed, ...]
    slots: int                      # how many views the pool serves
    dims: tuple[tuple[str, int], ...]

    def carve(self) -> list[Tensor | None]:
        """Allocate a block and cut it into the views (None: not planned at this size).

        Ordinary tensors even when the first run is under ``inference_mode``
        (``run``): a later ``run_tensors`` writes into them outside it.
        """
        views: list[Tensor | None] = [None] * self.slots
        with torch.inference_mode(False):
            block = torch.empty(self.nbytes, dtype=torch.uint8)
            for entry in self.entries:
                span = block[entry.offset:entry.offset + entry.nbytes].view(entry.dtype)
                views[entry.index] = span.as_strided(entry.sizes, entry.strides)
        return views

    def describe(self) -> str:
        at = ", ".join(f"{k}={v}" for k, v in self.dims)
        return (f"arena: {len(self.entries)} views in {self.nbytes / (1 << 20):.1f} MiB"
                + (f" at {at}" if at else ""))


class RunArena:
    """One run's block: the views are cut on first use and reused by later runs."""

    __slots__ = ("layout", "_views")

    def __init__(self, layout: ArenaLayout) -> None:
        self.layout = layout
        self._views: list[Tensor | None] | None = None

    @property
    def allocated(self) -> bool:
        return self._views is not None

    def view(self, index: int) -> Tensor | None:
        views = self._views
        if views is None:
            views = self._views = self.layout.carve()
        return views[index]


class ArenaPool:
    """The arena blocks of one executor: one per concurrent run, kept between runs.

    ``destination(value)`` gives a kernel a callable that returns the storage
    planned for ``value`` in the calling thread's current run (None outside a
    run, or when the value is not planned at this size); ``staging(node)`` the
    same for the copy of its input a kernel makes first, planned to live only
    while that node runs. ``acquire``/``release`` bracket a run.
    """

    MAX_IDLE = 4        # idle blocks kept per size (one per thread that ran concurrently)
    MAX_SIZES = 2       # sizes whose idle blocks are kept (the most recent ones)

    def __init__(self, plans: PlansBySize, nodes: Sequence[Node],
                 choices: KernelChoices) -> None:
        """``nodes``: the graph's nodes, in the order the plan was made and runs go;
        ``choices``: their kernels (``KernelChoices.calls_libdnnl``: the kernel writes
        its output where it is told; ``converts_input``: it copies its first input
        before reading it)."""
        takes_storage = choices.calls_libdnnl
        stages_input = choices.converts_input
        self.plans = plans
        self.values = _outputs(nodes, takes_storage)
        self.staged = [(i, node) for i, node in enumerate(nodes)
                       if takes_storage(node) and stages_input(node)
                       and node.inputs[0] is not None and _float_image(node.inputs[0])]
        self.index: dict[object, int] = {v: i for i, v in enumerate(self.values)}
        for _, node in self.staged:
            self.index[node] = len(self.index)
        self.by_name = {v.name: v for v in self.values}
        self.node_count = len(nodes)
        self._layouts: ShapeCache[tuple[tuple[str, int], ...], ArenaLayout] = \
            ShapeCache(PlansBySize.MAX_SIZES)
        self._idle: dict[tuple[tuple[str, int], ...], list[RunArena]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def __bool__(self) -> bool:
        return bool(self.values)

    def destination(self, value: Value) -> Destination | None:
        """The kernel-side lookup for ``value`` (None: the pool never places it)."""
        return self._lookup(value)

    def staging(self, node: Node) -> Destination | None:
        """The kernel-side lookup for the copy of ``node``'s input (None: never planned)."""
        return self._lookup(node)

    def _lookup(self, key: object) -> Destination | None:
        index = self.index.get(key)
        if index is None:
            return None
        local = self._local

        def storage() -> Tensor | None:
            arena: RunArena | None = getattr(local, "arena", None)
            return None if arena is None else arena.view(index)
        return storage

    def layout(self, dims: Mapping[str, int]) -> ArenaLayout:
        """The block layout at ``dims`` (made once per size, from the plan at that size)."""
        plan = self.plans.for_dims(dims)
        key = tuple(sorted(plan.dims.items()))
        found = self._layouts.get(key)
        if found is not None:
            return found
        wanted: list[tuple[Buffer, int, Value]] = []   # (buffer, view index, value it holds)
        for buf in plan.buffers:
            value = self.by_name.get(buf.values[0])
            if value is not None and buf.end < self.node_count:
                wanted.append((Buffer(buf.values, buf.nbytes, buf.start, buf.end),
                               self.index[value], value))
        for node_index, node in self.staged:
            source = node.inputs[0]
            assert source is not None
            size = nbytes(source, plan.dims)
            if size is not None:
                wanted.append((Buffer((f"{node.name}:staging",), align(size), node_index,
                                      node_index), self.index[node], source))
        placed = place([buf for buf, _, _ in wanted])
        entries = []
        for buf, (_, index, value) in zip(placed, wanted, strict=True):
            sizes = static_sizes(value, plan.dims)
            if sizes is None or value.spec.dtype is None:
                continue
            entries.append(Placed(index, buf.values[0], buf.offset, sizes,
                                  tuple(channels_last_strides(sizes)), value.spec.dtype.torch,
                                  buf.start, buf.end))
        layout = ArenaLayout(block_bytes(placed), tuple(entries), len(self.index), key)
        self._layouts.put(key, layout)
        return layout

    def acquire(self, dims: Mapping[str, int]) -> RunArena:
        """A block for a run at ``dims``, made current on this thread."""
        layout = self.layout(dims)
        with self._lock:
            idle = self._idle.get(layout.dims)
            arena = idle.pop() if idle else RunArena(layout)
        self._local.arena = arena
        return arena

    def release(self, arena: RunArena) -> None:
        """End the run: the block goes back to the pool for the next one."""
        self._local.arena = None
        if not arena.allocated:
            return
        key = arena.layout.dims
        with self._lock:
            idle = self._idle.pop(key, [])
            if len(idle) < self.MAX_IDLE:
                idle.append(arena)
            self._idle[key] = idle           # most recent size last
            while len(self._idle) > self.MAX_SIZES:
                self._idle.pop(next(iter(self._idle)))

    def held_bytes(self) -> int:
        """Bytes of the idle blocks the pool keeps between runs."""
        with self._lock:
            return sum(a.layout.nbytes for idle in self._idle.values() for a in idle)


def _float_image(value: Value) -> bool:
    """A float32 ``[N, C, *spatial]`` value of rank 4 or 5 (what direct kernels take)."""
    shape, dtype = value.spec.shape, value.spec.dtype
    return shape is not None and len(shape) in (4, 5) and dtype is not None \
        and dtype.torch is torch.float32


def _outputs(nodes: Sequence[Node], takes_storage: Callable[[Node], bool]) -> list[Value]:
    """The outputs the arena may place: float images written by ``takes_storage`` nodes."""
    return [node.outputs[0] for node in nodes
            if len(node.outputs) == 1 and takes_storage(node) and _float_image(node.outputs[0])]

