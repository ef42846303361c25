"""A torch ``nn.TransformerEncoder`` exported by both torch exporters, segflow against
onnxruntime (interleaved, a pause between runtimes): nodes after the passes, ms and
ratio per export, with and without the plan per input shape (``specialize``).

    python benchmarks/exported_encoder.py --rounds 15 --threads 1

The exports (4 layers, d_model 256, 4 heads, feed-forward 1024, batch_first, eval) are
built into ``--cache`` once. The TorchScript exporter (opset 17, batch and sequence
axes dynamic) bakes the key's sequence length into one reshape, so it is exported at
each sequence length checked; the dynamo exporter (opset 18) gets symbolic batch and
sequence dims (exported from a batch-2 example, so the batch is not specialized to 1).
Before timing, outputs are checked against onnxruntime's at batch 1 and 4, sequence 16
and 128 (atol 1e-4 + rtol 1e-3).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

D_MODEL, HEADS, FFN, LAYERS = 256, 4, 1024, 4


def _encoder():  # type: ignore[no-untyped-def]
    import torch
    torch.manual_seed(0)
    torch.backends.mha.set_fastpath_enabled(False)   # the fused fast path has no export
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).eval()
    with torch.no_grad():    # the clones start equal: make each layer its own
        for p in encoder.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return encoder


def export(cache: Path, exporter: str, seq: int) -> Path:
    """The export's file in ``cache`` (built on first use)."""
    import torch
    path = cache / (f"encoder_ts_s{seq}.onnx" if exporter == "torchscript"
                    else "encoder_dynamo.onnx")
    if path.exists():
        return path
    encoder = _encoder()
    warnings.filterwarnings("ignore")
    with torch.no_grad():
        if exporter == "torchscript":
            torch.onnx.export(encoder, (torch.randn(1, seq, D_MODEL),), str(path),
                              dynamo=False, opset_version=17, input_names=["x"],
                              output_names=["y"],
                              dynamic_axes={"x": {0: "batch", 1: "seq"},
                                            "y": {0: "batch", 1: "seq"}})
        else:
            from torch.export import Dim
            dims = {"src": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=1024)}}
            program = torch.onnx.export(encoder, (torch.randn(2, 128, D_MODEL),), dynamo=True,
                                        opset_version=18, input_names=["x"],
                                        output_names=["y"], dynamic_shapes=dims)
            program.save(str(path))
    return path


def _nodes(session, x: np.ndarray) -> int:  # type: ignore[no-untyped-def]
    session.run(None, {"x": x})
    specialized = session.specializations.get(((tuple(x.shape)),))
    return len((specialized or session).graph.nodes)


def check(path: Path, threads: int, shapes: list[tuple[int, int]]) -> None:
    import onnxruntime as ort

    import segflow
    sess = segflow.InferenceSession(str(path), intra_op_threads=threads)
    oracle = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seq in shapes:
        x = np.random.default_rng(batch * seq).standard_normal((batch, seq, D_MODEL))
        x = x.astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0],
                                   atol=1e-4, rtol=1e-3)
    print(f"  {path.name}: outputs match onnxruntime at (batch, seq) {shapes}")


def measure(path: Path, threads: int, rounds: int, batch: int, seq: int) -> None:
    import onnxruntime as ort

    import segflow
    x = np.random.default_rng(0).standard_normal((batch, seq, D_MODEL)).astype(np.float32)
    variants = {"specialize off": {"specialize": False}, "default": None}
    sessions = {name: segflow.InferenceSession(str(path), intra_op_threads=threads,
                                               optimize=opt)
                for name, opt in variants.items()}
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    oracle = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    nodes = {name: _nodes(s, x) for name, s in sessions.items()}
    times: dict[str, list[float]] = {name: [] for name in [*sessions, "onnxruntime"]}
    runs = {**{name: s.run for name, s in sessions.items()}, "onnxruntime": oracle.run}
    for _ in range(3):
        for run in runs.values():
            run(None, {"x": x})
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(10):
                run(None, {"x": x})
            times[name].append((time.perf_counter() - start) / 10)
            time.sleep(0.1)
    ort_ms = statistics.median(times["onnxruntime"]) * 1e3
    print(f"  {path.name} batch {batch} seq {seq}, {threads} thread(s), {rounds} rounds: "
          f"onnxruntime {ort_ms:.2f} ms")
    for name in sessions:
        ratio = statistics.median(a / b for a, b in zip(times[name], times["onnxruntime"]))
        print(f"    segflow {name:15s} {nodes[name]:4d} nodes  "
              f"{statistics.median(times[name]) * 1e3:6.2f} ms  {ratio:.3f}x onnxruntime")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "segflow-exported-encoder")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    if not args.no_check:
        for seq in (16, 128):
            check(export(args.cache, "torchscript", seq), args.threads, [(1, seq), (4, seq)])
        check(export(args.cache, "dynamo", 0), args.threads,
              [(1, 16), (4, 16), (1, 128), (4, 128)])
    measure(export(args.cache, "torchscript", args.seq), args.threads, args.rounds,
            args.batch, args.seq)
    measure(export(args.cache, "dynamo", 0), args.threads, args.rounds, args.batch, args.seq)


if __name__ == "__main__":
    main()
