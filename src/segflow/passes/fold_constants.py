"""Constant folding: evaluate at plan time whatever does not depend on the feeds.

Folded:

- every node whose inputs are all constants (initializers or earlier folds),
  evaluated once with its own bound kernel, so folding and running agree;
- ``Shape`` / ``Size`` of a value whose spec shape is static (only the dims
  ``Shape``'s start/end select need be static).

A node left unfolded whose data inputs have static shapes and whose other inputs are
constants gets the static output shapes its kernel computes over meta tensors
(``passes/static_shapes.py``), so a chain of computed reshapes settles in one walk.

Not folded: nodes with subgraphs, random ops, nodes reading or writing a sequence or an
optional, and results larger than
``max_bytes`` (folding must not turn a cheap ``Expand`` into a huge weight).
Dead nodes and unused initializers are removed afterwards.

>>> fold_constants(graph).changed   # doctest: +SKIP
True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import shape_window
from segflow.kernels.choice import REFERENCE, KernelChoice
from segflow.kernels.target import CpuTarget
from segflow.kernels.workspace import Workspace
from segflow.ops import default_registry
from segflow.ops.registry import Kernel, OpRegistry, SubgraphRunner, touches_strings
from segflow.passes._rewrite import new_const, remove_dead
from segflow.passes.result import PassResult
from segflow.passes.static_shapes import refine_static_shapes

DEFAULT_MAX_BYTES = 64 << 20

# Ops that must run every time (their result is not a function of their inputs).
_NONDETERMINISTIC = frozenset({
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
    "Bernoulli", "Dropout",
})


class _FoldContext:
    """The BindContext a kernel gets while folding: host device, no subgraphs."""

    device = torch.device("cpu")

    def captured(self, node: Node) -> list[Value]:
        return []

    def subgraph(self, graph: Graph) -> SubgraphRunner:
        raise NotImplementedError("nodes with subgraphs are not folded")

    def destination(self, value: Value) -> None:
        return None  # folded values are constants: no run storage

    def staging(self, node: Node) -> None:
        return None

    def workspace(self) -> Workspace:
        return Workspace()   # folded kernels run once

    def allow_inexact(self, node: Node, reason: str) -> bool:
        return False   # a folded constant is computed once: exactly

    @property
    def target(self) -> CpuTarget:
        # Folding runs before kernels are chosen: what a reference kernel asks of the
        # target (a linear's post-op) is looked up only if one asks.
        return CpuTarget.detect()

    def choice(self, node: Node) -> KernelChoice:
        return REFERENCE   # folded nodes run their reference kernels

    def reference(self, node: Node) -> Kernel:
        raise NotImplementedError("folded nodes are bound through their OpDef rows")


def fold_constants(graph: Graph, registry: OpRegistry | None = None, *,
                   max_bytes: int = DEFAULT_MAX_BYTES) -> PassResult:
    """Fold constant subgraphs and static shapes of ``graph`` (in place)."""
    registry = registry or default_registry()
    ctx = _FoldContext()
    folded = refined = 0
    for node in list(graph.nodes):
        results = _static_shape(node)
        if results is None and _foldable(node):
            results = _evaluate(node, registry, ctx)
        if results is None or len(results) < len(node.outputs):
            refined += refine_static_shapes(node, registry, ctx)
            continue
        if sum(t.numel() * t.element_size() for t in results) > max_bytes:
            continue
        _replace_with_constants(graph, node, results)
        folded += 1
    removed = remove_dead(graph) if folded else 0
    return PassResult(graph, bool(folded or removed or refined))


def _foldable(node: Node) -> bool:
    # A sequence or optional is no constant tensor a Value can hold, nor is a string
    # value (a host array).
    if node.subgraphs or node.op_type in _NONDETERMINISTIC or not node.inputs \
            or node.touches_containers or touches_strings(node):
        return False
    present = [v for v in node.inputs if v is not None]
    return bool(present) and all(v.is_const and not v.const.is_mkldnn  # type: ignore[union-attr]
                                 for v in present)


def _static_shape(node: Node) -> list[torch.Tensor] | None:
    """Shape/Size of a statically shaped value, without running anything."""
    if node.domain != "" or node.op_type not in ("Shape", "Size") or not node.inputs:
        return None
    source = node.inputs[0]
    if source is None or source.spec.shape is None:
        return None
    dims = list(source.spec.shape)
    if node.op_type == "Size":
        if not source.spec.is_static:
            return None
        total = 1
        for d in dims:
            total *= int(d)  # type: ignore[arg-type]
        return [torch.tensor(total, dtype=torch.int64)]
    start = node.attrs.get("start")
    end = node.attrs.get("end")
    picked = dims[shape_window(start, end, len(dims))]
    if not all(isinstance(d, int) for d in picked):
        return None
    return [torch.tensor(picked, dtype=torch.int64)]


def _evaluate(node: Node, registry: OpRegistry, ctx: _FoldContext) -> list[torch.Tensor] | None:
    try:
        opdef = registry.resolve(node)
        kernel = opdef.bind(node, ctx)
        inputs: Sequence[torch.Tensor | None] = [None if v is None else v.const
                                                 for v in node.inputs]
        with torch.inference_mode(False), torch.no_grad():
            outs = list(kernel(inputs))
    except Exception:
        # Leave it to run time, where the error (if any) names the node and the feeds.
        return None
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in outs):
        return None
    return [_owned(t) for t in outs]


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A compact tensor that shares no storage with a weight (kernels may return views)."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _replace_with_constants(graph: Graph, node: Node, results: Sequence[torch.Tensor]) -> None:
    for value, tensor in zip(node.outputs, results):
        if not value.uses and value not in graph.outputs:
            continue
        const = new_const(graph, value.name, tensor, value.spec.dtype)
        graph.replace_all_uses(value, const)
    if all(not v.uses and v not in graph.outputs for v in node.outputs):
        graph.remove(node)
