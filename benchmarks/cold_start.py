"""Cold start: loading a model and its first runs, segflow against onnxruntime.

    python benchmarks/cold_start.py                          # ResNet-50, MobileNetV2, BERT-base
    python benchmarks/cold_start.py --models mobilenet_v2 --repeats 8
    python benchmarks/cold_start.py --corpus mobilenet_v2/torchscript,bert_base/dynamo

What a process pays before its steady run: importing the runtime's session
module (torch and onnx are already in the process: the models are built with
them), making the session from the serialized model (segflow: reading the ONNX
graph, the graph passes, weight packing and the Winograd transform;
onnxruntime: its graph optimizations and prepacking), the first run (segflow
builds its libdnnl primitives, ~0.5 ms of JIT each, and records the replay) and
the second. Each measurement is a fresh process that builds the model,
serializes it, then times the import, ``InferenceSession(bytes)``, run 1, run 2
and the median of five more; the two runtimes alternate, ``--repeats`` processes
each. Segflow's package cache stays as the environment has it
(``SEGFLOW_CACHE_DIR``): the native kernels are compiled once per cache, not per
process, so run it once first to leave that out. Printed: median ms of each
phase per runtime, and segflow's load + first run over onnxruntime's, the
import left out (where ``PYTHONDONTWRITEBYTECODE`` is set, as on the development
VMs, every process compiles segflow's sources: ~0.5 s against ~0.2 s with
bytecode caches).

``--corpus label/exporter,...`` times the corpus's exports instead (``_corpus_build.py``,
opset 18, cached under ``SEGFLOW_CACHE_DIR``: run it once first so that no process
exports), each session made from the file, with the corpus's feeds at its ``bench_seq``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

MODELS = ("resnet50", "mobilenet_v2", "bert_base")
PHASES = ("import", "load", "run1", "run2", "steady")


def _corpus_model(spec: str) -> tuple[str, dict[str, Any]]:
    """The file of the corpus entry ``label/exporter`` and its feeds at batch 1."""
    from _corpus_build import Corpus, EntryId, Exporter
    from _corpus_models import MODELS as CORPUS

    label, exporter = spec.split("/")
    corpus = Corpus.open()
    entry = corpus.obtain(EntryId(label, Exporter(exporter), 18, False))
    if entry.path is None:
        raise RuntimeError(f"{spec}: no export ({entry.failure})")
    model = CORPUS[label]
    return entry.path, model.feeds(corpus.built(label, False), 1, model.bench_seq)


def child(runtime: str, name: str, threads: int) -> dict[str, float]:
    """In a fresh process: ms for the session and its runs (``name``: a built-in model,
    or ``label/exporter`` of the corpus)."""
    from segflow import models

    data: str | bytes
    if "/" in name:
        data, feeds = _corpus_model(name)
    else:
        data = models.build(name).SerializeToString()
        feeds = models.example_inputs(name, batch_size=1)
    start = time.perf_counter()
    if runtime == "onnxruntime":
        import onnxruntime as ort
    else:
        import segflow.runtime.session
    times = {"import": time.perf_counter() - start}
    start = time.perf_counter()
    if runtime == "onnxruntime":
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        sess: Any = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    else:
        sess = segflow.runtime.session.InferenceSession(data, intra_op_threads=threads)
    times["load"] = time.perf_counter() - start
    for phase in ("run1", "run2"):
        start = time.perf_counter()
        sess.run(None, feeds)
        times[phase] = time.perf_counter() - start
    steady = []
    for _ in range(5):
        start = time.perf_counter()
        sess.run(None, feeds)
        steady.append(time.perf_counter() - start)
    times["steady"] = statistics.median(steady)
    return {k: v * 1e3 for k, v in times.items()}


def measure(runtime: str, name: str, threads: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", runtime, name,
                          "--threads", str(threads)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{runtime} on {name} failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated built-in models")
    parser.add_argument("--corpus", default=None,
                        help="comma-separated corpus entries (label/exporter) instead")
    parser.add_argument("--repeats", type=int, default=4, help="fresh processes per runtime")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("RUNTIME", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.threads)))
        return 0
    from segflow import models

    names = args.models.split(",") if args.corpus is None else args.corpus.split(",")
    unknown = [n for n in names if n not in models.available() and "/" not in n]
    if unknown:
        print(f"cold_start.py: unknown model {unknown[0]!r}; available: "
              f"{', '.join(models.available())}", file=sys.stderr)
        return 2
    print(f"cold start, batch 1, {args.threads} threads, median of {args.repeats} fresh "
          "processes per runtime; ms")
    for name in names:
        rows: dict[str, list[dict[str, float]]] = {"segflow": [], "onnxruntime": []}
        for _ in range(args.repeats):
            for runtime in rows:
                rows[runtime].append(measure(runtime, name, args.threads))
        medians = {rt: {p: statistics.median(r[p] for r in runs) for p in PHASES}
                   for rt, runs in rows.items()}
        for runtime, m in medians.items():
            print(f"  {name:<13} {runtime:<12} " + "  ".join(f"{p} {m[p]:8.1f}" for p in PHASES))
        sf, ort = medians["segflow"], medians["onnxruntime"]
        print(f"  {name:<13} load + run1: segflow / onnxruntime "
              f"{(sf['load'] + sf['run1']) / (ort['load'] + ort['run1']):.2f}, "
              f"run1 / steady: segflow {sf['run1'] / sf['steady']:.2f}, "
              f"onnxruntime {ort['run1'] / ort['steady']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
