"""Local data-parallel processes: ``spawn`` runs a function on N ranks of this machine.

Each rank is a fresh process (the ``spawn`` start method: no forked torch state)
that joins a gloo process group over a free localhost port, with ``threads``
intra-op threads, calls ``fn(rank, world_size, *args)`` and hands back what it
returns. :func:`spawn` waits at most ``timeout_s``: a rank that fails, is killed
or hangs shows in its :class:`RankOutcome`, and a hanging one is stopped. Under
``torchrun`` (one process per rank, ``env://`` rendezvous) the same function runs
through :func:`run_torchrun_rank` instead.

>>> outcomes = spawn(train_on_rank, 2, args=(epochs,))     # doctest: +SKIP
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from segflow.errors import CommunicationError


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """What one rank did: its result, or the one-line error it raised, and its exit code
    (None: stopped by :func:`spawn` after the timeout)."""

    rank: int
    result: Any = None
    error: str | None = None
    exitcode: int | None = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


def free_port() -> int:
    """A localhost TCP port free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (),
          threads: int = 1, timeout_s: float = 600.0, group_timeout_s: float = 60.0
          ) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes under gloo.

    ``fn`` must be importable by name (a module-level function). ``group_timeout_s``
    bounds each collective (a rank that stops answering fails the others after it).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    context = mp.get_context("spawn")
    results: Any = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, name=f"segflow-rank-{rank}",
                                 args=(fn, rank, world_size, port, tuple(args), threads,
                                       group_timeout_s, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    reported: dict[int, tuple[Any, str | None]] = {}
    while len(reported) < world_size and time.monotonic() < deadline:
        try:
            rank, result, error = results.get(timeout=0.2)
            reported[rank] = (result, error)
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break
    outcomes = []
    for rank, process in enumerate(processes):
        process.join(max(0.0, deadline - time.monotonic()) if rank not in reported else 30)
        if process.is_alive():
            process.kill()
            process.join()
            exitcode = None
        else:
            exitcode = process.exitcode
        result, error = reported.get(rank, (None, None))
        if rank not in reported:
            error = ("timed out" if exitcode is None
                     else f"the process ended with exit code {exitcode} before reporting")
        outcomes.append(RankOutcome(rank, result, error, exitcode))
    return outcomes


def results_or_raise(outcomes: Sequence[RankOutcome]) -> list[Any]:
    """Every rank's result, or a :class:`CommunicationError` naming the first that failed."""
    for outcome in outcomes:
        if not outcome.ok:
            raise CommunicationError(f"rank {outcome.rank} failed: {outcome.error}")
    return [o.result for o in outcomes]


def run_torchrun_rank(fn: Callable[..., Any], *, args: Sequence[Any] = (),
                      group_timeout_s: float = 60.0) -> RankOutcome:
    """Run ``fn(rank, world_size, *args)`` in a process ``torchrun`` started (``env://``
    rendezvous); its outcome, which names the rank."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=group_timeout_s))
    try:
        rank = dist.get_rank()
        return RankOutcome(rank, fn(rank, dist.get_world_size(), *args))
    finally:
        dist.destroy_process_group()


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int,
               args: tuple[Any, ...], threads: int, group_timeout_s: float,
               results: Any) -> None:
    torch.set_num_threads(threads)
    result, error = None, None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=group_timeout_s))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        lines = str(exc).strip().splitlines()
        error = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    results.put((rank, result, error))
