"""The CPU target table: segflow against onnxruntime and PyTorch eager, interleaved.

Every runtime runs the same model in the same process, in rounds: each round
runs every runtime ``--per-round`` times (the order rotates per round), so
machine noise hits all of them alike. A ratio is the median over rounds of
(segflow median / peer median) within the round. Between the calls of a runtime
with its own thread pool (onnxruntime, OpenVINO) and another runtime's the script
pauses ``--settle`` seconds (0.1, untimed): onnxruntime's thread pool spins ~40 ms
after a run, and the runtime after it would otherwise share the cores with those
spinning workers.

OpenVINO, where it is installed, is an extra column (``--no-openvino`` leaves it
out): the ``openvino`` peer of ``segflow bench`` (float32, the latency hint,
segflow's thread count). The targets stay against onnxruntime and eager.

    python benchmarks/cpu_targets.py                       # the full table
    python benchmarks/cpu_targets.py --cases mlp_chain --rounds 30
    python benchmarks/cpu_targets.py --cases mlp_chain --variants "default;dense_chain=off"
    python benchmarks/cpu_targets.py --cases resnet50 --variants "default;compile=none;layout=off"
    python benchmarks/cpu_targets.py --cases mobilenet_v2 --variants "default;replay=off"
    python benchmarks/cpu_targets.py --cases mobilenet_v2 --variants "default;native=off"
    python benchmarks/cpu_targets.py --cases resnet50,resnet50@8 --variants "default;winograd=off"
    python benchmarks/cpu_targets.py --cases bert_base --variants "default;strassen=off"
    python benchmarks/cpu_targets.py --memory               # peak memory, ResNet-50 batch 1
                                                            # (RSS, and its private pages)
    python benchmarks/cpu_targets.py --memory --cases mobilenet_v2 --variants "default;compile=none"
    python benchmarks/cpu_targets.py --standalone           # each runtime in its own process

Peers: onnxruntime with default session options (CPU provider), torch eager
(``segflow.models.torch_module``) under ``torch.inference_mode``, and optionally
OpenVINO (``segflow.bench.peers``). segflow runs
with its defaults unless ``--variants`` says otherwise (``key=value`` pairs
joined by ``,``: ``compile``, ``engine``, ``threads``, pass switches
``fold_constants``/``fuse``/``dense_chain``/``layout``/``plan_memory`` = on|off,
``fuse.<rule>`` = on|off for one fuse rule (``fuse.batchnorm=off``),
``direct`` = on|off for convolutions through libdnnl or torch's oneDNN op,
``blocked`` = on|off for a depthwise region on nChw8c activations or NHWC, and
``arena`` = on|off for their outputs in a planned block per run or from malloc,
``replay`` = on|off for runs of direct kernels replayed from recorded addresses,
``native`` = on|off for native kernels: dense chains, the replay's C loop and
Winograd convolutions, ``winograd`` = on|off for stride-1 3x3 convolutions as
Winograd F(4x4,3x3) or libdnnl's direct convolution; unset, Winograd applies on
CPUs without AVX-512, and on AVX-512 ones to outputs of 32 or more 4x4 tiles an
image), ``native_linear`` = on|off for large linears through
segflow's packed kernel, ``strassen`` = on|off for that kernel as one level of
Strassen where the blocks allow it, ``native_stem`` = on|off for the convolution over
the NCHW image as segflow's kernel, reading it in place, or staged for libdnnl's).
The default (``compile=auto``) runs a small segment's inductor package when the
package cache (``SEGFLOW_CACHE_DIR``) already holds one, as after a
``compile=inductor`` variant has run; the case line then says "cached inductor
package", and ``compile=codegen`` measures without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Runner = Callable[[], object]
# Runtimes with their own thread pool: a pause (--settle) separates their calls from
# another runtime's. segflow and torch eager share one OpenMP pool.
OWN_POOLS = ("onnxruntime", "openvino")


@dataclass(frozen=True)
class Case:
    """One row of the table: a builder model at a batch size and its targets."""

    model: str
    batch: int = 1
    options: Mapping[str, int] = field(default_factory=dict)
    target_ort: float | None = None     # segflow / onnxruntime must be <= this
    target_eager: float | None = None   # segflow / torch eager must be <= this

    @property
    def label(self) -> str:
        return f"{self.model}@{self.batch}"


CASES = {
    "resnet50": Case("resnet50", 1, target_ort=1.0),
    "resnet50@8": Case("resnet50", 8, target_ort=1.0),
    "mobilenet_v2": Case("mobilenet_v2", 1, target_ort=1.0),
    "bert_base": Case("bert_base", 1, {"seq_len": 128}, target_ort=1.0),
    "mlp_chain": Case("mlp_chain", 1, target_eager=0.5),
}


def _segflow_kwargs(variant: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Session keyword arguments, and environment variables to set while it is made."""
    kwargs: dict[str, Any] = {}
    env: dict[str, str] = {}
    passes: dict[str, bool] = {}
    for item in filter(None, (p.strip() for p in variant.split(","))):
        if item == "default":
            continue
        key, _, value = item.partition("=")
        if key in ("fold_constants", "fuse", "dense_chain", "layout", "plan_memory") \
                or key.startswith("fuse."):   # a pass, or one fuse rule (fuse.batchnorm)
            passes[key] = value not in ("off", "0", "false")
        elif key == "threads":
            kwargs["intra_op_threads"] = int(value)
        elif key in ("compile", "engine"):
            kwargs[key] = value
        elif key == "direct":  # convolutions through libdnnl (on) or torch's op (off)
            env["SEGFLOW_ONEDNN_DIRECT"] = "0" if value in ("off", "0", "false") else "1"
        elif key == "blocked":  # a depthwise region on nChw8c activations (on) or NHWC
            env["SEGFLOW_ONEDNN_BLOCKED"] = "0" if value in ("off", "0", "false") else "1"
        elif key == "arena":  # direct kernels write into a planned block (on) or malloc
            env["SEGFLOW_ARENA"] = "0" if value in ("off", "0", "false") else "1"
        elif key == "replay":  # runs of direct kernels replayed (on) or called one by one
            env["SEGFLOW_ONEDNN_REPLAY"] = "0" if value in ("off", "0", "false") else "1"
        elif key == "native":  # native kernels: dense chains, the replay's C loop (on) or not
            env["SEGFLOW_NATIVE"] = "0" if value in ("off", "0", "false") else "1"
        elif key == "winograd":  # 3x3 convolutions as Winograd F(4x4,3x3) (on) or direct
            env["SEGFLOW_WINOGRAD"] = "0" if value in ("off", "0", "false") else "1"
        elif key == "native_linear":  # large linears: segflow's packed kernel (on) or libdnnl
            env["SEGFLOW_NATIVE_LINEAR"] = "0" if value in ("off", "0", "false") else "1"
        elif key == "strassen":  # that kernel as one level of Strassen where it fits (on)
            env["SEGFLOW_STRASSEN"] = "0" if value in ("off", "0", "false") else "1"
        elif key == "native_stem":  # the stem convolution: segflow's kernel (on) or libdnnl's
            env["SEGFLOW_NATIVE_STEM"] = "0" if value in ("off", "0", "false") else "1"
        else:
            raise SystemExit(f"unknown variant key {key!r} in {variant!r}")
    if passes:
        kwargs["optimize"] = passes
    return kwargs, env


