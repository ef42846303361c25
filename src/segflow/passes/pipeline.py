"""The inference optimization pipeline: which passes run, with what switches.

``InferenceSession`` runs it between import and segmentation::

    fold_constants -> fuse -> dense_chain -> layout -> plan_memory

Every pass can be switched off, from the API (``optimize=False`` or
``optimize={"fuse": False}``) or the environment (``SEGFLOW_OPTIMIZE=0``,
``SEGFLOW_NO_FOLD``, ``SEGFLOW_NO_FUSE``, ``SEGFLOW_NO_DENSE_CHAIN``,
``SEGFLOW_NO_LAYOUT``, ``SEGFLOW_NO_MEMORY_PLAN``); the API wins. So can each of the
fuse pass's rules (``passes/fuse/``): ``optimize={"fuse.batchnorm": False}``, or
``SEGFLOW_NO_FUSE=batchnorm,conv`` (rule names in place of ``1``), and the layout
pass's choices: ``optimize={"layout.winograd": False}`` (also ``layout.direct``,
``layout.blocked``, ``layout.native_linear``, ``layout.strassen``, ``layout.native_stem``;
``SEGFLOW_WINOGRAD``, ``SEGFLOW_ONEDNN_DIRECT``, ``SEGFLOW_ONEDNN_BLOCKED``,
``SEGFLOW_NATIVE_LINEAR``, ``SEGFLOW_STRASSEN``, ``SEGFLOW_NATIVE_STEM``).
Each pass adds one line to the log that ``explain()`` prints, e.g.
``fuse: 175 -> 57 nodes (batchnorm 53, conv 53, activation 49, linear 1)``.

>>> log = optimize(graph, OptimizeOptions.resolve(True))   # doctest: +SKIP
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from segflow.errors import InvalidSetting
from segflow.ir.graph import Graph, Node
from segflow.ir.types import Device, DeviceKind, DType
from segflow.kernels.linear import native_linear_preferred, panel_width
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import Library
from segflow.ops.fused import (
    FUSED_DOMAIN,
    LINEAR_PACK_MIN_WEIGHT,
    linear_calls_libdnnl,
    linear_calls_native,
    linear_uses_onednn,
    onednn_graph_available,
)
from segflow.ops.registry import OpRegistry
from segflow.passes.dense_chain import chain_dense
from segflow.passes.fold_constants import fold_constants
from segflow.passes.fuse import RULE_NAMES, run_rules
from segflow.passes.fuse.siblings import fuse_siblings
from segflow.passes.layout import POOLS, layout
from segflow.passes.plan_memory import MemoryPlan, plan_memory
from segflow.settings import (
    ENV_ARENA,
    ENV_COMPILE,
    ENV_INTRA_OP_THREADS,
    ENV_NATIVE_LINEAR,
    ENV_NATIVE_STEM,
    ENV_NO_DENSE_CHAIN,
    ENV_NO_FOLD,
    ENV_NO_FUSE,
    ENV_NO_LAYOUT,
    ENV_NO_MEMORY_PLAN,
    ENV_ONEDNN_BLOCKED,
    ENV_ONEDNN_DIRECT,
    ENV_ONEDNN_REPLAY,
    ENV_OPTIMIZE,
    ENV_PREBUILD,
    ENV_STRASSEN,
    ENV_WINOGRAD,
    FALSE_WORDS,
    TRUE_WORDS,
    _env_bool,
    _env_int,
    parse_choice,
)

PASSES = ("fold_constants", "fuse", "dense_chain", "layout", "plan_memory")
# ``optimize`` keys for the layout pass's choices -> the OptimizeOptions field each sets
# (their environment variables: SEGFLOW_ONEDNN_DIRECT, _ONEDNN_BLOCKED, SEGFLOW_WINOGRAD,
# SEGFLOW_NATIVE_LINEAR, SEGFLOW_STRASSEN, SEGFLOW_NATIVE_STEM).
LAYOUT_CHOICES = {"layout.direct": "onednn_direct", "layout.blocked": "onednn_blocked",
                  "layout.winograd": "winograd", "layout.native_linear": "native_linear",
                  "layout.strassen": "strassen", "layout.native_stem": "native_stem"}
_PASS_ENV = {"fold_constants": ENV_NO_FOLD, "fuse": ENV_NO_FUSE,
             "dense_chain": ENV_NO_DENSE_CHAIN, "layout": ENV_NO_LAYOUT,
             "plan_memory": ENV_NO_MEMORY_PLAN}


class CompileMode(enum.Enum):
    """Which backend lowers bulk segments (see :mod:`segflow.runtime.compile`)."""

    AUTO = "auto"
    CODEGEN = "codegen"
    INDUCTOR = "inductor"
    ONEDNN = "onednn"
    NONE = "none"

    @classmethod
    def parse(cls, text: str | CompileMode, source: str = "compile") -> CompileMode:
        """``source`` names where the value came from, for the error message."""
        return parse_choice(cls, text, source)

    def resolve(self) -> CompileMode:
        """The backend ``auto`` stands for without a graph: codegen (builds in ms).

        With a graph, :func:`run_pipeline` may pick ``onednn`` instead (see there).
        """
        return CompileMode.CODEGEN if self is CompileMode.AUTO else self


@dataclass(frozen=True, slots=True)
class OptimizeOptions:
    """Switches for each pass, the compile backend and the intra-op thread count."""

    fold_constants: bool = True
    fuse: bool = True
    dense_chain: bool = True
    layout: bool = True
    plan_memory: bool = True
    # The fuse rules switched off (names from passes.fuse.RULE_NAMES), and those switched
    # on by name (``siblings`` is otherwise off where _siblings_off says).
    fuse_off: frozenset[str] = frozenset()
    fuse_on: frozenset[str] = frozenset()
    compile: CompileMode = CompileMode.AUTO
    intra_op_threads: int | None = None
    # Prepacked convolutions call libdnnl directly when it is installed (kernels/onednn/).
    onednn_direct: bool = True
    # ... on nChw8c activations where that is faster (depthwise regions, passes/layout.py).
    onednn_blocked: bool = True
    # Their outputs are carved out of one planned block per run (runtime/arena.py).
    arena: bool = True
    # Runs of them are replayed from recorded addresses (kernels/onednn/replay.py).
    onednn_replay: bool = True
    # Their primitives are built while the session loads, for the first run's shapes
    # (runtime/prebuild.py), rather than by that run.
    prebuild: bool = True
    # 3x3 ones run as Winograd F(4x4, 3x3) where they qualify (kernels/winograd.py); None:
    # where it was measured faster (fused.winograd_preferred: CPUs without AVX-512, and
    # on AVX-512 ones outputs of 32 or more 4x4 tiles an image).
    winograd: bool | None = None
    # Large linears run segflow's packed-panel kernel (kernels/linear.py); None: where
    # it was measured faster (native_linear_preferred: a build with AVX2 + FMA).
    native_linear: bool | None = None
    # ... and as one level of Strassen where their weight and rows allow it
    # (kernels/native/strassen.c); None: where it was measured faster (strassen_preferred:
    # the AVX2 build's 24-column panels).
    strassen: bool | None = None
    # A direct convolution over the NCHW image runs segflow's stem kernel, which reads it
    # in place (kernels/stem.py); None: where it was measured faster
    # (fused.native_stem_preferred: the native library's AVX-512 build).
    native_stem: bool | None = None

    @classmethod
    def resolve(cls, optimize: bool | Mapping[str, bool] | None = None, *,
                compile: str | CompileMode | None = None, intra_op_threads: int | None = None,
                env: Mapping[str, str] | None = None) -> OptimizeOptions:
        """API values first, then ``SEGFLOW_*`` variables, then the defaults (all on)."""
        env = os.environ if env is None else env
        explicit: Mapping[str, bool] = {}
        rules_off: set[str] = set()
        rules_on: set[str] = set()
        choices: dict[str, bool] = {}     # OptimizeOptions field -> the API's value
        if isinstance(optimize, Mapping):
            rule_keys = {f"fuse.{rule}": rule for rule in RULE_NAMES}
            unknown = sorted(set(optimize) - set(PASSES) - set(rule_keys) - set(LAYOUT_CHOICES))
            if unknown:
                raise InvalidSetting(f"optimize: unknown passes {unknown}; known: "
                                     f"{', '.join(PASSES)}, fuse.<rule> for a fuse rule "
                                     f"({', '.join(RULE_NAMES)}) and "
                                     f"{', '.join(LAYOUT_CHOICES)}")
            explicit = {k: v for k, v in optimize.items() if k in PASSES}
            rules_off = {rule_keys[k] for k, v in optimize.items() if k in rule_keys and not v}
            rules_on = {rule_keys[k] for k, v in optimize.items() if k in rule_keys and v}
            choices = {LAYOUT_CHOICES[k]: bool(v) for k, v in optimize.items()
                       if k in LAYOUT_CHOICES}
            enabled = True
        elif optimize is None:
            enabled = _env_bool(env, ENV_OPTIMIZE, True)
        else:
            enabled = bool(optimize)
        switches = {}
        env_rules_off = _fuse_rules_off(env)
        for name in PASSES:
            if name in explicit:
                switches[name] = bool(explicit[name])
            elif name == "fuse" and env_rules_off:
                switches[name] = enabled      # some rules off, the pass itself on
            else:
                switches[name] = enabled and not _env_bool(env, _PASS_ENV[name], False)
        if not (isinstance(optimize, Mapping) and any(k.startswith("fuse.") for k in optimize)):
            rules_off = env_rules_off
        if compile is not None:
            mode = CompileMode.parse(compile)
        else:
            mode = CompileMode.parse(env.get(ENV_COMPILE, "").strip() or CompileMode.AUTO,
                                     source=ENV_COMPILE)
        threads = intra_op_threads
        if threads is None and env.get(ENV_INTRA_OP_THREADS, "").strip():
            threads = _env_int(env, ENV_INTRA_OP_THREADS, 1)
        if threads is not None and threads < 1:
            raise InvalidSetting(f"intra_op_threads={threads}: expected a positive integer")
        direct = choices.get("onednn_direct", _env_bool(env, ENV_ONEDNN_DIRECT, True))
        arena = _env_bool(env, ENV_ARENA, True)
        blocked = choices.get("onednn_blocked", _env_bool(env, ENV_ONEDNN_BLOCKED, True))
        replay = _env_bool(env, ENV_ONEDNN_REPLAY, True)
        prebuild = _env_bool(env, ENV_PREBUILD, True)
        return cls(compile=mode, intra_op_threads=threads, onednn_direct=direct, arena=arena,
                   onednn_blocked=blocked, onednn_replay=replay, prebuild=prebuild,
                   winograd=_auto(env, ENV_WINOGRAD, choices.get("winograd")),
                   native_linear=_auto(env, ENV_NATIVE_LINEAR, choices.get("native_linear")),
                   strassen=_auto(env, ENV_STRASSEN, choices.get("strassen")),
                   native_stem=_auto(env, ENV_NATIVE_STEM, choices.get("native_stem")),
                   fuse_off=frozenset(rules_off), fuse_on=frozenset(rules_on), **switches)

    def as_record(self) -> dict[str, object]:
        """The options in force, for RunStats settings and benchmark records."""
        return {"fold_constants": self.fold_constants, "fuse": self.fuse,
                "fuse_off": ",".join(r for r in RULE_NAMES if r in self.fuse_off),
                "dense_chain": self.dense_chain, "layout": self.layout,
                "plan_memory": self.plan_memory, "compile": self.compile.resolve().value,
                "onednn_direct": self.onednn_direct, "onednn_blocked": self.onednn_blocked,
                "arena": self.arena, "onednn_replay": self.onednn_replay,
                "prebuild": self.prebuild,
                "winograd": "auto" if self.winograd is None else self.winograd,
                "native_linear": "auto" if self.native_linear is None else self.native_linear,
                "strassen": "auto" if self.strassen is None else self.strassen,
                "native_stem": "auto" if self.native_stem is None else self.native_stem}


def _auto(env: Mapping[str, str], name: str, chosen: bool | None) -> bool | None:
    """A layout choice that defaults to "where measured faster": the API's value, else
    the ``SEGFLOW_*`` variable ``name``'s where set, else None (auto)."""
    if chosen is not None:
        return chosen
    return _env_bool(env, name, True) if env.get(name, "").strip() else None


