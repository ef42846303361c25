"""InferenceSession: the user-facing API (mirrors onnxruntime where they overlap).

>>> import segflow
>>> sess = segflow.InferenceSession("model.onnx")          # doctest: +SKIP
>>> outs = sess.run(None, {"input": x})                    # doctest: +SKIP
>>> sess.last_run_stats.syncs                              # doctest: +SKIP
1
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
import torch

from segflow.engine import make_engine
from segflow.engine.streams import StreamBackend
from segflow.errors import InvalidInput
from segflow.frontend.model_info import ModelInfo, describe_model
from segflow.frontend.onnx_import import INFERENCE_DATA_LIMIT, import_model, load_model
from segflow.ir import lowbit
from segflow.ir.graph import Graph, Value
from segflow.ir.types import Device, DeviceKind, DType
from segflow.kernels.native.build import describe_cache as describe_native_cache
from segflow.kernels.report import ReportFamily, describe_families
from segflow.kernels.target import CpuTarget
from segflow.ops import default_registry
from segflow.ops.registry import OpRegistry
from segflow.passes.pack_weights import PackStore
from segflow.passes.pipeline import (
    CompileMode,
    OptimizeOptions,
    configure_threads,
)
from segflow.passes.specialize import shape_skeleton, specialize_reason, symbolic_inputs
from segflow.profiler.sink import EventSink, active_sink
from segflow.runtime.aot_inductor import AotInductorSegment
from segflow.runtime.arena import ArenaPool
from segflow.runtime.binding import check_binds
from segflow.runtime.compile import SegmentCompiler
from segflow.runtime.completion import SyncMode
from segflow.runtime.executor import Executor
from segflow.runtime.explain import format_plan
from segflow.runtime.feeds import FeedValidator, feed_tensors
from segflow.runtime.host_memory import HostMemory, apply_host_memory, release_free_heap
from segflow.runtime.nonfinite import (
    NonFinitePolicy,
    NonFiniteScan,
    nonfinite_reach,
)
from segflow.runtime.onednn_graph import OneDnnGraphSegment
from segflow.runtime.ort_api import RunOptions, SessionOptions
from segflow.runtime.ort_session import (
    NodeArg,
    OrtSessionApi,
    check_run,
    node_args,
)
from segflow.runtime.plan import Plan, make_plan
from segflow.runtime.providers import ProviderSpec
from segflow.runtime.specialized import BoundModel, Specializations
from segflow.runtime.stats import RunStats
from segflow.settings import BulkSettings, engine_for_plan, resolve_engine

Tensor = torch.Tensor
ModelSource = str | os.PathLike[str] | bytes | onnx.ModelProto | BoundModel


__all__ = ["InferenceSession", "NodeArg", "PendingRun"]


class PendingRun:
    """A run started by :meth:`InferenceSession.run_async`: ``result()`` waits for it."""

    __slots__ = ("_session", "_wanted", "_feeds", "_outputs", "_wait", "_arrays", "stats")

    def __init__(self, session: InferenceSession, wanted: Sequence[int],
                 feeds: Sequence[Tensor], outputs: Sequence[Tensor],
                 wait: Callable[[], None], stats: RunStats) -> None:
        self._session = session
        self._wanted = wanted
        self._feeds = feeds      # kept alive (and compared for aliasing) until the result
        self._outputs = outputs
        self._wait = wait
        self._arrays: list[np.ndarray] | None = None
        self.stats = stats
        """The run's counters (its one output wait included)."""

    def result(self) -> list[np.ndarray]:
        """Wait for the run (once) and return its outputs as :meth:`InferenceSession.run`
        does; later calls return the same arrays."""
        if self._arrays is None:
            self._wait()
            self._arrays = self._session._arrays(self._wanted, self._feeds, self._outputs)
            self._outputs = ()
        return self._arrays