def _mib(n: Any) -> str:
    return f"{int(n) / (1 << 20):.1f} MiB"


def build_runners(case: Case, variants: list[str], openvino: bool = False
                  ) -> tuple[dict[str, Runner], dict[str, str]]:
    import onnxruntime as ort
    import torch

    import segflow
    from segflow import models

    build_opts = {k: v for k, v in case.options.items() if k != "seq_len"}
    model = models.build(case.model, **build_opts)
    feeds = models.example_inputs(case.model, batch_size=case.batch, **case.options)
    runners: dict[str, Runner] = {}
    notes: dict[str, str] = {}
    for variant in variants:
        kwargs, env = _segflow_kwargs(variant)
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            start = time.perf_counter()
            sess = segflow.InferenceSession(model, **kwargs)
            load = time.perf_counter() - start
        finally:
            for key, old in saved.items():
                if old is None:
                    del os.environ[key]
                else:
                    os.environ[key] = old
        name = "segflow" if variant == "default" else f"segflow[{variant}]"
        runners[name] = (lambda s=sess: s.run(None, feeds))
        report = sess.compile_report
        sess.run(None, feeds)  # the memory plan at this case's own sizes (RunStats)
        settings = sess.last_run_stats.settings
        plan = (f"memory plan at {settings.get('memory_plan_dims', 'static sizes')}: "
                f"planned {_mib(settings.get('memory_planned_peak_bytes', 0))} vs naive "
                f"{_mib(settings.get('memory_naive_bytes', 0))}")
        backend = report.backend
        if report.cache_hits and backend != "inductor":  # auto found packages (compile.py)
            backend += f" + {report.cache_hits} cached inductor package(s)"
        notes[name] = (f"load {load:.2f} s (compile {report.compile_time_s * 1e3:.0f} ms, "
                       f"backend {backend}); "
                       + "; ".join(line for line in sess.plan.pass_log
                                   if line.startswith("fuse") or (
                                       line.startswith("dense_chain") and "->" in line))
                       + "; " + plan
                       + ("; convolutions call libdnnl" if any(
                           "direct calls into" in line for line in sess.plan.pass_log) else ""))
    ort_sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    runners["onnxruntime"] = lambda: ort_sess.run(None, feeds)
    module = models.torch_module(case.model, **build_opts)
    tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}

    def eager() -> object:
        with torch.inference_mode():
            return module(**tensors)
    runners["torch"] = eager
    if openvino:
        from segflow.bench.peers import ModelSource, PeerUnavailable, prepare_peer
        from segflow.ir.types import Device

        try:
            peer = prepare_peer("openvino", ModelSource(model, case.model, build_opts), feeds,
                                Device.parse("cpu"))
        except PeerUnavailable as exc:
            notes["openvino"] = str(exc)
        else:
            runners["openvino"] = peer.run
            notes["openvino"] = f"{peer.detail}, {peer.version}"
    return runners, notes


