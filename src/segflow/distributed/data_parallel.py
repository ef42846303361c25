"""Data-parallel training over ``torch.distributed``: gradient all-reduce in engine tasks.

A :class:`segflow.TrainingSession` made with ``distributed=True`` (or a
:class:`DataParallelOptions`) under an initialized process group (``torchrun``, or
``torch.distributed.init_process_group`` with gloo on CPU, NCCL on GPU) builds a
:class:`DataParallel`. At start it checks that every rank has the same model and
parameter shapes, then broadcasts the parameters and statistics from rank 0. Each
step, every gradient bucket (``distributed/buckets.py``) becomes one ASYNC engine
task: it reads the backward segments that produce its gradients, copies them into
the bucket's flat tensor and launches a non-blocking all-reduce; the collective's
completion finishes the task, and the optimizer updates of the bucket's parameters
read it. So the all-reduce of the gradients produced first runs while the rest of the
backward segments still run on the engine's worker.

>>> torch.distributed.init_process_group("gloo")             # doctest: +SKIP
>>> sess = segflow.TrainingSession(model, loss=..., optimizer=...,
...                                distributed=DataParallelOptions(bucket_bytes=1 << 20))
>>> sess.step(local_batch)                                    # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from segflow.distributed.buckets import Bucket, GradientGroup, plan_buckets
from segflow.engine.base import Engine, ExecType, Var
from segflow.engine.counters import RunCounters
from segflow.errors import CommunicationError, InvalidInput, InvalidModel, InvalidSetting
from segflow.ir.types import Device
from segflow.profiler.sink import EventSink, active_sink
from segflow.runtime.stats import RunStats
from segflow.runtime.training_plan import Update

Tensor = torch.Tensor

DEFAULT_BUCKET_BYTES = 25 << 20  # torch DistributedDataParallel's bucket_cap_mb
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class DataParallelOptions:
    """How a distributed session communicates.

    - ``bucket_bytes``: gradients all-reduced together, at most this many bytes a
      bucket (a backward segment's gradients stay in one bucket)
    - ``average``: divide the summed gradients by the world size (as DDP does)
    - ``timeout_s``: the longest a step waits for its all-reduces before it fails
      (a rank that died or hangs); the process group's own timeout also applies
    - ``group``: the process group (None: the default group)
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    average: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: Any = None

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise InvalidSetting(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise InvalidSetting(f"timeout_s must be positive, got {self.timeout_s}")

    @staticmethod
    def resolve(spec: bool | DataParallelOptions) -> DataParallelOptions | None:
        if isinstance(spec, DataParallelOptions):
            return spec
        return DataParallelOptions() if spec else None


class _BucketState:
    """A bucket's flat tensor across steps (touched only by the tasks its Var orders)."""

    __slots__ = ("bucket", "flat", "var", "accumulated")

    def __init__(self, bucket: Bucket, device: Device) -> None:
        self.bucket = bucket
        self.flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=device.torch)
        self.var = Var(f"allreduce bucket {bucket.index}")
        self.accumulated = False  # holds no_sync() steps' local gradients


class _StepCommunication:
    """One step's all-reduces: how many are left, what they moved, the first error."""

    def __init__(self, buckets: int) -> None:
        self._lock = threading.Lock()
        self._left = buckets
        self.done = threading.Event()
        self.allreduces = 0
        self.bytes = 0
        if buckets == 0:
            self.done.set()

    def finished(self, nbytes: int | None) -> None:
        with self._lock:
            if nbytes is not None:
                self.allreduces += 1
                self.bytes += nbytes
            self._left -= 1
            if self._left == 0:
                self.done.set()


class DataParallel:
    """A session's data-parallel side: checks and broadcast at start, then all-reduces.

    ``state``: every parameter and statistic by name (broadcast from rank 0);
    ``groups``: the gradients per plan task; ``fingerprint``: the model's structure
    (its op sequence), compared across ranks.
    """

    def __init__(self, state: Mapping[str, Tensor], groups: Sequence[GradientGroup],
                 fingerprint: str, options: DataParallelOptions, engine: Engine,
                 device: Device) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidSetting("distributed training needs an initialized torch.distributed "
                                 "process group (launch with torchrun, or call "
                                 "torch.distributed.init_process_group first)")
        self.options = options
        self.group = options.group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = device
        self._engine = engine
        # The inline engine runs a task to its end at push: its all-reduce blocks there.
        self._blocking = engine.name == "inline"
        _check_same_model(state, fingerprint, self.rank, self.group)
        self._broadcast(state)
        self.buckets = [_BucketState(b, device) for b in plan_buckets(groups, options.bucket_bytes)]
        self._bucket_of = {g.task: s for s in self.buckets for g in s.bucket.groups}
        self._sync = True
        self._step: _StepCommunication | None = None

    # -- start -------------------------------------------------------------------------
    def _broadcast(self, state: Mapping[str, Tensor]) -> None:
        """Rank 0's parameters and statistics on every rank (as DDP's constructor)."""
        try:
            for name in sorted(state):
                dist.broadcast(state[name], src=self._global_rank(0), group=self.group)
        except RuntimeError as exc:
            raise CommunicationError(f"rank {self.rank}: broadcasting the parameters from "
                                     f"rank 0 failed: {_first_line(exc)}") from exc

    def _global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def describe(self) -> str:
        """One line for ``TrainingSession.explain()``: the ranks and the buckets."""
        sizes = ", ".join(f"{s.bucket.nbytes} B" for s in self.buckets)
        return (f"data-parallel: rank {self.rank} of {self.world_size}, "
                f"{len(self.buckets)} gradient buckets ({sizes}; cap "
                f"{self.options.bucket_bytes} B), each an all-reduce task after the backward "
                f"segments it reads, {'averaged' if self.options.average else 'summed'}")

    # -- the session's update tasks ----------------------------------------------------
    def route(self, update: Update) -> Update:
        """``update`` (a gradient update after plan task ``update.after``) reading its
        bucket's reduced gradients once that bucket's all-reduce has finished."""
        state = self._bucket_of[update.after]
        index = next(i for i, g in enumerate(state.bucket.groups) if g.task == update.after)
        group, offset = state.bucket.groups[index], state.bucket.offsets[index]
        views: list[Tensor] = []
        at = offset
        for shape in group.shapes:
            n = math.prod(shape)
            views.append(state.flat[at:at + n].view(shape))
            at += n

        def values(env: list[Tensor | None]) -> list[Tensor]:
            return views
        return replace(update, reads=(*update.reads, state.var), values=values)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps in the block accumulate gradients locally, with no communication; the
        first step after it all-reduces the sum (take those steps with ``update=False``)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def syncing(self) -> bool:
        return self._sync

    def communicate(self, run_vars: list[Var], env: list[Tensor | None],
                    counts: RunCounters) -> None:
        """Push one ASYNC all-reduce task per bucket (``TrainingExecutor.run_step``)."""
        step = self._step = _StepCommunication(len(self.buckets))
        sink = active_sink()
        for state in self.buckets:
            reads = [run_vars[t] for t in state.bucket.tasks]
            self._engine.push(self._task(state, env, step, sink, self._sync), reads,
                              (state.var,), ExecType.ASYNC, self.device,
                              f"all-reduce bucket {state.bucket.index}", counts)

    def _task(self, state: _BucketState, env: list[Tensor | None], step: _StepCommunication,
              sink: EventSink | None, sync: bool
              ) -> Callable[[Callable[[BaseException | None], None]], None]:
        bucket = state.bucket
        average = self.options.average
        world, rank = self.world_size, self.rank

        def task(done: Callable[[BaseException | None], None]) -> None:
            _gather(state, env)
            if not sync:
                state.accumulated = True
                step.finished(None)
                done(None)
                return
            state.accumulated = False
            start = time.perf_counter_ns()

            def finish(error: BaseException | None) -> None:
                if error is not None:
                    failure = CommunicationError(
                        f"rank {rank}: all-reduce of gradient bucket {bucket.index} "
                        f"({bucket.nbytes} bytes) failed; another rank may have failed or "
                        f"been killed: {_first_line(error)}")
                    step.finished(None)
                    done(failure)
                    return
                if average:
                    state.flat.div_(world)
                if sink is not None:
                    sink.span("comm", f"all-reduce bucket {bucket.index}", start,
                              time.perf_counter_ns(), device=str(self.device),
                              args={"bucket": bucket.index, "bytes": bucket.nbytes,
                                    "tasks": list(bucket.tasks)})
                step.finished(bucket.nbytes)
                done(None)

            try:
                work = dist.all_reduce(state.flat, group=self.group, async_op=True)
            except RuntimeError as exc:
                finish(exc)
                return
            if self._blocking:
                try:
                    work.wait()
                except RuntimeError as exc:
                    finish(exc)
                    return
                finish(None)
                return
            work.get_future().add_done_callback(lambda fut: finish(_error_of(fut)))
        return task

    def finish_step(self, stats: RunStats) -> RunStats:
        """Wait (bounded by ``timeout_s``) for the step's all-reduces and updates; raise
        the first failure as a :class:`CommunicationError`; the stats with the step's
        all-reduces, their bytes and this wait."""
        step = self._step
        if step is None:
            return stats
        self._step = None
        if not step.done.wait(self.options.timeout_s):
            raise CommunicationError(f"rank {self.rank}: the step's all-reduces did not finish "
                                     f"within {self.options.timeout_s:g} s; another rank may "
                                     "have failed or stopped")
        # The updates read the buckets' Vars: a failed all-reduce poisons them.
        self._engine.wait(*[s.var for s in self.buckets])
        return replace(stats, syncs=stats.syncs + 1, allreduces=step.allreduces,
                       allreduce_bytes=step.bytes)

    def check_step(self, update: bool) -> None:
        """A step under :meth:`no_sync` must not update: the ranks' parameters would differ."""
        if update and not self._sync:
            raise InvalidInput("a step inside no_sync() accumulates local gradients only; "
                               "call step(feeds, update=False) there")


def _gather(state: _BucketState, env: list[Tensor | None]) -> None:
    """Copy (or, after no_sync() steps, add) the bucket's gradients into its flat tensor."""
    bucket = state.bucket
    for group, offset in zip(bucket.groups, bucket.offsets):
        at = offset
        for slot, shape in zip(group.slots, group.shapes):
            n = math.prod(shape)
            view = state.flat[at:at + n]
            grad = env[slot]
            assert grad is not None
            if state.accumulated:
                view.add_(grad.reshape(-1))
            else:
                view.copy_(grad.reshape(-1))
            at += n


def _check_same_model(state: Mapping[str, Tensor], fingerprint: str, rank: int,
                      group: Any) -> None:
    """Every rank has the same model and the same parameter names, shapes and dtypes."""
    mine = (fingerprint, [(n, tuple(t.shape), str(t.dtype)) for n, t in state.items()])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, mine, group=group)
    except RuntimeError as exc:
        raise CommunicationError(f"rank {rank}: comparing the model across ranks failed: "
                                 f"{_first_line(exc)}") from exc
    reference = gathered[0]
    for other, (other_print, other_state) in enumerate(gathered):
        if other == 0:
            continue
        ours = dict((n, (s, d)) for n, s, d in reference[1])
        theirs = dict((n, (s, d)) for n, s, d in other_state)
        for name in [*ours, *(n for n in theirs if n not in ours)]:  # in the model's order
            if name not in theirs or name not in ours:
                where = f"rank {other}" if name in theirs else "rank 0"
                raise InvalidModel(f"parameter {name!r} exists only on {where}: every rank "
                                   "must train the same model")
            if ours[name] != theirs[name]:
                (s0, d0), (s1, d1) = ours[name], theirs[name]
                raise InvalidModel(f"parameter {name!r} has shape {list(s1)} ({d1}) on rank "
                                   f"{other} but {list(s0)} ({d0}) on rank 0: every rank must "
                                   "train the same model")
        if other_print != reference[0]:
            raise InvalidModel(f"rank {other} has another model than rank 0 (same parameters, "
                               "different operators): every rank must train the same model")


def model_fingerprint(op_types: Sequence[str]) -> str:
    """A short digest of a graph's operator sequence, compared across ranks."""
    return hashlib.sha256("\n".join(op_types).encode()).hexdigest()[:16]


def _error_of(fut: Any) -> BaseException | None:
    try:
        fut.value()
    except BaseException as exc:  # noqa: BLE001 - handed to the task's completion
        return exc
    return None


def _first_line(exc: BaseException) -> str:
    """The first sentence of a collective's error, without gloo's source location."""
    lines = str(exc).strip().splitlines()
    text = _SOURCE_LOCATION.sub("", lines[0]) if lines else ""
    sentence = text.split(". ", 1)[0].rstrip(".")
    return sentence or type(exc).__name__


_SOURCE_LOCATION = re.compile(r"^\[[^\]]*:\d+\]\s*")  # gloo's "[path/pair.cc:537] "
