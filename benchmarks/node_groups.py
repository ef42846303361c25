"""Where a run's time goes, segflow against onnxruntime, group by group.

    python benchmarks/node_groups.py --model mobilenet_v2
    python benchmarks/node_groups.py --model bert_base --runs 10
    python benchmarks/node_groups.py --model resnet50 --key "(layer\\d+)"

Each runtime runs alone in a fresh process (so neither shares the cores with the
other's threads), under its own profiler: segflow's ``segflow.profile()`` node
spans, onnxruntime's ``enable_profiling`` kernel times. Node names are mapped to
groups by ``--key``, a regular expression searched in each name: its first capture
group that matched is the group (a named group: its name; no groups: the whole
match), and a name it does not match counts as "other". The default key depends
on the model (``KEYS``: MobileNetV2's blocks, ResNet's blocks and stem, BERT's
sublayers with the layer index dropped); onnxruntime's fused nodes keep the name
of one of the nodes they fused, so most land in the group their ops came from.

Printed: per group, ms a run in each runtime and the difference, largest first;
then the sums, and each runtime's unprofiled median wall time over the same
number of runs. A profiled segflow run times node by node (no generated code,
no replayed libdnnl runs), so its sum exceeds its unprofiled run by the
per-node cost (tens of microseconds a node on the 2-core VM); read small groups
with that in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable

# onnxruntime names ResNet's fused stem after its Relu and MaxPool, segflow after its
# Conv: the named group gathers both under "stem".
_RESNET = r"^(layer\d+\.\d+)|^(?P<stem>(?:conv1|bn1|relu|maxpool)(?:_nchwc)?)$|^(fc)"
_BERT = r"encoder\.layer\.\d+\.(attention\.self|attention\.output|intermediate|output)"
KEYS = {
    "mobilenet_v2": r"(features\.\d+|classifier)",
    "resnet50": _RESNET,
    "resnet18": _RESNET,
    "bert_base": _BERT,
    "bert_tiny": _BERT,
}
_DEFAULT_KEY = r"^(.*)$"
RUNTIMES = ("segflow", "onnxruntime")


def group_times(spans: Iterable[tuple[str, float]], key: str, runs: int) -> dict[str, float]:
    """ms a run per group: ``spans`` are (node name, ms) over ``runs`` runs. A name's
    group is the first capture group of ``key`` that matched (a named one: its name),
    or the whole match where ``key`` has none; "other" where ``key`` does not match."""
    pattern = re.compile(key)
    names = {index: name for name, index in pattern.groupindex.items()}
    out: dict[str, float] = defaultdict(float)
    for name, ms in spans:
        match = pattern.search(name)
        group = "other" if match is None else match[0]
        if match is not None:
            for index in range(1, pattern.groups + 1):
                if match.group(index) is not None:
                    group = names.get(index, match.group(index))
                    break
        out[group] += ms / runs
    return dict(out)


def ort_spans(trace: list[dict[str, object]]) -> list[tuple[str, float]]:
    """(node name, ms) of each kernel in an onnxruntime profile (its JSON events)."""
    suffix = "_kernel_time"
    return [(str(e["name"])[:-len(suffix)], float(e["dur"]) / 1000)  # type: ignore[arg-type]
            for e in trace if e.get("cat") == "Node" and str(e.get("name", "")).endswith(suffix)]


def child(runtime: str, model: str, runs: int, key: str) -> dict[str, object]:
    """In a fresh process: one runtime's groups (profiled) and wall medians (not)."""
    from segflow import models

    options = {"seq_len": 128} if model.startswith("bert") else {}
    proto = models.build(model)
    feeds = models.example_inputs(model, batch_size=1, **options)
    walls: list[float] = []
    if runtime == "onnxruntime":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        with tempfile.TemporaryDirectory() as tmp:
            opts.enable_profiling = True
            opts.profile_file_prefix = os.path.join(tmp, "ort")
            sess = ort.InferenceSession(proto.SerializeToString(), opts,
                                        providers=["CPUExecutionProvider"])
            for _ in range(3 + runs):    # the profile holds every run: warm-up ones too
                start = time.perf_counter()
                sess.run(None, feeds)
                walls.append(time.perf_counter() - start)
            with open(sess.end_profiling()) as f:
                spans = ort_spans(json.load(f))
        groups = group_times(spans, key, 3 + runs)
        walls = walls[3:]
    else:
        import segflow

        sess = segflow.InferenceSession(proto)
        for _ in range(3):
            sess.run(None, feeds)
        for _ in range(runs):
            start = time.perf_counter()
            sess.run(None, feeds)
            walls.append(time.perf_counter() - start)
        with segflow.profile() as prof:
            for _ in range(runs):
                sess.run(None, feeds)
        groups = group_times([(e.name, e.duration_ns / 1e6) for e in prof.events
                              if e.category.value == "node"], key, runs)
    return {"groups": groups, "wall_ms": statistics.median(walls) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mobilenet_v2", help="a built-in model")
    parser.add_argument("--runs", type=int, default=20, help="profiled runs per runtime")
    parser.add_argument("--key", help="regex: a node name's group (default: per model)")
    parser.add_argument("--top", type=int, default=30, help="groups to print")
    parser.add_argument("--child", choices=RUNTIMES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    key = args.key or KEYS.get(args.model, _DEFAULT_KEY)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.runs, key)))
        return 0
    from segflow import models

    if args.model not in models.available():
        print(f"node_groups.py: unknown model {args.model!r}; available: "
              f"{', '.join(models.available())}", file=sys.stderr)
        return 2
    try:
        re.compile(key)
    except re.error as exc:
        print(f"node_groups.py: --key is not a regular expression: {exc}", file=sys.stderr)
        return 2
    results = {}
    for runtime in RUNTIMES:
        out = subprocess.run([sys.executable, __file__, "--child", runtime, "--model",
                              args.model, "--runs", str(args.runs), "--key", key],
                             capture_output=True, text=True, check=True)
        results[runtime] = json.loads(out.stdout.strip().splitlines()[-1])
    print(report(args.model, key, args.runs, results, args.top))
    return 0


def report(model: str, key: str, runs: int, results: dict[str, dict[str, object]],
           top: int) -> str:
    """The table: groups by segflow's time, then the sums and the unprofiled walls."""
    sf: dict[str, float] = results["segflow"]["groups"]  # type: ignore[assignment]
    ort: dict[str, float] = results["onnxruntime"]["groups"]  # type: ignore[assignment]
    groups = sorted(set(sf) | set(ort), key=lambda g: (-sf.get(g, 0.0), g))
    lines = [f"{model}, batch 1, ms a run over {runs} profiled runs, each runtime alone; "
             f"group: {key}",
             f"  {'group':<40} {'segflow':>9} {'ort':>9} {'diff':>8}"]
    for g in groups[:top]:
        a, b = sf.get(g, 0.0), ort.get(g, 0.0)
        lines.append(f"  {g[:40]:<40} {a:9.3f} {b:9.3f} {a - b:+8.3f}")
    if len(groups) > top:
        lines.append(f"  ... {len(groups) - top} more groups")
    a, b = sum(sf.values()), sum(ort.values())
    lines.append(f"  {'sum of nodes':<40} {a:9.3f} {b:9.3f} {a - b:+8.3f}")
    walls = [float(results[r]["wall_ms"]) for r in RUNTIMES]  # type: ignore[arg-type]
    lines.append(f"  {'unprofiled run (median)':<40} {walls[0]:9.3f} {walls[1]:9.3f} "
                 f"{walls[0] - walls[1]:+8.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
