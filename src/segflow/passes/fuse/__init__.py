"""Fusion and no-op elimination for inference graphs: the ``fuse`` pass.

Each rule is its own module and can be switched off by name
(``optimize={"fuse.batchnorm": False}``, ``SEGFLOW_NO_FUSE=batchnorm,conv``).
They run in this order, each over the whole graph:

1. ``noops`` (:mod:`.noops`): drop Identity, inference Dropout, Cast to the same
   type, Reshape/Flatten/Squeeze/Unsqueeze whose static output shape equals the
   input's, identity Transposes; merge Transpose pairs.
2. ``global_pool`` (:mod:`.global_pool`): a ReduceMean over every spatial axis of a
   4-D/5-D tensor, dims kept, becomes GlobalAveragePool.
3. ``pad`` (:mod:`.pad`): a zero constant Pad of a Conv's spatial dims becomes the
   Conv's own (possibly asymmetric) padding; a Pad of nothing is dropped.
4. ``batchnorm`` (:mod:`.batchnorm`): fold an inference BatchNormalization into the
   Conv or Gemm before it (new weight and bias constants).
5. ``linear`` (:mod:`.linear`): Gemm, and MatMul (+ Add of a bias) with a constant
   2-D weight or the 2-D Transpose of one, become ``segflow.FusedGemm`` (weight stored
   once in ``[N, K]`` layout).
6. ``integer_linear`` (:mod:`.integer_linear`): ``MatMulInteger -> Cast(float) ->
   Mul(scale) [-> Add(bias)]``, each linear of a dynamically quantized model, becomes
   ``com.microsoft.MatMulIntegerToFloat``.
7. ``gelu`` (:mod:`.gelu`): the exporters' erf pattern ``x * 0.5 * (1 + erf(x / sqrt 2))``,
   in any association, becomes one Gelu.
8. ``gelu_tanh`` (:mod:`.gelu_tanh`): the tanh approximation
   ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))`` becomes one
   ``Gelu(approximate="tanh")``.
9. ``silu`` (:mod:`.silu`): ``x * sigmoid(x)`` and ``x * sigmoid(alpha * x)`` become one
   Swish.
10. ``conv`` (:mod:`.conv`): Conv with a constant weight becomes ``segflow.FusedConv``;
    a following same-shape Add becomes its residual input.
11. ``activation`` (:mod:`.activation`): a Relu / Clip / LeakyRelu / Sigmoid / Tanh /
    HardSigmoid / HardSwish / Gelu / Swish after a fused Conv or Gemm becomes its post-op.
12. ``attention`` (:mod:`.attention`): ``softmax(Q @ Kt * s + M) @ V`` becomes
    ``segflow.Attention``, as torch's exporters write it: constant scalings of Q, Kt
    or the scores, an additive mask, the safe softmax ``Where(IsNaN(p), 0, p)``
    (``nan_to_zero``), and the reshapes and transposes that split and merge heads.
13. ``rmsnorm`` (:mod:`.rmsnorm`): the exporters' root-mean-square normalization
    ``x / sqrt(mean(x^2, -1) + eps) * w`` (its Pow/Mul, Sqrt/Div/Reciprocal forms)
    becomes one ONNX RMSNormalization.
14. ``layernorm`` (:mod:`.layernorm`): an Add read by a LayerNormalization or
    RMSNormalization over the last axis becomes ``segflow.AddLayerNorm`` (a transformer's
    residual add), with the sum as its second output where something else reads it (a
    pre-LN residual); an RMSNormalization alone becomes one too (its native kernel).
15. ``siblings`` (:mod:`.siblings`): FusedGemms reading the same input (a
    transformer's query, key and value projections) become one FusedGemm over their
    stacked weights and a Split into views.
16. ``views`` (:mod:`.views`): a Transpose that moves only size-1 axes is a Reshape, and
    a run of Reshape/Flatten/Squeeze/Unsqueeze is one Reshape (or none).

The order matters where rules build on each other: ``batchnorm`` folds into the
plain Conv/Gemm that ``conv``/``linear`` then fuse, and ``activation`` only finds
the fused nodes those two made and the single activation nodes ``gelu``, ``gelu_tanh``
and ``silu`` made of elementwise chains, and ``layernorm`` the RMSNormalization nodes
``rmsnorm`` made. With a rule off, the nodes it would have taken
stay as they are and the later rules match around them (a Conv followed by a
BatchNormalization and a Relu stays three nodes when ``batchnorm`` is off).

A fused node takes the place of the last node it absorbs, so every input it
reads is computed before it, and keeps that node's output value name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from segflow.ir.graph import Graph
from segflow.ops.fused import FUSED_DOMAIN
from segflow.passes._rewrite import remove_dead
from segflow.passes.fuse.activation import fuse_activation
from segflow.passes.fuse.attention import fuse_attention
from segflow.passes.fuse.batchnorm import fuse_batchnorm
from segflow.passes.fuse.conv import fuse_conv
from segflow.passes.fuse.gelu import fuse_gelu
from segflow.passes.fuse.gelu_tanh import fuse_gelu_tanh
from segflow.passes.fuse.global_pool import fuse_global_pool
from segflow.passes.fuse.integer_linear import fuse_integer_linear
from segflow.passes.fuse.layernorm import fuse_layernorm
from segflow.passes.fuse.linear import fuse_linear
from segflow.passes.fuse.noops import fuse_noops
from segflow.passes.fuse.pad import fuse_pad
from segflow.passes.fuse.rmsnorm import fuse_rmsnorm
from segflow.passes.fuse.siblings import fuse_siblings
from segflow.passes.fuse.silu import fuse_silu
from segflow.passes.fuse.views import fuse_views
from segflow.passes.result import PassResult

Rule = Callable[[Graph], int]

RULES: tuple[tuple[str, Rule], ...] = (
    ("noops", fuse_noops),
    ("global_pool", fuse_global_pool),
    ("pad", fuse_pad),
    ("batchnorm", fuse_batchnorm),
    ("linear", fuse_linear),
    ("integer_linear", fuse_integer_linear),
    ("gelu", fuse_gelu),
    ("gelu_tanh", fuse_gelu_tanh),
    ("silu", fuse_silu),
    ("conv", fuse_conv),
    ("activation", fuse_activation),
    ("attention", fuse_attention),
    ("rmsnorm", fuse_rmsnorm),
    ("layernorm", fuse_layernorm),
    ("siblings", fuse_siblings),
    ("views", fuse_views),
)
RULE_NAMES: tuple[str, ...] = tuple(name for name, _ in RULES)


def fuse(graph: Graph, rules: Collection[str] | None = None) -> PassResult:
    """Apply the fusion rules (all, or those named in ``rules``) to ``graph`` in place."""
    counts = run_rules(graph, rules)
    return PassResult(graph, any(counts.values()))


def run_rules(graph: Graph, rules: Collection[str] | None = None) -> dict[str, int]:
    """Apply the rules in order (all, or those named in ``rules``); returns how many
    rewrites each made (for the pass log)."""
    unknown = set(rules or ()) - set(RULE_NAMES)
    if unknown:
        raise ValueError(f"unknown fuse rules {sorted(unknown)}; known: {', '.join(RULE_NAMES)}")
    counts = {name: rule(graph) for name, rule in RULES if rules is None or name in rules}
    if any(counts.values()):
        remove_dead(graph)
        graph.opsets.setdefault(FUSED_DOMAIN, 1)
    return counts
