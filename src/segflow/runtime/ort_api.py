"""onnxruntime's session and run options, mapped onto segflow's settings.

A script written for onnxruntime builds a :class:`SessionOptions` and passes it as
``InferenceSession``'s second argument; :meth:`SessionOptions.session_keywords` turns
it into the keywords segflow's session takes. Precedence: an explicit segflow keyword,
then a ``segflow.*`` session config entry, then the onnxruntime field, then the
``SEGFLOW_*`` variables and segflow's defaults.

>>> so = SessionOptions()
>>> so.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_BASIC
>>> so.add_session_config_entry("segflow.bulk", "0")
>>> sess = segflow.InferenceSession("model.onnx", so)         # doctest: +SKIP
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from segflow.errors import InvalidSetting
from segflow.ir.types import Device
from segflow.passes.fuse import RULE_NAMES
from segflow.passes.options import CompileMode
from segflow.runtime.completion import SyncMode
from segflow.runtime.host_memory import HostMemory
from segflow.settings import ENGINES, parse_bool


class GraphOptimizationLevel(enum.IntEnum):
    """onnxruntime's optimization levels (same values), as segflow passes
    (``passes/pipeline.py``'s PIPELINE):

    - ``ORT_DISABLE_ALL``: no optimization pass (fold_constants, fuse, dense_chain and
      layout off); memory planning follows ``enable_mem_pattern``.
    - ``ORT_ENABLE_BASIC``: constant folding and the fusions that keep standard ONNX
      ops (onnxruntime's basic level: redundant node elimination and folding
      BatchNormalization into the Conv/Gemm before it): ``fold_constants`` and the
      fuse rules ``noops`` and ``batchnorm``.
    - ``ORT_ENABLE_EXTENDED``: every fuse rule (segflow's fused Gemm/Conv with post-ops,
      Gelu, Attention, RMSNormalization, AddLayerNorm, sibling linears) and dense chains;
      no layout pass.
    - ``ORT_ENABLE_LAYOUT`` and ``ORT_ENABLE_ALL`` (the default): everything, the layout
      pass's kernel choices and packed weights included; the ``SEGFLOW_NO_*`` variables
      still apply.
    """

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


# The fuse rules whose results are standard ONNX ops (the basic level's fusions).
BASIC_FUSE_RULES = ("noops", "batchnorm")
_NOT_BASIC = {f"fuse.{rule}": False for rule in RULE_NAMES if rule not in BASIC_FUSE_RULES}
# Each level as segflow's ``optimize`` mapping; None: segflow's defaults.
LEVEL_PASSES: dict[GraphOptimizationLevel, dict[str, bool] | None] = {
    GraphOptimizationLevel.ORT_DISABLE_ALL: {"quantize": False, "fold_constants": False,
                                             "fuse": False,
                                             "dense_chain": False, "layout": False,
                                             "specialize": False},
    GraphOptimizationLevel.ORT_ENABLE_BASIC: {**_NOT_BASIC, "dense_chain": False,
                                              "layout": False, "specialize": False},
    GraphOptimizationLevel.ORT_ENABLE_EXTENDED: {"layout": False},
    GraphOptimizationLevel.ORT_ENABLE_LAYOUT: None,
    GraphOptimizationLevel.ORT_ENABLE_ALL: None,
}


class ExecutionMode(enum.IntEnum):
    """onnxruntime's execution modes: ``ORT_SEQUENTIAL`` runs segflow's inline engine
    (every task on the calling thread), ``ORT_PARALLEL`` the threaded one (workers per
    device). Left unset, segflow's ``auto`` chooses (threaded where a plan spans
    devices)."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    """onnxruntime's node orders; accepted, segflow keeps the model's topological order."""

    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


_ENGINE_FOR_MODE = {ExecutionMode.ORT_SEQUENTIAL: "inline", ExecutionMode.ORT_PARALLEL: "threaded"}


def _flag(key: str, value: str) -> bool:
    return parse_bool(value, f"session config entry {key}")


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(key: str, value: str) -> str:
        text = value.strip().lower()
        if text not in allowed:
            raise InvalidSetting(f"session config entry {key}={value!r}: expected one of "
                                 f"{', '.join(allowed)}")
        return text
    return parse


# ``segflow.*`` session config entries -> (InferenceSession keyword, value parser).
SEGFLOW_CONFIG: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "segflow.bulk": ("bulk", _flag),
    "segflow.engine": ("engine", _choice(*ENGINES)),
    "segflow.compile": ("compile", _choice(*(m.value for m in CompileMode))),
    "segflow.optimize": ("optimize", _flag),
    "segflow.sync_mode": ("sync_mode", _choice(*(m.value for m in SyncMode))),
    "segflow.cuda_graphs": ("cuda_graphs", _flag),
    "segflow.host_memory": ("host_memory", _choice(*(m.value for m in HostMemory))),
}


def _level(value: object) -> GraphOptimizationLevel:
    try:
        return GraphOptimizationLevel(value)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidSetting(f"graph_optimization_level={value!r}: expected a "
                             "GraphOptimizationLevel") from None


def _mode(value: object) -> ExecutionMode:
    try:
        return ExecutionMode(value)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidSetting(f"execution_mode={value!r}: expected an ExecutionMode") from None


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidSetting(f"{name}={value!r}: expected 0 (the default) or a thread count")
    return value


class SessionOptions:
    """onnxruntime's ``SessionOptions``, mapped onto segflow:

    - ``intra_op_num_threads`` (0: torch's default) -> ``intra_op_threads``;
      ``inter_op_num_threads`` is recorded (segflow's threaded engine has one worker
      per device, not a pool to size).
    - ``graph_optimization_level`` -> the passes (see :class:`GraphOptimizationLevel`).
    - ``execution_mode`` -> the engine (see :class:`ExecutionMode`).
    - ``optimized_model_filepath``: the optimized graph written as ONNX, as far as it is
      expressible: segflow's fused ops have no ONNX form, so the file holds the graph
      after constant folding and the basic fusions (a warning says so where the session
      runs more); onnxruntime loads it.
    - ``enable_profiling`` / ``profile_file_prefix``: an onnxruntime-format profile,
      written by ``InferenceSession.end_profiling()`` to ``<prefix>_<date>.json``.
    - ``enable_mem_pattern`` -> the memory plan (``plan_memory``);
      ``enable_cpu_mem_arena`` -> the planned activation arena (``runtime/arena.py``).
    - ``log_severity_level`` 0 or 1 (verbose, info) prints each pass's log line to
      stderr as it runs (``SEGFLOW_DEBUG=1``); others are recorded.
    - ``add_session_config_entry``: ``segflow.*`` keys set segflow's own settings
      (:data:`SEGFLOW_CONFIG`); onnxruntime's keys are recorded, with a warning that
      segflow does not act on them.

    Fields not listed are accepted and recorded. An unknown attribute is an error.
    """

    __slots__ = ("intra_op_num_threads_", "inter_op_num_threads_", "_level", "_mode",
                 "execution_order", "optimized_model_filepath", "enable_profiling",
                 "profile_file_prefix", "log_severity_level", "log_verbosity_level",
                 "logid", "enable_mem_pattern", "enable_mem_reuse", "enable_cpu_mem_arena",
                 "use_deterministic_compute", "use_per_session_threads", "_config")

    def __init__(self) -> None:
        self.intra_op_num_threads_ = 0
        self.inter_op_num_threads_ = 0
        self._level: GraphOptimizationLevel | None = None   # None: not set (ENABLE_ALL)
        self._mode: ExecutionMode | None = None             # None: not set (segflow's auto)
        self.execution_order = ExecutionOrder.DEFAULT
        self.optimized_model_filepath = ""
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.enable_cpu_mem_arena = True
        self.use_deterministic_compute = False
        self.use_per_session_threads = True
        self._config: dict[str, str] = {}

    @property
    def intra_op_num_threads(self) -> int:
        return self.intra_op_num_threads_

    @intra_op_num_threads.setter
    def intra_op_num_threads(self, value: int) -> None:
        self.intra_op_num_threads_ = _count("intra_op_num_threads", value)

    @property
    def inter_op_num_threads(self) -> int:
        return self.inter_op_num_threads_

    @inter_op_num_threads.setter
    def inter_op_num_threads(self, value: int) -> None:
        self.inter_op_num_threads_ = _count("inter_op_num_threads", value)

    @property
    def graph_optimization_level(self) -> GraphOptimizationLevel:
        return GraphOptimizationLevel.ORT_ENABLE_ALL if self._level is None else self._level

    @graph_optimization_level.setter
    def graph_optimization_level(self, value: GraphOptimizationLevel) -> None:
        self._level = _level(value)

    @property
    def execution_mode(self) -> ExecutionMode:
        return ExecutionMode.ORT_SEQUENTIAL if self._mode is None else self._mode

    @execution_mode.setter
    def execution_mode(self, value: ExecutionMode) -> None:
        self._mode = _mode(value)

    def add_session_config_entry(self, key: str, value: str) -> None:
        """Set a config entry. ``segflow.*`` keys are checked now (an unknown key or a bad
        value raises InvalidSetting naming it); other keys are onnxruntime's, recorded."""
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidSetting(f"session config entry {key!r}={value!r}: key and value "
                                 "must be strings")
        if key.startswith("segflow."):
            if key not in SEGFLOW_CONFIG:
                raise InvalidSetting(f"unknown session config entry {key!r}; segflow's are "
                                     f"{', '.join(SEGFLOW_CONFIG)}")
            SEGFLOW_CONFIG[key][1](key, value)
        else:
            warnings.warn(f"session config entry {key!r} is onnxruntime's; segflow records it "
                          "but does not act on it", stacklevel=2)
        self._config[key] = value

    def get_session_config_entry(self, key: str) -> str:
        """The entry's value; an entry never set raises (as onnxruntime does)."""
        if key not in self._config:
            raise InvalidSetting(f"SessionOptions does not have configuration with key: {key}")
        return self._config[key]

    def session_keywords(self) -> dict[str, Any]:
        """The InferenceSession keywords these options stand for (only those they set),
        plus ``arena``/``debug`` for the pipeline options no keyword reaches."""
        keywords: dict[str, Any] = {}
        if self.intra_op_num_threads_ > 0:
            keywords["intra_op_threads"] = self.intra_op_num_threads_
        if self._mode is not None:
            keywords["engine"] = _ENGINE_FOR_MODE[self._mode]
        passes = LEVEL_PASSES[self._level] if self._level is not None else None
        if not self.enable_mem_pattern:
            passes = {**(passes or {}), "plan_memory": False}
        if passes is not None:
            keywords["optimize"] = passes
        for key, value in self._config.items():
            if key in SEGFLOW_CONFIG:
                keyword, parse = SEGFLOW_CONFIG[key]
                keywords[keyword] = parse(key, value)
        if not self.enable_cpu_mem_arena:
            keywords["arena"] = False
        if 0 <= self.log_severity_level <= 1:
            keywords["debug"] = 1
        return keywords


class RunOptions:
    """onnxruntime's ``RunOptions``. ``terminate=True`` makes a run (or the next one)
    raise instead of running; the log fields and ``run_tag`` (an older name of
    ``logid``) are recorded; ``add_run_config_entry`` records entries."""

    __slots__ = ("log_severity_level", "log_verbosity_level", "logid", "terminate",
                 "only_execute_path_to_fetches", "_config")

    def __init__(self) -> None:
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
        self._config: dict[str, str] = {}

    @property
    def run_tag(self) -> str:
        return self.logid

    @run_tag.setter
    def run_tag(self, value: str) -> None:
        self.logid = value

    def add_run_config_entry(self, key: str, value: str) -> None:
        self._config[str(key)] = str(value)

    def get_run_config_entry(self, key: str) -> str:
        if key not in self._config:
            raise InvalidSetting(f"RunOptions does not have configuration with key: {key}")
        return self._config[key]


def merge_keywords(options: SessionOptions | None, explicit: Mapping[str, Any]) -> dict[str, Any]:
    """The session's keywords: ``explicit`` ones (not None) over those ``options`` set.

    ``options`` of another type is refused, a string (a device, the second positional
    argument before it was ``sess_options``) with the keyword to use instead.
    """
    if options is not None and not isinstance(options, SessionOptions):
        if isinstance(options, str | Device):
            raise InvalidSetting(f"InferenceSession's second argument is sess_options, got "
                                 f"{options!r}; pass the device as device={str(options)!r}")
        raise InvalidSetting(f"sess_options: expected a segflow.SessionOptions, got "
                             f"{type(options).__name__}")
    merged = options.session_keywords() if options is not None else {}
    merged.update({k: v for k, v in explicit.items() if v is not None})
    return merged
