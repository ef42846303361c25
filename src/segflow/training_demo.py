"""Train a small CNN on scikit-learn's bundled digits (8x8 images, no download).

``segflow train-demo`` and ``examples/train_digits.py`` run :func:`main`; tests call
:func:`train`. ``--workers N`` trains data-parallel on N local processes (gloo, one
thread each; :func:`train_data_parallel`), and under ``torchrun`` each process it
starts is one rank. The model is built with :class:`segflow.frontend.builder.GraphBuilder`
(Conv-BN-Relu x2, MaxPool, Gemm-Relu, Gemm) and trained by a
:class:`segflow.TrainingSession`; test accuracy comes from ``predict`` (BatchNorm
on its running statistics).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from segflow.frontend.builder import GraphBuilder
from segflow.ir.types import DType
from segflow.optim import SGD, Adam, Optimizer
from segflow.progress import listening, step
from segflow.progress_display import shown
from segflow.runtime.training import CrossEntropyLoss, TrainingSession


@dataclass(frozen=True, slots=True)
class EpochRecord:
    epoch: int
    loss: float
    train_accuracy: float
    test_accuracy: float
    seconds: float


@dataclass(frozen=True, slots=True)
class DemoResult:
    epochs: tuple[EpochRecord, ...]
    test_accuracy: float
    seconds: float
    explain: str
    workers: int = 1
    overlap: float | None = None      # data-parallel: all-reduce time under backward segments
    allreduces_per_step: int = 0


def build_model(seed: int = 0, width: int = 16) -> GraphBuilder:
    """The digits CNN: [N, 1, 8, 8] -> logits [N, 10]."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("digits_cnn")

    def he(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    def conv_bn_relu(x, name: str, cin: int, cout: int):  # type: ignore[no-untyped-def]
        w = b.param(f"{name}.weight", he((cout, cin, 3, 3), cin * 9))
        y = b.op("Conv", x, w, pads=[1, 1, 1, 1], name=name)
        y = b.op("BatchNormalization", y, b.param(f"{name}.bn.weight", np.ones(cout, np.float32)),
                 b.param(f"{name}.bn.bias", np.zeros(cout, np.float32)),
                 b.param(f"{name}.bn.running_mean", np.zeros(cout, np.float32)),
                 b.param(f"{name}.bn.running_var", np.ones(cout, np.float32)), name=f"{name}.bn")
        return b.op("Relu", y, name=f"{name}.relu")

    x = b.input("image", DType.FLOAT32, ["N", 1, 8, 8])
    h = conv_bn_relu(x, "conv1", 1, width)
    h = conv_bn_relu(h, "conv2", width, 2 * width)
    h = b.op("MaxPool", h, kernel_shape=[2, 2], strides=[2, 2], name="pool")
    h = b.op("Flatten", h, name="flatten")
    hidden = 2 * width * 16
    h = b.op("Gemm", h, b.param("fc1.weight", he((64, hidden), hidden)),
             b.param("fc1.bias", np.zeros(64, np.float32)), transB=1, name="fc1")
    h = b.op("Relu", h, name="fc1.relu")
    logits = b.op("Gemm", h, b.param("fc2.weight", he((10, 64), 64)),
                  b.param("fc2.bias", np.zeros(10, np.float32)), transB=1, name="fc2")
    b.output(logits, "logits")
    return b


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardized digits as [N, 1, 8, 8] float32, split 75/25 (stratified)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0 - 0.3) / 0.4
    x_train, x_test, y_train, y_test = train_test_split(
        images[:, None], digits.target.astype(np.int64), test_size=0.25, random_state=seed,
        stratify=digits.target)
    return x_train, y_train, x_test, y_test