def _fuse_rules_off(env: Mapping[str, str]) -> set[str]:
    """The fuse rules ``SEGFLOW_NO_FUSE`` names (comma-separated); none for 0/1 or unset."""
    raw = env.get(ENV_NO_FUSE, "").strip()
    if raw == "" or raw.lower() in TRUE_WORDS + FALSE_WORDS:
        return set()          # the whole pass's switch (_env_bool reads it)
    names = {name.strip() for name in raw.split(",") if name.strip()}
    unknown = sorted(names - set(RULE_NAMES))
    if unknown:
        raise InvalidSetting(f"{ENV_NO_FUSE}={raw!r}: unknown fuse rules {unknown}; expected 0, "
                             f"1 or rule names from {', '.join(RULE_NAMES)}")
    return names


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """The log lines (one per pass), the memory plan (None when that pass is off) and the
    segment backend chosen for this graph."""

    log: tuple[str, ...]
    memory: MemoryPlan | None
    compile: CompileMode = CompileMode.CODEGEN


def configure_threads(options: OptimizeOptions) -> int:
    """Apply ``intra_op_threads`` (process-wide: torch has one intra-op pool); returns the count.

    Left unset, torch's default stands: ``OMP_NUM_THREADS`` or one thread per core,
    which measured fastest for every built-in model on two cores.
    """
    if options.intra_op_threads is not None and torch.get_num_threads() != options.intra_op_threads:
        torch.set_num_threads(options.intra_op_threads)
    return torch.get_num_threads()


