"""Latency of the corpus's models: segflow, onnxruntime, OpenVINO and torch eager.

Per model, batch 1 (text models at their ``bench_seq``): each runtime is loaded and
run once (cold start: load + first run; torch eager's is its first run, the module
being built already), then timed in rounds. A round runs every runtime
``per_round`` times, in an order that rotates per round, with an untimed pause
between runtimes (onnxruntime's and OpenVINO's worker threads spin for tens of ms
after a run and would share the cores with whatever runs next). A runtime's latency
is the median over rounds of its per-round median; a ratio is the median over
rounds of segflow's per-round median over the peer's.

OpenVINO runs float32: ``INFERENCE_PRECISION_HINT`` is ``f32`` (its CPU plugin runs
float32 models in bfloat16 by default on CPUs with AVX512_BF16). The peers here are
local to the corpus on purpose; ``segflow bench`` has its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from _corpus_build import Entry, one_line
from _corpus_models import MODELS, Built

RUNTIMES = ("segflow", "onnxruntime", "openvino", "torch")
PEERS = RUNTIMES[1:]


@dataclass
class Runner:
    name: str
    run: Callable[[], object]
    cold_s: float             # load + first run
    settle: bool = False      # owns a spinning thread pool: pause after its calls


@dataclass
class BenchRow:
    label: str
    onnx_nodes: int = 0
    segflow_nodes: int | None = None
    latency_ms: dict[str, float] = field(default_factory=dict)
    cold_ms: dict[str, float] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)   # segflow / peer
    missing: dict[str, str] = field(default_factory=dict)   # runtime -> why not measured


def _segflow(path: str, feeds: Mapping[str, np.ndarray],
             optimize: Mapping[str, bool] | None = None) -> tuple[Runner, int]:
    import segflow

    start = time.perf_counter()
    sess = segflow.InferenceSession(path, optimize=optimize)
    sess.run(None, feeds)
    cold = time.perf_counter() - start
    # The nodes of the plan the runs take: the one specialized for the feeds' shapes
    # where the session made one.
    ran = next(iter(sess.specializations.values()), sess)
    return Runner("segflow", lambda: sess.run(None, feeds), cold), ran.plan.compute_nodes


def _onnxruntime(path: str, feeds: Mapping[str, np.ndarray], threads: int = 0) -> Runner:
    import onnxruntime as ort

    start = time.perf_counter()
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    cold = time.perf_counter() - start
    return Runner("onnxruntime", lambda: sess.run(None, feeds), cold, settle=True)


def _openvino(path: str, feeds: Mapping[str, np.ndarray]) -> Runner:
    import openvino as ov

    start = time.perf_counter()
    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    request.infer(dict(feeds))
    cold = time.perf_counter() - start
    precision = str(compiled.get_property("INFERENCE_PRECISION_HINT"))   # <Type: 'float32'>
    if "f32" not in precision and "float32" not in precision:
        raise RuntimeError(f"OpenVINO compiled at {precision}, not f32")
    return Runner("openvino", lambda: request.infer(dict(feeds)), cold, settle=True)


def _torch(built: Built, feeds: Mapping[str, np.ndarray]) -> Runner:
    args = [torch.from_numpy(feeds[s.name]) for s in built.inputs]
    module = built.module.eval()

    def run() -> object:
        with torch.inference_mode():
            return module(*args)

    start = time.perf_counter()
    run()
    return Runner("torch", run, time.perf_counter() - start)


def bench_entry(entry: Entry, built: Built, seconds: float, per_round: int = 3,
                settle_s: float = 0.1, runtimes: Sequence[str] = RUNTIMES,
                optimize: Mapping[str, bool] | None = None, ort_threads: int = 0) -> BenchRow:
    """``optimize``: segflow's pass switches (None: its defaults); ``ort_threads``:
    onnxruntime's intra-op threads (0: its default)."""
    row = BenchRow(entry.id.label, onnx_nodes=entry.nodes)
    if entry.path is None:
        row.missing = {r: f"no export: {entry.failure}" for r in runtimes}
        return row
    model = MODELS[entry.id.model]
    feeds = model.feeds(built, 1, model.bench_seq)
    runners: list[Runner] = []
    for name in runtimes:
        try:
            if name == "segflow":
                runner, row.segflow_nodes = _segflow(entry.path, feeds, optimize)
            elif name == "onnxruntime":
                runner = _onnxruntime(entry.path, feeds, ort_threads)
            elif name == "openvino":
                runner = _openvino(entry.path, feeds)
            else:
                runner = _torch(built, feeds)
        except Exception as exc:  # noqa: BLE001 - a runtime that cannot run is a cell
            row.missing[name] = one_line(exc)
            continue
        runners.append(runner)
        row.cold_ms[name] = runner.cold_s * 1e3
        time.sleep(settle_s)
    if not runners:
        return row
    for runner in runners:   # warm up
        runner.run()
        time.sleep(settle_s if runner.settle else 0.0)
    one = max(statistics.median(_time(r, 1)) for r in runners)
    rounds = max(3, int(seconds / max(one * per_round * len(runners), 1e-3)))
    medians: dict[str, list[float]] = {r.name: [] for r in runners}
    for i in range(rounds):
        order = runners[i % len(runners):] + runners[:i % len(runners)]
        for runner in order:
            medians[runner.name].append(statistics.median(_time(runner, per_round)))
            time.sleep(settle_s)
    row.latency_ms = {k: statistics.median(v) * 1e3 for k, v in medians.items()}
    if "segflow" in medians:
        ours = medians["segflow"]
        for peer in PEERS:
            if peer in medians:
                row.ratio[peer] = statistics.median(a / b for a, b in zip(ours, medians[peer]))
    return row


def _time(runner: Runner, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        runner.run()
        times.append(time.perf_counter() - start)
    return times


def geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def format_rows(rows: Sequence[BenchRow], runtimes: Sequence[str] = RUNTIMES) -> str:
    peers = [p for p in PEERS if p in runtimes]
    cols = [f"{r[:4]} ms" for r in runtimes] + [f"cold {r[:4]}" for r in runtimes] + \
           [f"sf/{p[:4]}" for p in peers]
    header = f"| {'model':<34} | nodes onnx→sf | " + " | ".join(f"{c:>9}" for c in cols) + " |"
    lines = [header, "|" + "|".join("-" * (len(c) + 2) for c in header.split("|")[1:-1]) + "|"]

    def cell(d: Mapping[str, float], k: str, fmt: str) -> str:
        return f"{d[k]:{fmt}}" if k in d else "—"

    for r in rows:
        nodes = f"{r.onnx_nodes}→{r.segflow_nodes if r.segflow_nodes is not None else '—'}"
        cells = [cell(r.latency_ms, k, ".1f") for k in runtimes] + \
                [cell(r.cold_ms, k, ".0f") for k in runtimes] + \
                [cell(r.ratio, p, ".2f") for p in peers]
        lines.append(f"| {r.label:<34} | {nodes:>13} | " +
                     " | ".join(f"{c:>9}" for c in cells) + " |")
    means = [geomean([r.ratio[p] for r in rows if p in r.ratio]) for p in peers]
    blank = ["" for _ in range(2 * len(runtimes))]
    lines.append(f"| {'geometric mean':<34} | {'':>13} | " +
                 " | ".join(f"{c:>9}" for c in blank + [f"{m:.2f}" for m in means]) + " |")
    notes = [f"{r.label}: {k} not measured: {why}" for r in rows for k, why in r.missing.items()]
    return "\n".join(lines + notes)