def train(epochs: int = 12, batch_size: int = 32, lr: float = 0.05, optimizer: str = "sgd",
          seed: int = 0, engine: str | None = None, progress: bool = True) -> DemoResult:
    """Train and evaluate; when ``progress``, shows each epoch as a step
    (:mod:`segflow.progress`: a bar on a terminal's stderr) and prints a line after it."""
    x_train, y_train, x_test, y_test = load_data(seed)
    opt: Optimizer = (SGD(lr=lr, momentum=0.9, weight_decay=1e-4) if optimizer == "sgd"
                      else Adam(lr=lr))
    sess = TrainingSession(build_model(seed).to_model(), loss=CrossEntropyLoss(labels="label"),
                           optimizer=opt, engine=engine)
    rng = np.random.default_rng(seed)
    steps = -(-len(x_train) // batch_size)
    records: list[EpochRecord] = []
    start = time.perf_counter()
    # The first epoch also builds the training plan's kernels: seconds before a line shows.
    with shown() if progress else listening(None):
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            order = rng.permutation(len(x_train))
            total_loss, correct = 0.0, 0
            with step(f"epoch {epoch}/{epochs}", 0.0) as bar:
                for i in range(steps):
                    idx = order[i * batch_size:(i + 1) * batch_size]
                    result = sess.step({"image": x_train[idx], "label": y_train[idx]})
                    total_loss += result.loss * len(idx)
                    correct += int((result.outputs["logits"].argmax(1) == y_train[idx]).sum())
                    bar.update((i + 1) / steps,
                               f"epoch {epoch}/{epochs}  loss {result.loss:.4f}")
            logits, = sess.predict({"image": x_test})
            record = EpochRecord(epoch, total_loss / len(x_train), correct / len(x_train),
                                 float((logits.argmax(1) == y_test).mean()),
                                 time.perf_counter() - t0)
            records.append(record)
            if progress:
                print(f"epoch {epoch:2d}/{epochs}  loss {record.loss:.4f}  "
                      f"train acc {record.train_accuracy:6.2%}  "
                      f"test acc {record.test_accuracy:6.2%}  ({record.seconds:.2f} s)")
    seconds = time.perf_counter() - start
    explain = sess.explain()
    sess.close()
    return DemoResult(tuple(records), records[-1].test_accuracy, seconds, explain)


def train_data_parallel(workers: int, epochs: int = 12, batch_size: int = 32, lr: float = 0.05,
                        optimizer: str = "sgd", seed: int = 0, bucket_bytes: int = 64 << 10,
                        engine: str | None = None, progress: bool = True) -> DemoResult:
    """Train on ``workers`` local processes, each on ``batch_size`` rows of every global
    batch; rank 0's result (every rank holds the same parameters)."""
    from segflow.distributed.launch import results_or_raise, spawn

    outcomes = spawn(_train_rank, workers,
                     args=(epochs, batch_size, lr, optimizer, seed, bucket_bytes, engine,
                           progress))
    return results_or_raise(outcomes)[0]  # type: ignore[no-any-return]


def _train_rank(rank: int, world_size: int, epochs: int, batch_size: int, lr: float,
                optimizer: str, seed: int, bucket_bytes: int, engine: str | None,
                progress: bool) -> DemoResult:
    """One rank of :func:`train_data_parallel` (or of a ``torchrun`` launch): the same
    shuffle on every rank, rank r taking rows r*batch_size.. of each global batch (the
    last, incomplete one dropped); the last epoch's steps profiled for the overlap."""
    from segflow.distributed import DataParallelOptions
    from segflow.distributed.overlap import backward_segments, communication_overlap
    from segflow.profiler import profile

    x_train, y_train, x_test, y_test = load_data(seed)
    opt: Optimizer = (SGD(lr=lr, momentum=0.9, weight_decay=1e-4) if optimizer == "sgd"
                      else Adam(lr=lr))
    sess = TrainingSession(build_model(seed).to_model(), loss=CrossEntropyLoss(labels="label"),
                           optimizer=opt, engine=engine,
                           distributed=DataParallelOptions(bucket_bytes=bucket_bytes))
    rng = np.random.default_rng(seed)
    per_step = batch_size * world_size
    steps = len(x_train) // per_step
    shown_here = progress and rank == 0
    records: list[EpochRecord] = []
    overlaps: list[float] = []
    allreduces = 0
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        order = rng.permutation(len(x_train))
        total_loss, correct = 0.0, 0
        for i in range(steps):
            idx = order[i * per_step + rank * batch_size:i * per_step + (rank + 1) * batch_size]
            feeds = {"image": x_train[idx], "label": y_train[idx]}
            if epoch == epochs:
                with profile() as prof:
                    result = sess.step(feeds)
                overlaps.append(communication_overlap(prof.events,
                                                      backward_segments(sess.plan)))
            else:
                result = sess.step(feeds)
            allreduces = result.stats.allreduces
            total_loss += result.loss * len(idx)
            correct += int((result.outputs["logits"].argmax(1) == y_train[idx]).sum())
        logits, = sess.predict({"image": x_test})
        seen = steps * batch_size
        record = EpochRecord(epoch, total_loss / seen, correct / seen,
                             float((logits.argmax(1) == y_test).mean()),
                             time.perf_counter() - t0)
        records.append(record)
        if shown_here:
            print(f"epoch {epoch:2d}/{epochs}  loss {record.loss:.4f}  "
                  f"train acc {record.train_accuracy:6.2%}  "
                  f"test acc {record.test_accuracy:6.2%}  ({record.seconds:.2f} s, rank 0 "
                  f"of {world_size})", flush=True)
    seconds = time.perf_counter() - start
    explain = sess.explain()
    sess.close()
    overlap = float(np.mean(overlaps)) if overlaps else None
    return DemoResult(tuple(records), records[-1].test_accuracy, seconds, explain,
                      world_size, overlap, allreduces)


def min_accuracy(text: str) -> float:
    """``--min-accuracy``: ``95%`` or ``95`` (a percent), or ``0.95`` (a fraction) -> 0.95.

    A number with ``%`` is a percent; without, one above 1 is a percent and one up to 1 a
    fraction (``1`` is 100%; write ``1%`` for one percent).
    """
    number = text.strip().removesuffix("%")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percent such as 95%, 95 or 0.95, "
                                         f"got {text!r}") from None
    fraction = value / 100 if number != text.strip() or value > 1 else value
    if not 0 <= fraction <= 1:
        raise argparse.ArgumentTypeError(f"expected a percent from 0 to 100, got {text}")
    return fraction