def measure(runners: Mapping[str, Runner], rounds: int, per_round: int, warmup: int,
            settle: float = 0.0) -> dict[str, list[list[float]]]:
    """Per runtime, per round: the latencies (seconds) of ``per_round`` calls.

    ``settle`` seconds pass (untimed) between the calls of a runtime in ``OWN_POOLS``
    and another runtime's: onnxruntime's thread pool spins ~40 ms after a run (OpenVINO's
    ~1 ms, docs/performance.md), and whichever runtime
    follows would share the cores with it (segflow's ResNet-50 batch-1 run took
    88-95 ms instead of 50 right after one). Whenever the runtime changes, the next
    one runs once untimed: a call right after an idle gap can run slow while the
    cores come back (segflow's MobileNetV2 took 15-17 ms for the first calls
    after a 0.1 s sleep, 13.6 from the fifth on), and the first call after another
    runtime's finds its weights gone from the caches. Until 2026-12-06 only the
    changes to and from onnxruntime had that call, so onnxruntime never had a
    first call timed and segflow did in two rounds of three (after eager's calls):
    on a 2-core AVX-512 VM that alone put MobileNetV2 at 1.06-1.14x onnxruntime
    where 10 calls a round read 1.02.
    """
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            runners[name]()
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    clock = time.perf_counter
    previous = names[-1]
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            run = runners[name]
            if name != previous:
                if settle and (name in OWN_POOLS or previous in OWN_POOLS):
                    time.sleep(settle)
                run()        # untimed: the first call after another runtime's, or after
                             # an idle gap, finds the caches (or the cores) cold
            previous = name
            times = []
            for _ in range(per_round):
                t0 = clock()
                run()
                times.append(clock() - t0)
            samples[name].append(times)
    return samples


def round_ratios(samples: dict[str, list[list[float]]], a: str, b: str) -> list[float]:
    """Per round: median of a / median of b within the round."""
    return [statistics.median(x) / statistics.median(y) for x, y in zip(samples[a], samples[b])]


def ratio(samples: dict[str, list[list[float]]], a: str, b: str) -> float:
    """Median over rounds of (median of a / median of b) within the round."""
    return statistics.median(round_ratios(samples, a, b))


def spread(samples: dict[str, list[list[float]]], a: str, b: str) -> tuple[float, float]:
    """The quartiles of the per-round ratios: how much a shared, noisy machine moved them."""
    ratios = round_ratios(samples, a, b)
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q3


