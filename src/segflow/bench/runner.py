"""The benchmark runner: segflow modes and peers, measured in interleaved rounds.

Why one module near ~500 lines: the measuring protocol (interleaved rounds, settling,
paired ratios) and the record it writes are one contract with the gate in
:mod:`segflow.bench.baseline`; the modes and peers it runs live in ``modes.py`` and
``peers.py``.

For each model every variant (a segflow mode or a peer) is prepared once,
run once to record its counters and check its outputs (every peer's against
onnxruntime's: ``OutputCheck``), run once more under
the memory probe, warmed up, and then timed in rounds: each round runs every
variant once, in an order rotated every round, so machine drift (thermal,
other processes) hits all variants alike. Ratios between variants are the
median of per-round ratios, which cancels drift that a ratio of medians
would not.

Whenever the runtime changes (segflow's modes are one runtime, each peer another),
the runner idles ``settle_s`` seconds (untimed): a runtime's thread pool keeps
spinning after its run -- onnxruntime's for ~40 ms, OpenVINO's too
(docs/performance.md) -- and whichever variant runs next would share the cores with
those workers (up to twice its time on two cores).
Whenever the variant changes, the next one runs once more untimed before its
timed run: on a VM a call right after an idle gap can run slow while the cores
come back (~10-25% for the first few calls after a 0.1 s sleep), and the first call
after another variant's finds its weights gone from the caches. Every change of
variant gets that call, so no variant's timed calls are such a first call more
often than another's.

>>> from segflow.bench.runner import BenchSettings, run_benchmark, resolve_models
>>> result = run_benchmark(resolve_models(["mlp_chain:layers=4"]), BenchSettings(runs=5))
...                                                   # doctest: +SKIP
"""

from __future__ import annotations

import enum
import math
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from segflow.bench.memory import memory_kind, peak_extra_mib
from segflow.bench.modes import DEFAULT_MODELS, DEFAULT_MODES, DEFAULT_PEERS, MODES
from segflow.bench.peers import ModelSource, PeerUnavailable, prepare_peer
from segflow.errors import SegflowError
from segflow.ir.types import Device
from segflow.model_args import Feeds, make_feeds, parse_dim_arg, parse_input_arg

RECORD_SCHEMA = 1
# A peer's outputs may differ from onnxruntime's by this fraction of the largest output
# magnitude: float32 runtimes differ by ~1e-6 of it, bfloat16 by ~1e-2.
CHECK_TOLERANCE = 1e-3


