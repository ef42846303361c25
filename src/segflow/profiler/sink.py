"""The recording interface the runtime calls when a profiler is active.

The runtime only ever sees these Protocols; :mod:`segflow.profiler` implements them.
When no profiler is active the runtime takes a separate, uninstrumented path,
so profiling costs nothing when off.
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol, runtime_checkable


class EventSink(Protocol):
    def span(self, category: str, name: str, start_ns: int, end_ns: int, *,
             device: str = "", args: dict[str, Any] | None = None) -> None:
        """Record a completed span (host ``perf_counter_ns`` times).

        ``category``: run, push, segment, local, copy, node, sync (see
        :class:`segflow.profiler.events.Category`). Called from worker threads.
        """
        ...


@runtime_checkable
class DeviceSpanSink(Protocol):
    """A sink that also takes device-timed spans (CUDA events); optional."""

    def device_span(self, category: str, name: str, start_event: Any, end_event: Any, *,
                    device: str, args: dict[str, Any] | None = None) -> None:
        """Record a span timed by two recorded CUDA events, resolved later."""
        ...


# The profiler active in the calling context (set by ``segflow.profile()``).
ACTIVE: contextvars.ContextVar[EventSink | None] = contextvars.ContextVar(
    "segflow_active_profiler", default=None)


def active_sink() -> EventSink | None:
    return ACTIVE.get()