def overall_ms(times: list[list[float]]) -> float:
    return statistics.median(t for rnd in times for t in rnd) * 1e3


def run_table(cases: list[Case], variants: list[str], rounds: int, per_round: int,
              warmup: int, settle: float = 0.1, openvino: bool = False) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        runners, notes = build_runners(case, variants, openvino)
        samples = measure(runners, rounds, per_round, warmup, settle)
        for name, note in notes.items():
            print(f"  {case.label} {name}: {note}", flush=True)
        for name in [n for n in runners if n.startswith("segflow")]:
            row = {"case": case.label, "runtime": name,
                   "ms": overall_ms(samples[name]),
                   "ort_ms": overall_ms(samples["onnxruntime"]),
                   "eager_ms": overall_ms(samples["torch"]),
                   "vs_ort": ratio(samples, name, "onnxruntime"),
                   "vs_eager": ratio(samples, name, "torch"),
                   "vs_ort_iqr": spread(samples, name, "onnxruntime"),
                   "vs_eager_iqr": spread(samples, name, "torch"),
                   "target": _target(case)}
            if "openvino" in samples:     # a column, not a target
                row.update(ov_ms=overall_ms(samples["openvino"]),
                           vs_ov=ratio(samples, name, "openvino"),
                           vs_ov_iqr=spread(samples, name, "openvino"))
            row["pass"] = _passes(case, row)
            row["verdict"] = _verdict(case, row)
            rows.append(row)
            print(_format_row(row, openvino), flush=True)
    return rows


def _target(case: Case) -> str:
    parts = []
    if case.target_ort is not None:
        parts.append(f"<= {case.target_ort:.2f}x ort")
    if case.target_eager is not None:
        parts.append(f"<= {case.target_eager:.2f}x eager")
    return ", ".join(parts)


def _passes(case: Case, row: Mapping[str, Any]) -> bool:
    ok = True
    if case.target_ort is not None:
        ok &= row["vs_ort"] <= case.target_ort
    if case.target_eager is not None:
        ok &= row["vs_eager"] <= case.target_eager
    return bool(ok)


def _verdict(case: Case, row: Mapping[str, Any]) -> str:
    """PASS / MISS by the median ratio; "(noise)" when the quartiles straddle the target."""
    straddles = False
    for target, key in ((case.target_ort, "vs_ort"), (case.target_eager, "vs_eager")):
        if target is not None:
            q1, q3 = row[f"{key}_iqr"]
            straddles |= q1 <= target < q3
    return ("PASS" if row["pass"] else "MISS") + (" (noise)" if straddles else "")


HEADER = (f"{'case':<16} {'runtime':<28} {'segflow ms':>10} {'ort ms':>9} {'eager ms':>9} "
          f"{'sf/ort [quartiles]':>20} {'sf/eager [quartiles]':>20}  target")
OPENVINO_HEADER = f"   {'ov ms':>9} {'sf/ov [quartiles]':>20}"


def _format_ratio(row: Mapping[str, Any], key: str) -> str:
    q1, q3 = row[f"{key}_iqr"]
    return f"{row[key]:.2f} [{q1:.2f}-{q3:.2f}]"


def _format_row(row: Mapping[str, Any], openvino: bool = False) -> str:
    text = (f"{row['case']:<16} {row['runtime']:<28} {row['ms']:>10.2f} {row['ort_ms']:>9.2f} "
            f"{row['eager_ms']:>9.2f} {_format_ratio(row, 'vs_ort'):>20} "
            f"{_format_ratio(row, 'vs_eager'):>20}  {row['target']} {row['verdict']}")
    if not openvino:
        return text
    if "vs_ov" not in row:
        return text + f"   {'-':>9} {'-':>20}"
    return text + f"   {row['ov_ms']:>9.2f} {_format_ratio(row, 'vs_ov'):>20}"


