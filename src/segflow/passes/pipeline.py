"""The inference optimization pipeline: a table of passes, run in order.

``InferenceSession`` runs it between import and segmentation::

    quantize -> fold_constants -> fuse -> dense_chain -> layout -> specialize
        -> (contiguous constants) -> plan_memory

Every pass has one signature, ``(graph, PassContext) -> PassResult(graph, changed,
log)``: the context holds the device, the options (``passes/options.py``, resolved
once) and what the target offers. :data:`PIPELINE` lists them with the option that
switches each, from the API (``optimize=False``, ``optimize={"fuse": False}``,
``{"fuse.batchnorm": False}`` per fuse rule, ``{"layout.winograd": False}`` per
layout choice) or the environment (``SEGFLOW_OPTIMIZE=0``, ``SEGFLOW_NO_<PASS>``,
``SEGFLOW_NO_FUSE=batchnorm,conv``; all in ``settings.py``); the API wins. A row
marked ``training`` also runs for a :class:`segflow.TrainingSession`, whose graph is
differentiated afterwards; the others are off there.

Each pass adds one line to the log that ``explain()`` prints (``SEGFLOW_DEBUG=1``
also prints it as the pass runs), e.g.
``fuse: 175 -> 57 nodes (batchnorm 53, conv 53, activation 49, linear 1)``.

>>> log = optimize(graph, OptimizeOptions.resolve(True))   # doctest: +SKIP
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from segflow.ir.graph import Graph, Node
from segflow.ir.types import Device, DeviceKind, DType
from segflow.kernels.choice import KernelChoices, KernelKind
from segflow.kernels.target import CpuTarget, onednn_graph_available
from segflow.ops.fused import FUSED_DOMAIN, LINEAR_PACK_MIN_WEIGHT
from segflow.ops.registry import OpRegistry
from segflow.passes.dense_chain import chain_dense
from segflow.passes.fold_constants import fold_constants
from segflow.passes.fuse import RULE_NAMES, run_rules
from segflow.passes.fuse.siblings import fuse_siblings
from segflow.passes.options import (
    LAYOUT_CHOICES,
    PASSES,
    CompileMode,
    OptimizeOptions,
    configure_threads,
)
from segflow.passes.pack_weights import PackStore
from segflow.passes.plan_memory import MemoryPlan, plan_memory
from segflow.passes.quantize import quantize_pass
from segflow.passes.result import PassResult
from segflow.passes.select_kernels import select_kernels
from segflow.passes.specialize import specialize_pass

# The options' names stay importable from here, where the pipeline's callers look.
__all__ = ["LAYOUT_CHOICES", "PASSES", "PIPELINE", "CompileMode", "OptimizeOptions",
           "PassContext", "PassEntry", "PassResult", "PipelineResult",
           "choose_backend", "configure_threads", "contiguous_constants", "optimize",
           "run_pipeline"]


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """The log lines (one per pass), the memory plan (None when that pass is off), the
    segment backend chosen for this graph and the kernel choices (none where the
    kernel selection did not run)."""

    log: tuple[str, ...]
    memory: MemoryPlan | None
    compile: CompileMode = CompileMode.CODEGEN
    choices: KernelChoices = field(default_factory=KernelChoices)


@dataclass(frozen=True, slots=True)
class PassContext:
    """What every pass is given besides the graph: where it will run, the options
    resolved once, what the target offers, and the segment backend (chosen before
    the first pass that needs it)."""

    device: Device | None          # None: a custom placement names the imported nodes
    options: OptimizeOptions
    target: CpuTarget
    registry: OpRegistry | None = None
    backend: CompileMode = CompileMode.CODEGEN
    training: bool = False         # the graph is differentiated after the pipeline
    packs: PackStore | None = None  # packed weights shared with other sessions' pipelines


Pass = Callable[[Graph, PassContext], PassResult]


@dataclass(frozen=True, slots=True)
class PassEntry:
    """One row of the pipeline: a pass, the OptimizeOptions field that switches it
    (None: it always runs), and whether it runs for training graphs."""

    name: str
    run: Pass
    switch: str | None
    training: bool = False
    needs_backend: bool = False    # reads ``context.backend``


def optimize(graph: Graph, options: OptimizeOptions, *, registry: OpRegistry | None = None,
             device: Device | None = None) -> list[str]:
    """Run the enabled passes on ``graph`` in place; returns one log line per pass."""
    return list(run_pipeline(graph, options, registry=registry, device=device).log)


def run_pipeline(graph: Graph, options: OptimizeOptions, *, registry: OpRegistry | None = None,
                 device: Device | None = None, target: CpuTarget | None = None,
                 training: bool = False, dims: Mapping[str, int] | None = None,
                 packs: PackStore | None = None) -> PipelineResult:
    """Run :data:`PIPELINE`'s enabled passes, then plan memory; one log line each.

    ``device``: where the graph will run; None means a custom placement, whose
    rules name the imported nodes and op types: fusion and layout are skipped
    so the rules keep matching (and nothing fuses across devices).
    ``training``: only the rows marked for training run (the graph is differentiated
    next, and its gradients need the forward ops as imported); no memory plan.
    ``dims``: symbolic input dims to plan memory at (those not named: 1).
    ``packs``: weights packed by other sessions over the same weights (and where this
    pipeline's packings go for them).
    """
    context = PassContext(device, options, target or CpuTarget.detect(), registry,
                          training=training, packs=packs)
    choices = KernelChoices()
    log: list[str] = []
    why = ""
    chosen = training          # a training graph runs no compiled segments: no backend
    for entry in PIPELINE:
        if entry.needs_backend and not chosen:
            context, why = _with_backend(graph, context)
            chosen = True
        if training and not entry.training:
            lines: tuple[str, ...] = (f"{entry.name}: off (training)",)
        elif entry.switch is not None and not getattr(options, entry.switch):
            lines = (f"{entry.name}: off",)
        else:
            result = entry.run(graph, context)
            lines = result.log
            if result.choices is not None:
                choices = result.choices
        _note(options, lines, log)
    if not chosen:
        context, why = _with_backend(graph, context)
    memory = None
    if training:
        _note(options, ("plan_memory: off (training)",), log)
    elif options.plan_memory:
        memory = plan_memory(graph, dims=dims)
        _note(options, (f"plan_memory: {memory.summary()}",), log)
    else:
        _note(options, ("plan_memory: off",), log)
    if not training:
        _note(options, (f"compile: {context.backend.value} ({why})",), log)
    return PipelineResult(tuple(log), memory, context.backend, choices)


def _with_backend(graph: Graph, context: PassContext) -> tuple[PassContext, str]:
    backend, why = choose_backend(graph, context.options.compile, context.device,
                                  direct=context.options.onednn_direct, target=context.target)
    return replace(context, backend=backend), why


def _note(options: OptimizeOptions, lines: tuple[str, ...], log: list[str]) -> None:
    log.extend(lines)
    if options.debug >= 1:
        for line in lines:
            print(f"segflow pass: {line}", file=sys.stderr)

def contiguous_constants(graph: Graph) -> int:
    """Make every strided constant of ``graph`` contiguous; returns how many were.

    Passes may leave a constant as a view of another (the fuse pass keeps a MatMul's
    ``[K, N]`` weight as its ``[N, K]`` transpose, which the layout pass packs
    without a copy); kernels and backends past the pipeline get plain row-major
    tensors (oneDNN packed ones are left as they are).
    """
    count = 0
    for value in graph.initializers.values():
        tensor = value.const
        # (A string constant is a host array, not a tensor: ops/strings.py.)
        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided \
                and not tensor.is_mkldnn \
                and not tensor.is_contiguous():
            value.const = tensor.contiguous()
            count += 1
    return count


def choose_backend(graph: Graph, mode: CompileMode, device: Device | None, *,
                   direct: bool = True, target: CpuTarget | None = None
                   ) -> tuple[CompileMode, str]:
    """The segment backend for ``graph`` and why.

    ``auto`` keeps ``codegen``: always available, builds in milliseconds, one copy of
    the weights, and on CPU its convolutions call libdnnl directly
    (``kernels/onednn/``), a primitive built once per input layout.
    Only where that path is off (``direct=False``, ``SEGFLOW_ONEDNN_DIRECT=0``) or
    libdnnl is missing does a CPU graph with depthwise convolutions get ``onednn``:
    oneDNN Graph then keeps the convolution primitives between runs that torch's
    oneDNN op rebuilds on every call, at the price of its own packed copy of the
    weights. With the direct path, codegen measured at least as fast for depthwise
    graphs and compiles in milliseconds instead of a fraction of a second; without
    convolutions oneDNN Graph measured slower (docs/performance.md, "Segment backend
    for depthwise graphs"). ``compile="onednn"`` opts in for any
    graph. A small segment still runs an inductor package found in the disk cache
    (:func:`segflow.runtime.compile.uses_cached_package`): nothing is compiled for it.
    """
    on_cpu = device is not None and device.kind is DeviceKind.CPU
    if mode is CompileMode.ONEDNN and not (on_cpu and onednn_graph_available()):
        return CompileMode.CODEGEN, "onednn requested, but it needs a CPU device and a torch " \
            "with oneDNN Graph"
    if mode is not CompileMode.AUTO:
        return mode, "requested"
    convs = [node for node in graph.nodes if _is_conv2d(node)]
    depthwise = sum(1 for node in convs if _is_depthwise(node))
    if depthwise and on_cpu:
        if direct and (target if target is not None else CpuTarget.detect()).dnnl is not None:
            return CompileMode.CODEGEN, (f"auto: {len(convs)} convolutions, {depthwise} "
                                         "depthwise, called straight into libdnnl")
        if onednn_graph_available():
            return CompileMode.ONEDNN, (f"auto: {len(convs)} convolutions, {depthwise} "
                                        "depthwise, which oneDNN Graph fuses with the "
                                        "convolution before them (libdnnl is not used)")
    if convs:
        return CompileMode.CODEGEN, ("auto: no depthwise convolutions; codegen keeps one copy "
                                     "of the weights (compile='onednn' trades memory for speed)")
    return CompileMode.CODEGEN, ("auto: no convolutions; codegen, or for a small segment its "
                                 "inductor package if the disk cache holds one")


def _is_conv2d(node: Node) -> bool:
    weight = node.inputs[1] if node.op_type in ("FusedConv", "Conv") and len(node.inputs) > 1 \
        else None
    return weight is not None and weight.spec.shape is not None and len(weight.spec.shape) == 4 \
        and weight.spec.dtype is DType.FLOAT32


def _is_depthwise(node: Node) -> bool:
    shape = node.inputs[1].spec.shape if node.inputs[1] is not None else None
    return int(node.attrs.get("group", 1)) > 1 and shape is not None and shape[1] == 1


# -- the passes, one signature: (graph, context) -> PassResult ---------------------------
def fold_constants_pass(graph: Graph, context: PassContext) -> PassResult:
    """Evaluate the nodes whose inputs are all constants (passes/fold_constants.py)."""
    before, consts = len(graph.nodes), len(graph.initializers)
    result = fold_constants(graph, context.registry)
    line = (f"fold_constants: {before} -> {len(graph.nodes)} nodes"
            + (f", {len(graph.initializers) - consts:+d} constants" if result.changed
               else " (nothing to fold)"))
    return PassResult(graph, result.changed, (line,))


def fuse_pass(graph: Graph, context: PassContext) -> PassResult:
    """Run the fuse rules that are on (passes/fuse/)."""
    options, device = context.options, context.device
    if device is None:
        return PassResult(graph, False,
                          ("fuse: skipped (custom placement names the imported nodes)",))
    start = len(graph.nodes)
    rules = [r for r in RULE_NAMES if r not in options.fuse_off]
    auto_off = _siblings_off(context) if "siblings" in rules else ""
    if auto_off:
        rules.remove("siblings")
    counts = run_rules(graph, rules)
    left = 0
    if auto_off:        # siblings whose own weights the native kernel takes stay apart
        def apart(nodes: list[Node]) -> bool:
            nonlocal left
            packed = all(_weight_numel(n) >= LINEAR_PACK_MIN_WEIGHT for n in nodes)
            left += packed
            return packed
        counts["siblings"] = fuse_siblings(graph, apart)
    done = ", ".join(f"{name} {n}" for name, n in counts.items() if n)
    off = [r for r in RULE_NAMES if r in options.fuse_off]
    line = (f"fuse: {start} -> {len(graph.nodes)} nodes ({done or 'nothing to fuse'})"
            + (f"; rules off: {', '.join(off)}" if off else "")
            + (f"; siblings off (auto): {left} group{'s' if left > 1 else ''} of "
               f"linears left separate, {auto_off}" if left else ""))
    return PassResult(graph, any(counts.values()), (line,))


def dense_chain_pass(graph: Graph, context: PassContext) -> PassResult:
    """Chain runs of small dense layers into one native call (passes/dense_chain.py)."""
    device = context.device
    if device is None:
        return PassResult(graph, False, ("dense_chain: skipped (custom placement)",))
    if device.kind is not DeviceKind.CPU:
        return PassResult(graph, False, ("dense_chain: skipped (not a CPU device)",))
    before = len(graph.nodes)
    if not chain_dense(graph).changed:
        return PassResult(graph, False, (
            "dense_chain: nothing to chain (no runs of small dense layers)",))
    chains = [n for n in graph.nodes if n.op_type == "DenseChain" and n.domain == FUSED_DOMAIN]
    layers = sum(len(n.attrs["activations"]) for n in chains)
    return PassResult(graph, True, (
        f"dense_chain: {before} -> {len(graph.nodes)} nodes ({len(chains)} "
        f"chain{'s' if len(chains) > 1 else ''} of {layers} small dense layers, one native "
        "call each)",))


def layout_pass(graph: Graph, context: PassContext) -> PassResult:
    """Choose the CPU kernels and pack their weights (passes/select_kernels.py)."""
    options, device, backend = context.options, context.device, context.backend
    if backend is CompileMode.INDUCTOR:
        return PassResult(graph, False, ("layout: skipped (inductor packs its own weights)",))
    if backend is CompileMode.ONEDNN:
        return PassResult(graph, False,
                          ("layout: skipped (oneDNN Graph packs its own weights)",))
    if device is None:
        return PassResult(graph, False, ("layout: skipped (custom placement)",))
    if device.kind is not DeviceKind.CPU:
        return PassResult(graph, False, ("layout: skipped (not a CPU device)",))
    selection = select_kernels(graph, device, context.target, direct=options.onednn_direct,
                               blocked=options.onednn_blocked, winograd=options.winograd,
                               native_linear=options.native_linear,
                               strassen=options.strassen, native_stem=options.native_stem,
                               packs=context.packs)
    choices = selection.choices
    if not selection.modified:
        return PassResult(graph, False, (
            "layout: nothing to do (no oneDNN-eligible convolutions or linears)",), choices)
    return PassResult(graph, True, (_layout_line(choices, context),), choices)


def contiguous_constants_pass(graph: Graph, context: PassContext) -> PassResult:
    """:func:`contiguous_constants` (no log line: it is bookkeeping between passes)."""
    return PassResult(graph, contiguous_constants(graph) > 0)


# The inference pipeline, in order. A row's switch is its OptimizeOptions field (and its
# ``optimize`` key); ``training``: the row also runs before a graph is differentiated.
PIPELINE: tuple[PassEntry, ...] = (
    PassEntry("quantize", quantize_pass, "quantize"),
    PassEntry("fold_constants", fold_constants_pass, "fold_constants"),
    PassEntry("fuse", fuse_pass, "fuse"),
    PassEntry("dense_chain", dense_chain_pass, "dense_chain"),
    PassEntry("layout", layout_pass, "layout", needs_backend=True),
    PassEntry("specialize", specialize_pass, "specialize"),
    PassEntry("contiguous_constants", contiguous_constants_pass, None, training=True),
)


def _layout_line(choices: KernelChoices, context: PassContext) -> str:
    options = context.options
    kinds = choices.counts()
    convs = sum(1 for n in choices if choices[n].channels_last)
    direct_linears = kinds[KernelKind.DIRECT_LINEAR]
    linears = kinds[KernelKind.ONEDNN_LINEAR] + direct_linears
    native_linears = kinds[KernelKind.NATIVE_LINEAR]
    parts = [f"{convs} convolutions (channels_last)"] if convs else []
    if linears:
        parts.append(f"{linears} linears" + (f" ({direct_linears} for libdnnl's inner product)"
                                             if direct_linears else ""))
    text = f"layout: prepacked for oneDNN: {', '.join(parts)}" if parts else "layout: prepacked"
    if native_linears:
        text += (f"; {native_linears} linear{'s' if native_linears > 1 else ''} packed for the "
                 f"native kernel (kernels/linear.py)")
    if convs and options.onednn_direct:
        why = context.target.dnnl_why
        direct = any(choices[n].calls_libdnnl for n in choices)
        pools = sum(1 for n in choices if choices[n].kind is KernelKind.DIRECT_POOL)
        scales = kinds[KernelKind.DIRECT_BINARY]
        others = [f"{pools} pooling{'s' if pools > 1 else ''}"] if pools else []
        if scales:
            others.append(f"{scales} channel scale{'s' if scales > 1 else ''}")
        also = f" (and {', '.join(others)})" if others else ""
        text += f"; direct calls into {why}{also}" if direct else f"; libdnnl {why}"
        blocked = sum(1 for n in choices if choices[n].blocked)
        if blocked:
            text += f"; {blocked} convolutions on nChw8c activations"
        winograd = kinds[KernelKind.WINOGRAD]
        if winograd:
            text += f"; {winograd} 3x3 convolutions as Winograd F(4x4,3x3)"
        stems = kinds[KernelKind.NATIVE_STEM]
        if stems:
            text += (f"; {stems} stem convolution{'s' if stems > 1 else ''} native "
                     "(reading the NCHW image in place)")
    return text


def _weight_numel(node: Node) -> int:
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    return weight.const.numel() if weight is not None and weight.const is not None else 0


# The native kernel's panel width (output columns) at which sibling linears with packed
# weights stay separate: the AVX-512 build's (kernels/native/panel.h).
SEPARATE_SIBLINGS_PANEL = 48


def _siblings_off(context: PassContext) -> str:
    """Why linears that share an input and whose K x N weights are each packed for the
    native kernel are not merged by the ``siblings`` rule unless it is named on ("" where
    they are): on a CPU whose native kernel uses 48-column panels (AVX-512).

    Merging S such linears gives one K x (S*N) product over the same rows. Where the
    native kernel's panels are 48 columns wide (its AVX-512 build), the S separate
    products measured faster than the merged one, with a run's native calls replayed
    (kernels/replay.py) so that the S - 1 extra calls cost no Python
    (docs/performance.md, "Sibling linears"). With 24-column panels (AVX2), and for
    libdnnl's or torch's linears, the rule runs."""
    options, device = context.options, context.device
    if device is None or "siblings" in options.fuse_on or device.kind is not DeviceKind.CPU \
            or not options.layout or options.native_linear is False:
        return ""
    target = context.target
    if target.native is None or (options.native_linear is None
                                 and not target.native_linear_preferred()):
        return ""
    if target.native_panel_width != SEPARATE_SIBLINGS_PANEL:
        return ""
    return (f"the native kernel's {SEPARATE_SIBLINGS_PANEL}-column panels run packed "
            "sibling linears faster as separate calls")
