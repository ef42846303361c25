"""The Profiler: records runtime spans while active; exports traces, tables and summaries.

>>> import segflow
>>> with segflow.profile() as prof:                 # doctest: +SKIP
...     sess.run(None, feeds)
>>> prof.export_chrome_trace("trace.json")          # doctest: +SKIP
>>> print(prof.table())                             # doctest: +SKIP
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Sequence
from typing import Any

from segflow.profiler.events import Category, Event
from segflow.profiler.sink import ACTIVE, EventSink

# A raw span as recorded on the hot path; turned into an Event only when read.
_Raw = tuple[str, str, int, int, int, str, dict[str, Any] | None]
_PendingDevice = tuple[str, str, Any, Any, str, dict[str, Any] | None]


class Profiler:
    """Collects spans from the runtime (implements :class:`EventSink`).

    Thread-safe: worker threads record concurrently. Recording appends one
    tuple per span (an atomic list append, no lock); :class:`Event` records,
    thread names and CUDA device times are resolved only when :attr:`events`
    is read.

    Use it through :func:`profile`; ``with`` activates it for the calling
    context (threads started inside the block are not covered: ContextVars
    do not flow into new threads).
    """

    def __init__(self, *, device_clock: Any | None = None) -> None:
        self._lock = threading.Lock()
        self._raw: list[_Raw] = []
        self._append = self._raw.append
        self._pending: list[_PendingDevice] = []
        self._thread_names: dict[int, str] = {}   # lane id -> thread name
        self._thread_lane = threading.local()
        self._anchors: dict[str, tuple[Any, int]] = {}
        self._device_clock = device_clock
        # Events built from the first n raw spans and m device spans: (n, m, events).
        self._resolved: tuple[int, int, list[Event]] | None = None
        self._token: contextvars.Token[EventSink | None] | None = None
        self.pid = os.getpid()

    # -- the EventSink side (hot path) ------------------------------------------------------
    def span(self, category: str, name: str, start_ns: int, end_ns: int, *,
             device: str = "", args: dict[str, Any] | None = None) -> None:
        # No lock: list.append is atomic (GIL, and per-object locks on free-threaded
        # builds), and this is the hot path.
        lane = getattr(self._thread_lane, "id", None)
        if lane is None:
            lane = self._new_lane()
        self._append((category, name, start_ns, end_ns, lane, device, args))

    def _new_lane(self) -> int:
        # Lanes are per Thread object: OS thread idents are reused after a thread ends.
        with self._lock:
            lane = len(self._thread_names) + 1
            self._thread_names[lane] = threading.current_thread().name
        self._thread_lane.id = lane
        return lane

    def device_span(self, category: str, name: str, start_event: Any, end_event: Any, *,
                    device: str, args: dict[str, Any] | None = None) -> None:
        with self._lock:
            if device not in self._anchors:
                # Anchored after this span's start event: elapsed times are signed.
                self._anchors[device] = self._clock().anchor(device)
            self._pending.append((category, name, start_event, end_event, device, args))

    # -- activation ----------------------------------------------------------------------
    def __enter__(self) -> Profiler:
        if self._token is not None:
            raise RuntimeError("this Profiler is already active")
        from segflow.profiler.cuda import initialized_cuda_devices

        for device in initialized_cuda_devices():
            self._anchors.setdefault(device, self._clock().anchor(device))
        self._token = ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        ACTIVE.reset(self._token)
        self._token = None

    # -- reading -------------------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        """Every recorded span, ordered by start time (parents before children)."""
        with self._lock:
            raw, pending = self._raw[:], self._pending[:]
            cached = self._resolved
            if cached is not None and cached[:2] == (len(raw), len(pending)):
                return list(cached[2])
            names = dict(self._thread_names)
            events = [Event(Category.parse(c), n, s, e, names.get(t, str(t)), t, d,
                            a if a is not None else {})
                      for c, n, s, e, t, d, a in raw]
            events.extend(self._resolve_device(pending))
            events.sort(key=lambda ev: (ev.start_ns, -ev.end_ns))
            self._resolved = (len(raw), len(pending), events)
            return list(events)

    def _resolve_device(self, pending: list[_PendingDevice]) -> list[Event]:
        if not pending:
            return []
        self._clock().synchronize()
        lanes = sorted({p[4] for p in pending})
        out = []
        for category, name, start, end, device, args in pending:
            anchor, host_ns = self._anchors[device]
            start_ns = host_ns + round(anchor.elapsed_time(start) * 1e6)
            end_ns = host_ns + round(anchor.elapsed_time(end) * 1e6)
            # Device lanes get negative ids so they never collide with thread lanes (1, 2, ...).
            out.append(Event(Category.parse(category), name, start_ns, max(end_ns, start_ns),
                             f"{device} (device)", -1 - lanes.index(device), device,
                             args if args is not None else {}))
        return out

    def _clock(self) -> Any:
        if self._device_clock is None:
            from segflow.profiler.cuda import CudaClock

            self._device_clock = CudaClock()
        return self._device_clock

    def clear(self) -> None:
        """Forget every recorded span (call it between runs, not during one)."""
        with self._lock:
            self._raw.clear()
            self._pending.clear()
            self._resolved = None

    def chrome_trace(self) -> dict[str, Any]:
        """The trace as a Chrome trace-event dict (see :meth:`export_chrome_trace`)."""
        from segflow.profiler.chrome_trace import to_chrome_trace

        return to_chrome_trace(self.events, pid=self.pid)

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome trace JSON file (open it in https://ui.perfetto.dev or
        chrome://tracing): one lane per thread/worker, segment spans enclosing their
        node spans, and counters of pushes and syncs so far."""
        from segflow.profiler.chrome_trace import write_chrome_trace

        write_chrome_trace(self.events, path, pid=self.pid)

    def table(self, *, by: Sequence[str] = ("engine", "op"), limit: int | None = None) -> str:
        """Aggregate tables like nvprof's API summary: per engine call and per op type."""
        from segflow.profiler.tables import format_tables

        return format_tables(self.events, sections=by, limit=limit)

    def summary(self) -> dict[str, Any]:
        """The aggregates as a dict: counts, per-category and per-op statistics."""
        from segflow.profiler.tables import summarize

        return summarize(self.events)


def profile(*, device_clock: Any | None = None) -> Profiler:
    """Profile every ``InferenceSession.run`` in the ``with`` block.

    >>> with segflow.profile() as prof:             # doctest: +SKIP
    ...     sess.run(None, feeds)
    >>> print(prof.table())                         # doctest: +SKIP
    """
    return Profiler(device_clock=device_clock)
