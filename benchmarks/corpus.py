"""A corpus of real ONNX exports: transformers and torch models exported by both torch
exporters, checked against onnxruntime and timed against onnxruntime, OpenVINO and
torch eager.

    python benchmarks/corpus.py --list                        # the models and entries
    python benchmarks/corpus.py                               # build (or find) every export
    python benchmarks/corpus.py --check                       # segflow vs onnxruntime
    python benchmarks/corpus.py --check --models bert_base,resnet50 --exporters dynamo
    python benchmarks/corpus.py --bench --opsets 18           # latency, batch 1
    python benchmarks/corpus.py --check --small               # the narrow test variants

Every model is built from a config with random weights (seeded; nothing is
downloaded), wrapped to be called with keyword arguments and to return plain
tensors, and exported with ``torch.onnx.export(dynamo=False)`` and
``dynamo=True`` at opsets 17 and 18, with a dynamic batch axis (and sequence axis
for text models). Exports are cached under ``$SEGFLOW_CACHE_DIR/corpus/``
(``segflow cache`` trust rules; a file is also checked with ``onnx.checker``
before use), listed in ``manifest.json`` there, with each failed export's reason.
Building the whole corpus takes many minutes; ``--models`` narrows it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _corpus_build import OPSETS, Corpus, Entry, Exporter, entries  # noqa: E402
from _corpus_models import MODELS  # noqa: E402


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=_csv, default=list(MODELS),
                        help="comma-separated model names (default: all; see --list)")
    parser.add_argument("--exporters", type=_csv, default=[e.value for e in Exporter],
                        help="torchscript,dynamo")
    parser.add_argument("--opsets", type=_csv, default=[str(o) for o in OPSETS])
    parser.add_argument("--small", action="store_true",
                        help="the narrow, few-layer variants (for tests)")
    parser.add_argument("--list", action="store_true", help="list models and cached entries")
    parser.add_argument("--rebuild", action="store_true",
                        help="export again, also where an export failed before")
    parser.add_argument("--check", action="store_true", help="segflow vs onnxruntime")
    parser.add_argument("--bench", action="store_true", help="latency at batch 1")
    parser.add_argument("--runtimes", type=_csv, default=None,
                        help="for --bench: segflow,onnxruntime,openvino,torch")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="for --bench: timed seconds per model (at least 3 rounds)")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; available: {', '.join(MODELS)}")
    try:
        args.exporters = [Exporter(e) for e in args.exporters]
        args.opsets = [int(o) for o in args.opsets]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _list(corpus: Corpus, models: list[str]) -> None:
    for name in models:
        model = MODELS[name]
        seqs = f" seq {','.join(map(str, model.seq_lens))}" if model.seq_lens else ""
        print(f"{name:<22} {model.kind.value:<6}{seqs:<12} {model.description}")
    print(f"\ncache: {corpus.store.directory}" +
          (f" (not the cache: {corpus.distrust})" if corpus.distrust else ""))
    for label, record in sorted(corpus.manifest.items()):
        state = record.get("failure") or f"{record.get('nodes')} nodes, " \
                                         f"{record.get('bytes', 0) / 1e6:.1f} MB"
        print(f"  {label:<44} {state}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    corpus = Corpus.open()
    if args.list:
        _list(corpus, args.models)
        return 0
    if corpus.distrust:
        print(f"note: the cache is not used ({corpus.distrust}); building into "
              f"{corpus.store.directory}", file=sys.stderr)
    import _corpus_bench
    import _corpus_check

    check_rows: list[_corpus_check.CheckRow] = []
    bench_rows: list[_corpus_bench.BenchRow] = []
    previous = None
    for entry_id in entries(args.models, args.exporters, args.opsets, args.small):
        if previous is not None and previous != entry_id.model:
            corpus.release(previous, args.small)
        previous = entry_id.model
        entry: Entry = corpus.obtain(entry_id, rebuild=args.rebuild)
        built = corpus.built(entry_id.model, entry_id.small)
        state = entry.failure or ("cached" if entry.cached else f"built in {entry.build_s:.1f} s")
        state += f"; {entry.note}" if entry.note else ""
        print(f"{entry_id.label:<44} {state}", file=sys.stderr, flush=True)
        if args.check:
            rows = _corpus_check.check_entry(entry, built)
            check_rows += rows
            for row in rows:
                print(f"  {row.shape:<9} {row.verdict.value:<13} metric {row.metric:.3g} "
                      f"{row.reason}", file=sys.stderr, flush=True)
        if args.bench:
            runtimes = args.runtimes or list(_corpus_bench.RUNTIMES)
            bench_rows.append(_corpus_bench.bench_entry(entry, built, args.seconds,
                                                        runtimes=runtimes))
    if check_rows:
        print(_corpus_check.format_rows(check_rows))
    if bench_rows:
        print(_corpus_bench.format_rows(bench_rows, args.runtimes or _corpus_bench.RUNTIMES))
    if args.json:
        record = {"check": [{**r.__dict__, "verdict": r.verdict.value} for r in check_rows],
                  "bench": [r.__dict__ for r in bench_rows],
                  "manifest": corpus.manifest}
        Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    failed = [r for r in check_rows if r.verdict.value in ("wrong", "load error", "run error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
