"""The ``segflow`` command line: run | check | explain | profile | bench | cache | doctor |
train-demo.

Each subcommand is one ``_cmd_*`` function; ``_build_parser`` is the dispatch table.
Models are given as an ONNX path or as ``builtin:NAME`` (see ``segflow run --list``);
with no model the default built-in model (``builtin:resnet50``) is used.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from segflow import __version__
from segflow.errors import SegflowError, SegflowWarning
from segflow.model_args import (
    CliParser,
    add_model_args,
    checksum,
    non_negative_float,
    open_model,
    positive_int,
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
    opened = open_model(args)
    sess, feeds = opened.session, opened.feeds.arrays
    names = [o.name for o in sess.get_outputs()]
    outputs = sess.run(None, feeds)
    for _ in range(args.repeat - 1):
        outputs = sess.run(None, feeds)
    stats = sess.last_run_stats
    print(f"model: {opened.label}")
    for name, array in feeds.items():
        print(f"  input  {name}: {array.dtype}{list(array.shape)}")
    for name, out in zip(names, outputs):
        print(f"  output {name}: {_describe_output(out)}")
    if stats is not None:
        print(f"run: {stats.wall_time_s * 1e3:.2f} ms  segments={stats.segments} "
              f"pushes={stats.pushes} syncs={stats.syncs} kernels={stats.kernels} "
              f"copies={stats.copies} engine={stats.engine}")
    report = sess.compile_report
    # A backend that compiles on the first run (onednn, inductor) makes run 1 slower.
    hint = "  (run 1 includes it; --repeat N to time later runs)" \
        if report.first_run_compile_s and args.repeat == 1 else ""
    print(report.describe() + hint)
    if args.verbose:
        for line in sess.kernel_report():
            print(line)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        import onnxruntime as ort
    except ImportError:
        raise SegflowError("segflow check needs onnxruntime: pip install onnxruntime") from None

    opened = open_model(args)
    sess, feeds, label = opened.session, opened.feeds.arrays, opened.label
    options = ort.SessionOptions()
    options.log_severity_level = 4   # its errors come back as exceptions: one line here
    try:
        ref = ort.InferenceSession(opened.model.reference_source, options,
                                   providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - any refusal of onnxruntime's is reported
        raise SegflowError(f"onnxruntime cannot load {label}: {_ort_message(exc)}") from None
    try:
        expected = ref.run(None, feeds)
    except Exception as exc:  # noqa: BLE001
        raise SegflowError(f"onnxruntime cannot run {label} on these inputs "
                           f"({opened.feeds.describe()}): {_ort_message(exc)}") from None
    try:
        got = sess.run(None, feeds)
    except SegflowError as exc:
        raise SegflowError(f"segflow cannot run {label}: {exc}") from None
    print(f"model: {label}")
    print(f"inputs: {opened.feeds.describe()}")
    print(f"metric: worst |segflow - ort| / (atol + rtol*|ort|) over the elements, "
          f"atol={args.atol:g} rtol={args.rtol:g}; <= 1 passes; NaN and Inf must be "
          "where onnxruntime has them")
    failed = False
    for out, a, b in zip(sess.get_outputs(), got, expected):
        verdict = compare_values(a, b, args.atol, args.rtol)
        print(f"  {out.name}: {verdict.describe()}")
        failed = failed or not verdict.ok
    return 1 if failed else 0


@dataclass(frozen=True, slots=True)
class Verdict:
    """One output of ``check``: the worst tolerance ratio, the max abs error, and what
    else failed (shapes, NaN/Inf positions)."""

    worst: float
    max_abs: float
    nonfinite: int = 0          # NaN/Inf positions both sides agree on
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.worst <= 1

    def describe(self) -> str:
        if self.problem and math.isnan(self.worst):
            return f"{self.problem}  FAIL"
        same = f"  {self.nonfinite} NaN/Inf in the same places" if self.nonfinite else ""
        problem = f"  {self.problem}" if self.problem else ""
        return (f"worst {self.worst:.3g}  max abs err {self.max_abs:.3g}{same}{problem}  "
                f"{'ok' if self.ok else 'FAIL'}")


def _describe_output(out: Any) -> str:
    """An output line's text: dtype, shape, checksum and mean; a sequence's per tensor."""
    if out is None:
        return "empty optional"
    if isinstance(out, list):
        return f"sequence of {len(out)}" + "".join(
            f"\n    [{i}] {_describe_output(t)}" for i, t in enumerate(out))
    mean = float(np.mean(out)) if out.size else 0.0
    return f"{out.dtype}{list(out.shape)} checksum={checksum(out)} mean={mean:.6g}"


def compare_values(a: Any, b: Any, atol: float, rtol: float) -> Verdict:
    """:func:`compare_outputs` over any output: a sequence (a list) tensor by tensor, its
    worst ratio the worst of them; an empty optional (None) only matches None."""
    if a is None or b is None or isinstance(a, list) != isinstance(b, list):
        if a is None and b is None:
            return Verdict(0.0, 0.0)
        return Verdict(math.nan, math.nan, problem=f"{_kind(a)} != onnxruntime {_kind(b)}")
    if not isinstance(a, list):
        return compare_outputs(a, b, atol, rtol)
    if len(a) != len(b):
        return Verdict(math.nan, math.nan, problem=f"a sequence of {len(a)} != onnxruntime "
                                                   f"{len(b)}")
    verdicts = [compare_outputs(x, y, atol, rtol) for x, y in zip(a, b)]
    problems = [f"[{i}] {v.problem}" for i, v in enumerate(verdicts) if v.problem]
    def worst(values: list[float]) -> float:   # NaN (a tensor not compared) wins
        return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)
    return Verdict(worst([v.worst for v in verdicts]), worst([v.max_abs for v in verdicts]),
                   nonfinite=sum(v.nonfinite for v in verdicts), problem="; ".join(problems))


def _kind(value: Any) -> str:
    if value is None:
        return "an empty optional"
    return f"a sequence of {len(value)}" if isinstance(value, list) else "a tensor"


def compare_outputs(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> Verdict:
    """segflow's output ``a`` against onnxruntime's ``b``: ``|a - b| <= atol + rtol*|b|``
    elementwise, reported as the worst ratio ``|a - b| / (atol + rtol*|b|)`` (<= 1
    passes); NaN and Inf must sit where ``b`` has them (and Inf with its sign)."""
    if a.shape != b.shape:
        return Verdict(math.nan, math.nan,
                       problem=f"shape {list(a.shape)} != onnxruntime {list(b.shape)}")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(a64) & np.isfinite(b64)
    same = (np.isnan(a64) & np.isnan(b64)) | (~finite & (a64 == b64))
    misplaced = int(np.count_nonzero(~finite & ~same))
    diff = np.abs(a64[finite] - b64[finite])
    bound = atol + rtol * np.abs(b64[finite])
    # With both tolerances 0 the bound is 0: any difference is then infinitely over it.
    ratio = np.where(bound > 0, diff / np.where(bound > 0, bound, 1),
                     np.where(diff > 0, np.inf, 0.0))
    return Verdict(float(ratio.max()) if ratio.size else 0.0,
                   float(diff.max()) if diff.size else 0.0,
                   nonfinite=int(np.count_nonzero(~finite & same)),
                   problem=f"NaN/Inf differ from onnxruntime's at {misplaced} positions"
                   if misplaced else "")


def _ort_message(exc: BaseException) -> str:
    """onnxruntime's message without the C++ source location and signature it embeds."""
    return re.sub(r"/onnxruntime_src/\S+ (?:[\w:~]+\([^)]*\) )?", "", _first_line(exc))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _cmd_explain(args: argparse.Namespace) -> int:
    opened = open_model(args)
    print(f"model: {opened.label}")
    print(f"inputs: {opened.feeds.describe()}")
    print(opened.session.explain())
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

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


