"""Static memory planning: lifetimes, in-place reuse and an arena layout.

Works on the node order of a graph (the order segments run in) and the static
shapes in value specs:

- **lifetimes**: a value lives from the node that defines it to its last
  reader (graph outputs: to the end). Values produced by ops that may return a
  view of an input (Reshape, Transpose, Slice, Identity ...) share their
  input's storage, so they extend its lifetime instead of allocating.
- **in-place**: an elementwise node (Relu, Add, FusedConv's residual ...) may
  write its output over an input that dies at that node, when the two have the
  same static shape and dtype and no view of that input is still alive.
- **arena**: every remaining buffer gets an offset in one arena, greedy by
  size (largest first, lowest offset that does not overlap a buffer alive at
  the same time). ``arena_bytes`` is the planned peak; ``naive_bytes`` is what
  one allocation per value would hold.

The runtime uses the plan three ways: its in-place decisions (generated code
calls ``relu_``, ``add_``, oneDNN's in-place residual conv); freeing every
value at its last use; and, for kernels that write where they are told (the
convolutions and poolings called straight into libdnnl), the arena itself:
``runtime/arena.py`` lays those outputs out again by this plan, in one block
per run. Torch ops still allocate their own outputs. ``explain()`` and
RunStats report the planned peak next to the naive total.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.memory import Buffer, align, block_bytes, place
from segflow.shape_cache import ShapeCache

# Ops whose kernels always return a freshly allocated output (never a view of an input).
FRESH_OUTPUT_OPS = frozenset({
    "Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Pow", "Relu",
    "Sigmoid", "Tanh", "Erf", "Exp", "Log", "Sqrt", "Neg", "Abs", "Reciprocal", "Softmax",
    "LogSoftmax", "LayerNormalization", "BatchNormalization", "InstanceNormalization",
    "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Concat", "Gelu",
    "LeakyRelu", "HardSigmoid", "HardSwish", "Swish", "Where", "Equal", "Greater", "Less", "Not",
    "FusedConv", "FusedGemm", "DenseChain", "Attention", "AddLayerNorm", "Clip", "ReduceMean",
    "ReduceSum", "ReduceMax",
})

# op type -> input indices the op can overwrite with its output (elementwise ops only).
INPLACE_INPUTS: Mapping[str, tuple[int, ...]] = {
    "Relu": (0,), "Sigmoid": (0,), "Tanh": (0,), "Erf": (0,), "Exp": (0,), "Neg": (0,),
    "Abs": (0,), "Sqrt": (0,), "Add": (0, 1), "Mul": (0, 1), "Sub": (0,), "Div": (0,),
    "FusedConv": (3,),
}


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The result of :func:`plan_memory`."""

    buffers: tuple[Buffer, ...]
    arena_bytes: int            # planned peak (arena size)
    naive_bytes: int            # one allocation per planned value, no reuse
    live_peak_bytes: int        # most bytes alive at once (a lower bound for any layout)
    unplanned: int              # computed values whose size is not static
    inplace: Mapping[Node, int] = field(default_factory=dict)  # node -> input it overwrites
    dims: Mapping[str, int] = field(default_factory=dict)      # symbolic dims sized as

    def summary(self) -> str:
        at = ""
        if self.dims:
            at = " at " + ", ".join(f"{k}={v}" for k, v in self.dims.items())
        return (f"planned peak {_mib(self.arena_bytes)} vs naive {_mib(self.naive_bytes)} "
                f"(live peak {_mib(self.live_peak_bytes)}){at}, {len(self.buffers)} buffers, "
                f"{len(self.inplace)} in-place, {self.unplanned} unplanned")

    def as_record(self) -> dict[str, int | str]:
        """The numbers RunStats settings carry (and the symbolic dims they were sized at)."""
        record: dict[str, int | str] = {"memory_planned_peak_bytes": self.arena_bytes,
                                        "memory_naive_bytes": self.naive_bytes,
                                        "memory_inplace_nodes": len(self.inplace)}
        if self.dims:
            record["memory_plan_dims"] = ", ".join(f"{k}={v}" for k, v in self.dims.items())
        return record


