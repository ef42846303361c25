"""Winograd F(4x4, 3x3) against libdnnl's direct convolution and onnxruntime, per shape.

    python benchmarks/winograd_shapes.py                    # ResNet-50's four shapes, batch 1
    python benchmarks/winograd_shapes.py --batch 8 --rounds 10
    python benchmarks/winograd_shapes.py --shapes 64x56,96x20  # channels x image size

Each shape is a two-convolution model, x -> 1x1 conv -> 3x3 conv (pad 1) -> ReLU,
C channels throughout (the 1x1 convolution hands the 3x3 one a channels-last
input, as inside ResNet-50). Three sessions run it in one process, interleaved
round by round: segflow with Winograd (the default), segflow with
``SEGFLOW_WINOGRAD=0`` (libdnnl's direct convolution), and onnxruntime. Each
round pauses, makes one untimed call (onnxruntime's pool spins for ~40 ms after a
run and would slow the next runtime's threads) and times ``--per-round`` calls.
Printed: median milliseconds a call, and the median per-round ratio of Winograd
to each of the other two, with quartiles. The figures include the 1x1
convolution, the same in all three.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SHAPES = ((64, 56), (128, 28), (256, 14), (512, 7))   # ResNet-50's stride-1 3x3 convolutions


def model(batch: int, channels: int, size: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((channels, channels, 1, 1)) / np.sqrt(channels)).astype(np.float32)
    w3 = (rng.standard_normal((channels, channels, 3, 3))
          / np.sqrt(9 * channels)).astype(np.float32)
    b3 = rng.standard_normal(channels).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"]),
             helper.make_node("Conv", ["a", "w3", "b3"], ["c"], kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(
        nodes, "winograd_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w3, "w3"),
         numpy_helper.from_array(b3, "b3")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):.3f} [{q[0]:.3f}-{q[2]:.3f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(f"{c}x{s}" for c, s in SHAPES),
                        help="channels x image size, comma-separated (channels: multiples "
                             "of 8)")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]

    import onnxruntime as ort

    import segflow

    print(f"batch {args.batch}, {args.threads} threads; ms a call (median), "
          "winograd / direct and winograd / ort [quartiles of the per-round ratios]")
    for channels, size in shapes:
        proto = model(args.batch, channels, size)
        feeds = {"x": np.random.default_rng(1).standard_normal(
            (args.batch, channels, size, size)).astype(np.float32)}
        winograd = segflow.InferenceSession(proto, intra_op_threads=args.threads)
        saved = os.environ.get("SEGFLOW_WINOGRAD")
        os.environ["SEGFLOW_WINOGRAD"] = "0"
        try:
            direct = segflow.InferenceSession(proto, intra_op_threads=args.threads)
        finally:
            if saved is None:
                del os.environ["SEGFLOW_WINOGRAD"]
            else:
                os.environ["SEGFLOW_WINOGRAD"] = saved
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        peer = ort.InferenceSession(proto.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])
        runs = {"winograd": lambda s=winograd, f=feeds: s.run(None, f),
                "direct": lambda s=direct, f=feeds: s.run(None, f),
                "ort": lambda s=peer, f=feeds: s.run(None, f)}
        reference = runs["ort"]()[0]
        for name in ("winograd", "direct"):
            np.testing.assert_allclose(runs[name]()[0], reference, atol=1e-4, rtol=1e-3)
        ms: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            order = list(runs.items())
            for name, run in order if r % 2 else order[::-1]:
                time.sleep(0.05)
                run()
                start = time.perf_counter()
                for _ in range(args.per_round):
                    run()
                ms[name].append((time.perf_counter() - start) / args.per_round * 1e3)
        over_direct = [a / b for a, b in zip(ms["winograd"], ms["direct"], strict=True)]
        over_ort = [a / b for a, b in zip(ms["winograd"], ms["ort"], strict=True)]
        times = " / ".join(f"{statistics.median(ms[name]):.2f}" for name in runs)
        print(f"{channels:4d} ch @ {size}x{size}: winograd / direct / ort {times} ms; "
              f"w/direct {_quartiles(over_direct)}, w/ort {_quartiles(over_ort)}", flush=True)


if __name__ == "__main__":
    main()
