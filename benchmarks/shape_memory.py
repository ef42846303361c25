"""Resident memory of one session run over many input shapes, and after it is deleted.

    python benchmarks/shape_memory.py                  # BERT-tiny, sequence lengths 1..128
    python benchmarks/shape_memory.py --shapes 32 --cycles 4

One ``InferenceSession`` over the built-in BERT-tiny runs once at each sequence length
1..N. The table gives the process's RSS (``/proc/self/statm``) at start, after the
session loads, after the N shapes, after ``del sess`` and ``gc.collect()``, and after
that with the free heap handed back (``malloc_trim``: under ``host_memory="retain"``
glibc keeps freed memory in the heap). Each figure is MiB over the start, taken in a
fresh process that loaded one warm-up session first (imports, libraries, JIT kernels
of the first shape), so only what the shapes add shows. torch eager on the same model
and weights gives its figures in its own process, for comparison.

``--cycles C`` then times C more passes over the same N lengths (ms per run, median of
the passes): with N above a kernel's cap (``segflow.shape_cache``), that is what a
workload cycling over more shapes than the cap costs against one that fits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

MODEL = "bert_tiny"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _lengths(shapes: int) -> list[int]:
    return list(range(1, shapes + 1))


def _measure(make: Callable[[], Callable[[dict[str, Any]], object]],
             feeds: list[dict[str, Any]], cycles: int) -> dict[str, object]:
    """RSS (MiB over the start) after ``make()`` loads a runner, after it runs every
    feed, after it is deleted, and after the heap's free memory is trimmed; and the
    median ms a run over ``cycles`` passes. One runner is made and dropped first, so
    that what the first one leaves for the process (imports, thread pools) is not
    counted."""
    from segflow.runtime.host_memory import release_free_heap

    warm = make()
    warm(feeds[0])
    del warm
    gc.collect()
    release_free_heap()
    start = _rss_mib()
    run = make()
    loaded = _rss_mib()
    for f in feeds:
        run(f)
    ran = _rss_mib()
    per_run = []
    for _ in range(cycles):
        t0 = time.perf_counter()
        for f in feeds:
            run(f)
        per_run.append((time.perf_counter() - t0) * 1e3 / len(feeds))
    del run
    gc.collect()
    deleted = _rss_mib()
    release_free_heap()
    trimmed = _rss_mib()
    return {"start": start, "load": loaded - start, "shapes": ran - start,
            "del": deleted - start, "trim": trimmed - start,
            "ms": statistics.median(per_run) if per_run else None}


def child_segflow(shapes: int, cycles: int) -> dict[str, object]:
    import segflow
    from segflow import models

    model = models.build(MODEL)
    feeds = [models.example_inputs(MODEL, seq_len=n) for n in _lengths(shapes)]

    def make() -> Callable[[dict[str, Any]], object]:
        return partial(segflow.InferenceSession(model).run, None)
    return _measure(make, feeds, cycles)


def child_torch(shapes: int, cycles: int) -> dict[str, object]:
    import torch

    from segflow import models

    feeds = [{k: torch.from_numpy(v) for k, v in models.example_inputs(
        MODEL, seq_len=n).items()} for n in _lengths(shapes)]

    def make() -> Callable[[dict[str, Any]], object]:
        module = models.torch_module(MODEL)
        return lambda f: module(**f)
    with torch.inference_mode():
        return _measure(make, feeds, cycles)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=int, default=128,
                        help="sequence lengths 1..N (default 128, the model's maximum)")
    parser.add_argument("--cycles", type=int, default=0,
                        help="timed passes over the N lengths after the first (default 0)")
    parser.add_argument("--child", choices=("segflow", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.shapes <= 128:
        parser.error("--shapes must be 1..128 (BERT-tiny's position table)")
    if args.child:
        fn = child_segflow if args.child == "segflow" else child_torch
        print(json.dumps(fn(args.shapes, args.cycles)))
        return 0
    print(f"{MODEL}: one session over sequence lengths 1..{args.shapes}; RSS in MiB over "
          "the start (a fresh process per row)")
    print(f"{'runtime':8s} {'start':>7s} {'load':>6s} {'shapes':>7s} {'del+gc':>7s} "
          f"{'trimmed':>8s}" + (f" {'ms/run':>7s}" if args.cycles else ""))
    for name in ("segflow", "torch"):
        out = subprocess.run([sys.executable, __file__, "--child", name, "--shapes",
                              str(args.shapes), "--cycles", str(args.cycles)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        line = (f"{name:8s} {r['start']:7.1f} {r['load']:+6.1f} {r['shapes']:+7.1f} "
                f"{r['del']:+7.1f} {r['trim']:+8.1f}")
        if args.cycles:
            line += f" {r['ms']:7.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
