"""GPU check: every built-in model correct on CUDA, then syncs, launches and device busy time.

Usage (from the source tree; installs nothing)::

    PYTHONPATH=src python benchmarks/gpu_check.py                 # CUDA machine, < 8 minutes
    PYTHONPATH=src python benchmarks/gpu_check.py --dry-run       # tiny sizes on the CPU

Stage 1 runs every model of ``segflow.models.available()`` through segflow on
the device (bulk, ``sync_mode="event"``, then with CUDA graphs after capture)
and compares with onnxruntime (its CUDA provider when it has one, else CPU).

Stage 2 benchmarks ResNet-50 at batch 1 and 32, BERT-base at batch 1 and the
tiny-layer MLP chain in the modes nobulk/stream, bulk/stream, bulk/event and
bulk/event+graphs (also with the threaded engine, with device-resident I/O,
and pipelined: two runs in flight through ``run_async``), against onnxruntime
CUDA (with and without its ``enable_cuda_graph``), PyTorch eager and PyTorch
with the whole model captured as one CUDA graph (``torch+graph``: a floor over
the same kernels). Every other row is measured the same way: numpy inputs in,
numpy outputs out, one inference at a time. Per row: latency p50/p90,
segflow's sync counter, and from one ``torch.profiler`` pass (CUDA only): host
synchronizations and launches seen by CUPTI, device kernels, and device busy
fraction = kernel+copy time per run (union over streams) / p50.

One table goes to stdout; the full record to ``$OUT/gpu_check.json`` (or
``--json``). Exit status 1 when a correctness check fails; with
``--strict-targets`` also 2 when a performance target is missed.

The dry run (``--dry-run``, implies ``--device cpu``) uses tiny model sizes,
few iterations and segflow's fake stream backend, so the CUDA accounting
(syncs per mode) is exercised on any machine; device metrics read "n/a".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import onnx
import torch

import segflow
from segflow import models
from segflow.engine.streams import FakeBackend
from segflow.profiler.cuda import device_activity

Feeds = dict[str, np.ndarray]
RunFn = Callable[[], list[np.ndarray]]

# -- what runs --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mode:
    """A segflow configuration benchmarked as one row."""

    name: str
    bulk: bool
    sync_mode: str
    cuda_graphs: bool
    engine: str | None = None  # None: the session default (SEGFLOW_ENGINE, else auto)
    device_io: bool = False    # feeds already on the device, outputs left there (run_tensors)
    pipelined: bool = False    # run_async: the next run is launched before this one's wait


MODES = (
    Mode("nobulk/stream", False, "stream", False),
    Mode("bulk/stream", True, "stream", False),
    Mode("bulk/event", True, "event", False),
    Mode("bulk/event+graphs", True, "event", True),
    Mode("bulk/event+graphs/threaded", True, "event", True, "threaded"),
    Mode("bulk/event+graphs/device-io", True, "event", True, device_io=True),
    Mode("bulk/event+graphs/pipelined", True, "event", True, pipelined=True),
)
PEERS = ("ort", "ort+graph", "torch", "torch+graph")


@dataclass(frozen=True, slots=True)
class Workload:
    key: str
    model: str
    batch: int
    warmup: int
    iters: int
    options: Mapping[str, int] = field(default_factory=dict)


GPU_WORKLOADS = (
    Workload("resnet50_b1", "resnet50", 1, 20, 200),
    Workload("resnet50_b32", "resnet50", 32, 5, 40),
    Workload("bert_base_b1", "bert_base", 1, 10, 100),
    Workload("mlp_chain_b1", "mlp_chain", 1, 20, 200),
)

_TINY_IMAGE = {"image_size": 32, "num_classes": 10}
_TINY_BERT = {"seq_len": 16, "layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 100,
              "max_positions": 32}
DRY_OPTIONS: Mapping[str, Mapping[str, int]] = {
    "resnet50": _TINY_IMAGE, "resnet18": _TINY_IMAGE, "mobilenet_v2": _TINY_IMAGE,
    "bert_base": _TINY_BERT, "bert_tiny": _TINY_BERT, "mlp_chain": {"layers": 8, "width": 16},
}
DRY_WORKLOADS = (
    Workload("resnet50_b1", "resnet50", 1, 1, 3, _TINY_IMAGE),
    Workload("resnet50_b32", "resnet50", 2, 1, 2, _TINY_IMAGE),
    Workload("bert_base_b1", "bert_base", 1, 1, 3, _TINY_BERT),
    Workload("mlp_chain_b1", "mlp_chain", 1, 1, 3, {"layers": 8, "width": 16}),
)


@dataclass(slots=True)
class Config:
    device: str
    dry_run: bool
    correctness_models: list[str]
    workloads: list[Workload]
    modes: list[Mode]
    peers: list[str]
    budget_s: float
    profile_runs: int
    fake_streams: bool
    json_path: str | None
    strict_targets: bool
    tolerance: float


# -- helpers ---------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget: later stages are skipped (and reported) once it runs out."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


def log(text: str) -> None:
    print(text, flush=True)


def rel_error(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    """max |got - want| / max |want| over all outputs (inf on a shape mismatch)."""
    worst = 0.0
    for a, b in zip(got, want):
        if isinstance(a, torch.Tensor):  # a device-io row's output
            a = a.detach().cpu().numpy()
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return float("inf")
        if a.size == 0:
            continue
        scale = max(float(np.abs(b).max()), 1e-6)
        worst = max(worst, float(np.abs(a - b).max()) / scale)
    if len(got) != len(want):
        return float("inf")
    return worst


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class ModelCache:
    """Each (model, options) built once: bert_base's weights take seconds to draw."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, tuple[tuple[str, int], ...]], onnx.ModelProto] = {}

    def get(self, name: str, options: Mapping[str, int]) -> onnx.ModelProto:
        key = (name, tuple(sorted(options.items())))
        if key not in self._models:
            self._models[key] = models.build(name, **options)
        return self._models[key]