class PlansBySize:
    """One graph's memory plan, re-sized for the symbolic dims a run binds.

    The pipeline plans once, with every symbolic input dim at 1. A run at
    batch 8 should report the peak for batch 8: this re-plans for the dims of
    the run (the in-place decisions are symbolic, so only sizes change) and
    keeps the ``MAX_SIZES`` most recently used plans (and the one it was given), so a
    steady batch size costs one dict lookup per run.
    """

    MAX_SIZES = 8

    def __init__(self, graph: Graph, plan: MemoryPlan) -> None:
        self.graph = graph
        self.base = plan
        self.names = tuple(plan.dims)
        self._base_key = tuple(plan.dims[n] for n in self.names)
        self._plans: ShapeCache[tuple[int, ...], MemoryPlan] = ShapeCache(self.MAX_SIZES)
        self._last: tuple[dict[str, int], MemoryPlan] | None = None

    def for_dims(self, dims: Mapping[str, int]) -> MemoryPlan:
        """The plan sized at ``dims`` (names the graph does not plan for are ignored)."""
        last = self._last  # a steady size: one dict comparison
        if last is not None and last[0] == dims:
            return last[1]
        key = tuple(dims.get(n, self.base.dims[n]) for n in self.names)
        if key == self._base_key:
            plan = self.base
        else:   # the cache is thread-safe: sessions may run on several threads
            plan = self._plans.get_or_make(
                key, lambda: plan_memory(self.graph, dims=dict(zip(self.names, key))))
        self._last = (dict(dims), plan)
        return plan


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def static_sizes(value: Value, dims: Mapping[str, int] | None = None
                 ) -> tuple[int, ...] | None:
    """``value``'s sizes with symbolic dims taken from ``dims`` (None: not all known)."""
    shape = value.spec.shape
    if shape is None:
        return None
    sizes = []
    for d in shape:
        if isinstance(d, str) and dims is not None and d in dims:
            d = dims[d]
        if not isinstance(d, int):
            return None
        sizes.append(d)
    return tuple(sizes)


def nbytes(value: Value, dims: Mapping[str, int] | None = None) -> int | None:
    """Bytes of ``value`` when its dtype and shape are known (symbolic dims from ``dims``)."""
    spec = value.spec
    if spec.dtype is None:
        return None
    try:
        itemsize = spec.dtype.torch.itemsize
    except (ValueError, AttributeError):
        return None
    sizes = static_sizes(value, dims)
    if sizes is None:
        return None
    count = 1
    for d in sizes:
        count *= d
    return count * itemsize


def symbolic_dims(graph: Graph) -> list[str]:
    """The symbolic dimension names of the graph inputs, in order of appearance."""
    names: list[str] = []
    for value in graph.inputs:
        for d in value.spec.shape or ():
            if isinstance(d, str) and d not in names:
                names.append(d)
    return names


class _Groups:
    """Union-find over values that may share storage (views, in-place results)."""

    def __init__(self) -> None:
        self.parent: dict[Value, Value] = {}

    def find(self, value: Value) -> Value:
        root = self.parent.setdefault(value, value)
        while root is not self.parent[root]:
            root = self.parent[root]
        while value is not root:
            value, self.parent[value] = self.parent[value], root
        return root

    def union(self, keep: Value, other: Value) -> None:
        a, b = self.find(keep), self.find(other)
        if a is not b:
            self.parent[b] = a


