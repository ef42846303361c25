"""The engine contract: tasks over variables, pushed in program order.

A task declares the :class:`Var` objects it reads and writes. The engine runs
tasks that touch the same Var in push order (read-after-write,
write-after-read, write-after-write); tasks with no Var in common may run
concurrently.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol

from segflow.engine.counters import RunCounters
from segflow.ir.types import Device


class ExecType(enum.Enum):
    """How a task executes. Only ``SYNC`` tasks may join a bulk segment."""

    SYNC = "sync"    # ordinary kernels enqueued on the device's stream/worker
    ASYNC = "async"  # completes through a callback the task calls itself
    LOCAL = "local"  # runs on the pushing thread (host-side or data-dependent-shape work)
    COPY = "copy"    # cross-device copy, on the copy worker


class Var:
    """An engine variable: the unit of dependency tracking."""

    __slots__ = ("name", "_state")

    def __init__(self, name: str = "") -> None:
        self.name = name
        # Owned and mutated by the engine that tracks this var.
        self._state: object | None = None

    def __repr__(self) -> str:
        return f"Var({self.name})"


Task = Callable[[], None]
AsyncTask = Callable[[Callable[[BaseException | None], None]], None]


class Engine(Protocol):
    """What every engine provides. See :mod:`segflow.engine.inline` and ``threaded``."""

    name: str

    def push(self, fn: Task | AsyncTask, reads: Sequence[Var], writes: Sequence[Var],
             exec_type: ExecType = ExecType.SYNC, device: Device | None = None,
             name: str = "", counts: RunCounters | None = None) -> None:
        """Schedule ``fn`` after every earlier task that conflicts on a Var.

        ``counts`` (the pushing run's): one push, and one host wait for a LOCAL
        task that reads a Var an earlier task writes (it runs on the pushing
        thread once that task is done).
        """
        ...

    def wait(self, *vars: Var, counts: RunCounters | None = None) -> None:
        """Block until every task pushed so far that writes one of ``vars`` has finished.

        One host wait, counted in ``counts``. Re-raises the first error of a task
        these vars depend on.
        """
        ...

    def wait_all(self) -> None:
        """Block until every pushed task has finished."""
        ...

    def close(self) -> None:
        """Stop worker threads (idempotent)."""
        ...
