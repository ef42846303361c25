"""The pipeline's options: which passes run, the layout pass's choices, the segment
backend and the intra-op thread count, resolved once (API values, then the
``SEGFLOW_*`` variables that :mod:`segflow.settings` reads, then the defaults).

>>> OptimizeOptions.resolve({"fuse.batchnorm": False}).fuse_off    # doctest: +SKIP
frozenset({'batchnorm'})
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from segflow.errors import InvalidSetting
from segflow.passes.fuse import RULE_NAMES
from segflow.settings import AUTO_CHOICE_ENV, ENV_COMPILE, PipelineEnv, parse_choice

# The passes ``optimize`` switches by name (the OptimizeOptions field of the same name).
PASSES = ("quantize", "fold_constants", "fuse", "dense_chain", "layout", "specialize",
          "plan_memory")
# ``optimize`` keys for the layout pass's choices -> the OptimizeOptions field each sets
# (their environment variables: settings.py).
# ``optimize`` keys for the quantize pass's steps -> the OptimizeOptions field each sets.
QUANTIZE_CHOICES = {"quantize.residual": "quantize_residual"}
LAYOUT_CHOICES = {"layout.direct": "onednn_direct", "layout.blocked": "onednn_blocked",
                  "layout.winograd": "winograd", "layout.native_linear": "native_linear",
                  "layout.strassen": "strassen", "layout.native_stem": "native_stem"}


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

    # QDQ convolutions become integer QConv nodes (passes/quantize.py) ...
    quantize: bool = True
    # ... and a residual Add between Q/DQ pairs joins the QConv before it (sum post-op).
    quantize_residual: bool = True
    fold_constants: bool = True
    fuse: bool = True
    dense_chain: bool = True
    layout: bool = True
    # A graph computing its shapes from symbolic input dims is planned again for each
    # input shape it runs at (passes/specialize.py, runtime/specialized.py).
    specialize: bool = True
    plan_memory: bool = True
    # The fuse rules switched off (names from passes.fuse.RULE_NAMES), and those switched
    # on by name (``siblings`` is otherwise off where _siblings_off says).
    fuse_off: frozenset[str] = frozenset()
    fuse_on: frozenset[str] = frozenset()
    compile: CompileMode = CompileMode.AUTO
    intra_op_threads: int | None = None
    # Prepacked convolutions call libdnnl directly when it is installed (kernels/onednn/).
    onednn_direct: bool = True
    # ... on nChw8c activations where that is faster (depthwise regions, passes/select_kernels.py).
    onednn_blocked: bool = True
    # Their outputs are carved out of one planned block per run (runtime/arena.py).
    arena: bool = True
    # Runs of them are replayed from recorded addresses (kernels/onednn/replay.py).
    onednn_replay: bool = True
    # Their primitives are built while the session loads, for the first run's shapes
    # (runtime/prebuild.py), rather than by that run.
    prebuild: bool = True
    # 3x3 ones run as Winograd F(4x4, 3x3) where they qualify (kernels/winograd.py); None:
    # where it was measured faster (CpuTarget.winograd_preferred: CPUs without AVX-512, and
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
    # (CpuTarget.native_stem_preferred: the native library's AVX-512 build).
    native_stem: bool | None = None
    # SEGFLOW_DEBUG: 1 prints each pass's log line to stderr as the pipeline runs it.
    debug: int = 0

    @classmethod
    def resolve(cls, optimize: bool | Mapping[str, bool] | None = None, *,
                compile: str | CompileMode | None = None, intra_op_threads: int | None = None,
                env: Mapping[str, str] | None = None) -> OptimizeOptions:
        """API values first, then ``SEGFLOW_*`` variables (read by
        :class:`segflow.settings.PipelineEnv`), then the defaults (all on)."""
        read = PipelineEnv.read(env, fuse_rules=RULE_NAMES)
        explicit: Mapping[str, bool] = {}
        rules_off: set[str] = set()
        rules_on: set[str] = set()
        choices: dict[str, bool] = {}     # OptimizeOptions field -> the API's value
        if isinstance(optimize, Mapping):
            rule_keys = {f"fuse.{rule}": rule for rule in RULE_NAMES}
            unknown = sorted(set(optimize) - set(PASSES) - set(rule_keys) - set(LAYOUT_CHOICES)
                             - set(QUANTIZE_CHOICES))
            if unknown:
                raise InvalidSetting(f"optimize: unknown passes {unknown}; known: "
                                     f"{', '.join(PASSES)}, fuse.<rule> for a fuse rule "
                                     f"({', '.join(RULE_NAMES)}) and "
                                     f"{', '.join(LAYOUT_CHOICES)}, "
                                     f"{', '.join(QUANTIZE_CHOICES)}")
            explicit = {k: v for k, v in optimize.items() if k in PASSES}
            rules_off = {rule_keys[k] for k, v in optimize.items() if k in rule_keys and not v}
            rules_on = {rule_keys[k] for k, v in optimize.items() if k in rule_keys and v}
            choices = {LAYOUT_CHOICES[k]: bool(v) for k, v in optimize.items()
                       if k in LAYOUT_CHOICES}
            choices.update({QUANTIZE_CHOICES[k]: bool(v) for k, v in optimize.items()
                            if k in QUANTIZE_CHOICES})
            enabled = True
        elif optimize is None:
            enabled = read.optimize
        else:
            enabled = bool(optimize)
        switches = {name: bool(explicit[name]) if name in explicit
                    else enabled and name not in read.passes_off for name in PASSES}
        if not (isinstance(optimize, Mapping) and any(k.startswith("fuse.") for k in optimize)):
            rules_off = set(read.fuse_rules_off)
        if compile is not None:
            mode = CompileMode.parse(compile)
        else:
            mode = CompileMode.parse(read.compile or CompileMode.AUTO, source=ENV_COMPILE)
        threads = intra_op_threads if intra_op_threads is not None else read.intra_op_threads
        if threads is not None and threads < 1:
            raise InvalidSetting(f"intra_op_threads={threads}: expected a positive integer")
        auto = {name: choices.get(name, read.auto_choices.get(name)) for name in AUTO_CHOICE_ENV}
        return cls(compile=mode, intra_op_threads=threads,
                   quantize_residual=choices.get("quantize_residual", True),
                   onednn_direct=choices.get("onednn_direct", read.onednn_direct),
                   arena=read.arena,
                   onednn_blocked=choices.get("onednn_blocked", read.onednn_blocked),
                   onednn_replay=read.onednn_replay, prebuild=read.prebuild,
                   winograd=auto["winograd"], native_linear=auto["native_linear"],
                   strassen=auto["strassen"], native_stem=auto["native_stem"],
                   fuse_off=frozenset(rules_off), fuse_on=frozenset(rules_on),
                   debug=read.debug, **switches)

    def as_record(self) -> dict[str, object]:
        """The options in force, for RunStats settings and benchmark records."""
        return {"quantize": self.quantize, "quantize_residual": self.quantize_residual,
                "fold_constants": self.fold_constants, "fuse": self.fuse,
                "fuse_off": ",".join(r for r in RULE_NAMES if r in self.fuse_off),
                "dense_chain": self.dense_chain, "layout": self.layout,
                "specialize": self.specialize, "plan_memory": self.plan_memory,
                "compile": self.compile.resolve().value,
                "onednn_direct": self.onednn_direct, "onednn_blocked": self.onednn_blocked,
                "arena": self.arena, "onednn_replay": self.onednn_replay,
                "prebuild": self.prebuild,
                "winograd": "auto" if self.winograd is None else self.winograd,
                "native_linear": "auto" if self.native_linear is None else self.native_linear,
                "strassen": "auto" if self.strassen is None else self.strassen,
                "native_stem": "auto" if self.native_stem is None else self.native_stem}


def configure_threads(options: OptimizeOptions) -> int:
    """Apply ``intra_op_threads`` (process-wide: torch has one intra-op pool); returns the count.

    Left unset, torch's default stands: ``OMP_NUM_THREADS`` or one thread per core.
    """
    if options.intra_op_threads is not None and torch.get_num_threads() != options.intra_op_threads:
        torch.set_num_threads(options.intra_op_threads)
    return torch.get_num_threads()
