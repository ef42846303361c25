"""What inference_mode saves: ``run`` against ``run_tensors``, interleaved.

    python benchmarks/grad_mode.py                       # MLP chain, ResNet-50, BERT-base
    python benchmarks/grad_mode.py --models resnet50 --rounds 40

On the host, ``InferenceSession.run`` (numpy out) runs its kernels under
``torch.inference_mode``, so torch skips the autograd and view-tracking
dispatch keys on every op. ``run_tensors`` returns torch tensors that may meet
autograd later, so it runs them as ordinary tensors. Both run the same
kernels on the same session; ``run`` also converts its outputs to numpy (a
few microseconds), which counts against it. Each round times ``--calls``
calls of each, in alternating order; the ratio is the median over rounds of
run / run_tensors.
"""

from __future__ import annotations

import argparse
import statistics
import time

MODELS = {"mlp_chain": {}, "resnet50": {}, "bert_base": {"seq_len": 128}}


def measure(model: str, options: dict[str, int], rounds: int, calls: int) -> tuple[float, ...]:
    import torch

    import segflow
    from segflow import models

    build = {k: v for k, v in options.items() if k != "seq_len"}
    feeds = models.example_inputs(model, batch_size=1, **options)
    tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}
    sess = segflow.InferenceSession(models.build(model, **build))
    modes = {"run": lambda: sess.run(None, feeds), "run_tensors": lambda: sess.run_tensors(tensors)}
    for call in modes.values():
        for _ in range(3):
            call()
    ms: dict[str, list[float]] = {name: [] for name in modes}
    ratios = []
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for name in order:
            start = time.perf_counter()
            for _ in range(calls):
                modes[name]()
            ms[name].append((time.perf_counter() - start) / calls * 1e3)
        ratios.append(ms["run"][-1] / ms["run_tensors"][-1])
    quartiles = statistics.quantiles(ratios, n=4)
    return (statistics.median(ms["run"]), statistics.median(ms["run_tensors"]),
            statistics.median(ratios), quartiles[0], quartiles[2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=0,
                        help="calls per round (default: 20 for the MLP chain, else 3)")
    args = parser.parse_args()
    print(f"{'model':<12} {'run ms':>9} {'run_tensors ms':>15} {'ratio [quartiles]':>22}")
    for model in args.models.split(","):
        calls = args.calls or (20 if model == "mlp_chain" else 3)
        run, plain, ratio, q1, q3 = measure(model, MODELS[model], args.rounds, calls)
        print(f"{model:<12} {run:>9.3f} {plain:>15.3f} {ratio:>9.3f} [{q1:.3f}-{q3:.3f}]",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
