"""Statically quantized CNNs (onnxruntime's quantizer, QDQ format): segflow vs onnxruntime.

    python benchmarks/quantized.py                         # resnet50 and mobilenet_v2
    python benchmarks/quantized.py --models resnet50 --seconds 20 --agree 64
    python benchmarks/quantized.py --no-int8               # segflow with the int8 pass off

Each model is the corpus's float export (torchscript, opset 18) quantized by
``onnxruntime.quantization.quantize_static``: QDQ format, uint8 activations, int8
weights per output channel, calibrated over fixed-seed random images (after
``quant_pre_process``). The files are kept in the corpus store
(``$SEGFLOW_CACHE_DIR/corpus/``) under the same trust rules, keyed by the float
export's key and the quantizer's version and settings.

Latency: batch 1, the runtimes interleaved with a pause between them (the corpus
bench's timing). Correctness against onnxruntime's run of the same quantized file:
top-1 agreement over ``--agree`` random images, and the share of output values
within one quantization step of the final QuantizeLinear (its scale, read from the
graph), both with the int8 pass on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from _corpus_bench import bench_entry, format_rows  # noqa: E402
from _corpus_build import Corpus, Entry, EntryId, Exporter, one_line  # noqa: E402

QUANT_FORMAT = 1          # bump when what the quantization writes changes
CALIBRATION_IMAGES = 16
CALIBRATION_SEED = 20
MODELS_QUANTIZED = ("resnet50", "mobilenet_v2")


def _images(count: int, seed: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, *shape[1:])).astype(np.float32) for _ in range(count)]


def _input_shape(path: str) -> tuple[str, tuple[int, ...]]:
    proto = onnx.load(path, load_external_data=False)
    value = proto.graph.input[0]
    dims = [d.dim_value or 1 for d in value.type.tensor_type.shape.dim]
    return value.name, tuple(dims)


def quantize(float_path: str, out: Path) -> str:
    """``float_path`` statically quantized (QDQ, u8 activations, s8 per-channel weights)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    name, shape = _input_shape(float_path)
    images = _images(CALIBRATION_IMAGES, CALIBRATION_SEED, shape)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{name: image} for image in images])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    prepared = out.with_name(out.name + ".pre.onnx")
    quant_pre_process(float_path, str(prepared), skip_symbolic_shape=True)
    quantize_static(str(prepared), str(out), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    per_channel=True)
    prepared.unlink(missing_ok=True)
    return ""


def obtain(corpus: Corpus, model: str) -> Entry:
    """The QDQ quantized export of ``model`` (built once, kept in the corpus store)."""
    import onnxruntime

    float_entry = corpus.obtain(EntryId(model, Exporter.TORCHSCRIPT, 18, False))
    if float_entry.path is None:
        return float_entry
    what = {"format": QUANT_FORMAT, "float": float_entry.key,
            "onnxruntime": onnxruntime.__version__, "images": CALIBRATION_IMAGES,
            "seed": CALIBRATION_SEED, "settings": "qdq-u8-s8-per-channel"}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    name = f"{model}-qdq-u8s8-op18-{key[:16]}.onnx"
    try:
        got = corpus.store.obtain(name, lambda out: quantize(float_entry.path or "", out),
                                  wait_s=1800, description={"entry": f"{model}/qdq", "key": key})
    except Exception as exc:  # noqa: BLE001 - a failed quantization is a row's reason
        return replace(float_entry, key=key, path=None, failure=one_line(exc))
    if got.path is None:
        return replace(float_entry, key=key, path=None, failure=got.failure)
    nodes = len(onnx.load(str(got.path), load_external_data=False).graph.node)
    return replace(float_entry, key=key, path=str(got.path), nodes=nodes)


def _output_step(path: str) -> float:
    """The scale of the QuantizeLinear nearest the graph's output (one quantization step
    of the logits), or 0.0 where the output is not quantized."""
    from onnx import numpy_helper

    proto = onnx.load(path)
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    name = proto.graph.output[0].name
    seen = 0
    while name in producer and seen < 8:
        node = producer[name]
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and node.input[1] in inits:
            return float(inits[node.input[1]].reshape(-1)[0])
        name, seen = node.input[0], seen + 1
    return 0.0


def agreement(path: str, count: int, optimize: dict[str, bool] | None = None,
              threads: int = 0) -> tuple[float, float, float]:
    """(top-1 agreement, share of outputs within one step, max |difference| in steps) of
    segflow against onnxruntime over ``count`` random images."""
    import onnxruntime as ort

    import segflow

    name, shape = _input_shape(path)
    ours = segflow.InferenceSession(path, optimize=optimize)
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    theirs = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    step = _output_step(path) or 1.0
    agree = within = total = 0
    worst = 0.0
    for image in _images(count, 1234, shape):
        a = ours.run(None, {name: image})[0]
        b = theirs.run(None, {name: image})[0]
        agree += int(np.argmax(a) == np.argmax(b))
        steps = np.abs(a.astype(np.float64) - b.astype(np.float64)) / step
        within += int(np.count_nonzero(steps <= 1.0 + 1e-3))
        total += steps.size
        worst = max(worst, float(steps.max()))
    return agree / count, within / max(total, 1), worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS_QUANTIZED))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--agree", type=int, default=64, help="random images compared")
    parser.add_argument("--no-int8", action="store_true", help="segflow's int8 pass off")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads for both runtimes (0: their defaults)")
    args = parser.parse_args(argv)
    if args.threads:   # segflow's kernels run on torch's intra-op pool
        import torch
        torch.set_num_threads(args.threads)
    corpus = Corpus.open()
    rows = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        entry = obtain(corpus, model)
        if entry.path is None:
            print(f"{model}: no quantized model: {entry.failure}")
            continue
        optimize = {"quantize": False} if args.no_int8 else None
        if args.agree:
            top1, within, worst = agreement(entry.path, args.agree, optimize, args.threads)
            print(f"{model} qdq: top-1 agreement {top1:.1%} over {args.agree} images, "
                  f"{within:.2%} of outputs within one step, worst {worst:.2f} steps")
        row = bench_entry(entry, corpus.built(model, False), args.seconds,
                          runtimes=("segflow", "onnxruntime"), optimize=optimize,
                          ort_threads=args.threads)
        rows.append(replace(row, label=f"{model}/qdq-u8s8"))
        corpus.release(model, False)
    print(format_rows(rows, ("segflow", "onnxruntime")))


if __name__ == "__main__":
    main()