# -- runners --------------------------------------------------------------------------------


def segflow_runner(model: onnx.ModelProto, feeds: Feeds, mode: Mode, cfg: Config
                   ) -> tuple[RunFn, segflow.InferenceSession]:
    backend = FakeBackend() if cfg.fake_streams else None
    sess = segflow.InferenceSession(model, device=cfg.device, bulk=mode.bulk,
                                    engine=mode.engine, sync_mode=mode.sync_mode,
                                    cuda_graphs=mode.cuda_graphs, stream_backend=backend)
    if mode.pipelined:
        # Two runs in flight: each call launches one and waits for the one before, so
        # p50 is the interval between results and busy is the device's share of it.
        in_flight: list[segflow.PendingRun] = []

        def pipelined() -> list[np.ndarray]:
            in_flight.append(sess.run_async(None, feeds))
            return (in_flight.pop(0) if len(in_flight) > 1 else in_flight[0]).result()
        return pipelined, sess
    if mode.device_io:
        on_device = {k: torch.from_numpy(v).to(cfg.device) for k, v in feeds.items()}
        return (lambda: sess.run_tensors(on_device)), sess  # type: ignore[return-value]
    return (lambda: sess.run(None, feeds)), sess


def ort_providers(cfg: Config, graph: bool) -> list[Any]:
    if cfg.device.startswith("cuda"):
        index = int(cfg.device.partition(":")[2] or 0)
        options: dict[str, Any] = {"device_id": index, "use_tf32": 0}
        if graph:
            options["enable_cuda_graph"] = 1
        return [("CUDAExecutionProvider", options)]
    return ["CPUExecutionProvider"]


def ort_session(model: onnx.ModelProto, cfg: Config, graph: bool = False) -> Any:
    import onnxruntime as ort

    data = model.SerializeToString()
    providers = ort_providers(cfg, graph)
    try:
        sess = ort.InferenceSession(data, providers=providers)
    except Exception:  # noqa: BLE001 - older versions reject use_tf32: retry without it
        if isinstance(providers[0], tuple):
            providers[0][1].pop("use_tf32", None)
        sess = ort.InferenceSession(data, providers=providers)
    wanted = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
    if sess.get_providers()[0] != wanted:
        raise RuntimeError(f"onnxruntime fell back to {sess.get_providers()[0]}")
    return sess