def plan_memory(graph: Graph, order: Sequence[Node] | None = None, *,
                inplace: bool = True, dims: Mapping[str, int] | None = None) -> MemoryPlan:
    """Plan storage for the computed values of ``graph`` run in ``order`` (default: its nodes).

    Sizes need static shapes; a symbolic input dim (``batch``) is sized from
    ``dims``, 1 where it names none. In-place decisions compare shapes symbolically,
    so they hold for every size.
    """
    nodes = list(order if order is not None else graph.nodes)
    dims = {**dict.fromkeys(symbolic_dims(graph), 1), **(dims or {})}
    end_of_graph = len(nodes)
    groups = _Groups()
    pinned: set[Value] = set()  # group roots holding a graph input or a constant
    last_use: dict[Value, int] = {}
    defined: dict[Value, int] = {}
    for value in [*graph.inputs, *graph.initializers.values()]:
        pinned.add(groups.find(value))
    for index, node in enumerate(nodes):
        for value in _reads(node):
            last_use[value] = index
            if value.producer is None:
                pinned.add(groups.find(value))
        for value in node.outputs:
            defined[value] = index
            last_use.setdefault(value, index)
        if node.op_type not in FRESH_OUTPUT_OPS:
            # A view shares its input's storage; a sequence holds its input tensors
            # (no sequence op is fresh): either way the inputs live as long as the output.
            for source in node.inputs:
                if source is not None:
                    for out in node.outputs:
                        groups.union(source, out)
    for value in graph.outputs:
        last_use[value] = end_of_graph
    # Pinned status and lifetimes are per group (a view keeps its base alive).
    pinned = {groups.find(v) for v in pinned}
    group_end: dict[Value, int] = {}
    for value, end in last_use.items():
        root = groups.find(value)
        group_end[root] = max(group_end.get(root, end), end)

    chosen: dict[Node, int] = {}
    if inplace:
        for index, node in enumerate(nodes):
            slot = _inplace_input(node, index, groups, pinned, group_end, graph)
            if slot is not None:
                chosen[node] = slot
                target = node.inputs[slot]
                assert target is not None
                root = groups.find(target)
                # The output's group (its views, a graph output among them) now lives in
                # the target's storage: that group's end and pinning carry over. Its root
                # need not be the output itself (a Reshape joins its shape constant too).
                other = groups.find(node.outputs[0])
                groups.union(root, other)
                group_end[root] = max(group_end[root], group_end.get(other, index),
                                      last_use.get(node.outputs[0], index))
                if other in pinned:
                    pinned.add(root)

    buffers, unplanned = _buffers(nodes, groups, pinned, group_end, defined, chosen, dims)
    placed = place(buffers)
    return MemoryPlan(
        buffers=tuple(placed),
        arena_bytes=block_bytes(placed),
        naive_bytes=sum(b.nbytes for b in placed) + sum(
            nbytes(node.outputs[0], dims) or 0 for node in chosen),
        live_peak_bytes=_live_peak(placed, end_of_graph),
        unplanned=unplanned,
        inplace=chosen,
        dims=dict(dims),
    )


def _reads(node: Node) -> list[Value]:
    reads = [v for v in node.inputs if v is not None]
    for sub in node.subgraphs.values():
        reads.extend(sub.captured_values())
    return reads


def _inplace_input(node: Node, index: int, groups: _Groups, pinned: set[Value],
                   group_end: dict[Value, int], graph: Graph) -> int | None:
    candidates = INPLACE_INPUTS.get(node.op_type)
    if not candidates or node.domain not in ("", "segflow") or len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    if out.spec.shape is None or any(d is None for d in out.spec.shape) or out.spec.dtype is None:
        return None
    for slot in candidates:
        if slot >= len(node.inputs):
            continue
        target = node.inputs[slot]
        if target is None or target.producer is None or target.const is not None:
            continue
        producer = target.producer
        if producer.op_type not in FRESH_OUTPUT_OPS or target in graph.outputs:
            continue  # only a value that owns its storage may be overwritten
        root = groups.find(target)
        if root in pinned or group_end.get(root, -1) != index:
            continue  # another reader, a view, or the caller still needs it
        if target.spec != out.spec:
            continue
        if sum(1 for v in node.inputs if v is target) != 1:
            continue
        return slot
    return None


def _buffers(nodes: Sequence[Node], groups: _Groups, pinned: set[Value],
             group_end: dict[Value, int], defined: dict[Value, int],
             inplace: Mapping[Node, int], dims: Mapping[str, int]) -> tuple[list[Buffer], int]:
    inplace_outputs = {node.outputs[0] for node in inplace}
    members: dict[Value, list[str]] = {}
    owners: list[Value] = []
    unplanned = 0
    for node in nodes:
        for value in node.outputs:
            root = groups.find(value)
            if root in pinned:
                continue
            if value in inplace_outputs:
                members.setdefault(root, []).append(value.name)
                continue
            if node.op_type not in FRESH_OUTPUT_OPS:
                continue  # a (possible) view: lives in its input's buffer
            if nbytes(value, dims) is None:
                unplanned += 1
                continue
            owners.append(value)
    buffers = []
    named: set[Value] = set()
    for value in owners:
        root = groups.find(value)
        size = nbytes(value, dims)
        assert size is not None
        # In-place results are listed with the first buffer of their group.
        extra = members.get(root, []) if root not in named else []
        named.add(root)
        buffers.append(Buffer((value.name, *extra), align(size), defined[value],
                              max(group_end.get(root, defined[value]), defined[value])))
    return buffers, unplanned


def _live_peak(buffers: Sequence[Buffer], steps: int) -> int:
    delta = [0] * (steps + 2)
    for b in buffers:
        delta[b.start] += b.nbytes
        delta[b.end + 1] -= b.nbytes
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak
