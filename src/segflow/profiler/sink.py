"""The recording interface the runtime calls when a profiler is active.

The runtime only ever sees this Protocol; :mod:`segflow.profiler` implements it.
When no profiler is active the runtime takes a separate, uninstrumented path,
so profiling costs nothing when off.
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol


class EventSink(Protocol):
    def span(self, category: str, name: str, start_ns: int, end_ns: int, *,
             device: str = "", args: dict[str, Any] | None = None) -> None:
        """Record a completed span. ``category``: segment, node, push, sync, copy, local."""
        ...


# The profiler active in the calling context (set by ``segflow.profile()``).
ACTIVE: contextvars.ContextVar[EventSink | None] = contextvars.ContextVar(
    "segflow_active_profiler", default=None)


def active_sink() -> EventSink | None:
    return ACTIVE.get()