def ort_cuda_available() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def ort_runner(model: onnx.ModelProto, feeds: Feeds, cfg: Config) -> RunFn:
    sess = ort_session(model, cfg)
    return lambda: list(sess.run(None, feeds))


def ort_graph_runner(model: onnx.ModelProto, feeds: Feeds, cfg: Config,
                     reference: Sequence[np.ndarray]) -> RunFn:
    """onnxruntime's CUDA graph: inputs and outputs bound to fixed device buffers."""
    import onnxruntime as ort

    sess = ort_session(model, cfg, graph=True)
    index = int(cfg.device.partition(":")[2] or 0)
    binding = sess.io_binding()
    inputs = {}
    for name, array in feeds.items():
        inputs[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), "cuda",
                                                        index)
        binding.bind_ortvalue_input(name, inputs[name])
    outputs = []
    for meta, ref in zip(sess.get_outputs(), reference):
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(ref.shape), ref.dtype, "cuda",
                                                          index)
        binding.bind_ortvalue_output(meta.name, value)
        outputs.append(value)

    def run() -> list[np.ndarray]:
        for name, array in feeds.items():
            inputs[name].update_inplace(np.ascontiguousarray(array))
        sess.run_with_iobinding(binding)
        return [value.numpy() for value in outputs]
    return run


def torch_runner(name: str, options: Mapping[str, int], feeds: Feeds, cfg: Config) -> RunFn:
    device = torch.device(cfg.device)
    module = models.torch_module(name, **options).eval().to(device)

    def run() -> list[np.ndarray]:
        with torch.inference_mode():
            tensors = {k: torch.from_numpy(v).to(device) for k, v in feeds.items()}
            out = module(**tensors)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return [t.cpu().numpy() for t in outs]
    return run


def torch_graph_runner(name: str, options: Mapping[str, int], feeds: Feeds, cfg: Config
                       ) -> RunFn:
    """PyTorch with the whole model captured as one CUDA graph: static device inputs
    filled from pinned host buffers, one replay, outputs copied back (a floor for
    what any runtime over the same kernels can reach)."""
    device = torch.device(cfg.device)
    module = models.torch_module(name, **options).eval().to(device)
    pinned = {k: torch.from_numpy(np.ascontiguousarray(v)).pin_memory()
              for k, v in feeds.items()}
    static = {k: t.to(device) for k, t in pinned.items()}
    side = torch.cuda.Stream(device)
    with torch.inference_mode():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):  # lazy initialisation stays out of the capture
                module(**static)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module(**static)
    outs = out if isinstance(out, (tuple, list)) else (out,)

    def run() -> list[np.ndarray]:
        for k, v in feeds.items():
            pinned[k].copy_(torch.from_numpy(v))
            static[k].copy_(pinned[k], non_blocking=True)
        graph.replay()
        return [t.cpu().numpy() for t in outs]
    return run


# -- stage 1: correctness --------------------------------------------------------------


def reference_outputs(model: onnx.ModelProto, feeds: Feeds, cfg: Config
                      ) -> tuple[list[np.ndarray], str]:
    """onnxruntime's outputs: its CUDA provider when present, else its CPU provider."""
    if cfg.device.startswith("cuda") and ort_cuda_available():
        try:
            return list(ort_session(model, cfg).run(None, feeds)), "onnxruntime-cuda"
        except Exception as exc:  # noqa: BLE001
            log(f"    onnxruntime CUDA failed ({_error(exc)}); using its CPU provider")
    cpu = replace(cfg, device="cpu")
    return list(ort_session(model, cpu).run(None, feeds)), "onnxruntime-cpu"


