"""Profiler: records what the runtime does (see :mod:`segflow.profiler.sink`)."""

from segflow.profiler.sink import ACTIVE, EventSink, active_sink

__all__ = ["ACTIVE", "EventSink", "active_sink"]