class VariantKind(enum.Enum):
    SEGFLOW = "segflow"
    PEER = "peer"


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """How to benchmark. With ``runs`` None, rounds continue for ``seconds`` per model."""

    batch_size: int = 1
    device: str = "cpu"
    modes: tuple[str, ...] = DEFAULT_MODES
    peers: tuple[str, ...] = DEFAULT_PEERS
    warmup: int = 1
    runs: int | None = None
    seconds: float = 8.0
    min_runs: int = 3
    counters_only: bool = False
    # Untimed pause around a peer that owns a spinning thread pool (module docstring).
    settle_s: float = 0.1
    # ``--input NAME=VALUE`` and ``--dim NAME=SIZE`` as given, applied to every model
    # (segflow.model_args); unset dims of a file model are guessed, its first the batch.
    inputs: tuple[str, ...] = ()
    dims: tuple[str, ...] = ()

    def validate(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise SegflowError(f"unknown mode(s) {', '.join(unknown) or '(none given)'}; "
                               f"available: {', '.join(MODES)}")
        from segflow.bench.peers import PEERS

        bad = [p for p in self.peers if p not in PEERS]
        if bad:
            raise SegflowError(f"unknown peer(s) {', '.join(bad)}; available: {', '.join(PEERS)}")
        if self.batch_size < 1 or self.warmup < 0 or (self.runs is not None and self.runs < 1):
            raise SegflowError("--batch-size and --runs must be >= 1, --warmup >= 0")
        if self.runs is None and self.seconds <= 0:
            raise SegflowError("--seconds must be > 0")
        if not 0 <= self.settle_s <= 10:
            raise SegflowError("--settle must be between 0 and 10 seconds")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model to benchmark: a built-in name with options, or an ONNX file."""

    label: str
    builtin: str | None = None
    options: Mapping[str, int] = field(default_factory=dict)
    path: str | None = None


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Latency over the timed runs (milliseconds) and throughput (items per second)."""

    runs: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    throughput: float

    @classmethod
    def of(cls, times_ns: Sequence[int], batch_size: int) -> LatencyStats:
        ms = np.asarray(times_ns, dtype=np.float64) / 1e6
        p50, p90, p99 = (float(np.percentile(ms, q)) for q in (50, 90, 99))
        mean = float(ms.mean())
        return cls(len(ms), mean, p50, p90, p99, float(ms.min()), float(ms.max()),
                   batch_size / (mean / 1e3) if mean > 0 else math.inf)


@dataclass(frozen=True, slots=True)
class OutputCheck:
    """A peer's outputs against another runtime's, checked once per model.

    ``relative_diff`` is ``max_abs_diff`` over the largest magnitude among the outputs
    checked against; ``ok`` when it is at most ``tolerance``. A peer that fails it is
    still timed, and its row says that it computes something else.
    """

    against: str
    max_abs_diff: float
    relative_diff: float
    tolerance: float
    ok: bool

    @classmethod
    def of(cls, outputs: Sequence[np.ndarray], expected: Sequence[np.ndarray], against: str,
           tolerance: float = CHECK_TOLERANCE) -> OutputCheck:
        diff = _max_abs_diff(expected, outputs)
        scale = max((float(np.max(np.abs(np.asarray(e, np.float64)))) for e in expected
                     if np.size(e)), default=0.0)
        relative = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        return cls(against, diff, relative, tolerance, relative <= tolerance)


@dataclass(frozen=True, slots=True)
class VariantResult:
    """One segflow mode or peer on one model. ``status`` is "ok", "missing" or "error"."""

    name: str
    kind: VariantKind
    status: str = "ok"
    detail: str = ""
    counters: Mapping[str, int] | None = None
    settings: Mapping[str, Any] | None = None
    latency: LatencyStats | None = None
    relative: float | None = None          # latency / reference variant, median per round
    peak_memory_mib: float | None = None
    max_abs_diff: float | None = None      # outputs vs the reference variant
    precision: str | None = None           # a peer's compute precision ("f32", "bf16")
    check: OutputCheck | None = None       # a peer's outputs vs onnxruntime's

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True, slots=True)
class ModelResult:
    """Every variant of one model, plus the drift-cancelling ratios between them."""

    model: str
    source: str
    shapes: Mapping[str, list[int]]
    batch_size: int
    device: str
    reference: str
    variants: tuple[VariantResult, ...]
    ratios: Mapping[str, float]
    rounds: int
    setup_s: float
    bench_s: float
    guess_note: str = ""     # which symbolic dims were guessed, and how to set them

    def variant(self, name: str) -> VariantResult | None:
        return next((v for v in self.variants if v.name == name), None)