def _cmd_doctor(args: argparse.Namespace) -> int:
    from segflow.doctor import report

    print("\n".join(report()))
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
    parser = CliParser(
        prog="segflow",
        description="Run ONNX models in bulk segments through a dependency engine, "
                    "with counters (segments, pushes, syncs, kernels) that make "
                    "performance regressions visible.")
    parser.add_argument("--version", action="version", version=f"segflow {__version__}")
    parser.add_argument("--traceback", action="store_true",
                        help="on an unexpected error, print its full traceback instead of "
                             "one line (accepted anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="run a model and print its outputs",
                       description="Run a model once on given or random inputs; print its "
                                   "inputs, output names, shapes and checksums, the run's "
                                   "counters and the compile line (--verbose: what each "
                                   "kernel family did).")
    add_model_args(p)
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="run N times, print the last")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print the kernel report (libdnnl, native kernels, arena)")
    p.add_argument("--list", action="store_true", help="list the built-in models and exit")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("check", help="compare segflow with onnxruntime",
                       description="Run segflow and onnxruntime on the same inputs. An "
                                   "output passes where |segflow - ort| <= atol + rtol*|ort| "
                                   "at every element and NaN/Inf sit where onnxruntime's "
                                   "do; each output's line gives the worst ratio "
                                   "|segflow - ort| / (atol + rtol*|ort|) (<= 1 passes) and "
                                   "the max abs error. Exit 1 when an output fails, 2 when "
                                   "either runtime cannot load or run the model.")
    add_model_args(p)
    p.add_argument("--atol", type=non_negative_float, default=1e-4,
                   help="absolute tolerance (1e-4)")
    p.add_argument("--rtol", type=non_negative_float, default=1e-3,
                   help="relative tolerance (1e-3)")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("explain", help="print the segment plan and boundary reasons",
                       description="Print the segment table (index, first..last node, node "
                                   "count, exec types, device, boundary reason), the passes "
                                   "and the kernels, with memory planned at the input shapes "
                                   "run would use (--input, --dim).")
    add_model_args(p)
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

    p = sub.add_parser("doctor", help="print what this installation runs with",
                       description="One line each: segflow's version and location, Python, "
                                   "torch (CUDA), onnx, numpy, optional peers, the CPU and the "
                                   "kernel choices it gets, the C compiler and whether the "
                                   "native kernels load (built first if not cached), libdnnl, "
                                   "and the cache directory. For bug reports.")
    p.set_defaults(func=_cmd_doctor)

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
    show_traceback = "--traceback" in words
    words = [w for w in words if w != "--traceback"]
    if "--version" in words and ("--verbose" in words or "-v" in words):
        words = ["doctor"]   # the version with everything a bug report needs
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
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            with shown(steps=not getattr(args, "no_progress", False), hints=hints):
                return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if show_traceback:
            raise
        if isinstance(exc, SegflowError):   # bad input or model: the message names it
            print(f"segflow: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        # Anything else is segflow's bug: one line to say so, the traceback on request;
        # exit 1 either way, as Python's own exit for an uncaught exception.
        print(f"segflow: error: unexpected {_first_line(exc)} (rerun with --traceback "
              "for the full traceback)", file=sys.stderr)
        return 1


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: object = None, line: str | None = None) -> None:
    """segflow's own warnings as one ``segflow: warning:`` line on stderr (Python's format
    adds the file, line and source of the call, which name the CLI, not the user's
    problem); anyone else's as Python prints them."""
    if issubclass(category, SegflowWarning) or "/segflow/" in filename.replace("\\", "/"):
        print(f"segflow: warning: {' '.join(str(message).split())}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


if __name__ == "__main__":
    sys.exit(main())