def optimize(graph: Graph, options: OptimizeOptions, *, registry: OpRegistry | None = None,
             device: Device | None = None) -> list[str]:
    """Run the enabled passes on ``graph`` in place; returns one log line per pass."""
    return list(run_pipeline(graph, options, registry=registry, device=device).log)


def run_pipeline(graph: Graph, options: OptimizeOptions, *, registry: OpRegistry | None = None,
                 device: Device | None = None) -> PipelineResult:
    """Like :func:`optimize`, also returning the memory plan.

    ``device``: where the graph will run; None means a custom placement, whose
    rules name the imported nodes and op types: fusion and layout are skipped
    so the rules keep matching (and nothing fuses across devices).
    """
    log: list[str] = []
    before = len(graph.nodes)
    if options.fold_constants:
        consts = len(graph.initializers)
        result = fold_constants(graph, registry)
        log.append(f"fold_constants: {before} -> {len(graph.nodes)} nodes"
                   + (f", {len(graph.initializers) - consts:+d} constants" if result.modified
                      else " (nothing to fold)"))
    else:
        log.append("fold_constants: off")
    if options.fuse and device is None:
        log.append("fuse: skipped (custom placement names the imported nodes)")
    elif options.fuse:
        start = len(graph.nodes)
        rules = [r for r in RULE_NAMES if r not in options.fuse_off]
        auto_off = (_siblings_off(options, device) if "siblings" in rules and device is not None
                    else "")
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
        log.append(f"fuse: {start} -> {len(graph.nodes)} nodes ({done or 'nothing to fuse'})"
                   + (f"; rules off: {', '.join(off)}" if off else "")
                   + (f"; siblings off (auto): {left} group{'s' if left > 1 else ''} of "
                      f"linears left separate, {auto_off}" if left else ""))
    else:
        log.append("fuse: off")
    log.append(_dense_chain(graph, options, device))
    backend, why = choose_backend(graph, options.compile, device,
                                  direct=options.onednn_direct)
    log.append(_layout(graph, options, backend, device))
    contiguous_constants(graph)
    memory = None
    if options.plan_memory:
        memory = plan_memory(graph)
        log.append(f"plan_memory: {memory.summary()}")
    else:
        log.append("plan_memory: off")
    log.append(f"compile: {backend.value} ({why})")
    return PipelineResult(tuple(log), memory, backend)


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
        if tensor is not None and tensor.layout == torch.strided and not tensor.is_mkldnn \
                and not tensor.is_contiguous():
            value.const = tensor.contiguous()
            count += 1
    return count