# -- model resolution --------------------------------------------------------------------
def parse_model_spec(text: str) -> ModelSpec:
    """``NAME``, ``builtin:NAME``, ``NAME:opt=val,opt=val`` or a path to an ONNX file."""
    from segflow import models

    raw = text.removeprefix("builtin:")
    name, _, opts = raw.partition(":")
    if name in models.available() and not Path(text).exists():
        options: dict[str, int] = {}
        for item in filter(None, opts.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not value.strip().isdigit():
                raise SegflowError(f"model {text!r}: bad option {item!r}, expected KEY=INT")
            options[key.strip()] = int(value)
        return ModelSpec(raw, name, options)
    if text.startswith("builtin:"):
        raise SegflowError(f"unknown built-in model {name!r}; available: "
                           f"{', '.join(models.available())}")
    if not Path(text).exists():
        raise SegflowError(f"model {text!r} is neither a built-in model "
                           f"({', '.join(models.available())}) nor an existing file")
    return ModelSpec(text, path=text)


def resolve_models(names: Sequence[str] | None) -> list[ModelSpec]:
    """Model specs for the CLI arguments (the built-in set when none are given)."""
    return [parse_model_spec(n) for n in (names or DEFAULT_MODELS)]


def _load(spec: ModelSpec, settings: BenchSettings) -> tuple[ModelSource, Feeds]:
    """The model and its feeds: a built-in model's example inputs, or random data at the
    dims ``settings.inputs``/``dims`` set and guesses for the rest (a file's first
    symbolic dim: the batch size)."""
    from segflow import models
    from segflow.frontend.onnx_import import declared_inputs, load_model

    examples = None
    if spec.builtin is not None:
        try:
            model = models.build(spec.builtin, **spec.options)
            examples = models.example_inputs(spec.builtin, batch_size=settings.batch_size,
                                             **spec.options)
        except ValueError as exc:
            raise SegflowError(str(exc)) from None
        source = ModelSource(model, spec.builtin, dict(spec.options))
    else:
        assert spec.path is not None
        source = ModelSource(load_model(spec.path))
    feeds = make_feeds(declared_inputs(source.model),
                       [parse_input_arg(text) for text in settings.inputs],
                       dict(parse_dim_arg(text) for text in settings.dims),
                       batch_size=settings.batch_size, examples=examples)
    return source, feeds


# -- measuring ---------------------------------------------------------------------------
@dataclass(slots=True)
class _Live:
    """A variant being measured (mutable, internal)."""

    name: str
    kind: VariantKind
    run: Callable[[], list[np.ndarray]] | None
    status: str = "ok"
    detail: str = ""
    counters: dict[str, int] | None = None
    settings: dict[str, Any] | None = None
    stats_of: Callable[[], Any] | None = None
    times: list[int] = field(default_factory=list)
    peak_mib: float | None = None
    diff: float | None = None
    close: Callable[[], None] | None = None
    runtime: str = "segflow"    # the pause between runtimes applies when this changes
    precision: str | None = None
    check: OutputCheck | None = None


Progress = Callable[[str, float], None]


def _prepare(source: ModelSource, feeds: Mapping[str, np.ndarray],
             settings: BenchSettings, device: Device, dims: Mapping[str, int]
             ) -> list[_Live]:
    import segflow

    live: list[_Live] = []
    for mode in settings.modes:
        spec = MODES[mode]
        try:
            sess = segflow.InferenceSession(source.model, device=device, bulk=spec.bulk,
                                            engine=spec.engine, dims=dims)
        except Exception as exc:  # noqa: BLE001 - reported per variant, others still run
            live.append(_Live(mode, VariantKind.SEGFLOW, None, "error",
                              f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue

        def run(sess: segflow.InferenceSession = sess) -> list[np.ndarray]:
            return sess.run(None, feeds)

        def stats_of(sess: segflow.InferenceSession = sess) -> Any:
            return sess.last_run_stats

        live.append(_Live(mode, VariantKind.SEGFLOW, run, detail=spec.doc, stats_of=stats_of,
                          close=sess.close))
    if settings.counters_only:
        return live
    for peer in settings.peers:
        try:
            runner = prepare_peer(peer, source, feeds, device)
        except PeerUnavailable as exc:
            live.append(_Live(peer, VariantKind.PEER, None, "missing", str(exc), runtime=peer))
            continue
        live.append(_Live(peer, VariantKind.PEER, runner.run,
                          detail=f"{runner.detail} ({peer} {runner.version})",
                          settings=dict(runner.settings) or None, runtime=peer,
                          precision=runner.precision))
    return live


def _first_run(variant: _Live, reference: list[np.ndarray] | None) -> list[np.ndarray] | None:
    """Run once; record counters (segflow) and the output difference to the reference."""
    assert variant.run is not None
    try:
        outputs = variant.run()
    except Exception as exc:  # noqa: BLE001
        variant.status, variant.detail = "error", f"{type(exc).__name__}: {str(exc)[:200]}"
        return None
    if variant.stats_of is not None:
        stats = variant.stats_of()
        variant.counters = stats.counters()
        variant.settings = {"engine": stats.engine, **stats.settings}
    if reference is not None:
        variant.diff = _max_abs_diff(reference, outputs)
    return outputs


def _max_abs_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return math.inf
        if x.size:
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
    return worst


def _timed_rounds(active: list[_Live], settings: BenchSettings,
                  tick: Callable[[float], None]) -> int:
    for _ in range(settings.warmup):
        for v in active:
            assert v.run is not None
            v.run()
        tick(0.0)
    start = time.perf_counter()
    rounds = 0
    clock = time.perf_counter_ns
    # Every variant has run before timing starts (first run, memory probe, warm-up), the
    # last of them last.
    previous: _Live | None = active[-1] if active else None
    while True:
        if settings.runs is not None:
            if rounds >= settings.runs:
                break
        elif rounds >= settings.min_runs and time.perf_counter() - start >= settings.seconds:
            break
        shift = rounds % len(active)
        for v in active[shift:] + active[:shift]:
            assert v.run is not None
            if previous is not None and previous is not v:
                if previous.runtime != v.runtime:
                    time.sleep(settings.settle_s)
                v.run()         # untimed: the first call after another variant's (or an
                                # idle gap) finds the caches (or the cores) cold
            t0 = clock()
            v.run()
            v.times.append(clock() - t0)
            previous = v
        rounds += 1
        done = rounds / settings.runs if settings.runs else \
            (time.perf_counter() - start) / settings.seconds
        tick(min(done, 1.0))
    return rounds


def _check_peers(live: list[_Live], outputs: Mapping[str, list[np.ndarray]]) -> None:
    """Check every peer but onnxruntime against onnxruntime's outputs (the first segflow
    mode's when onnxruntime did not run): a peer that computes something else must not
    be timed as if it computed the same."""
    against = "onnxruntime" if "onnxruntime" in outputs else next(
        (v.name for v in live if v.kind is VariantKind.SEGFLOW and v.name in outputs), None)
    if against is None:
        return
    for v in live:
        if v.kind is VariantKind.PEER and v.name != against and v.name in outputs:
            v.check = OutputCheck.of(outputs[v.name], outputs[against], against)


def _paired_ratio(a: Sequence[int], b: Sequence[int]) -> float:
    return float(np.median(np.asarray(a, np.float64) / np.asarray(b, np.float64)))


def bench_model(spec: ModelSpec, settings: BenchSettings,
                progress: Progress | None = None) -> ModelResult:
    """Benchmark one model under every mode and peer of ``settings``."""
    device = Device.parse(settings.device)
    say = progress or (lambda text, fraction: None)
    t_setup = time.perf_counter()
    say(f"{spec.label}: building", 0.0)
    source, loaded = _load(spec, settings)
    feeds = loaded.arrays
    say(f"{spec.label}: preparing sessions and peers", 0.05)
    live = _prepare(source, feeds, settings, device, loaded.dims)
    try:
        reference_out: list[np.ndarray] | None = None
        first_out: dict[str, list[np.ndarray]] = {}
        for v in live:
            if v.status == "ok":
                out = _first_run(v, reference_out)
                if out is not None:
                    first_out[v.name] = out
                if reference_out is None and out is not None:
                    reference_out = out
        _check_peers(live, first_out)
        del first_out
        active = [v for v in live if v.status == "ok"]
        setup_s = time.perf_counter() - t_setup
        t_bench = time.perf_counter()
        rounds = 0
        if not settings.counters_only and active:
            for v in active:
                assert v.run is not None
                v.peak_mib = peak_extra_mib(v.run, device)
            say(f"{spec.label}: timing {len(active)} variants", 0.15)
            rounds = _timed_rounds(
                active, settings,
                lambda f: say(f"{spec.label}: timing {len(active)} variants", 0.15 + 0.85 * f))
    finally:
        for v in live:
            if v.close is not None:
                v.close()
    say(f"{spec.label}: done", 1.0)
    return replace(_result(spec, source, feeds, settings, live, rounds, setup_s,
                           time.perf_counter() - t_bench), guess_note=loaded.note() or "")


def _result(spec: ModelSpec, source: ModelSource, feeds: Mapping[str, np.ndarray],
            settings: BenchSettings, live: list[_Live], rounds: int, setup_s: float,
            bench_s: float) -> ModelResult:
    timed = [v for v in live if v.status == "ok" and v.times]
    segflow_timed = [v for v in timed if v.kind is VariantKind.SEGFLOW]
    ref = segflow_timed[0] if segflow_timed else None
    ratios: dict[str, float] = {}
    for i, a in enumerate(segflow_timed):
        others = segflow_timed[i + 1:] + [v for v in timed if v.kind is VariantKind.PEER]
        for b in others:
            ratios[f"{a.name}/{b.name}"] = _paired_ratio(a.times, b.times)
    variants = tuple(
        VariantResult(
            name=v.name, kind=v.kind, status=v.status, detail=v.detail, counters=v.counters,
            settings=v.settings,
            latency=LatencyStats.of(v.times, settings.batch_size) if v.times else None,
            relative=_paired_ratio(v.times, ref.times) if ref is not None and v.times else None,
            peak_memory_mib=v.peak_mib, max_abs_diff=v.diff, precision=v.precision,
            check=v.check)
        for v in live)
    return ModelResult(
        model=spec.label, source=spec.path or f"builtin:{spec.builtin}",
        shapes={k: list(np.shape(a)) for k, a in feeds.items()},
        batch_size=settings.batch_size, device=str(Device.parse(settings.device)),
        reference=ref.name if ref is not None else "", variants=variants, ratios=ratios,
        rounds=rounds, setup_s=setup_s, bench_s=bench_s)


def run_benchmark(specs: Sequence[ModelSpec], settings: BenchSettings,
                  progress: Progress | None = None) -> list[ModelResult]:
    """Benchmark every model in turn; ``progress(text, fraction_of_all)`` reports along."""
    settings.validate()
    results = []
    for i, spec in enumerate(specs):
        def report(text: str, fraction: float, i: int = i) -> None:
            if progress is not None:
                progress(text, (i + fraction) / len(specs))
        results.append(bench_model(spec, settings, report))
    return results


# -- records -----------------------------------------------------------------------------
def versions() -> dict[str, str]:
    import torch

    import segflow

    out = {"segflow": segflow.__version__, "python": sys.version.split()[0],
           "torch": torch.__version__, "onnx": onnx.__version__, "numpy": np.__version__}
    try:
        import onnxruntime

        out["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    openvino = sys.modules.get("openvino")   # imported by an openvino peer, if one ran
    if openvino is not None:
        out["openvino"] = openvino.__version__
    return out


def machine() -> dict[str, Any]:
    import os

    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.machine(),
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i)
                                for i in range(torch.cuda.device_count())]
    return info


def _variant_dict(v: VariantResult) -> dict[str, Any]:
    d = asdict(v)
    d["kind"] = v.kind.value
    return d


def to_record(results: Sequence[ModelResult], settings: BenchSettings) -> dict[str, Any]:
    """The machine-readable record written by ``--json`` and ``--save-baseline``."""
    device = Device.parse(settings.device)
    return {
        "schema": RECORD_SCHEMA,
        "kind": "segflow-bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions(),
        "machine": machine(),
        "settings": {**asdict(settings), "memory": memory_kind(device)},
        "models": [
            {**{k: v for k, v in asdict(r).items() if k != "variants"},
             "variants": [_variant_dict(v) for v in r.variants]}
            for r in results
        ],
    }
