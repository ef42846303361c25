"""Chain consecutive small dense layers into one ``segflow.DenseChain`` node (CPU).

After fusion, an MLP is a run of ``FusedGemm`` nodes, each reading the one
before. When the layers are small, each costs far more in dispatch than in
arithmetic (a 64 x 64 layer at batch 1: ~0.1 us of multiply-adds, 3-4 us per
ATen call), so the pass replaces a run of them by one node whose kernel does
the whole run in one native call (:mod:`segflow.kernels.dense_chain`).

A ``FusedGemm`` joins a chain when

- its weight is a dense float32 constant of at most :data:`CHAIN_MAX_WEIGHT`
  elements (512 x 512), its bias (if any) a float32 constant vector, its
  input float32 of rank >= 2, and its activation one the native kernel has;
- where its input's shape is static, its rows times its weight's elements are at most
  ``CpuTarget.dense_chain_max_macs`` (past that the kernel hands every call to torch,
  which runs the layers one by one without the separate ``FusedGemm``'s in-place
  activation: a 4-layer encoder's 128 x 256 -> 1024 -> 256 feed-forwards measured ~6%
  of a run slower chained, docs/performance.md);
- and, past the first, it is the only reader of the previous layer's output
  (read once, as its input), which is not a graph output.

A chain needs at least :data:`CHAIN_MIN_LAYERS` layers. Weights are stored
transposed (``[K, N]``, the native kernel's layout) in place of the
``FusedGemm``'s ``[N, K]`` copies, which become dead and are dropped; a layer
without a bias gets a zero vector. The pass runs for CPU targets only (on CUDA
each layer is a launch anyway, and CUDA graphs batch them).
"""

from __future__ import annotations

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType
from segflow.kernels.choice import DENSE_CHAIN_ACTIVATIONS
from segflow.kernels.target import CpuTarget
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import new_const, remove_dead, replace_nodes, single_use
from segflow.passes.result import PassResult

CHAIN_MAX_WEIGHT = 1 << 18
CHAIN_MIN_LAYERS = 2


def chain_dense(graph: Graph) -> PassResult:
    """Replace each chain of small ``FusedGemm`` layers in ``graph`` (in place)."""
    chains = find_chains(graph)
    for chain in chains:
        _replace(graph, chain)
    if chains:
        remove_dead(graph)
    return PassResult(graph, bool(chains))


def find_chains(graph: Graph) -> list[list[Node]]:
    """The chains the pass would build, in graph order (each a list of FusedGemm nodes)."""
    chains: list[list[Node]] = []
    taken: set[int] = set()
    for node in graph.nodes:
        if id(node) in taken or not _eligible(node):
            continue
        chain = [node]
        while True:
            nxt = _next_layer(graph, chain[-1])
            if nxt is None:
                break
            chain.append(nxt)
        if len(chain) >= CHAIN_MIN_LAYERS:
            chains.append(chain)
            taken.update(id(n) for n in chain)
    return chains


def _weight(node: Node) -> torch.Tensor | None:
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if w is None or w.const is None or w.const.is_mkldnn:
        return None
    return w.const


def _eligible(node: Node) -> bool:
    if node.domain != FUSED_DOMAIN or node.op_type != "FusedGemm" or len(node.outputs) != 1:
        return False
    x, weight = node.inputs[0], _weight(node)
    if (x is None or x.spec.dtype is not DType.FLOAT32 or x.spec.rank is None
            or x.spec.rank < 2 or weight is None or weight.dim() != 2
            or weight.dtype != torch.float32 or weight.numel() > CHAIN_MAX_WEIGHT):
        return False
    if x.spec.is_static:   # rows known: a call the kernel would hand to torch stays apart
        rows = 1
        for d in x.spec.shape[:-1]:  # type: ignore[index]
            rows *= int(d)  # type: ignore[arg-type]
        if rows * weight.numel() > CpuTarget.dense_chain_max_macs:
            return False
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is not None and (bias.const is None or bias.const.is_mkldnn
                             or bias.const.dtype != torch.float32
                             or bias.const.numel() != weight.shape[0]):
        return False
    return str(node.attrs.get("activation", "")) in DENSE_CHAIN_ACTIVATIONS


def _next_layer(graph: Graph, node: Node) -> Node | None:
    out = node.outputs[0]
    if not single_use(graph, out):
        return None
    consumer = out.uses[0]
    if (not _eligible(consumer) or consumer.inputs[0] is not out
            or sum(1 for v in consumer.inputs if v is out) != 1):
        return None
    return consumer


def _replace(graph: Graph, chain: list[Node]) -> None:
    inputs: list[Value | None] = [chain[0].inputs[0]]
    activations: list[str] = []
    params: list[float] = []
    for node in chain:
        weight = _weight(node)
        assert weight is not None
        inputs.append(new_const(graph, f"{node.name}.weight_kn", weight.t().contiguous()))
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is None or bias.const is None:
            bias = new_const(graph, f"{node.name}.bias",
                             torch.zeros(weight.shape[0], dtype=torch.float32))
        elif bias.const.dim() != 1 or not bias.const.is_contiguous():
            bias = new_const(graph, f"{node.name}.bias", bias.const.reshape(-1).contiguous())
        inputs.append(bias)
        activations.append(str(node.attrs.get("activation", "")))
        layer_params = [float(p) for p in node.attrs.get("activation_params", [])]
        params.extend((layer_params + [0.0, 0.0])[:2])
    last = chain[-1]
    fused = Node("DenseChain", inputs, [Value(last.outputs[0].name)],
                 {"activations": activations, "activation_params": params},
                 name=f"{chain[0].name}..{last.name}", domain=FUSED_DOMAIN, opset=1)
    replace_nodes(graph, last, chain[:-1], fused)