# -- memory --------------------------------------------------------------------------------
def _status_kib(field_name: str) -> int:
    from segflow.bench.memory import status_kib

    kib = status_kib(field_name)
    if kib is None:
        raise RuntimeError(f"{field_name} not in /proc/self/status")
    return kib


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _trim() -> None:
    import ctypes
    import ctypes.util

    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def memory_child(runtime: str, case: Case, runs: int, variant: str = "default"
                 ) -> dict[str, float]:
    """In a fresh process: MiB for loading a session, and the peak a run adds above that."""
    import onnxruntime as ort
    import torch

    import segflow
    from segflow import models

    build_opts = {k: v for k, v in case.options.items() if k != "seq_len"}
    model = models.build(case.model, **build_opts)
    data = model.SerializeToString()
    feeds = models.example_inputs(case.model, batch_size=case.batch, **case.options)
    _trim()
    before = _status_kib("VmRSS")
    before_anon = _status_kib("RssAnon")
    _reset_peak()
    if runtime == "onnxruntime":
        sess: Any = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        run: Runner = lambda: sess.run(None, feeds)  # noqa: E731
    elif runtime == "torch":
        module = models.torch_module(case.model, **build_opts)
        tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}

        def run() -> object:
            with torch.inference_mode():
                return module(**tensors)
    else:
        kwargs, env = _segflow_kwargs(variant)
        os.environ.update(env)  # a fresh process per measurement
        sess = segflow.InferenceSession(model, **kwargs)
        run = lambda: sess.run(None, feeds)  # noqa: E731
    load_peak = _status_kib("VmHWM") - before
    _trim()
    loaded = _status_kib("VmRSS")
    loaded_anon = _status_kib("RssAnon")
    _reset_peak()
    for _ in range(runs):
        run()
    cold_peak = _status_kib("VmHWM") - loaded   # includes one-time work (arenas, JIT code)
    _trim()
    held = _status_kib("VmRSS") - loaded         # what the runtime keeps between runs
    # Of that, anonymous (private) pages; the rest is shared libraries' code and data
    # pages first touched by the runs: shared with other processes, reclaimable.
    held_anon = _status_kib("RssAnon") - loaded_anon
    warm_base = _status_kib("VmRSS")
    _reset_peak()
    for _ in range(runs):
        run()
    warm_peak = _status_kib("VmHWM") - warm_base  # what a run adds on top of that
    result = {"loaded_mib": (loaded - before) / 1024, "load_peak_mib": load_peak / 1024,
              "loaded_anon_mib": (loaded_anon - before_anon) / 1024,
              "run_peak_mib": cold_peak / 1024, "held_mib": held / 1024,
              "held_anon_mib": held_anon / 1024, "warm_run_peak_mib": warm_peak / 1024}
    if runtime == "segflow":
        planned = sess.last_run_stats.settings.get("memory_planned_peak_bytes", 0)
        result["planned_mib"] = planned / (1 << 20)
        result["arena_mib"] = sess.arena_bytes / (1 << 20)
    return result


def time_child(runtime: str, case: Case, variant: str, runs: int) -> float:
    """In a fresh process: the median latency (ms) of one runtime running alone."""
    runners, _ = build_runners(case, [variant])
    name = runtime if runtime != "segflow" else next(n for n in runners if n.startswith("segflow"))
    samples = measure({name: runners[name]}, 1, runs, 5)
    return overall_ms(samples[name])


def run_standalone(cases: list[Case], variants: list[str], runs: int) -> None:
    """Each runtime alone in its own process: intrinsic speed, no thread-pool interference."""
    print(f"{'case':<16} {'runtime':<28} {'segflow ms':>10} {'ort ms':>9} {'eager ms':>9} "
          f"{'sf/ort':>7} {'sf/eager':>8}   (standalone, median of {runs} runs)")
    for case in cases:
        def child(runtime: str, variant: str = "default", case: Case = case) -> float:
            out = subprocess.run([sys.executable, __file__, "--time-child", runtime,
                                  "--cases", _case_key(case), "--variants", variant,
                                  "--runs", str(runs)],
                                 capture_output=True, text=True, check=True)
            return float(out.stdout.strip().splitlines()[-1])
        peers = {"onnxruntime": child("onnxruntime"), "torch": child("torch")}
        for variant in variants:
            ms = child("segflow", variant)
            name = "segflow" if variant == "default" else f"segflow[{variant}]"
            print(f"{case.label:<16} {name:<28} {ms:>10.2f} {peers['onnxruntime']:>9.2f} "
                  f"{peers['torch']:>9.2f} {ms / peers['onnxruntime']:>7.2f} "
                  f"{ms / peers['torch']:>8.2f}", flush=True)


def _case_key(case: Case) -> str:
    return next(key for key, c in CASES.items() if c == case)


