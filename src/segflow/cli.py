"""The ``segflow`` command line: run | check | explain | profile | bench | cache | train-demo.

Each subcommand is one ``_cmd_*`` function; ``_build_parser`` is the dispatch table.
Models are given as an ONNX path or as ``builtin:NAME`` (see ``segflow run --list``);
with no model the default built-in model (``builtin:resnet50``) is used.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import numpy as np

from segflow import __version__
from segflow.errors import SegflowError
from segflow.model_args import (
    add_model_args,
    checksum,
    load_model_arg,
    open_session,
    parse_inputs,
)
from segflow.progress import Topic
from segflow.progress_display import shown


# -- subcommands ------------------------------------------------------------------------
def _cmd_run(args: argparse.Namespace) -> int:
    if args.list:
        from segflow import models
        for name in models.available():
            print(f"{name:14s} {models.info(name).summary}")
        return 0
    sess, label = open_session(args)
    feeds = parse_inputs(args.input, sess, args.seed, label)
    names = [o.name for o in sess.get_outputs()]
    outputs = sess.run(None, feeds)
    for _ in range(args.repeat - 1):
        outputs = sess.run(None, feeds)
    stats = sess.last_run_stats
    print(f"model: {label}")
    for name, array in feeds.items():
        print(f"  input  {name}: {array.dtype}{list(array.shape)}")
    for name, out in zip(names, outputs):
        print(f"  output {name}: {out.dtype}{list(out.shape)} checksum={checksum(out)} "
              f"mean={float(np.mean(out)) if out.size else 0.0:.6g}")
    if stats is not None:
        print(f"run: {stats.wall_time_s * 1e3:.2f} ms  segments={stats.segments} "
              f"pushes={stats.pushes} syncs={stats.syncs} kernels={stats.kernels} "
              f"copies={stats.copies} engine={stats.engine}")
    report = sess.compile_report
    # A backend that compiles on the first run (onednn, inductor) makes run 1 slower.
    hint = "  (run 1 includes it; --repeat N to time later runs)" \
        if report.first_run_compile_s and args.repeat == 1 else ""
    print(report.describe() + hint)
    for line in sess.kernel_report():
        print(line)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        import onnxruntime as ort
    except ImportError:
        raise SegflowError("segflow check needs onnxruntime: pip install onnxruntime") from None
    import onnx

    sess, label = open_session(args)
    feeds = parse_inputs(args.input, sess, args.seed, label)
    model, _ = load_model_arg(args.model)
    payload = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    ref = ort.InferenceSession(payload, providers=["CPUExecutionProvider"])
    expected = ref.run(None, feeds)
    got = sess.run(None, feeds)
    worst = 0
    print(f"model: {label}  (tolerance: abs {args.atol:g} + rel {args.rtol:g})")
    for out, a, b in zip(sess.get_outputs(), got, expected):
        if a.shape != b.shape:
            print(f"  {out.name}: shape {list(a.shape)} != onnxruntime {list(b.shape)}  FAIL")
            worst = 1
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        abs_err = float(np.max(np.abs(a64 - b64))) if a.size else 0.0
        rel_err = float(np.max(np.abs(a64 - b64) / (np.abs(b64) + 1e-12))) if a.size else 0.0
        ok = bool(np.all(np.abs(a64 - b64) <= args.atol + args.rtol * np.abs(b64)))
        print(f"  {out.name}: max abs err {abs_err:.3g}  max rel err {rel_err:.3g}  "
              f"{'ok' if ok else 'FAIL'}")
        worst = worst or (0 if ok else 1)
    return worst


def _cmd_explain(args: argparse.Namespace) -> int:
    sess, label = open_session(args)
    print(f"model: {label}")
    print(sess.explain())
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path
    from typing import Any

    from segflow.cache_descriptions import NativeBuildDescription, PackageDescription, age
    from segflow.cache_store import ArtifactStore
    from segflow.kernels.native.build import cached_builds, clear_builds
    from segflow.runtime.aot_inductor import cached_packages, clear_packages
    from segflow.settings import cache_max_bytes

    packages, native = ArtifactStore.inspect("aoti"), ArtifactStore.inspect("native")
    if args.clear:
        for what, store, cleared in (("packages", packages, clear_packages()),
                                     ("native kernel builds", native, clear_builds())):
            print(f"removed {cleared.files} {what} ({cleared.bytes / (1 << 20):.1f} MiB) "
                  f"from {store.shared}")
            if cleared.partial_builds:
                print(f"  and {cleared.partial_builds} partial builds left by killed processes")
            for skipped in cleared.skipped:
                print(f"  left alone: {skipped}")
        return 0
    listed = cached_packages()
    sizes = [p.stat().st_size for p in listed]
    print(f"inductor packages: {packages.shared}")
    print(f"{len(sizes)} packages, {sum(sizes) / (1 << 20):.1f} MiB "
          f"(cap {cache_max_bytes() >> 20} MiB: $SEGFLOW_CACHE_MAX_MB; least recently used "
          "packages are evicted when a new one is written)")
    now = time.time()

    def entry(store: ArtifactStore, path: Path, parse: Callable[[object], Any]) -> str:
        """One listed artifact: what its description says (read as untrusted data), its
        size, and when it was built (else last used)."""
        described = parse(store.description(path.name))
        st = path.stat()
        size = f"{st.st_size / (1 << 20):.1f} MiB"
        if described is None:
            return f"  {path.name}  (no description)  {size}  used {age(now - st.st_mtime)}"
        return f"  {described.describe()}  {size}  built {age(now - described.created)}  " \
               f"[{path.name}]"

    if args.list:
        for path in listed:
            print(entry(packages, path, PackageDescription.parse))
    builds = cached_builds()
    print(f"native kernels: {native.shared}: {len(builds)} builds, "
          f"{sum(p.stat().st_size for p in builds) / (1 << 20):.1f} MiB (rebuilt on demand)")
    if args.list:
        for path in builds:
            print(entry(native, path, NativeBuildDescription.parse))
    for store in (packages, native):
        if store.distrust:
            print(f"not trusted: {store.distrust}; each process builds its own "
                  f"{store.kind} artifacts until it is fixed")
    return 0


def _cmd_train_demo(args: argparse.Namespace) -> int:
    import importlib

    try:
        demo = importlib.import_module("segflow.training_demo")
    except ImportError:
        raise SegflowError("training is not available in this build") from None
    return int(demo.main(args.rest) or 0)


# -- parser -----------------------------------------------------------------------------
Command = Callable[[argparse.Namespace], int]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="segflow",
        description="Run ONNX models in bulk segments through a dependency engine, "
                    "with counters (segments, pushes, syncs, kernels) that make "
                    "performance regressions visible.")
    parser.add_argument("--version", action="version", version=f"segflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="run a model and print its outputs",
                       description="Run a model once on given or random inputs; print output "
                                   "names, shapes, checksums and the run's counters.")
    add_model_args(p)
    p.add_argument("--repeat", type=int, default=1, help="run N times, print the last")
    p.add_argument("--list", action="store_true", help="list the built-in models and exit")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("check", help="compare segflow with onnxruntime",
                       description="Run segflow and onnxruntime on the same random inputs; "
                                   "print max abs/rel error per output; exit 1 over tolerance.")
    add_model_args(p)
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (1e-4)")
    p.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (1e-3)")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("explain", help="print the segment plan and boundary reasons",
                       description="Print the segment table (index, first..last node, node "
                                   "count, exec types, device, boundary reason) and totals.")
    add_model_args(p, with_inputs=False)
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("cache", help="show or clear the compiled-segment package cache",
                       description="Show where compile=inductor keeps its packages "
                                   "($SEGFLOW_CACHE_DIR, else ~/.cache/segflow) and how much "
                                   "they take; writing a package evicts the least recently "
                                   "used ones beyond $SEGFLOW_CACHE_MAX_MB. Under "
                                   "compile=auto a small segment runs its package when one "
                                   "is cached. Also the native kernels built there "
                                   "(kernels/native), which any process rebuilds when missing, "
                                   "and whether the cache is trusted (only its user may "
                                   "own or write it).")
    p.add_argument("--list", action="store_true", help="list each package with its size")
    p.add_argument("--clear", action="store_true",
                   help="delete every package and native kernel build, and partial builds "
                        "left by killed processes (links are left alone, never followed)")
    p.set_defaults(func=_cmd_cache)

    # The demo parses its own flags (and --help), so this parser adds none.
    p = sub.add_parser("train-demo", help="train a small CNN on the bundled digits data set",
                       add_help=False)
    p.set_defaults(func=_cmd_train_demo, rest=[])

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


def _register_profiling(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``profile`` and ``bench`` live with the profiler/bench packages."""
    try:
        from segflow.bench.cli import register as register_bench
    except ImportError:
        return
    register_bench(sub)


_EXTRA_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (  # type: ignore[type-arg]
    _register_profiling,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    # No command means `run`: `segflow`, `segflow MODEL`, `segflow --device cpu MODEL`
    # (an unknown flag is then run's error, not a silent run of the default model).
    commands = next(action.choices for action in parser._actions
                    if isinstance(action, argparse._SubParsersAction))
    if not words or words[0] not in commands and words[0] not in ("-h", "--help",
                                                                   "--version"):
        words = ["run", *words]
    # train-demo passes its flags through to the demo; every other command must know them all.
    args, extra = parser.parse_known_args(words)
    if args.command == "train-demo":
        args.rest = [*args.rest, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # Long steps show on stderr while they run (a terminal only); notices once, at the end,
    # with the flags that change what they say, which the library does not know.
    hints = {Topic.CACHED_PACKAGES: "--compile codegen runs without them, "
                                    "segflow cache --clear removes them"}
    try:
        with shown(steps=not getattr(args, "no_progress", False), hints=hints):
            return int(args.func(args))
    except SegflowError as exc:
        print(f"segflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
