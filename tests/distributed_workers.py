"""What each rank of the data-parallel tests runs (``segflow.distributed.launch.spawn``
imports these by name in its processes), and the model and data they share with the
single-process reference the tests compare against."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Any

import numpy as np

BATCH = 8          # per rank
CLASSES = 10


def build_model(seed: int, hidden: int = 16) -> Any:
    """Conv-Relu-Flatten-Gemm-Relu-Gemm on [N, 1, 8, 8]: no BatchNorm, so the gradient of
    a batch split across ranks is the mean of the ranks' gradients."""
    from segflow.frontend.builder import GraphBuilder
    from segflow.ir.types import DType

    rng = np.random.default_rng(seed)
    b = GraphBuilder("dp_cnn")

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    x = b.input("image", DType.FLOAT32, ["N", 1, 8, 8])
    h = b.op("Conv", x, b.param("conv.weight", weight(4, 1, 3, 3)),
             b.param("conv.bias", weight(4)), pads=[1, 1, 1, 1], name="conv")
    h = b.op("Relu", h, name="conv.relu")
    h = b.op("Flatten", h, name="flatten")
    h = b.op("Gemm", h, b.param("fc1.weight", weight(hidden, 256)),
             b.param("fc1.bias", weight(hidden)), transB=1, name="fc1")
    h = b.op("Relu", h, name="fc1.relu")
    logits = b.op("Gemm", h, b.param("fc2.weight", weight(CLASSES, hidden)),
                  b.param("fc2.bias", weight(CLASSES)), transB=1, name="fc2")
    b.output(logits, "logits")
    return b.to_model()


def global_batch(step: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of every rank together at ``step``; rank r takes rows r*BATCH..."""
    rng = np.random.default_rng(100 + step)
    images = rng.standard_normal((BATCH * world_size, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, CLASSES, BATCH * world_size).astype(np.int64)
    return images, labels


def session(model: Any, distributed: Any = False, engine: str | None = None) -> Any:
    from segflow.optim import SGD
    from segflow.runtime.training import CrossEntropyLoss, TrainingSession

    return TrainingSession(model, loss=CrossEntropyLoss(labels="label"),
                           optimizer=SGD(lr=0.1, momentum=0.9, weight_decay=1e-3),
                           engine=engine, distributed=distributed)


def train_steps(rank: int, world_size: int, steps: int, bucket_bytes: int,
                engine: str | None, accumulate: bool) -> dict[str, Any]:
    """``steps`` data-parallel steps (each rank starting from its own weights, rank 0's
    broadcast); the last one profiled. With ``accumulate``, each step takes the first
    half of the rank's batch under no_sync() and the second half synchronized (its
    gradient, a sum of two half-batch means, is twice the whole batch's)."""
    import segflow
    from segflow.distributed import DataParallelOptions
    from segflow.passes.segment import Phase

    sess = session(build_model(seed=rank), DataParallelOptions(bucket_bytes=bucket_bytes),
                   engine)
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    stats = None
    for step in range(steps):
        images, labels = global_batch(step, world_size)
        x, y = images[lo:hi], labels[lo:hi]
        profiled = step == steps - 1
        with segflow.profile() if profiled else nullcontext() as prof:
            if accumulate:
                half = BATCH // 2
                with sess.no_sync():
                    sess.step({"image": x[:half], "label": y[:half]}, update=False)
                result = sess.step({"image": x[half:], "label": y[half:]})
            else:
                result = sess.step({"image": x, "label": y})
        stats = result.stats
    assert prof is not None
    events = prof.events
    backward = {s.index for s in sess.plan.segments if s.phase is Phase.BACKWARD}
    spans = {
        "comm": [(e.start_ns, e.end_ns) for e in events if e.category.value == "comm"],
        "backward": [(e.start_ns, e.end_ns) for e in events if e.category.value == "segment"
                     and e.args.get("segment") in backward],
    }
    trace = prof.chrome_trace()
    params = {n: t.detach().numpy().copy() for n, t in sess.parameters().items()}
    sess.close()
    assert stats is not None
    return {"params": params, "allreduces": stats.allreduces,
            "allreduce_bytes": stats.allreduce_bytes, "spans": spans, "trace": trace,
            "engine": stats.engine}


def killed_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 dies after the first step; rank 0 keeps stepping and reports what it got."""
    from segflow.distributed import DataParallelOptions
    from segflow.errors import CommunicationError

    sess = session(build_model(seed=0), DataParallelOptions(bucket_bytes=1024, timeout_s=20))
    images, labels = global_batch(0, world_size)
    feeds = {"image": images[:BATCH], "label": labels[:BATCH]}
    sess.step(feeds)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        for _ in range(20):
            sess.step(feeds)
    except CommunicationError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def stalled_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 stops answering (asleep) after the first step; rank 0, with a 3 s step
    timeout, reports what it got."""
    from segflow.distributed import DataParallelOptions
    from segflow.errors import CommunicationError

    sess = session(build_model(seed=0), DataParallelOptions(bucket_bytes=1024, timeout_s=3))
    images, labels = global_batch(0, world_size)
    feeds = {"image": images[:BATCH], "label": labels[:BATCH]}
    sess.step(feeds)
    if rank == 1:
        time.sleep(8)
        os._exit(4)
    start = time.monotonic()
    try:
        sess.step(feeds)
    except CommunicationError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def mismatched_shapes(rank: int, world_size: int) -> str:
    """Rank 1 builds a wider hidden layer; every rank reports the error it got at start."""
    from segflow.errors import InvalidModel

    try:
        session(build_model(seed=0, hidden=16 if rank == 0 else 24), True)
    except InvalidModel as exc:
        return str(exc)
    return ""