def run_memory(case: Case, runs: int, variants: list[str]) -> dict[str, dict[str, float]]:
    results = {}
    jobs = [("segflow", v) for v in variants] + [("onnxruntime", "default"), ("torch", "default")]
    for runtime, variant in jobs:
        out = subprocess.run([sys.executable, __file__, "--memory-child", runtime,
                              "--cases", _case_key(case), "--runs", str(runs),
                              "--variants", variant],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
        name = runtime if variant == "default" else f"{runtime}[{variant}]"
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def _run_total(r: Mapping[str, float], held: str = "held_mib") -> float:
    """What a run takes: what the runtime holds between runs (``held``: all of it, or
    its private pages) plus what a warm run adds on top."""
    return r[held] + r["warm_run_peak_mib"]


def _memory_verdict(results: Mapping[str, Mapping[str, float]]) -> None:
    """The target (a run's peak memory <= onnxruntime's), read two ways: in RSS, and in
    private pages only, where the code pages each runtime's libraries touch do not count."""
    if "segflow" not in results or "onnxruntime" not in results:
        return
    sf, ort = results["segflow"], results["onnxruntime"]
    for name, held in (("RSS", "held_mib"), ("private pages", "held_anon_mib")):
        ours, theirs = _run_total(sf, held), _run_total(ort, held)
        verdict = "PASS" if ours <= theirs else "MISS"
        print(f"  run total, {name}: segflow {ours:.1f} against onnxruntime {theirs:.1f} MiB "
              f"({ours - theirs:+.1f}) {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--variants", default="default",
                        help="segflow configurations, ';'-separated (see module docstring)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.1,
                        help="untimed seconds between onnxruntime's calls and another "
                             "runtime's (its pool spins ~40 ms after a run; 0: no pause)")
    parser.add_argument("--no-openvino", action="store_true",
                        help="leave out the OpenVINO column (shown when openvino is installed)")
    parser.add_argument("--memory", action="store_true", help="peak memory, fresh processes")
    parser.add_argument("--runs", type=int, default=5, help="runs per memory measurement")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--standalone", action="store_true",
                        help="each runtime alone in a fresh process (no interleaving)")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--time-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [name for name in args.cases.split(",") if name]
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; known: {', '.join(CASES)}")
    cases = [CASES[name] for name in names]
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, cases[0], args.runs, variants[0])))
        return 0
    if args.time_child:
        print(time_child(args.time_child, cases[0], variants[0], args.runs))
        return 0
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.memory:
        case = cases[0]
        results = run_memory(case, args.runs, variants)
        print(f"memory, {case.label}, MiB, fresh process per runtime. loaded: RSS the session "
              f"adds; cold peak: high-water mark over the first {args.runs} runs above the "
              "loaded session; held: kept after them (arenas, JIT code, caches); warm peak: "
              f"what {args.runs} more runs add on top; run total = held + warm peak; "
              "process = loaded + run total (weights included). anon: of loaded and held, the "
              "private (anonymous) pages; the rest is shared libraries' code pages first "
              "touched, shared between processes and reclaimable")
        for runtime, r in results.items():
            extra = (f"  planned {r['planned_mib']:.1f}  arena {r['arena_mib']:.1f}"
                     if "planned_mib" in r else "")
            total = _run_total(r)
            print(f"  {runtime:<12} loaded {r['loaded_mib']:7.1f} "
                  f"(anon {r['loaded_anon_mib']:6.1f})  load peak {r['load_peak_mib']:7.1f}  "
                  f"cold peak {r['run_peak_mib']:6.1f}  "
                  f"held {r['held_mib']:6.1f} (anon {r['held_anon_mib']:5.1f})  warm peak "
                  f"{r['warm_run_peak_mib']:6.1f}  run total {total:6.1f}  process "
                  f"{r['loaded_mib'] + total:6.1f}{extra}")
        _memory_verdict(results)
        return 0
    if args.standalone:
        run_standalone(cases, variants, max(args.runs, 20))
        return 0
    import importlib.util

    openvino = not args.no_openvino and importlib.util.find_spec("openvino") is not None
    print(HEADER + (OPENVINO_HEADER if openvino else ""))
    rows = run_table(cases, variants, args.rounds, args.per_round, args.warmup, args.settle,
                     openvino)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
