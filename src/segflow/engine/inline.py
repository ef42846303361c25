"""The inline engine: every task runs at push, in push order, on the caller's thread.

Deterministic and easy to debug: a failing kernel raises straight out of
``push`` with the node named. Dependencies are trivially satisfied because
every earlier task has already finished.
"""

from __future__ import annotations

from collections.abc import Sequence

from segflow.engine.base import AsyncTask, ExecType, Task, Var
from segflow.ir.types import Device


class InlineEngine:
    name = "inline"

    def push(self, fn: Task | AsyncTask, reads: Sequence[Var], writes: Sequence[Var],
             exec_type: ExecType = ExecType.SYNC, device: Device | None = None,
             name: str = "") -> None:
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

    def wait(self, var: Var) -> None:
        return None

    def wait_all(self) -> None:
        return None

    def close(self) -> None:
        return None