def check_model(name: str, cache: ModelCache, cfg: Config) -> dict[str, Any]:
    options = dict(DRY_OPTIONS.get(name, {})) if cfg.dry_run else {}
    record: dict[str, Any] = {"model": name, "options": options}
    try:
        model = cache.get(name, options)
        feeds = models.example_inputs(name, batch_size=1, **options)
        want, record["reference"] = reference_outputs(model, feeds, cfg)
        for mode in (Mode("bulk/event", True, "event", False),
                     Mode("bulk/event+graphs", True, "event", True)):
            run, sess = segflow_runner(model, feeds, mode, cfg)
            got = [run() for _ in range(3)][-1]  # graphs: warm-up, capture, replay
            err = rel_error(got, want)
            stats = sess.last_run_stats
            record[mode.name] = {"rel_error": err, "ok": err <= cfg.tolerance,
                                 "syncs": stats.syncs if stats else None,
                                 "explain_graphs": [line.strip() for line in
                                                    sess.explain().splitlines()
                                                    if line.startswith("  segment")]}
            sess.close()
        record["ok"] = all(record[m]["ok"] for m in ("bulk/event", "bulk/event+graphs"))
    except Exception as exc:  # noqa: BLE001 - reported per model, the check goes on
        record["ok"] = False
        record["error"] = _error(exc)
        record["traceback"] = traceback.format_exc(limit=8)
    _free()
    return record


# -- stage 2: benchmarks ----------------------------------------------------------------