def main(argv: Sequence[str] | None = None) -> int:
    """``segflow train-demo``: train the digits CNN; exit 1 below ``--min-accuracy``."""
    from segflow.model_args import (
        CliParser,
        non_negative_int,
        positive_float,
        positive_int,
    )

    parser = CliParser(prog="segflow train-demo",
                       description="Train a small CNN on the sklearn digits; exit 1 when "
                                   "the test accuracy is below --min-accuracy.")
    parser.add_argument("--epochs", type=positive_int, default=12, help="epochs (12)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="batch size (32)")
    parser.add_argument("--lr", type=positive_float, default=None,
                        help="learning rate (default 0.05 for sgd, 0.003 for adam)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--engine", choices=["inline", "threaded"], default=None)
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="data-parallel processes on this machine, gloo, one thread "
                             "each; --batch-size is per process (1: one process)")
    parser.add_argument("--bucket-kb", type=positive_int, default=64,
                        help="data-parallel gradient bucket size in KiB (64)")
    parser.add_argument("--min-accuracy", type=min_accuracy, default=0.95, metavar="PERCENT",
                        help="lowest test accuracy that passes: 95%%, 95 or 0.95 (a number "
                             "up to 1 is a fraction, above 1 a percent); default 95%%")
    parser.add_argument("--explain", action="store_true", help="print the training plan")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or epoch lines")
    args = parser.parse_args(argv)
    lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 0.003)
    import torch.distributed as dist

    if dist.is_torchelastic_launched():  # torchrun started this process as one rank
        from segflow.distributed.launch import run_torchrun_rank

        outcome = run_torchrun_rank(_train_rank, args=(
            args.epochs, args.batch_size, lr, args.optimizer, args.seed, args.bucket_kb << 10,
            args.engine, not args.quiet))
        if outcome.rank != 0:  # every rank holds the same parameters: rank 0 reports
            return 0
        result = outcome.result
    elif args.workers > 1:
        result = train_data_parallel(args.workers, args.epochs, args.batch_size, lr,
                                     args.optimizer, args.seed, args.bucket_kb << 10,
                                     args.engine, progress=not args.quiet)
    else:
        result = train(args.epochs, args.batch_size, lr, args.optimizer, args.seed,
                       args.engine, progress=not args.quiet)
    if args.explain:
        print(result.explain)
    print(f"test accuracy {result.test_accuracy:.2%} after {len(result.epochs)} epochs "
          f"in {result.seconds:.1f} s")
    if result.overlap is not None:
        print(f"data-parallel: {result.workers} processes, {result.allreduces_per_step} "
              f"all-reduces a step, {result.overlap:.0%} of the all-reduce time overlapped "
              "backward segments (last epoch)")
    if result.test_accuracy < args.min_accuracy:
        print(f"test accuracy {result.test_accuracy:.2%} is below --min-accuracy "
              f"{args.min_accuracy * 100:g}%")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
