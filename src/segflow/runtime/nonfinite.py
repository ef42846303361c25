"""NaN and infinities: a session's results carry them as onnxruntime's do.

Some of the fastest CPU kernels lose them. oneDNN's ReLU, clip and hard-sigmoid
post-ops take max/min instructions that return the bound for a NaN, and its
erf-GELU gives NaN for +inf (``Activation.onednn_loses``); libdnnl's max pooling
skips NaN; Winograd's transforms and Strassen's sums spread a NaN or an infinity
over a tile or half a matrix, where a direct kernel keeps it to the outputs that
read it; torch's CPU ``scaled_dot_product_attention`` (an Attention node's torch
path without the native library) gives 0 for a row that holds a NaN score. A
kernel binder asks ``BindContext.allow_inexact`` before choosing one of them, and
:class:`NonFinitePolicy` answers:

- A node that a NaN or an infinity can reach from inside the graph never gets
  one: :func:`nonfinite_reach` follows the results of every node whose op may
  create one out of finite inputs (``OpDef.creates_nonfinite``: a division by a
  computed value, a log, a square root, an exponential, ...), and of every constant
  the passes folded out of such a node. Where the model's weights hold one, no node
  gets one.
- Every other node may. The nodes that did are recorded, and a run whose
  float feeds hold a NaN or an infinity (:class:`NonFiniteScan`) runs a second
  executor over the same plan, every kernel exact, built by the first such run
  (``InferenceSession``). Finite feeds keep the fast kernels.

A max pooling follows torch's rule, NaN wherever the window holds one. onnxruntime's
MLAS kernel keeps a NaN only when it comes last in the window's order, so there
segflow's NaN outputs are a superset of onnxruntime's.

Not covered: finite values whose products or sums overflow float range inside a
fused kernel (an output summing to +inf and -inf, so NaN, before a ReLU post-op).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from segflow.ir.graph import Graph, Node, Value, node_reads
from segflow.kernels.native.build import NativeLibrary
from segflow.ops.registry import OpRegistry

Tensor = torch.Tensor


@dataclass(slots=True)
class NonFinitePolicy:
    """Which nodes may bind a kernel that loses NaN or infinities, and those that did.

    ``exact`` holds the nodes that must not (None: every node); ``inexact`` maps
    each node that did to why its kernel differs, for ``explain()``.
    """

    exact: frozenset[Node] | None
    inexact: dict[str, str] = field(default_factory=dict)

    @classmethod
    def everywhere(cls) -> NonFinitePolicy:
        """Every kernel exact: the executor that runs feeds holding NaN or Inf."""
        return cls(None)

    def keeps(self, node: Node) -> bool:
        """Whether ``node`` must run a kernel that keeps NaN and infinities."""
        return self.exact is None or node in self.exact

    def allow(self, node: Node, reason: str) -> bool:
        """``BindContext.allow_inexact``: True, recorded, unless ``node`` must be exact."""
        if self.keeps(node):
            return False
        self.inexact.setdefault(node.label, reason)
        return True

    def note(self, what: str, reason: str) -> None:
        """Record kernels no binder chose that may lose NaN or Inf (a compiled segment)."""
        self.inexact.setdefault(what, reason)

    def describe(self, exact_runs: int) -> list[str]:
        """``explain()`` lines: the kernels that lose NaN or Inf and what runs instead."""
        lines = []
        if self.exact:
            lines.append(f"non-finite values: {len(self.exact)} nodes a NaN or Inf can reach "
                         "from inside the graph run kernels that keep them")
        if self.inexact:
            reasons: dict[str, int] = {}
            for reason in self.inexact.values():
                reasons[reason] = reasons.get(reason, 0) + 1
            kinds = "; ".join(f"{n} x {reason}" for reason, n in sorted(reasons.items()))
            lines.append(f"non-finite values: {len(self.inexact)} kernels lose NaN or Inf "
                         f"({kinds}); a run whose feeds hold NaN or Inf runs exact kernels "
                         f"instead ({exact_runs} so far)")
        return lines


class NonFiniteScan:
    """Whether float tensors hold a NaN or an infinity (``scan(tensors) -> bool``): a
    run's feeds, a model's weights.

    A contiguous float32 host tensor is scanned by the native library's
    ``segflow_any_nonfinite_f32`` (``kernels/native/finite.c``: a ctypes call, where a
    torch reduction costs a dispatch and a result tensor, which counts on a small
    model's feed). Any other float tensor, or every one without the library, is summed
    once: a NaN or an infinity anywhere makes the sum non-finite, and a sum of finite
    values overflowing float range only sends that run the exact way too. Half types
    are summed in float32, so that an ordinary image does not overflow them.
    """

    def __init__(self, library: NativeLibrary | None) -> None:
        self._native: Any = None
        if library is not None:
            fn = library.dll.segflow_any_nonfinite_f32
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
            fn.restype = ctypes.c_int
            self._native = fn

    def __call__(self, tensors: Iterable[Tensor]) -> bool:
        native = self._native
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                continue   # a string value (a host array); a Cast of it may make NaN
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if native is not None and tensor.dtype == torch.float32 \
                    and tensor.device.type == "cpu" and tensor.is_contiguous():
                if native(tensor.data_ptr(), tensor.numel()):
                    return True
                continue
            wide = torch.float32 if tensor.element_size() < 4 else None
            if not math.isfinite(float(tensor.sum(dtype=wide))):
                return True
        return False


def nonfinite_reach(graph: Graph, registry: OpRegistry, carried: Collection[str] = ()
                    ) -> tuple[frozenset[Node], frozenset[str]]:
    """The nodes of ``graph`` a NaN or an infinity can reach from inside it, and the
    names of the values that may carry one: the results, at any distance, of a node
    whose op may create one, and of a constant named in ``carried``. Graph inputs are
    not sources: runs check their feeds.

    ``carried`` is what the same walk found over the graph before its passes: a folded
    constant keeps the name of the value it stands for, so a division by zero folded
    away is still seen (the passes' packed weights come from weights checked finite).
    Every node of a control-flow body counts as reached (a body is bound on its own),
    and a control-flow node creates what its bodies may create.
    """
    tainted: set[Value] = set()
    reached: set[Node] = set()
    for node in graph.nodes:
        reads = [v for v in node_reads(node) if v is not None]
        if any(v in tainted or (v.is_const and v.name in carried) for v in reads):
            reached.add(node)
            tainted.update(node.outputs)
        elif _creates(node, registry):
            tainted.update(node.outputs)
        for sub in node.subgraphs.values():
            reached.update(_body_nodes(sub))
    return frozenset(reached), frozenset(v.name for v in tainted)


def _creates(node: Node, registry: OpRegistry) -> bool:
    """Whether ``node`` (or a node of its bodies) may create NaN or Inf from finite inputs."""
    opdef = registry.resolve(node)
    if opdef.creates_nonfinite is not None and opdef.creates_nonfinite(node):
        return True
    return any(_creates(inner, registry) for sub in node.subgraphs.values()
               for inner in sub.nodes)


def _body_nodes(graph: Graph) -> list[Node]:
    nodes = list(graph.nodes)
    for node in graph.nodes:
        for sub in node.subgraphs.values():
            nodes.extend(_body_nodes(sub))
    return nodes