def timed(fn: RunFn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(label: str, fn: RunFn, work: Workload, cfg: Config,
            reference: Sequence[np.ndarray] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": work.key, "mode": label}
    first = fn()
    if reference is not None:
        row["rel_error"] = rel_error(first, reference)
    times = timed(fn, work.warmup, work.iters)
    row["p50_ms"] = 1e3 * statistics.median(times)
    row["p90_ms"] = 1e3 * float(np.percentile(times, 90))
    row["mean_ms"] = 1e3 * statistics.fmean(times)
    row["iters"] = len(times)
    if cfg.device.startswith("cuda") and cfg.profile_runs > 0:
        try:
            metrics = device_activity(fn, cfg.profile_runs)
            row.update(asdict(metrics))
            busy = metrics.busy_us / (row["p50_ms"] * 1e3)
            row["busy"] = min(busy, 1.0) if metrics.kernels > 0 else None
        except Exception as exc:  # noqa: BLE001 - metrics are optional
            row["profile_error"] = _error(exc)
    return row


def bench_workload(work: Workload, cache: ModelCache, cfg: Config, budget: Budget
                   ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    model = cache.get(work.model, work.options)
    feeds = models.example_inputs(work.model, batch_size=work.batch, **work.options)
    reference, _ = reference_outputs(model, feeds, cfg)
    for mode in cfg.modes:
        if budget.left() < 20:
            rows.append({"workload": work.key, "mode": mode.name, "skipped": "time budget"})
            continue
        try:
            fn, sess = segflow_runner(model, feeds, mode, cfg)
            row = measure(mode.name, fn, work, cfg, reference)
            stats = sess.last_run_stats
            assert stats is not None
            row.update(kind="segflow", syncs=stats.syncs, pushes=stats.pushes,
                       segments=stats.segments, compute_nodes=stats.nodes,
                       settings=stats.settings,
                       graphs=[line.strip() for line in sess.explain().splitlines()
                               if line.startswith(("cuda graphs", "  segment", "sync mode"))])
            sess.close()
        except Exception as exc:  # noqa: BLE001
            row = {"workload": work.key, "mode": mode.name, "error": _error(exc),
                   "traceback": traceback.format_exc(limit=8)}
        rows.append(row)
        log(_row_line(row))
        _free()
    for peer in cfg.peers:
        if budget.left() < 20:
            rows.append({"workload": work.key, "mode": peer, "skipped": "time budget"})
            continue
        try:
            fn = _peer(peer, work, model, feeds, reference, cfg)
            row = measure(peer, fn, work, cfg, reference)
            row["kind"] = "peer"
        except _Unavailable as exc:
            row = {"workload": work.key, "mode": peer, "unavailable": str(exc)}
        except Exception as exc:  # noqa: BLE001
            row = {"workload": work.key, "mode": peer, "unavailable": _error(exc)}
        rows.append(row)
        log(_row_line(row))
        _free()
    return rows


class _Unavailable(Exception):
    pass


def _peer(peer: str, work: Workload, model: onnx.ModelProto, feeds: Feeds,
          reference: Sequence[np.ndarray], cfg: Config) -> RunFn:
    cuda = cfg.device.startswith("cuda")
    if peer in ("ort", "ort+graph"):
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise _Unavailable("onnxruntime is not installed") from None
        if cuda and not ort_cuda_available():
            raise _Unavailable("onnxruntime has no CUDAExecutionProvider here")
        if peer == "ort":
            return ort_runner(model, feeds, cfg)
        if not cuda:
            raise _Unavailable("enable_cuda_graph needs the CUDA provider")
        return ort_graph_runner(model, feeds, cfg, reference)
    if peer == "torch":
        return torch_runner(work.model, work.options, feeds, cfg)
    if peer == "torch+graph":
        if not cuda:
            raise _Unavailable("CUDA graphs need a CUDA device")
        return torch_graph_runner(work.model, work.options, feeds, cfg)
    raise ValueError(f"unknown peer {peer!r}")


# -- report ----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _row_line(row: Mapping[str, Any]) -> str:
    if "error" in row:
        return f"  {row['workload']:<14} {row['mode']:<26} ERROR {row['error']}"
    if "unavailable" in row:
        return f"  {row['workload']:<14} {row['mode']:<26} unavailable: {row['unavailable']}"
    if "skipped" in row:
        return f"  {row['workload']:<14} {row['mode']:<26} skipped ({row['skipped']})"
    return (f"  {row['workload']:<14} {row['mode']:<26} p50 {row['p50_ms']:.3f} ms  "
            f"syncs {_fmt(row.get('syncs'))}  host-syncs {_fmt(row.get('host_syncs'), '.1f')}  "
            f"busy {_fmt(row.get('busy'), '.1%')}")


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each segflow row's p50 divided by each peer's p50 on the same workload."""
    peers = {(r["workload"], r["mode"]): r["p50_ms"] for r in rows
             if r.get("kind") == "peer" and "p50_ms" in r}
    for row in rows:
        if row.get("kind") != "segflow" or "p50_ms" not in row:
            continue
        for peer in PEERS:
            base = peers.get((row["workload"], peer))
            row[f"x_{peer}"] = row["p50_ms"] / base if base else None


HEADERS = ("workload", "mode", "p50 ms", "p90 ms", "syncs", "pushes", "host syncs*",
           "launches*", "kernels*", "busy*", "x ort", "x ort+graph", "x torch",
           "x torch+graph")


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    table = []
    for r in rows:
        if "p50_ms" not in r:
            reason = r.get("error") or r.get("unavailable") or r.get("skipped") or "?"
            table.append([r["workload"], r["mode"], f"-- {str(reason)[:70]}"])
            continue
        table.append([
            r["workload"], r["mode"], f"{r['p50_ms']:.3f}", f"{r['p90_ms']:.3f}",
            _fmt(r.get("syncs")), _fmt(r.get("pushes")), _fmt(r.get("host_syncs"), ".1f"),
            _fmt(r.get("launches"), ".1f"), _fmt(r.get("kernels"), ".1f"),
            _fmt(r.get("busy"), ".1%"), _fmt(r.get("x_ort"), ".2f"),
            _fmt(r.get("x_ort+graph"), ".2f"), _fmt(r.get("x_torch"), ".2f"),
            _fmt(r.get("x_torch+graph"), ".2f"),
        ])
    widths = [len(h) for h in HEADERS]
    for line in table:
        if len(line) == len(HEADERS):
            widths = [max(w, len(c)) for w, c in zip(widths, line)]
    out = ["  ".join(h.ljust(w) for h, w in zip(HEADERS, widths)),
           "  ".join("-" * w for w in widths)]
    for line in table:
        if len(line) == len(HEADERS):
            out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        else:
            out.append(f"{line[0].ljust(widths[0])}  {line[1].ljust(widths[1])}  {line[2]}")
    out.append("* from torch.profiler (CUPTI) over a separate profiled window, per run; "
               "busy = device kernel+copy time / p50")
    return "\n".join(out)


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    ok: bool | None  # None: could not be evaluated here
    detail: str


def evaluate_targets(rows: Sequence[Mapping[str, Any]], cuda: bool) -> list[Target]:
    """The issue's targets for ResNet-50 at batch 1 (timing targets only on CUDA)."""
    def get(mode: str) -> Mapping[str, Any]:
        return next((r for r in rows if r["workload"] == "resnet50_b1" and r["mode"] == mode
                     and "p50_ms" in r), {})

    graphs, event, nobulk = get("bulk/event+graphs"), get("bulk/event"), get("nobulk/stream")
    ort, torch_row = get("ort"), get("torch")
    targets = []
    syncs = graphs.get("syncs")
    targets.append(Target("graphs: syncs per inference == 1",
                          None if syncs is None else syncs == 1, f"counter {_fmt(syncs)}, "
                          f"measured {_fmt(graphs.get('host_syncs'), '.1f')}"))
    measured = graphs.get("host_syncs")
    targets.append(Target("graphs: measured host syncs per inference <= 1",
                          None if measured is None else measured <= 1.0 + 1e-9,
                          _fmt(measured, ".2f")))
    busy = graphs.get("busy")
    targets.append(Target("graphs: device busy >= 97%", None if busy is None else busy >= 0.97,
                          _fmt(busy, ".1%")))
    for mode, label in (("bulk/event+graphs/device-io", "device-resident I/O"),
                        ("bulk/event+graphs/pipelined", "two runs in flight")):
        other = get(mode).get("busy")
        targets.append(Target(f"graphs, {label}: device busy >= 97%",
                              None if other is None else other >= 0.97, _fmt(other, ".1%")))
    for peer_row, peer, bound in ((ort, "onnxruntime CUDA", 0.8), (torch_row, "torch eager", 0.7)):
        if not cuda or not graphs or not peer_row:
            missing = next((r for r in rows if r["workload"] == "resnet50_b1"
                            and r["mode"] == ("ort" if bound == 0.8 else "torch")), {})
            reason = ("timing targets need CUDA" if not cuda else
                      str(missing.get("unavailable") or missing.get("error") or "missing row"))
            targets.append(Target(f"graphs: latency <= {bound}x {peer}", None, reason))
            continue
        ratio = graphs["p50_ms"] / peer_row["p50_ms"]
        targets.append(Target(f"graphs: latency <= {bound}x {peer}", ratio <= bound,
                              f"{ratio:.2f}x"))
    nodes = nobulk.get("compute_nodes")
    ok = None
    if nobulk and event:
        # stream mode: one synchronize per compute node, plus the wait for the outputs.
        ok = nobulk.get("syncs") == nodes + 1 and event.get("syncs") == 1
    targets.append(Target("nobulk/stream syncs == compute nodes + 1, bulk/event == 1", ok,
                          f"{_fmt(nobulk.get('syncs'))} (nodes {_fmt(nodes)}) vs "
                          f"{_fmt(event.get('syncs'))}"))
    return targets


def environment(cfg: Config) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "numpy": np.__version__, "onnx": onnx.__version__,
        "device": cfg.device, "dry_run": cfg.dry_run, "fake_streams": cfg.fake_streams,
        "engine": os.environ.get("SEGFLOW_ENGINE", "auto (default: inline on one device)"),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    if cfg.device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(cfg.device))
    try:
        import onnxruntime as ort
        env["onnxruntime"] = ort.__version__
        env["onnxruntime_providers"] = ort.get_available_providers()
    except ImportError:
        env["onnxruntime"] = None
    return env


# -- main ----------------------------------------------------------------------------------


def write_record(record: Mapping[str, Any], cfg: Config) -> bool:
    if not cfg.json_path:
        return False
    os.makedirs(os.path.dirname(os.path.abspath(cfg.json_path)), exist_ok=True)
    with open(cfg.json_path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    return True


def parse_args(argv: Sequence[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None,
                        help="cuda:0 (default when CUDA is available) or cpu")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes, few iterations, CPU with fake streams")
    parser.add_argument("--models", default=None,
                        help="comma-separated models for the correctness stage (default: all)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated workload keys (default: all), e.g. resnet50_b1")
    parser.add_argument("--modes", default=None, help="comma-separated segflow modes")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="stop starting new rows after this many seconds")
    parser.add_argument("--profile-runs", type=int, default=10)
    parser.add_argument("--no-fake-streams", action="store_true",
                        help="on the CPU, run the host path instead of the fake stream backend")
    parser.add_argument("--json", default=None, help="where to write the JSON record "
                        "(default: $OUT/gpu_check.json when $OUT is set)")
    parser.add_argument("--strict-targets", action="store_true",
                        help="exit 2 when a performance target is missed")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max relative error vs onnxruntime (default 1e-3, TF32 off)")
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.dry_run or not torch.cuda.is_available()
                             else "cuda:0")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu or --dry-run")
    workloads = list(DRY_WORKLOADS if args.dry_run else GPU_WORKLOADS)
    if args.workloads:
        keys = set(args.workloads.split(","))
        workloads = [w for w in workloads if w.key in keys]
    modes = list(MODES)
    if args.modes:
        names = args.modes.split(",")
        modes = [m for m in MODES if m.name in names]
    json_path = args.json
    if json_path is None and os.environ.get("OUT"):
        json_path = os.path.join(os.environ["OUT"], "gpu_check.json")
    return Config(
        device=device, dry_run=args.dry_run,
        correctness_models=args.models.split(",") if args.models else models.available(),
        workloads=workloads, modes=modes,
        peers=[p for p in args.peers.split(",") if p], budget_s=args.budget_s,
        profile_runs=0 if args.dry_run else args.profile_runs,
        fake_streams=device == "cpu" and not args.no_fake_streams,
        json_path=json_path, strict_targets=args.strict_targets,
        tolerance=args.tolerance if args.tolerance is not None else 1e-3,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    budget = Budget(cfg.budget_s)
    warnings.simplefilter("ignore")
    # Exact fp32 everywhere (onnxruntime runs with use_tf32=0), so tolerances stay tight.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    record: dict[str, Any] = {"environment": environment(cfg), "correctness": [], "bench": []}
    log(f"segflow GPU check on {cfg.device}" + (" (dry run)" if cfg.dry_run else ""))
    log(json.dumps(record["environment"]))
    cache = ModelCache()

    log("\n== correctness vs onnxruntime ==")
    for name in cfg.correctness_models:
        result = check_model(name, cache, cfg)
        record["correctness"].append(result)
        if "error" in result:
            log(f"  {name:<14} FAIL  {result['error']}")
        else:
            log(f"  {name:<14} {'ok  ' if result['ok'] else 'FAIL'}  vs {result['reference']}: "
                f"event {result['bulk/event']['rel_error']:.2e}, graphs "
                f"{result['bulk/event+graphs']['rel_error']:.2e}")

    write_record(record, cfg)
    log("\n== benchmarks ==")
    for work in cfg.workloads:
        if budget.left() < 30:
            record["bench"].append({"workload": work.key, "mode": "*", "skipped": "time budget"})
            continue
        log(f"-- {work.key} ({work.model}, batch {work.batch})")
        try:
            record["bench"] += bench_workload(work, cache, cfg, budget)
        except Exception as exc:  # noqa: BLE001
            record["bench"].append({"workload": work.key, "mode": "*", "error": _error(exc)})
            log(f"  {work.key}: ERROR {_error(exc)}")
        _free()
        write_record(record, cfg)  # partial results survive a timeout
    add_ratios(record["bench"])

    log("\n" + format_table(record["bench"]))
    targets = evaluate_targets(record["bench"], cfg.device.startswith("cuda"))
    record["targets"] = [asdict(t) for t in targets]
    log("\n== targets (ResNet-50, batch 1) ==")
    for target in targets:
        status = {True: "PASS", False: "MISS", None: "n/a "}[target.ok]
        log(f"  {status}  {target.name}: {target.detail}")
    record["elapsed_s"] = budget.elapsed()
    failed = [r["model"] for r in record["correctness"] if not r["ok"]]
    record["correctness_failed"] = failed
    log(f"\ncorrectness: {len(record['correctness']) - len(failed)}/"
        f"{len(record['correctness'])} ok" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    log(f"elapsed {record['elapsed_s']:.0f} s")
    if write_record(record, cfg):
        log(f"wrote {cfg.json_path}")
    if failed:
        return 1
    if cfg.strict_targets and any(t.ok is False for t in targets):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
