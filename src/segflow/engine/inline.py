"""The inline engine: every task runs at push, in push order, on the caller's thread.

Deterministic and easy to debug: a failing kernel raises straight out of
``push`` with the node named. Dependencies are trivially satisfied because
every earlier task has already finished. Its waits still count: a wait for
outputs, or a LOCAL task's wait for a Var an earlier task wrote, is the same
host wait under every engine; here it returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from segflow.engine.base import AsyncTask, ExecType, Task, Var
from segflow.engine.counters import RunCounters
from segflow.ir.types import Device

_WRITTEN = "written"  # a Var's state here: some pushed task wrote it


class InlineEngine:
    name = "inline"

    def push(self, fn: Task | AsyncTask, reads: Sequence[Var], writes: Sequence[Var],
             exec_type: ExecType = ExecType.SYNC, device: Device | None = None,
             name: str = "", counts: RunCounters | None = None) -> None:
        if counts is not None:
            counts.count_push()
            if exec_type is ExecType.LOCAL and any(v._state is _WRITTEN for v in reads):
                counts.count_wait()
        for var in writes:
            var._state = _WRITTEN
        if exec_type is ExecType.ASYNC:
            errors: list[BaseException] = []
            done: list[bool] = []

            def on_complete(error: BaseException | None = None) -> None:
                if error is not None:
                    errors.append(error)
                done.append(True)

            fn(on_complete)  # type: ignore[call-arg]
            if not done:
                raise RuntimeError(f"async task {name!r} did not complete under the inline engine")
            if errors:
                raise errors[0]
            return
        fn()  # type: ignore[call-arg]

    def wait(self, *vars: Var, counts: RunCounters | None = None) -> None:
        if counts is not None and vars:
            counts.count_wait()

    def wait_all(self) -> None:
        return None

    def close(self) -> None:
        return None