def choose_backend(graph: Graph, mode: CompileMode, device: Device | None, *,
                   direct: bool = True) -> tuple[CompileMode, str]:
    """The segment backend for ``graph`` and why.

    ``auto`` keeps ``codegen``: always available, builds in milliseconds, one copy of
    the weights, and on CPU its convolutions call libdnnl directly
    (``kernels/onednn/``), a primitive built once per input layout.
    Only where that path is off (``direct=False``, ``SEGFLOW_ONEDNN_DIRECT=0``) or
    libdnnl is missing does a CPU graph with depthwise convolutions get ``onednn``:
    oneDNN Graph then keeps the convolution primitives between runs that torch's
    oneDNN op rebuilds on every call, at the price of its own packed copy of the
    weights. With direct calls, codegen runs depthwise graphs as fast as oneDNN Graph
    on AVX-512 and faster on AVX2, after milliseconds of compile instead of hundreds
    (benchmarks/cpu_targets.py; docs/performance.md). Without convolutions oneDNN
    Graph is slower. ``compile="onednn"`` opts in for any
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
        if direct and Library.load() is not None:
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


def _dense_chain(graph: Graph, options: OptimizeOptions, device: Device | None) -> str:
    if not options.dense_chain:
        return "dense_chain: off"
    if device is None:
        return "dense_chain: skipped (custom placement)"
    if device.kind is not DeviceKind.CPU:
        return "dense_chain: skipped (not a CPU device)"
    before = len(graph.nodes)
    if not chain_dense(graph).modified:
        return "dense_chain: nothing to chain (no runs of small dense layers)"
    chains = [n for n in graph.nodes if n.op_type == "DenseChain" and n.domain == FUSED_DOMAIN]
    layers = sum(len(n.attrs["activations"]) for n in chains)
    return (f"dense_chain: {before} -> {len(graph.nodes)} nodes ({len(chains)} "
            f"chain{'s' if len(chains) > 1 else ''} of {layers} small dense layers, one native "
            "call each)")


def _weight_numel(node: Node) -> int:
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    return weight.const.numel() if weight is not None and weight.const is not None else 0


def _siblings_off(options: OptimizeOptions, device: Device) -> str:
    """Why linears whose weights are each packed for the native kernel are not merged by
    the ``siblings`` rule unless it is named on ("" where they are): on CPU, where
    large linears will run the native kernel built for AVX-512 (48-wide panels).
    There three 768 -> 768 linears over one input measured faster than one 768 -> 2304
    (docs/performance.md), with a run's native kernels replayed (kernels/replay.py) so
    that the two extra calls cost no Python. With
    AVX2's 24-wide panels, and for libdnnl's or torch's linears, the rule merges them."""
    if "siblings" in options.fuse_on or device.kind is not DeviceKind.CPU \
            or not options.layout or options.native_linear is False:
        return ""
    library, _ = NativeLibrary.for_session()
    if library is None or (options.native_linear is None
                           and not native_linear_preferred(library)):
        return ""
    if panel_width(library) != 48:
        return ""
    return ("the native kernel's 48-wide panels ran BERT-base's query, key and value "
            "projections faster as three linears")


