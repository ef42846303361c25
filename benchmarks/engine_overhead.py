"""Engine overhead: bulk on/off x inline/threaded, and the per-push cost of each engine.

Usage::

    python benchmarks/engine_overhead.py [--runs 30] [--layers 200]

Prints, for the MLP chain of tiny layers and for ResNet-50 (batch 1), the median
latency of each mode and the per-task engine overhead: (nobulk - bulk) / (extra
tasks), i.e. what one additional engine task costs. A second table times empty
tasks pushed straight to each engine (push cost and push-to-completion cost).
Numbers are medians over interleaved rounds, so machine drift hits every mode alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import segflow
from segflow import models
from segflow.engine import ExecType, Var, make_engine

MODES = [("inline", True), ("inline", False), ("threaded", True), ("threaded", False)]


def bench_model(name: str, runs: int, **options: int) -> None:
    model = models.build(name, **options)
    feeds = models.example_inputs(name, **options)
    sessions = {mode: segflow.InferenceSession(model, engine=mode[0], bulk=mode[1])
                for mode in MODES}
    times: dict[tuple[str, bool], list[float]] = {mode: [] for mode in MODES}
    tasks = {}
    for sess in sessions.values():  # warm up
        sess.run(None, feeds)
    for _ in range(runs):
        for mode, sess in sessions.items():
            start = time.perf_counter()
            sess.run(None, feeds)
            times[mode].append(time.perf_counter() - start)
            tasks[mode] = sess.last_run_stats.pushes
    print(f"\n{name} ({', '.join(f'{k}={v}' for k, v in options.items()) or 'defaults'}), "
          f"median of {runs} interleaved runs")
    print(f"{'engine':10s} {'bulk':5s} {'pushes':>7s} {'ms':>9s}")
    med = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
    for mode in MODES:
        print(f"{mode[0]:10s} {'on' if mode[1] else 'off':5s} {tasks[mode]:7d} {med[mode]:9.3f}")
    for engine in ("inline", "threaded"):
        extra = tasks[(engine, False)] - tasks[(engine, True)]
        if extra > 0:
            per_task = (med[(engine, False)] - med[(engine, True)]) * 1e3 / extra
            print(f"  {engine}: bulk off adds {per_task:.2f} us per extra task "
                  f"({extra} extra tasks)")


def bench_push(n: int = 20000) -> None:
    print(f"\nempty tasks, {n} pushes each")
    print(f"{'engine':10s} {'push us':>9s} {'push+complete us':>17s}")
    for name in ("inline", "threaded"):
        engine = make_engine(name)
        var = Var("v")
        start = time.perf_counter()
        for _ in range(n):
            engine.push(_noop, (), (var,), ExecType.SYNC)
        pushed = time.perf_counter() - start
        engine.wait_all()
        total = time.perf_counter() - start
        engine.close()
        print(f"{name:10s} {pushed / n * 1e6:9.2f} {total / n * 1e6:17.2f}")


def _noop() -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--skip-resnet", action="store_true")
    args = parser.parse_args()
    bench_push()
    bench_model("mlp_chain", args.runs, layers=args.layers)
    if not args.skip_resnet:
        bench_model("resnet50", max(5, args.runs // 3))


if __name__ == "__main__":
    main()
