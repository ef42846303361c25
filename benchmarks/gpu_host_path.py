"""Where the host time of one CUDA-graph inference goes (a GPU probe, ~40 s on one GPU).

Usage (from the source tree; installs nothing)::

    PYTHONPATH=src python benchmarks/gpu_host_path.py [--models resnet50,bert_base,mlp_chain]

Per model at batch 1, p50 of 200 runs after 20 warm-ups, TF32 off:

- ``graphs``: ``run`` (numpy in and out) with ``cuda_graphs=True``, the default
  copies (on the compute stream for these one-device plans);
- ``graphs copy stream``: the same with feeds and outputs forced through the
  copy stream (what plans spanning devices do), for the A/B;
- ``graphs device io`` (and ``... copy stream``): ``run_tensors`` on device feeds;
- ``segflow graph gpu ms``: device time of one replay of the captured graph
  (CUDA events around 50 back-to-back replays): the floor for the rows above;
- ``torch+graph``: PyTorch with the whole model captured as one graph, numpy in
  and out (``gpu_check.torch_graph_runner``).

Then a cProfile of 300 ``run`` calls (top 30 by own time) per model, and with
``$OUT`` set, a Chrome trace of three segflow runs and three torch+graph runs of
the first model (``$OUT/trace_<model>.json``) and every number in
``$OUT/gpu_host_path.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402

import segflow  # noqa: E402
from segflow import models  # noqa: E402


def p50_ms(fn: Callable[[], object], runs: int = 200, warmup: int = 20) -> float:
    times = gpu_check.timed(fn, warmup, runs)  # type: ignore[arg-type]
    return round(statistics.median(times) * 1e3, 4)


def replay_ms(replay: Callable[[], None], runs: int = 50) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / runs, 4)


def probe(name: str, device: str, out: str | None, trace: bool) -> dict[str, object]:
    model = models.build(name)
    feeds = models.example_inputs(name, batch_size=1)
    row: dict[str, object] = {}
    sess = segflow.InferenceSession(model, device=device, cuda_graphs=True)
    row["graphs"] = p50_ms(lambda: sess.run(None, feeds))
    copy = segflow.InferenceSession(model, device=device, cuda_graphs=True)
    copy._executor.completion.io_on_compute = False  # type: ignore[attr-defined]
    row["graphs copy stream"] = p50_ms(lambda: copy.run(None, feeds))
    on_device = {k: torch.from_numpy(v).to(device) for k, v in feeds.items()}
    row["graphs device io"] = p50_ms(lambda: sess.run_tensors(on_device))
    row["graphs device io copy stream"] = p50_ms(lambda: copy.run_tensors(on_device))
    graph = getattr(sess._executor.completion, "graphs", {}).get(0)
    if graph is not None:
        captured = [e for e in graph.cache._entries.values() if hasattr(e, "graph")]
        if captured:
            row["segflow graph gpu ms"] = replay_ms(captured[-1].graph.replay)
    cfg = gpu_check.parse_args(["--device", device])
    torch_graph = gpu_check.torch_graph_runner(name, {}, feeds, cfg)
    row["torch+graph"] = p50_ms(torch_graph)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        sess.run(None, feeds)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[:6000])
    if out and trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                sess.run(None, feeds)
            for _ in range(3):
                torch_graph()
        prof.export_chrome_trace(os.path.join(out, f"trace_{name}.json"))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50,bert_base,mlp_chain")
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    out = os.environ.get("OUT")
    report = {}
    for i, name in enumerate(args.models.split(",")):
        report[name] = probe(name, args.device, out, trace=i == 0)
        print(name, json.dumps(report[name]), flush=True)
        torch.cuda.empty_cache()
    if out:
        with open(os.path.join(out, "gpu_host_path.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
