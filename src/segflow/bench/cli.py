"""The ``segflow bench`` and ``segflow profile`` subcommands (see docs/benchmarking.md).

``register(subparsers)`` is called by :mod:`segflow.cli` (run them as ``segflow bench``);
the model arguments they share with it live in :mod:`segflow.model_args`.
"""

from __future__ import annotations

import argparse

from segflow import progress
from segflow.bench import baseline as gate
from segflow.bench.modes import (
    DEFAULT_MODELS,
    DEFAULT_MODES,
    DEFAULT_PEERS,
    MODES,
    PEER_NAMES,
)
from segflow.model_args import (
    add_input_args,
    add_model_args,
    check_device,
    non_negative_float,
    non_negative_int,
    open_model,
    parse_dim_arg,
    parse_input_arg,
    positive_float,
    positive_int,
)
from segflow.progress_display import shown

DEFAULT_SECONDS = 8.0  # timed seconds per model; keeps the default set under ~2 minutes


def _csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none")


def _cmd_bench(args: argparse.Namespace) -> int:
    # The runner and report need torch and onnx: imported here, not to build --help.
    from segflow.bench.report import format_results, plot_results, require_matplotlib
    from segflow.bench.runner import BenchSettings, resolve_models, run_benchmark, to_record

    if args.plot:
        require_matplotlib()
    check_device(args.device)
    for text in args.input:     # bad syntax fails before the first model loads
        parse_input_arg(text)
    for text in args.dim:
        parse_dim_arg(text)
    max_slowdown = gate.parse_tolerance(args.max_slowdown)
    baseline = gate.load_record(args.baseline) if args.baseline else None
    counters_only = args.counters_only
    settings = BenchSettings(
        batch_size=args.batch_size, device=args.device, modes=_csv(args.modes),
        peers=() if counters_only else _csv(args.peers),
        warmup=0 if counters_only else args.warmup,
        runs=args.runs, seconds=args.seconds if args.seconds is not None else DEFAULT_SECONDS,
        counters_only=counters_only, settle_s=args.settle, inputs=tuple(args.input),
        dims=tuple(args.dim))
    settings.validate()
    specs = resolve_models(args.models)
    # The command line's display shows the step (segflow.progress); the sessions' own
    # steps (an inductor compile) show beneath it.
    with shown(steps=not args.no_progress), progress.step("segflow bench", 0.0) as step:
        results = run_benchmark(specs, settings,
                                lambda text, fraction: step.update(fraction, text))
    print(format_results(results, counters_only=counters_only))
    for result in results:
        if result.guess_note:
            print(f"{result.model}: {result.guess_note}")
    record = to_record(results, settings)
    for path in (args.json, args.save_baseline):
        if path:
            gate.save_record(record, path)
            print(f"wrote {path}")
    if args.plot:
        plot_results(results, args.plot)
        print(f"wrote {args.plot}")
    if baseline is None:
        return 0
    report = gate.compare(baseline, record, max_slowdown=max_slowdown,
                          timing=not counters_only, baseline_name=args.baseline)
    print()
    print(report.format())
    return 1 if report.failed else 0


def _cmd_profile(args: argparse.Namespace) -> int:
    import segflow

    opened = open_model(args)
    sess, feeds, label = opened.session, opened.feeds.arrays, opened.label
    for _ in range(args.warmup):
        sess.run(None, feeds)
    with segflow.profile() as prof:
        for _ in range(args.runs):
            sess.run(None, feeds)
    stats = sess.last_run_stats
    print(f"model: {label}  ({args.runs} profiled run(s) after {args.warmup} warmup)")
    print("inputs: " + ", ".join(f"{name} {array.dtype}{list(array.shape)}"
                                 for name, array in feeds.items()))
    if stats is not None:
        print(f"counters per run: segments={stats.segments} pushes={stats.pushes} "
              f"syncs={stats.syncs} kernels={stats.kernels} copies={stats.copies} "
              f"engine={stats.engine}")
    print(prof.table(limit=args.limit or None))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``bench`` and ``profile`` to the ``segflow`` command line."""
    p = sub.add_parser(
        "bench", help="benchmark models: latency, counters, peers, regression gate",
        description="Benchmark segflow modes against peers (onnxruntime, PyTorch eager, "
                    "optionally OpenVINO) "
                    "in interleaved rounds; print latency p50/p90/p99, throughput, the "
                    "per-run counters and peak memory; optionally compare against a "
                    "baseline (counters exactly, timings as in-run ratios). Exit 1 when the "
                    "baseline gate finds a regression.")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="built-in name (NAME or NAME:opt=val,...) or ONNX file "
                        f"(default: {' '.join(DEFAULT_MODELS)}); --input and --dim "
                        "apply to each")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="batch size: a file model's first symbolic dim (1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (cpu)")
    add_input_args(p, seed=False)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"segflow modes, comma separated, from {', '.join(MODES)} "
                        f"({','.join(DEFAULT_MODES)})")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"peers, comma separated, from {', '.join(PEER_NAMES)}, or 'none' "
                        f"({','.join(DEFAULT_PEERS)}); openvino runs in float32, "
                        "openvino-default in OpenVINO's default precision (bfloat16 on "
                        "CPUs with AVX512_BF16 or AMX)")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="warmup rounds per model (1)")
    amount = p.add_mutually_exclusive_group()
    amount.add_argument("--runs", type=positive_int, default=None,
                        help="timed rounds per model")
    amount.add_argument("--seconds", type=positive_float, default=None,
                        help=f"timed seconds per model, at least 3 rounds ({DEFAULT_SECONDS:g})")
    p.add_argument("--settle", type=non_negative_float, default=0.1, metavar="SECONDS",
                   help="untimed pause whenever the runtime changes (segflow, each "
                        "peer): a runtime's thread pool spins after a run (onnxruntime's "
                        "~40 ms) and would slow the next variant (0.1; 0 measures that "
                        "interference)")
    p.add_argument("--json", metavar="PATH", help="write the machine-readable record")
    p.add_argument("--save-baseline", metavar="PATH", help="write the record as a baseline")
    p.add_argument("--baseline", metavar="PATH",
                   help="compare with a baseline; exit 1 on a regression")
    p.add_argument("--max-slowdown", default="10%",
                   help="tolerance for timing ratios vs the baseline (10%%)")
    p.add_argument("--counters-only", action="store_true",
                   help="no timing, no peers: run each model once per mode and record "
                        "counters (the cheap, deterministic CI gate)")
    p.add_argument("--plot", metavar="PNG", help="draw latency per variant (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "profile", help="profile a model: per-op and per-engine-call table, Chrome trace",
        description="Run a model under segflow.profile(); print the aggregate tables "
                    "(per engine call and per op type) and optionally write a Chrome trace.")
    add_model_args(p)
    p.add_argument("--trace", metavar="PATH", help="write a Chrome trace JSON file")
    p.add_argument("--runs", type=positive_int, default=1, help="profiled runs (1)")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="unprofiled runs first (1)")
    p.add_argument("--limit", type=non_negative_int, default=25,
                   help="op rows shown (25; 0 = all)")
    p.set_defaults(func=_cmd_profile)
