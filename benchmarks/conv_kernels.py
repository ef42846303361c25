"""Convolution kernel time per run: oneDNN under segflow against onnxruntime's, per shape.

    python benchmarks/conv_kernels.py                       # ResNet-50, batch 1, 2 threads
    python benchmarks/conv_kernels.py --batch 8 --threads 1

It separates the kernels from everything around them. segflow (default backend)
runs in one fresh process with ``ONEDNN_VERBOSE`` on, which reports each
convolution's execution time; onnxruntime runs in another with its profiler on,
which reports each Conv node's kernel time. Both take the median over
``--runs`` runs after warm-up, match the convolutions in graph order and sum
them by shape. The last line pairs each verbose run's wall time with its summed
convolution time: the difference is what segflow spends outside the convolution
kernels (per-call primitive setup, the other ops, Python, and the verbose
printing itself, a few microseconds per primitive).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def _ort_child(model: str, batch: int, threads: int, runs: int) -> dict[str, Any]:
    import onnxruntime as ort

    from segflow import models

    feeds = models.example_inputs(model, batch_size=batch)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    sess = ort.InferenceSession(models.build(model).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])
    for _ in range(3 + runs):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    times: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") \
                and e["args"]["op_name"] == "Conv":
            times[e["name"]].append(e["dur"] / 1e3)
    return {"ms": [statistics.median(t[-runs:]) for t in times.values()]}


def _segflow_child(model: str, batch: int, threads: int, runs: int) -> dict[str, Any]:
    import torch

    import segflow
    from segflow import models
    from segflow.kernels.onednn.library import Library

    feeds = models.example_inputs(model, batch_size=batch)
    sess = segflow.InferenceSession(models.build(model), intra_op_threads=threads)
    for _ in range(3):
        sess.run(None, feeds)
    wall = []
    direct = Library.load()   # convolutions that call libdnnl print through its own switch
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        if direct is not None:
            direct.set_verbose(1)
        sess.run(None, feeds)  # the verbose header prints on the first primitive
        print("RUNS", flush=True)
        for _ in range(runs):
            start = time.perf_counter()
            sess.run(None, feeds)
            wall.append((time.perf_counter() - start) * 1e3)
        if direct is not None:
            direct.set_verbose(0)
    return {"wall_ms": wall}


def _verbose_convs(stdout: str, runs: int) -> tuple[list[str], list[float], list[float]]:
    """Shapes and median ms per convolution, and each run's summed convolution ms."""
    timed = stdout.split("RUNS", 1)[1]
    lines = [ln for ln in timed.splitlines() if ",exec,cpu,convolution," in ln]
    per_run = len(lines) // runs
    ms_of = [float(ln.rsplit(",", 1)[1]) for ln in lines]
    shapes, ms = [], []
    for i in range(per_run):
        match = re.search(r",((?:g\d+)?mb\d+_\S+?),", lines[i])   # g<groups> when grouped
        shapes.append(re.sub(r"_iw.*|mb\d+_", "", match.group(1)) if match else "?")
        ms.append(statistics.median(ms_of[i + k * per_run] for k in range(runs)))
    sums = [sum(ms_of[k * per_run:(k + 1) * per_run]) for k in range(runs)]
    return shapes, ms, sums


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="builder model (default resnet50)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--threads", type=int, default=2,
                        help="intra-op threads for both runtimes (default 2)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per runtime (default 5)")
    parser.add_argument("--child", choices=["ort", "segflow"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fn = _ort_child if args.child == "ort" else _segflow_child
        result = fn(args.model, args.batch, args.threads, args.runs)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    common = ["--model", args.model, "--batch", str(args.batch), "--threads",
              str(args.threads), "--runs", str(args.runs)]
    outs = {}
    for child in ("ort", "segflow"):
        proc = subprocess.run([sys.executable, __file__, "--child", child, *common],
                              capture_output=True, text=True, check=True)
        outs[child] = proc.stdout
    ort_ms = json.loads(outs["ort"].split("RESULT ", 1)[1])["ms"]
    result = json.loads(outs["segflow"].split("RESULT ", 1)[1].splitlines()[0])
    shapes, sf_ms, run_sums = _verbose_convs(outs["segflow"], args.runs)
    if len(shapes) != len(ort_ms):
        print(f"segflow ran {len(shapes)} convolutions and onnxruntime {len(ort_ms)}: "
              "cannot match them", file=sys.stderr)
        return 1
    by_shape: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for shape, a, b in zip(shapes, ort_ms, sf_ms):
        row = by_shape[shape]
        row[0] += 1
        row[1] += a
        row[2] += b
    print(f"{args.model} at batch {args.batch}, {args.threads} threads, median of {args.runs} "
          "runs; convolution kernel ms per run, summed by shape")
    print(f"{'shape':40s} {'n':>3s} {'onnxruntime':>12s} {'oneDNN':>8s} {'diff':>7s}")
    for shape, (n, a, b) in sorted(by_shape.items(), key=lambda kv: kv[1][2] - kv[1][1]):
        print(f"{shape:40s} {int(n):3d} {a:12.2f} {b:8.2f} {b - a:+7.2f}")
    total_ort, total_sf = sum(ort_ms), sum(sf_ms)
    print(f"{'total':40s} {len(shapes):3d} {total_ort:12.2f} {total_sf:8.2f} "
          f"{total_sf - total_ort:+7.2f}")
    walls = result["wall_ms"]
    outside = sorted(w - k for w, k in zip(walls, run_sums))
    print(f"segflow wall time per run {statistics.median(walls):.2f} ms (verbose on); outside "
          f"the convolution kernels, run by run: median {statistics.median(outside):.2f} ms "
          f"[{outside[0]:.2f}-{outside[-1]:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