def _layout(graph: Graph, options: OptimizeOptions, backend: CompileMode,
            device: Device | None) -> str:
    if not options.layout:
        return "layout: off"
    if backend is CompileMode.INDUCTOR:
        return "layout: skipped (inductor packs its own weights)"
    if backend is CompileMode.ONEDNN:
        return "layout: skipped (oneDNN Graph packs its own weights)"
    if device is None:
        return "layout: skipped (custom placement)"
    if device.kind is not DeviceKind.CPU:
        return "layout: skipped (not a CPU device)"
    packed = layout(graph, device, direct=options.onednn_direct,
                    blocked=options.onednn_blocked, winograd=options.winograd,
                    native_linear=options.native_linear, strassen=options.strassen,
                    native_stem=options.native_stem)
    if not packed.modified:
        return "layout: nothing to do (no oneDNN-eligible convolutions or linears)"
    convs = sum(1 for n in graph.nodes if n.attrs.get("channels_last"))
    linears = sum(1 for n in graph.nodes if n.op_type == "FusedGemm" and linear_uses_onednn(n))
    direct_linears = sum(1 for n in graph.nodes if n.op_type == "FusedGemm"
                         and linear_calls_libdnnl(n))
    native_linears = sum(1 for n in graph.nodes if n.op_type == "FusedGemm"
                         and linear_calls_native(n))
    parts = [f"{convs} convolutions (channels_last)"] if convs else []
    if linears:
        parts.append(f"{linears} linears" + (f" ({direct_linears} for libdnnl's inner product)"
                                             if direct_linears else ""))
    text = f"layout: prepacked for oneDNN: {', '.join(parts)}" if parts else "layout: prepacked"
    if native_linears:
        text += (f"; {native_linears} linear{'s' if native_linears > 1 else ''} packed for the "
                 f"native kernel (kernels/linear.py)")
    if convs and options.onednn_direct:
        _, why = Library.probe()
        direct = any(n.attrs.get("onednn_direct") for n in graph.nodes)
        pools = sum(1 for n in graph.nodes if n.op_type in POOLS and n.attrs.get(
            "onednn_direct"))
        also = f" (and {pools} pooling{'s' if pools > 1 else ''})" if pools else ""
        text += f"; direct calls into {why}{also}" if direct else f"; libdnnl {why}"
        blocked = sum(1 for n in graph.nodes if n.attrs.get("onednn_blocked"))
        if blocked:
            text += f"; {blocked} convolutions on nChw8c activations"
        winograd = sum(1 for n in graph.nodes if n.attrs.get("winograd"))
        if winograd:
            text += f"; {winograd} 3x3 convolutions as Winograd F(4x4,3x3)"
        stems = sum(1 for n in graph.nodes if n.attrs.get("native_stem"))
        if stems:
            text += (f"; {stems} stem convolution{'s' if stems > 1 else ''} native "
                     "(reading the NCHW image in place)")
    return text
