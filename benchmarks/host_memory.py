"""Page faults and time per run under each host-memory policy, segflow alone in a process.

    python benchmarks/host_memory.py                          # ResNet-18 at batch 32
    python benchmarks/host_memory.py --model resnet50 --batch 8 --pairs 3

Each policy (``retain``, ``system``; see ``segflow.runtime.host_memory``) runs in
its own fresh process, alternated ``--pairs`` times, since malloc's configuration
is process-wide. A process warms up for ``--warmup`` runs, then reports per run:
minor page faults (``ru_minflt``) and wall time, and at the end its VmRSS and
VmHWM. Nothing else runs in the process: onnxruntime's or eager's allocations
would move glibc's dynamic thresholds and hide the faults.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

POLICIES = ("retain", "system")


def child(model: str, batch: int, warmup: int, runs: int, policy: str) -> dict[str, object]:
    import segflow
    from segflow import models
    from segflow.bench.memory import status_kib

    feeds = models.example_inputs(model, batch_size=batch)
    sess = segflow.InferenceSession(models.build(model), host_memory=policy)
    for _ in range(warmup):
        sess.run(None, feeds)
    faults, ms = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        sess.run(None, feeds)
        ms.append((time.perf_counter() - start) * 1e3)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    def mib(field: str) -> float:
        kib = status_kib(field)
        return float("nan") if kib is None else kib / 1024
    assert sess.last_run_stats is not None
    return {"policy": sess.last_run_stats.settings["host_memory"], "faults": faults, "ms": ms,
            "rss_mib": mib("VmRSS"), "hwm_mib": mib("VmHWM")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="builder model (default resnet18)")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per process (default 5)")
    parser.add_argument("--pairs", type=int, default=2, help="processes per policy, alternated")
    parser.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.batch, args.warmup, args.runs, args.child)))
        return 0
    print(f"{args.model} at batch {args.batch}: {args.warmup} warm-up runs, then {args.runs} "
          f"runs per process; {args.pairs} processes per policy")
    print(f"{'asked':7s} {'in force':8s} {'faults/run':>16s} {'ms/run (median, range)':>26s} "
          f"{'VmRSS':>8s} {'VmHWM':>8s}")
    for _ in range(args.pairs):
        for policy in POLICIES:
            out = subprocess.run([sys.executable, __file__, "--child", policy, "--model",
                                  args.model, "--batch", str(args.batch), "--warmup",
                                  str(args.warmup), "--runs", str(args.runs)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            faults, ms = r["faults"], r["ms"]
            print(f"{policy:7s} {r['policy']:8s} {min(faults):>7d}-{max(faults):<8d} "
                  f"{statistics.median(ms):10.1f} ({min(ms):.1f}-{max(ms):.1f})"
                  f"{r['rss_mib']:9.0f} {r['hwm_mib']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