@dataclass(frozen=True, slots=True)
class _Planning:
    """What making a session's plan needs beyond the session: the imported graph and the
    settings resolved at load (``InferenceSession._plan``)."""

    graph: Graph
    placement: Mapping[str, str | Device] | None
    dims: Mapping[str, int] | None
    carried: frozenset[str] | None   # nonfinite_reach's carried values (None: weights not finite)
    threads: int
    memory_policy: HostMemory
    config: Mapping[str, Any]
    engine: str
    stream_backend: StreamBackend | None
    packs: PackStore | None          # packed weights shared with the plans per input shape


class InferenceSession(OrtSessionApi):
    """Load, plan and bind a model once; run it many times.

    The positional arguments are onnxruntime's (:mod:`segflow.runtime.ort_api`,
    :mod:`segflow.runtime.providers`); segflow's settings are keywords, which win over
    what ``sess_options`` sets.

    Args:
        model: path to an ONNX file, serialized bytes, or a ``ModelProto``.
        sess_options: a :class:`segflow.SessionOptions`. A device here is refused, naming
            ``device=``: accepting it would leave one argument two meanings.
        providers: provider names or ``(name, options)`` tuples, choosing the device.
        provider_options: one options dict per provider.
        device: ``"cpu"`` (default), ``"cpu:N"`` or ``"cuda:N"``; given with
            ``providers``, the two must agree.
        bulk: bulk inference segments (None: ``SEGFLOW_BULK_INFERENCE``, default on).
        engine: ``"auto"``, ``"inline"`` or ``"threaded"`` (None: ``SEGFLOW_ENGINE``, default
            auto: threaded when the plan spans devices, inline otherwise).
        placement: node-name glob or op type -> device, for multi-device runs.
        sync_mode: on CUDA, ``"event"`` (default: tasks record events, the host waits
            once for the outputs) or ``"stream"`` (a stream synchronize after every task).
        cuda_graphs: on CUDA, capture eligible bulk segments as CUDA graphs and replay them.
        stream_backend: the device stream backend (tests pass a fake one; default CUDA).
        optimize: run the optimization passes (True/False, or ``{"fuse": False, ...}`` per
            pass, ``{"fuse.batchnorm": False}`` per fuse rule, ``{"layout.winograd": False}``
            (also ``layout.direct``, ``layout.blocked``) for the layout pass's choices;
            None: ``SEGFLOW_OPTIMIZE``, ``SEGFLOW_NO_*`` and the choices' variables, default
            all on, Winograd where measured faster).
        compile: segment backend, ``"auto"`` | ``"codegen"`` | ``"onednn"`` | ``"inductor"``
            | ``"none"`` (None: ``SEGFLOW_COMPILE``, default auto: codegen, or onednn for a
            CPU graph with depthwise convolutions where libdnnl's direct path is off or
            missing; ``compile_report`` says which ran).
        intra_op_threads: torch intra-op threads (process-wide; None: ``SEGFLOW_INTRA_OP_THREADS``,
            else torch's default from ``OMP_NUM_THREADS`` / the core count).
        host_memory: on CPU, ``"retain"`` keeps a run's freed activation memory in the
            heap for the next run instead of faulting it in again, ``"system"`` leaves
            malloc alone (process-wide; None: ``SEGFLOW_HOST_MEMORY``, default retain;
            see :mod:`segflow.runtime.host_memory`).
        dims: symbolic input dim -> size to plan memory (and prebuild kernels) at, e.g.
            ``{"batch": 8, "H": 224}``; a dim not named is planned at 1. Runs at other
            sizes re-plan for theirs; this only sets the plan ``explain()`` shows.
    """

    def __init__(self, model: ModelSource, sess_options: SessionOptions | None = None,
                 providers: Sequence[ProviderSpec] | None = None,
                 provider_options: Sequence[Mapping[str, Any]] | None = None, *,
                 device: str | Device | None = None,
                 bulk: bool | None = None, engine: str | None = None,
                 placement: Mapping[str, str | Device] | None = None,
                 registry: OpRegistry | None = None, sync_mode: str | None = None,
                 cuda_graphs: bool | None = None, stream_backend: StreamBackend | None = None,
                 optimize: bool | Mapping[str, bool] | None = None, compile: str | None = None,
                 intra_op_threads: int | None = None,
                 host_memory: str | None = None,
                 dims: Mapping[str, int] | None = None) -> None:
        load_start = time.perf_counter_ns()
        explicit = {"bulk": bulk, "engine": engine, "sync_mode": sync_mode,
                    "cuda_graphs": cuda_graphs, "optimize": optimize, "compile": compile,
                    "intra_op_threads": intra_op_threads, "host_memory": host_memory}
        others = {"device": device, "placement": placement, "registry": registry,
                  "stream_backend": stream_backend, "dims": dims}
        # The settings sess_options and the keywords make together; sets self.device.
        config, profile = self._setup(model, sess_options, providers, provider_options,
                                      explicit, others, load_start)
        self.registry = registry or default_registry()
        given = model.tensors if isinstance(model, BoundModel) else None
        proto = load_model(model.proto if isinstance(model, BoundModel) else model)
        # A bound model is the session's own, checked when it loaded, with its inputs'
        # dims bound.
        graph = import_model(proto, self.registry, tensors=given, checked=given is not None)
        self.model_info: ModelInfo = describe_model(proto)
        # A graph over symbolic dims may be planned again per input shape (see
        # _specializations): the model's nodes and the weights as read, before the passes.
        skeleton, stripped = (shape_skeleton(proto, INFERENCE_DATA_LIMIT)
                              if symbolic_inputs(graph) and placement is None
                              else (None, frozenset()))
        del proto   # the graph holds the weights now
        initializers = graph.initializers
        read: dict[str, Tensor] = {}
        for name in stripped:
            const = initializers[name].const if name in initializers else None
            if const is not None:
                read[name] = const
        if profile is not None:
            kind = "uri" if isinstance(model, str | os.PathLike) else "array"
            profile.session_span(f"model_loading_{kind}", load_start, time.perf_counter_ns())
        init_start = time.perf_counter_ns()
        # onnxruntime describes the model's inputs and outputs as declared, before passes.
        self._input_args = node_args(graph.inputs, self.model_info)
        self._output_args = node_args(graph.outputs, self.model_info)
        self.settings = BulkSettings.resolve(inference=config.get("bulk"))
        self.options = OptimizeOptions.resolve(config.get("optimize"),
                                               compile=config.get("compile"),
                                               intra_op_threads=config.get("intra_op_threads"))
        # SessionOptions' enable_cpu_mem_arena and log_severity_level reach options no
        # keyword sets.
        self.options = replace(self.options,
                               arena=self.options.arena and config.get("arena", True),
                               debug=max(self.options.debug, config.get("debug", 0)))
        threads = configure_threads(self.options)
        memory_policy = apply_host_memory(HostMemory.resolve(config.get("host_memory")),
                                          self.device)
        # Weights holding NaN or Inf: no kernel may lose them (runtime/nonfinite.py).
        # Checked before the passes pack them into formats that cannot be read back, as
        # are the values a NaN may arise in (the passes fold some into constants).
        # The CPU the kernels are chosen for, its libraries and ISA: looked up once, here
        # (kernels/target.py), and passed to the passes, binding and codegen.
        self.target = CpuTarget.detect()
        self._holds_nonfinite = NonFiniteScan(self.target.native)
        # The weights a plan per input shape shares are scanned once, by the session
        # that read them (``read``; a bound model's ``tensors``).
        scanned = {*read, *(given or ())}
        read_finite = not self._holds_nonfinite(read.values())
        weights_finite = read_finite and (
            model.finite if isinstance(model, BoundModel) else True) and not \
            self._holds_nonfinite(v.const for v in graph.initializers.values()
                                  if v.const is not None and v.name not in scanned)
        carried = nonfinite_reach(graph, self.registry)[1] if weights_finite else None
        # Planned again per input shape, its plans take the weights packed here.
        packs = (model.packs if isinstance(model, BoundModel)
                 else PackStore(read.values()) if read and self.options.specialize else None)
        self._optimize_config = config.get("optimize")
        self.exact_runs = 0
        """Runs whose feeds held NaN or Inf and ran every kernel exact (explain says why)."""
        self._check_feeds = FeedValidator(graph.inputs)
        self._output_names = [v.name for v in graph.outputs]
        self._all_outputs = tuple(range(len(graph.outputs)))
        self._local = threading.local()
        self._warned_outputs: set[str] = set()
        self._checked_shapes: dict[str, tuple[int, ...]] = {}
        self._profile = profile
        self._profile_sink: EventSink | None = profile.profiler if profile is not None else None
        # Settings a plan reads, checked here whenever the plan is made.
        engine = resolve_engine(config.get("engine"))
        SyncMode.parse(config.get("sync_mode", "event"))
        planning = _Planning(graph, placement, dims, carried, threads, memory_policy, config,
                             engine, stream_backend, packs)
        self._specialized: Specializations | None = None
        self._planning: _Planning | None = None
        self._planning_lock = threading.Lock()
        if (skeleton is not None and self.options.specialize
                and not self._sess_options.optimized_model_filepath
                and specialize_reason(graph) is not None):
            # Every run at a shape below the cap takes a plan of its own, so the session's
            # plan is made when something needs it (explain, a shape past the cap or one
            # whose bound model does not import); the checks that binding makes of each
            # node run now, so an invalid model still fails at load.
            check_binds(graph, self.registry, self.device.torch, self.target)
            self._specialized = self._specializations(skeleton, read, packs, graph,
                                                      read_finite)
            for name in self._PLANNED:   # a session loaded again (_rebuild) drops its plan
                self.__dict__.pop(name, None)
            self._planning = planning
        else:
            self._plan(planning)
            if (skeleton is not None and self.options.specialize
                    and specialize_reason(self.graph) is not None):
                self._specialized = self._specializations(skeleton, read, packs, graph,
                                                          read_finite)
        del read
        if profile is not None:
            profile.session_span("session_initialization", init_start, time.perf_counter_ns())

    # The attributes _plan sets: read before the session's plan is made, they make it.
    _PLANNED = frozenset({
        "graph", "plan", "engine_name", "_engine", "_executor", "_nonfinite",
        "_exact_args", "_exact", "_exact_lock", "compile_report", "prebuild_report",
        "_memory_plans", "_const_storages", "_numpy_run_mode", "released_at_load"})

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes not set yet: those of a plan deferred at load.
        if name in InferenceSession._PLANNED and self.__dict__.get("_planning") is not None:
            with self._planning_lock:
                planning = self._planning
                if planning is not None:
                    self._plan(planning)
                    self._planning = None
            return getattr(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def planned(self) -> bool:
        """Whether the session's own plan is made (always, but where every run may take a
        plan per input shape: then by the first thing that needs it)."""
        return self.__dict__.get("_planning") is None

    def _plan(self, planning: _Planning) -> None:
        """Run the passes over the imported graph, plan it and bind the plan."""
        graph, placement, config = planning.graph, planning.placement, planning.config
        self.graph = graph
        sync_mode = config.get("sync_mode", "event")
        cuda_graphs = bool(config.get("cuda_graphs", False))
        stream_backend = planning.stream_backend
        # With optimized_model_filepath set, the ONNX-expressible passes run first and
        # their graph is written (runtime/ort_session.py); their log lines lead.
        pipeline, written = self._run_passes(None if placement else self.device,
                                             planning.dims, planning.packs)
        self.plan: Plan = make_plan(graph, self.registry, self.settings, self.device,
                                    placement, pass_log=(*written, *pipeline.log),
                                    memory=pipeline.memory, choices=pipeline.choices)
        memory = self.plan.memory
        self.engine_name = engine_for_plan(planning.engine,
                                           {s.device for s in self.plan.segments})
        self._engine = make_engine(self.engine_name)
        record: dict[str, object] = {"device": str(self.device), **self.settings.as_dict(),
                                     "sync_mode": SyncMode.parse(sync_mode).value,
                                     "cuda_graphs": cuda_graphs, **self.options.as_record(),
                                     "compile": pipeline.compile.value,
                                     "intra_op_threads": planning.threads,
                                     "host_memory": planning.memory_policy.value,
                                     **(memory.as_record() if memory is not None else {})}
        # Kernels that lose NaN or Inf only where none can reach them from inside the
        # graph; a run whose feeds hold one runs the exact executor (_executor_for).
        carried = planning.carried
        self._nonfinite = NonFinitePolicy(
            None if carried is None else nonfinite_reach(graph, self.registry, carried)[0])
        model = self._source[0]
        compiler = SegmentCompiler(pipeline.compile, memory, self.device.torch,
                                   cached_packages=self.options.compile is CompileMode.AUTO,
                                   replay=self.options.onednn_replay,
                                   keeps_nonfinite=self._nonfinite.keeps, target=self.target,
                                   model=model, model_name=graph.name)
        plans = self.plan.memory_by_size
        arena = None
        if plans is not None and self.options.arena:
            pool = ArenaPool(plans, graph.nodes, self.plan.choices)
            arena = pool if pool else None
        self._executor = Executor(self.plan, self.registry, self._engine, record,
                                  sync_mode=sync_mode, cuda_graphs=cuda_graphs,
                                  stream_backend=stream_backend, compiler=compiler, arena=arena,
                                  nonfinite=self._nonfinite, target=self.target)
        if any(isinstance(fn, AotInductorSegment | OneDnnGraphSegment)
               for fn in self._executor.compiled):
            self._nonfinite.note("compiled segments", "inductor's or oneDNN Graph's fused "
                                 "kernels are not checked for NaN")
        self._exact_args = (record, SyncMode.parse(sync_mode), stream_backend)
        self._exact: Executor | None = None
        self._exact_lock = threading.Lock()
        # Compile time (not a setting, not run time): compile_report.compile_time_s.
        self.compile_report = compiler.report
        # libdnnl's primitives for a first run's layouts, built now rather than by that
        # run (runtime/prebuild.py); None: SEGFLOW_PREBUILD=0.
        self.prebuild_report = (self._executor.prebuild(memory.dims if memory is not None
                                                        else {})
                                if self.options.prebuild else None)
        # RunStats report the memory plan at the dims each run binds (planned at ``dims``).
        self._memory_plans = plans if memory is not None and memory.dims else None
        self._const_storages = {_storage(t) for t in self._executor.template
                                if t is not None}
        # run() hands back numpy arrays, so its tensors never meet autograd: on the host
        # it runs under inference_mode, which skips torch's autograd dispatch layer on
        # every op (~0.2-0.4 us an addmm, which counts where layers are tiny:
        # benchmarks/grad_mode.py). run_tensors() returns torch
        # tensors that may meet autograd later, so it keeps them ordinary tensors.
        default = self.plan.default_device
        host_only = all((s.device or default).kind is DeviceKind.CPU
                        for s in self.plan.segments) and default.kind is DeviceKind.CPU
        self._numpy_run_mode: Callable[[], contextlib.AbstractContextManager[object]] = (
            torch.inference_mode if host_only else contextlib.nullcontext)
        # What loading freed (dense weights replaced by packed ones, folded constants'
        # intermediates) goes back to the OS: under host_memory="retain" glibc would
        # keep it (runtime/host_memory.py).
        self.released_at_load = release_free_heap()

    # -- description -------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        """The model's inputs (initializers it lets a caller override excluded)."""
        return list(self._input_args)

    def get_outputs(self) -> list[NodeArg]:
        """The model's outputs; a dim neither the model nor a fixed size names is None."""
        return list(self._output_args)

    def explain(self) -> str:
        """The segment table: index, first..last node, count, exec types, device, reason.

        On devices with streams, also the sync mode and each segment's CUDA-graph state;
        on CPU, the kernels that call libdnnl (with any input layout that fell back to
        torch so far, and why) and the activation arena; and the memory loading freed
        and gave back to the OS.
        """
        lines = [*self._executor.completion.describe(), *self.kernel_report(),
                 *(self._specialized.describe() if self._specialized is not None else ()),
                 *self.compile_report.cached_package_lines(),
                 *self._nonfinite.describe(self.exact_runs)]
        if self.released_at_load >= 1 << 20:
            lines.append(f"load: returned {self.released_at_load / 2**20:.0f} MiB freed while "
                         "loading (weights replaced by packed copies) to the OS")
        return "\n".join([format_plan(self.plan), *lines]) if lines else format_plan(self.plan)

    def kernel_report(self) -> list[str]:
        """What the CPU kernels did so far: those calling libdnnl, the input layouts they
        built and each that fell back to torch (and why); the dense chains, how many calls
        ran native and why any went through torch; the replayed runs of direct kernels;
        what the disk cache's checks refused (the native library, inductor packages);
        and the activation arena."""
        report = self.compile_report
        lines: list[str] = []
        for family, described in describe_families(
                [*self._executor.kernel_ops, *((r.label, r) for r in report.replays),
                 *((r.label, r) for r in report.native_replays)]):
            if family is ReportFamily.DIRECT and self.prebuild_report is not None:
                described.insert(1, f"  {self.prebuild_report.describe()}")
            lines += described
        lines += describe_native_cache()
        lines += [f"disk cache: {note}" for note in self.compile_report.cache_notes]
        arena = self._executor.arena
        if arena is not None:   # the block at the sizes the plan was made for
            lines.append(arena.layout(arena.plans.base.dims).describe())
        return lines

    @property
    def arena_bytes(self) -> int:
        """Bytes of the planned activation blocks the session keeps between runs
        (runtime/arena.py; 0 when no kernel writes into one), and of the blocks its
        replayed runs of native kernels write their results in (kernels/replay.py)."""
        arena = self._executor.arena
        held = arena.held_bytes() if arena is not None else 0
        return held + sum(r.block_bytes for r in self.compile_report.native_replays)

    @property
    def specializations(self) -> dict[tuple[tuple[int, ...], ...], InferenceSession]:
        """The sessions planned for the input shapes runs brought so far, by the feeds'
        shapes in input order (empty where the graph's shapes are not computed at run
        time, or ``optimize={"specialize": False}``)."""
        return self._specialized.sessions if self._specialized is not None else {}

    @property
    def last_run_stats(self) -> RunStats | None:
        """Counters of the last run made by the calling thread."""
        return getattr(self._local, "stats", None)

    # -- running -----------------------------------------------------------------------
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: RunOptions | None = None) -> list[np.ndarray]:
        """Run the model; returns numpy arrays in ``output_names`` order (None or []: all).
        A sequence is a list of arrays and an empty optional None, feeds and outputs alike.

        ``run_options``: a :class:`segflow.RunOptions`; with ``terminate`` set the run
        raises instead. On the host (inline engine) the kernels run under
        ``torch.inference_mode``: nothing of the run can reach autograd, so torch skips
        that dispatch layer.
        """
        if run_options is not None:
            check_run(run_options)
        runner, wanted, tensors, outputs, wait = self._start(output_names, input_feed)
        wait()
        return runner._arrays(wanted, tensors, outputs)

    def run_async(self, output_names: Sequence[str] | None,
                  input_feed: Mapping[str, Any]) -> PendingRun:
        """Start a run and return before the host waits for the device.

        ``result()`` on the returned :class:`PendingRun` waits (the run's one host
        synchronization, counted in ``last_run_stats`` already) and gives what
        :meth:`run` would have. On CUDA the host can stage and launch the next
        inference while this one runs, so back-to-back batch-1 inferences keep the
        device busy. Where nothing runs asynchronously (host devices, profiled runs)
        the run is complete when this returns.
        """
        runner, wanted, tensors, outputs, wait = self._start(output_names, input_feed)
        return PendingRun(runner, wanted, tensors, outputs, wait, self._local.stats)

    def _start(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]
               ) -> tuple[InferenceSession, Sequence[int], list[Tensor], list[Tensor],
                          Callable[[], None]]:
        """What :meth:`run` and :meth:`run_async` share: check the feeds, start the run
        (on the plan specialized for their shapes where there is one), keep its stats for
        this thread; the outputs are ready once ``wait()`` returns. Returns the session
        whose plan ran (its outputs are handed back by its ``_arrays``)."""
        tensors, dims = self._validate(feeds)
        wanted = self._output_indices(output_names)
        runner = self._runner_for(tensors)
        executor = runner._executor_for(tensors)
        with runner._numpy_run_mode():
            outputs, stats, wait = executor.start(tensors, active_sink() or self._profile_sink,
                                                  host_outputs=True, dims=dims)
        self._local.stats = runner._sized(stats, dims)
        return runner, wanted, tensors, outputs, wait

    def _runner_for(self, feeds: Sequence[Tensor]) -> InferenceSession:
        """The session whose plan runs ``feeds``: the one specialized for their shapes, or
        this one (not specialized, or past the cap)."""
        specialized = self._specialized
        runner = specialized.session_for(feeds) if specialized is not None else None
        return runner if runner is not None else self

    def _specializations(self, skeleton: onnx.ModelProto, read: Mapping[str, Tensor],
                         packs: PackStore | None, graph: Graph,
                         finite: bool) -> Specializations:
        """Plans per input shape for this session's model (``runtime/specialized.py``):
        each a session over ``skeleton`` with the inputs' dims bound and the weights
        ``read`` at load, with this session's options less ``specialize`` (no profile,
        no optimized model file)."""
        model, sess_options, keywords = self._source
        options = copy.copy(sess_options) if sess_options is not None else None
        if options is not None:
            options.optimized_model_filepath = ""
            options.enable_profiling = False
        base = self._optimize_config
        optimize = {**base, "specialize": False} if isinstance(base, Mapping) \
            else {"specialize": False}
        child = {**keywords, "optimize": optimize, "dims": None, "device": self.device}

        def build(bound: BoundModel) -> InferenceSession:
            return InferenceSession(bound, options, **child)
        return Specializations(skeleton, read, [v.name for v in graph.inputs], build,
                               packs=packs, finite=finite)

    def _executor_for(self, feeds: Sequence[Tensor]) -> Executor:
        """The session's executor, or where its kernels lose NaN or Inf and ``feeds`` hold
        one, the exact one: the same plan, every kernel bound to keep them (built by the
        first such run; no compiled segments, no planned arena)."""
        if not self._nonfinite.inexact or not self._holds_nonfinite(feed_tensors(feeds)):
            return self._executor
        with self._exact_lock:
            if self._exact is None:
                record, sync_mode, backend = self._exact_args
                self._exact = Executor(self.plan, self.registry, self._engine,
                                       {**record, "nonfinite": "exact"}, sync_mode=sync_mode,
                                       stream_backend=backend,
                                       nonfinite=NonFinitePolicy.everywhere(),
                                       target=self.target)
            self.exact_runs += 1
            return self._exact

    def _arrays(self, wanted: Sequence[int], tensors: Sequence[Tensor],
                outputs: Sequence[Tensor]) -> list[np.ndarray]:
        """The wanted outputs as numpy arrays.

        Outputs that share storage with a weight, a feed or an earlier output are
        copied, so the caller can never mutate segflow's state or their own inputs
        through them.
        """
        weights = self._const_storages
        seen = {_storage(t) for t in feed_tensors(tensors)}
        arrays: list[Any] = []

        def array(value: Value, tensor: Tensor) -> np.ndarray:
            storage = _storage(tensor)
            aliased = storage in seen or storage in weights
            seen.add(storage)
            return self._to_numpy(value, tensor, aliased)
        for i in wanted:
            value, out = self.graph.outputs[i], outputs[i]
            # A sequence output is a list of arrays and an empty optional None, as
            # onnxruntime returns them.
            if isinstance(out, list):
                arrays.append([array(Value(value.name), t) for t in out])
            else:
                arrays.append(None if out is None else array(value, out))
        return arrays

    def run_tensors(self, feeds: Mapping[str, Tensor]) -> list[Tensor]:
        """Run on torch tensors; returns torch tensors (no numpy round trip).

        The outputs are ordinary tensors (not inference tensors), usable with autograd;
        a sequence is a list of tensors and an empty optional None, feeds and outputs alike.
        """
        tensors, dims = self._validate(feeds)
        runner = self._runner_for(tensors)
        outputs, stats = runner._executor_for(tensors).run(
            tensors, active_sink() or self._profile_sink, dims=dims)
        self._local.stats = runner._sized(stats, dims)
        return outputs

    def close(self) -> None:
        if self._specialized is not None:
            self._specialized.close()
        if self.planned:   # a plan never made has no engine to close
            self._engine.close()

    def _rebuild(self, providers: Sequence[ProviderSpec],
                 provider_options: Sequence[Mapping[str, Any]] | None) -> None:
        model, sess_options, keywords = self._source
        InferenceSession.__init__(self, model, sess_options, providers, provider_options,
                                  **{**keywords, "device": None})

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------
    def _output_indices(self, names: Sequence[str] | None) -> Sequence[int]:
        if not names:   # None or [] (onnxruntime's two ways of asking for all)
            return self._all_outputs
        all_names = self._output_names
        indices = []
        for name in names:
            if name not in all_names:
                raise InvalidInput(f"unknown output name {name!r}; the model's outputs are "
                                   f"{', '.join(all_names)}")
            indices.append(all_names.index(name))
        return indices

    def _sized(self, stats: RunStats, dims: dict[str, int]) -> RunStats:
        """``stats`` with the memory plan sized for this run's symbolic dims (batch ...)."""
        sizes = self._memory_plans
        if sizes is None or not dims:
            return stats
        plan = sizes.for_dims(dims)
        if plan is sizes.base:
            return stats
        return replace(stats, settings={**stats.settings, **plan.as_record()})

    def _validate(self, feeds: Mapping[str, Any]) -> tuple[list[Tensor], dict[str, int]]:
        """The feeds as tensors in input order, and the symbolic dims they bind."""
        return self._check_feeds(feeds)

    def _to_numpy(self, value: Value, tensor: Tensor, aliased: bool) -> np.ndarray:
        if isinstance(tensor, np.ndarray):  # a string value: already a host array
            array = tensor
            if aliased or not array.flags.c_contiguous:
                array = np.array(array, copy=True, order="C")
            self._check_declared(value, array.shape)
            return array
        t = tensor.detach() if tensor.requires_grad else tensor
        if not t.is_cpu:
            t = t.cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ml_dtypes' (as onnx's)
            array = t.view(torch.uint16).numpy().view(_BFLOAT16)
        elif value.spec.dtype is not None and value.spec.dtype.is_lowbit:
            array = lowbit.to_numpy(t, value.spec.dtype)   # float8, int4 ...: ml_dtypes'
        else:
            array = t.numpy()
        if aliased or not array.flags.c_contiguous:
            array = np.array(array, copy=True, order="C")
        self._check_declared(value, array.shape)
        return array

    def _check_declared(self, value: Value, shape: tuple[int, ...]) -> None:
        declared = value.spec.shape
        if declared is None or self._checked_shapes.get(value.name) == shape:
            return  # nothing declared, or this shape was checked (and warned about) already
        self._checked_shapes[value.name] = shape
        fixed_mismatch = len(declared) != len(shape) or any(
            isinstance(d, int) and d != s for d, s in zip(declared, shape))
        if fixed_mismatch and value.name not in self._warned_outputs:
            self._warned_outputs.add(value.name)
            warnings.warn(f"output {value.name!r} has shape {list(shape)} but the model declares "
                          f"{value.spec.describe()}; returning what the graph computed",
                          stacklevel=3)


_BFLOAT16 = DType.BFLOAT16.numpy


def _storage(tensor: Tensor) -> int:
    if isinstance(tensor, np.ndarray):  # a string value (ops/strings.py)
        return int(tensor.__array_interface__["data"][0])
    if tensor.is_mkldnn:  # an opaque prepacked weight (passes/pack_weights.py): never an output
        return id(tensor)
    return tensor.untyped_storage().data_ptr()


