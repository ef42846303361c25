"""Every environment-backed setting segflow reads, declared in one place.

Settings come from the API first; a value left as None there falls back to
the environment variable, then to the default. The settings in force are
recorded in every RunStats and benchmark record.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from segflow.errors import InvalidSetting

_Choice = TypeVar("_Choice", bound=enum.Enum)

ENV_BULK_INFERENCE = "SEGFLOW_BULK_INFERENCE"
ENV_BULK_TRAIN = "SEGFLOW_BULK_TRAIN"
ENV_BULK_MAX_NODES_FWD = "SEGFLOW_BULK_MAX_NODES_FWD"
ENV_BULK_MAX_NODES_BWD = "SEGFLOW_BULK_MAX_NODES_BWD"
ENV_ENGINE = "SEGFLOW_ENGINE"
ENV_DEBUG = "SEGFLOW_DEBUG"
# Inference optimization (segflow.passes.pipeline): API values win over these.
ENV_OPTIMIZE = "SEGFLOW_OPTIMIZE"                  # 0: run the graph as imported
ENV_NO_FOLD = "SEGFLOW_NO_FOLD"                    # 1: skip constant folding
ENV_NO_QUANTIZE = "SEGFLOW_NO_QUANTIZE"            # 1: QDQ convolutions stay float
ENV_NO_FUSE = "SEGFLOW_NO_FUSE"                    # 1: skip fusion; rule names: those rules
ENV_NO_LAYOUT = "SEGFLOW_NO_LAYOUT"                # 1: keep dense NCHW convolution weights
ENV_NO_MEMORY_PLAN = "SEGFLOW_NO_MEMORY_PLAN"      # 1: no memory plan, no in-place ops
ENV_NO_SPECIALIZE = "SEGFLOW_NO_SPECIALIZE"       # 1: no plans per input shape
ENV_COMPILE = "SEGFLOW_COMPILE"                    # auto | codegen | onednn | inductor | none
ENV_INTRA_OP_THREADS = "SEGFLOW_INTRA_OP_THREADS"  # torch.set_num_threads (else OMP_NUM_THREADS)
ENV_CACHE_DIR = "SEGFLOW_CACHE_DIR"  # compiled segments (compile="inductor"); else XDG cache
ENV_CACHE_MAX_MB = "SEGFLOW_CACHE_MAX_MB"          # package cache size cap, MiB (default 2048)
ENV_HOST_MEMORY = "SEGFLOW_HOST_MEMORY"            # retain | system (runtime/host_memory.py)
ENV_ONEDNN_DIRECT = "SEGFLOW_ONEDNN_DIRECT"        # 0: convolutions through torch's oneDNN op
ENV_ONEDNN_BLOCKED = "SEGFLOW_ONEDNN_BLOCKED"      # 0: no nChw8c region (passes/select_kernels.py)
ENV_DNNL_LIBRARY = "SEGFLOW_DNNL_LIBRARY"          # libdnnl path (kernels/onednn/)
ENV_ARENA = "SEGFLOW_ARENA"                        # 0: direct convolutions allocate outputs
ENV_ONEDNN_REPLAY = "SEGFLOW_ONEDNN_REPLAY"        # 0: no replayed runs (kernels/onednn/replay.py)
ENV_PREBUILD = "SEGFLOW_PREBUILD"                  # 0: direct kernels built at their first run
ENV_NO_DENSE_CHAIN = "SEGFLOW_NO_DENSE_CHAIN"      # 1: small dense layers stay one node each
ENV_NATIVE = "SEGFLOW_NATIVE"                      # 0: never build or load native kernels
ENV_NATIVE_LINEAR = "SEGFLOW_NATIVE_LINEAR"        # 0: no native linears; 1: on AVX-512 too
ENV_WINOGRAD = "SEGFLOW_WINOGRAD"                  # 0: 3x3 convs direct; 1: Winograd on AVX-512 too
ENV_STRASSEN = "SEGFLOW_STRASSEN"                  # 0: native linears never run as Strassen
ENV_NATIVE_STEM = "SEGFLOW_NATIVE_STEM"            # 0: stems staged; 1: native on AVX2 too

ENGINES = ("auto", "inline", "threaded")


def parse_choice(kind: type[_Choice], value: object, source: str) -> _Choice:
    """``value`` as a member of the string enum ``kind`` (case and spaces ignored).

    A value that is none of them raises InvalidSetting naming ``source`` (the
    option or ``SEGFLOW_*`` variable it came from) and the accepted values.
    """
    if isinstance(value, kind):
        return value
    try:
        return kind(str(value).strip().lower())
    except ValueError:
        choices = ", ".join(str(m.value) for m in kind)
        raise InvalidSetting(f"{source}={value!r}: expected one of {choices}") from None


# The words a boolean variable may be set to.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(raw: str, source: str) -> bool:
    """``raw`` as a boolean (:data:`TRUE_WORDS`, :data:`FALSE_WORDS`, case and spaces
    ignored); anything else raises InvalidSetting naming ``source``."""
    text = raw.strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise InvalidSetting(f"{source}={raw!r}: expected 0 or 1")


def _env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    return parse_bool(raw, name)


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidSetting(f"{name}={raw!r}: expected a positive integer") from None
    if value < 1:
        raise InvalidSetting(f"{name}={raw!r}: expected a positive integer")
    return value


@dataclass(frozen=True, slots=True)
class BulkSettings:
    """How the segment planner groups nodes (see DESIGN.md, "Segmentation policy")."""

    inference: bool = True
    train: bool = True
    max_nodes_fwd: int = 15
    max_nodes_bwd: int = 15

    @classmethod
    def resolve(cls, *, inference: bool | None = None, train: bool | None = None,
                max_nodes_fwd: int | None = None, max_nodes_bwd: int | None = None,
                env: Mapping[str, str] | None = None) -> BulkSettings:
        """API values win; None falls back to the environment, then the default."""
        env = os.environ if env is None else env
        d = cls()
        return cls(
            inference=inference if inference is not None else _env_bool(
                env, ENV_BULK_INFERENCE, d.inference),
            train=train if train is not None else _env_bool(env, ENV_BULK_TRAIN, d.train),
            max_nodes_fwd=max_nodes_fwd if max_nodes_fwd is not None else _env_int(
                env, ENV_BULK_MAX_NODES_FWD, d.max_nodes_fwd),
            max_nodes_bwd=max_nodes_bwd if max_nodes_bwd is not None else _env_int(
                env, ENV_BULK_MAX_NODES_BWD, d.max_nodes_bwd),
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def resolve_engine(name: str | None, env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    chosen = name or env.get(ENV_ENGINE) or "auto"
    if chosen not in ENGINES:
        source = "engine" if name else ENV_ENGINE
        raise InvalidSetting(f"{source}={chosen!r}: expected one of {', '.join(ENGINES)}")
    return chosen


def engine_for_plan(choice: str, devices: Collection[object], *,
                    communicates: bool = False) -> str:
    """Resolve ``"auto"``: the threaded engine only where it has concurrency to exploit.

    A plan on one device is a chain of tasks the host waits for anyway; handing it
    to a worker thread costs a thread switch per run and, on CPU, a second OpenMP
    thread team that oversubscribes the cores (docs/performance.md). Plans spanning
    devices get the threaded engine, and so do data-parallel steps (``communicates``):
    their all-reduces run while the worker goes on with the backward segments.
    """
    if choice != "auto":
        return choice
    return "threaded" if len(set(devices)) > 1 or communicates else "inline"


def environment(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """The variables to obey: ``env`` where a caller gives them (tests), else the process's.

    The one place segflow reads ``os.environ``; every setting goes through it.
    """
    return os.environ if env is None else env


def native_kernels(env: Mapping[str, str] | None = None) -> bool:
    """``SEGFLOW_NATIVE``: whether segflow builds and loads its native kernels (default on)."""
    return _env_bool(environment(env), ENV_NATIVE, True)


def c_compiler(env: Mapping[str, str] | None = None) -> str:
    """The C compiler the native kernels are built with: ``$CC``, else ``cc``."""
    return environment(env).get("CC", "").strip() or "cc"


def dnnl_library(env: Mapping[str, str] | None = None) -> str:
    """``SEGFLOW_DNNL_LIBRARY``: the libdnnl file to load; "" to look where the wheel puts it."""
    return environment(env).get(ENV_DNNL_LIBRARY, "").strip()


def host_memory(env: Mapping[str, str] | None = None) -> str:
    """``SEGFLOW_HOST_MEMORY`` as given (``retain`` where unset): what a CPU run's freed
    memory does (``runtime/host_memory.py`` parses it)."""
    return environment(env).get(ENV_HOST_MEMORY, "").strip() or "retain"


def debug_level(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    try:
        return int(env.get(ENV_DEBUG, "0") or 0)
    except ValueError:
        return 0


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where compiled segments are kept between processes (not created here).

    ``SEGFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/segflow``, else ``~/.cache/segflow``.
    """
    env = os.environ if env is None else env
    explicit = env.get(ENV_CACHE_DIR, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "segflow"


CACHE_MAX_MB = 2048


def cache_max_bytes(env: Mapping[str, str] | None = None) -> int:
    """The package cache's size cap: ``SEGFLOW_CACHE_MAX_MB`` MiB, default 2048 (2 GiB).

    A new package evicts the least recently used ones until the cache fits (the new
    one is always kept, even alone over the cap).
    """
    env = os.environ if env is None else env
    return _env_int(env, ENV_CACHE_MAX_MB, CACHE_MAX_MB) << 20


# -- the inference pipeline's variables (segflow.passes.pipeline) -------------------------
# A pass's SEGFLOW_NO_* variable: 1 switches the pass off.
PASS_OFF_ENV = {"quantize": ENV_NO_QUANTIZE, "fold_constants": ENV_NO_FOLD, "fuse": ENV_NO_FUSE,
                "dense_chain": ENV_NO_DENSE_CHAIN, "layout": ENV_NO_LAYOUT,
                "specialize": ENV_NO_SPECIALIZE, "plan_memory": ENV_NO_MEMORY_PLAN}
# The layout pass's choices that default to "where measured faster" (None when unset).
AUTO_CHOICE_ENV = {"winograd": ENV_WINOGRAD, "native_linear": ENV_NATIVE_LINEAR,
                   "strassen": ENV_STRASSEN, "native_stem": ENV_NATIVE_STEM}


@dataclass(frozen=True, slots=True)
class PipelineEnv:
    """The pipeline's ``SEGFLOW_*`` variables, read once (``OptimizeOptions.resolve``
    lets API values win over them)."""

    optimize: bool = True                    # SEGFLOW_OPTIMIZE
    passes_off: frozenset[str] = frozenset()  # passes whose SEGFLOW_NO_* is 1
    fuse_rules_off: frozenset[str] = frozenset()  # SEGFLOW_NO_FUSE=rule,rule
    compile: str = ""                        # SEGFLOW_COMPILE as given ("" unset)
    intra_op_threads: int | None = None
    onednn_direct: bool = True
    onednn_blocked: bool = True
    arena: bool = True
    onednn_replay: bool = True
    prebuild: bool = True
    auto_choices: Mapping[str, bool] = field(default_factory=dict)  # AUTO_CHOICE_ENV's set
    debug: int = 0                           # SEGFLOW_DEBUG: 1 prints one line per pass

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None, *,
             fuse_rules: Collection[str] = ()) -> PipelineEnv:
        """``fuse_rules``: the fuse rule names ``SEGFLOW_NO_FUSE`` may list."""
        env = os.environ if env is None else env
        rules_off = _fuse_rules_off(env, fuse_rules)
        passes_off = {name for name, var in PASS_OFF_ENV.items()
                      if not (name == "fuse" and rules_off) and _env_bool(env, var, False)}
        threads = (_env_int(env, ENV_INTRA_OP_THREADS, 1)
                   if env.get(ENV_INTRA_OP_THREADS, "").strip() else None)
        return cls(optimize=_env_bool(env, ENV_OPTIMIZE, True),
                   passes_off=frozenset(passes_off), fuse_rules_off=frozenset(rules_off),
                   compile=env.get(ENV_COMPILE, "").strip(), intra_op_threads=threads,
                   onednn_direct=_env_bool(env, ENV_ONEDNN_DIRECT, True),
                   onednn_blocked=_env_bool(env, ENV_ONEDNN_BLOCKED, True),
                   arena=_env_bool(env, ENV_ARENA, True),
                   onednn_replay=_env_bool(env, ENV_ONEDNN_REPLAY, True),
                   prebuild=_env_bool(env, ENV_PREBUILD, True),
                   auto_choices={name: _env_bool(env, var, True)
                                 for name, var in AUTO_CHOICE_ENV.items()
                                 if env.get(var, "").strip()},
                   debug=debug_level(env))


def _fuse_rules_off(env: Mapping[str, str], known: Collection[str]) -> set[str]:
    """The fuse rules ``SEGFLOW_NO_FUSE`` names (comma-separated); none for 0/1 or unset."""
    raw = env.get(ENV_NO_FUSE, "").strip()
    if raw == "" or raw.lower() in TRUE_WORDS + FALSE_WORDS:
        return set()          # the whole pass's switch
    names = {name.strip() for name in raw.split(",") if name.strip()}
    unknown = sorted(names - set(known))
    if unknown:
        raise InvalidSetting(f"{ENV_NO_FUSE}={raw!r}: unknown fuse rules {unknown}; expected 0, "
                             f"1 or rule names from {', '.join(known)}")
    return names
