"""One linear layer at a few row counts: segflow's kernels against onnxruntime's Gemm.

    python benchmarks/linear_rows.py                         # the default shapes, 2 threads
    python benchmarks/linear_rows.py --shapes 1280x1000 --rows 1 2 8 --threads 1

For each ``KxN`` weight and row count it times, interleaved in one process (rounds
of each kernel in turn, the median of per-round ratios to onnxruntime):

- ``packed``: libdnnl's inner product over the weight in its own packing, what a
  ``DirectLinear`` runs (``brgemm`` on AVX2);
- ``plain``: libdnnl's inner product over the plain [N, K] weight (``gemm:jit``);
- ``ort``: onnxruntime's Gemm (transB=1) alone in a session, with an untimed pause
  before and after it (its thread pool spins after a call).

At one row (a classifier at batch 1) the packed kernel ran 0.9-1.2x onnxruntime's
time on two AVX2 cores, and an ad hoc one-thread C matrix-vector kernel over the
packing 1.5-1.75x on the large weights: the layer is bound by reading the weight,
and one thread cannot (docs/performance.md, ZEN3).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from segflow.kernels.onednn.library import Library
from segflow.kernels.onednn.linear import DirectLinear

SHAPES = ["1280x1000", "2048x1000", "768x768", "768x3072", "256x256"]
# Untimed pause around onnxruntime's calls: its pool's threads spin ~40 ms after a run and
# would slow whatever ran next on a 2-core machine (docs/benchmarking.md, "settle").
SETTLE_S = 0.1


def _ort_gemm(w: np.ndarray, b: np.ndarray, rows: int, threads: int) -> ort.InferenceSession:
    n, k = w.shape
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _kernels(lib: Library, k: int, n: int, rows: int, threads: int
             ) -> dict[str, Callable[[], object]]:
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n)
    x = torch.randn(rows, k)
    ref = torch.addmm(b, x, w.t())
    packed = lib.pack_linear(w, rows)
    assert packed is not None
    fns: dict[str, Callable[[], object]] = {}
    op = DirectLinear(lib, k, n, rows, None, None, lambda y: y, 4, 1)
    fns["packed"] = lambda: op(x, packed, b)
    # The same op told that its weight's format is the plain one: it reads ``w`` as is.
    plain = DirectLinear(lib, k, n, rows, None, None, lambda y: y, 4, 1)
    plain.packed_md = lib.memory_desc(w)
    plain_w = w.view(torch.uint8).reshape(-1)  # bytes, as a DirectLinear's weight is
    fns["plain"] = lambda: plain(x, plain_w, b)
    sess = _ort_gemm(w.numpy(), b.numpy(), rows, threads)
    feeds = {"x": x.numpy()}
    fns["ort"] = lambda: sess.run(None, feeds)[0]
    for name, fn in fns.items():
        got = np.asarray(fn())
        err = float(np.abs(got - ref.numpy()).max())
        assert err < 1e-3, f"{name} differs from addmm by {err}"
    return fns


def _time(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float
          ) -> dict[str, list[float]]:
    for fn in fns.values():            # warm-up, and the calls per round
        fn()
    start = time.perf_counter()
    for _ in range(5):
        fns["ort"]()
    per_call = (time.perf_counter() - start) / 5
    calls = max(2, int(budget_s / max(per_call, 1e-6) / rounds / len(fns)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if name == "ort":
                time.sleep(SETTLE_S)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
            if name == "ort":
                time.sleep(SETTLE_S)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="KxN weights")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 8, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=1.5,
                        help="seconds of timing per shape and row count")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = Library.load()
    if lib is None:
        raise SystemExit(f"libdnnl {Library.probe()[1]}")
    print(f"torch {torch.__version__}, {args.threads} threads, libdnnl {lib.version}; "
          "us per call (median), and the median per-round ratio to onnxruntime")
    print(f"{'shape':>10} {'rows':>5}  " + "  ".join(f"{n:>18}" for n in
                                                  ("packed", "plain", "ort")))
    for shape in args.shapes:
        k, n = (int(d) for d in shape.split("x"))
        for rows in args.rows:
            times = _time(_kernels(lib, k, n, rows, args.threads), args.rounds, args.budget)
            cells = []
            for name in ("packed", "plain", "ort"):
                if name not in times:
                    cells.append(f"{'-':>18}")
                    continue
                ratio = statistics.median(a / o for a, o in zip(times[name], times["ort"],
                                                                strict=True))
                cells.append(f"{statistics.median(times[name]):9.1f} ({ratio:4.2f}x)")
            print(f"{shape:>10} {rows:>5}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
