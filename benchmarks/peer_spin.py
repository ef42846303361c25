"""Does a runtime's thread pool spin after a run, and what does that cost the next one?

    python benchmarks/peer_spin.py                              # MobileNetV2, the peers below
    python benchmarks/peer_spin.py --model mlp_chain --peers onnxruntime,openvino --trials 40

Two readings, per runtime (segflow's default session and each peer of
``segflow.bench.peers``, built as ``segflow bench`` builds them):

- **idle CPU**: the process's CPU time during the ``--settle`` seconds of sleep right
  after one of the runtime's calls. The calling thread sleeps, so whatever CPU time
  passes is the runtime's workers spinning (or working) after the run returned.
- **segflow after it**: segflow's next call, timed right after one of the runtime's
  calls with no pause, and after a pause of ``--settle`` seconds. segflow after
  segflow is the control: the same pause without another runtime's threads shows
  what the idle gap alone costs (the cores clocking down, on a VM).

Trials interleave the runtimes (rotated order); figures are medians over trials.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

import segflow
from segflow import models
from segflow.bench.peers import ModelSource, PeerUnavailable, prepare_peer
from segflow.ir.types import Device

Run = Callable[[], object]


def idle_cpu_ms(run: Run, settle: float) -> float:
    """CPU time (ms) the process uses while the caller sleeps ``settle`` s after ``run()``."""
    run()
    before = time.process_time()
    time.sleep(settle)
    return (time.process_time() - before) * 1e3


def next_call_ms(first: Run, then: Run, pause: float) -> float:
    """``then``'s latency (ms) right after one call of ``first`` and a ``pause``."""
    first()
    if pause:
        time.sleep(pause)
    t0 = time.perf_counter()
    then()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v2", help="built-in model (mobilenet_v2)")
    parser.add_argument("--peers", default="onnxruntime,openvino,torch")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--settle", type=float, default=0.1)
    args = parser.parse_args(argv)

    model = models.build(args.model)
    feeds = models.example_inputs(args.model)
    sess = segflow.InferenceSession(model)
    runners: dict[str, Run] = {"segflow": lambda: sess.run(None, feeds)}
    source = ModelSource(model, args.model, {})
    for name in filter(None, args.peers.split(",")):
        try:
            runners[name] = prepare_peer(name, source, feeds, Device.parse("cpu")).run
        except PeerUnavailable as exc:
            print(f"{name}: {exc}")
    for run in runners.values():
        for _ in range(3):
            run()
    segflow_run = runners["segflow"]
    names = list(runners)
    idle: dict[str, list[float]] = {n: [] for n in names}
    after: dict[str, list[float]] = {n: [] for n in names}
    after_pause: dict[str, list[float]] = {n: [] for n in names}
    for trial in range(args.trials):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            run = runners[name]
            idle[name].append(idle_cpu_ms(run, args.settle))
            after[name].append(next_call_ms(run, segflow_run, 0.0))
            after_pause[name].append(next_call_ms(run, segflow_run, args.settle))
    alone = statistics.median(after["segflow"])
    print(f"{args.model}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"{args.trials} trials, medians [quartiles]; settle {args.settle:g} s")
    print(f"{'runtime':<18} {'idle CPU ms':>18} {'segflow after, ms':>22} "
          f"{'after a pause, ms':>22}")
    for name in names:
        def cell(values: list[float]) -> str:
            q1, q2, q3 = np.percentile(values, (25, 50, 75))
            return f"{q2:.2f} [{q1:.2f}-{q3:.2f}]"
        print(f"{name:<18} {cell(idle[name]):>18} {cell(after[name]):>22} "
              f"{cell(after_pause[name]):>22}")
    print(f"(segflow after segflow, no pause: {alone:.2f} ms: the reference)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
