"""Fuzz segflow against onnxruntime: random valid graphs, broken models, bad feeds.

Each case (``seed:index``) ends as one outcome (``tests/fuzz_cases.py``, OUTCOMES):
equal, refused, unsupported, strict, or a failure: wrong, mask, raw, crash, hang.
The cases run in a worker process, so a crash or a hang is an outcome too.

    python benchmarks/fuzz.py --cases 2000                 # the table, one line a failure
    python benchmarks/fuzz.py --cases 2000 --seed 3
    python benchmarks/fuzz.py --case 0:123 --verbose       # one case: its graph and result
    python benchmarks/fuzz.py --cases 500 --optimize layout=off --optimize native=off

``--optimize key=value`` (on/off) switches what the sessions run, through the
``SEGFLOW_*`` variables: the passes (``fold_constants``, ``fuse``, ``dense_chain``,
``layout``, ``plan_memory``), ``direct`` (libdnnl's convolutions and pools),
``blocked``, ``arena``, ``replay``, ``prebuild``, ``native`` (every native kernel),
``native_linear``, ``strassen``, ``winograd``, ``native_stem``; and ``compile`` =
auto|codegen|onednn|inductor|none. Exit status 1 when a case failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
if (ROOT / "src" / "segflow").is_dir():
    sys.path.insert(0, str(ROOT / "src"))

import fuzz_cases  # noqa: E402 - found through the path set above

# --optimize key -> (variable, value for "on", value for "off")
SWITCHES = {
    "fold_constants": ("SEGFLOW_NO_FOLD", "0", "1"),
    "fuse": ("SEGFLOW_NO_FUSE", "0", "1"),
    "dense_chain": ("SEGFLOW_NO_DENSE_CHAIN", "0", "1"),
    "layout": ("SEGFLOW_NO_LAYOUT", "0", "1"),
    "plan_memory": ("SEGFLOW_NO_MEMORY_PLAN", "0", "1"),
    "direct": ("SEGFLOW_ONEDNN_DIRECT", "1", "0"),
    "blocked": ("SEGFLOW_ONEDNN_BLOCKED", "1", "0"),
    "arena": ("SEGFLOW_ARENA", "1", "0"),
    "replay": ("SEGFLOW_ONEDNN_REPLAY", "1", "0"),
    "prebuild": ("SEGFLOW_PREBUILD", "1", "0"),
    "native": ("SEGFLOW_NATIVE", "1", "0"),
    "native_linear": ("SEGFLOW_NATIVE_LINEAR", "1", "0"),
    "strassen": ("SEGFLOW_STRASSEN", "1", "0"),
    "winograd": ("SEGFLOW_WINOGRAD", "1", "0"),
    "native_stem": ("SEGFLOW_NATIVE_STEM", "1", "0"),
}


def switches_env(items: list[str]) -> dict[str, str]:
    """``["layout=off", "compile=none"]`` -> the ``SEGFLOW_*`` variables they set."""
    env: dict[str, str] = {}
    for item in items:
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip().lower()
        if key == "compile":
            env["SEGFLOW_COMPILE"] = value
            continue
        if key not in SWITCHES or value not in ("on", "off", "1", "0"):
            raise SystemExit(f"--optimize {item!r}: expected one of {', '.join(SWITCHES)} "
                             f"or compile, = on|off")
        name, on, off = SWITCHES[key]
        env[name] = on if value in ("on", "1") else off
    return env


def table(results: list[fuzz_cases.Result]) -> str:
    kinds = sorted({r.kind for r in results}, key=lambda k: (k != "valid", k))
    counts = Counter((r.kind, r.outcome) for r in results)
    outcomes = [o for o in fuzz_cases.OUTCOMES if any(r.outcome == o for r in results)]
    width = max(len(k) for k in kinds + ["kind", "all"])
    lines = ["  ".join([f"{'kind':<{width}}", *(f"{o:>11}" for o in outcomes), f"{'cases':>6}"])]
    for kind in [*kinds, "all"]:
        row = [counts[(kind, o)] if kind != "all" else sum(counts[(k, o)] for k in kinds)
               for o in outcomes]
        lines.append("  ".join([f"{kind:<{width}}", *(f"{n:>11}" for n in row),
                                f"{sum(row):>6}"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", action="append", default=[],
                        help="run only this case id (seed:index); repeatable")
    parser.add_argument("--optimize", action="append", default=[], metavar="KEY=on|off")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a case may take")
    parser.add_argument("--verbose", action="store_true", help="print each case's graph")
    args = parser.parse_args(argv)
    env = switches_env(args.optimize)
    ids = args.case or fuzz_cases.case_ids(args.seed, args.cases)
    if args.verbose:
        import onnx

        for case_id in ids:
            case = fuzz_cases.make_case(*fuzz_cases.parse_case_id(case_id))
            print(f"{case_id} {case.kind}")
            print(onnx.printer.to_text(onnx.load_from_string(case.model).graph))
            print("feeds:", {k: f"{getattr(v, 'dtype', type(v))}{list(getattr(v, 'shape', []))}"
                             for k, v in case.feeds.items()})
    start = time.perf_counter()
    results = fuzz_cases.run_guarded(ids, timeout_s=args.timeout, env=env)
    seconds = time.perf_counter() - start
    settings = ", ".join(args.optimize) or "defaults"
    print(f"{len(results)} cases (seed {args.seed}, {settings}) in {seconds:.1f} s")
    print(table(results))
    failures = [r for r in results if r.outcome in fuzz_cases.FAILING]
    for r in failures:
        print(f"{r.outcome:>5} {r.case_id} {r.kind}: {r.detail}")
    if args.verbose or args.case:
        for r in results:
            if r.outcome not in fuzz_cases.FAILING:
                print(f"{r.outcome:>5} {r.case_id} {r.kind}: {r.detail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
