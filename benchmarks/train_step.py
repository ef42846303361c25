"""Training step time: segflow vs PyTorch eager on ResNet-18 (forward + backward + SGD).

Usage::

    python benchmarks/train_step.py [--batch 16] [--image-size 224] [--runs 5]
                                    [--engine threaded] [--num-classes 1000]

Both sides start from the same weights (``segflow.models``), train in BatchNorm
training mode with softmax cross-entropy and SGD(lr=0.01, momentum=0.9,
weight_decay=1e-4) on the same batch, in the same process, interleaved
(segflow step, torch step, ...), so machine drift hits both alike. Prints the
median step times and the ratio segflow / torch (lower is better; target <= 1.0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import segflow
from segflow import models
from segflow.optim import SGD

LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 1e-4


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--engine", default="threaded", choices=["inline", "threaded"])
    args = parser.parse_args(argv)
    options = {"num_classes": args.num_classes, "image_size": args.image_size}

    feeds = models.example_inputs(args.model, batch_size=args.batch, **options)
    labels = np.random.default_rng(0).integers(0, args.num_classes, args.batch)
    sess = segflow.TrainingSession(models.build(args.model, **options),
                                   loss=segflow.CrossEntropyLoss(labels="labels"),
                                   optimizer=SGD(LR, MOMENTUM, WEIGHT_DECAY),
                                   engine=args.engine)
    seg_feeds = {**feeds, "labels": labels}

    module = models.torch_module(args.model, **options).train()
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)
    torch_feeds = {k: torch.from_numpy(v) for k, v in feeds.items()}
    torch_labels = torch.from_numpy(labels)

    def segflow_step() -> float:
        start = time.perf_counter()
        sess.step(seg_feeds)
        sess.parameters()  # waits for the last optimizer tasks
        return time.perf_counter() - start

    def torch_step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(**torch_feeds), torch_labels)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        segflow_step()
        torch_step()
    seg_times, torch_times = [], []
    for _ in range(args.runs):
        seg_times.append(segflow_step())
        torch_times.append(torch_step())
    seg_ms = statistics.median(seg_times) * 1e3
    torch_ms = statistics.median(torch_times) * 1e3
    ratio = seg_ms / torch_ms
    stats = sess.last_run_stats
    assert stats is not None
    print(f"{args.model} batch {args.batch} image {args.image_size}, {args.runs} interleaved "
          f"steps, torch {torch.__version__} with {torch.get_num_threads()} threads")
    print(f"segflow ({args.engine}): {seg_ms:9.1f} ms/step  "
          f"[{stats.forward_segments} fwd + {stats.backward_segments} bwd segments, "
          f"{stats.updates} update tasks, {stats.syncs} sync]")
    print(f"torch eager:       {torch_ms:9.1f} ms/step")
    print(f"ratio segflow/torch: {ratio:.3f}x")
    sess.close()
    return ratio


if __name__ == "__main__":
    main()
