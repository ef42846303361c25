"""onnxruntime-format profiles: what ``SessionOptions.enable_profiling`` writes.

onnxruntime writes a JSON list of complete ("X") events, ``ts`` and ``dur`` in
microseconds from the profile's start: ``cat: "Session"`` for loading, initialization
and each ``model_run``, ``cat: "Node"`` for each kernel, named ``<node>_kernel_time``
with ``args.op_name`` and ``args.provider``. Tools written for those files (summing
node time per op type, say) read segflow's the same way; segflow's segment and
engine spans come as ``Session`` events under their own names.

>>> profile = SessionProfile("onnxruntime_profile_", "CPUExecutionProvider")  # doctest: +SKIP
>>> sess.run(None, feeds); profile.write()                                   # doctest: +SKIP
'onnxruntime_profile__2024-05-01_12-00-00.json'
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Any

from segflow.profiler.events import Category, Event
from segflow.profiler.profiler import Profiler

# segflow's span categories -> onnxruntime's event names (None: the span's own name).
_SESSION_NAMES = {Category.RUN: "model_run", Category.SEGMENT: None, Category.LOCAL: None,
                  Category.COPY: None, Category.SYNC: None}


class SessionProfile:
    """The profile of one session: a :class:`Profiler` its runs record into, the
    session's own spans (loading, initialization), and the file it is written to."""

    def __init__(self, prefix: str, provider: str, start_ns: int | None = None) -> None:
        self.prefix = prefix
        self.provider = provider
        self.profiler = Profiler()
        # The origin of the events' ``ts`` (``perf_counter_ns``): the session's start.
        self.start_ns = time.perf_counter_ns() if start_ns is None else start_ns
        # onnxruntime reports its profile's start on the system clock, in ns.
        self.start_time_ns = time.time_ns()
        self._started = datetime.datetime.now()
        self._session: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def session_span(self, name: str, start_ns: int, end_ns: int) -> None:
        """Record a session-level span (``model_loading_uri``, ``session_initialization``)."""
        with self._lock:
            self._session.append((name, start_ns, end_ns))

    def events(self) -> list[dict[str, Any]]:
        """The profile as onnxruntime's list of event dicts."""
        pid = os.getpid()
        with self._lock:
            session = list(self._session)
        # Session spans go on lane 0: they ran before any run's lanes existed (the lanes
        # are the profiler's 1, 2, ... per thread, where onnxruntime writes OS thread ids).
        out = [_event("Session", name, start, end, self.start_ns, pid, 0, {})
               for name, start, end in session]
        out += [converted for e in self.profiler.events
                if (converted := self._event(e, pid)) is not None]
        return out

    def _event(self, e: Event, pid: int) -> dict[str, Any] | None:
        if e.category is Category.NODE:
            return _event("Node", f"{e.name}_kernel_time", e.start_ns, e.end_ns,
                          self.start_ns, pid, e.thread_id,
                          {"op_name": e.op_type, "provider": self.provider,
                           **{k: str(v) for k, v in e.args.items() if k != "op"}})
        if e.category in _SESSION_NAMES:
            name = _SESSION_NAMES[e.category] or e.name
            return _event("Session", name, e.start_ns, e.end_ns, self.start_ns, pid,
                          e.thread_id, {k: str(v) for k, v in e.args.items()})
        return None  # pushes, device lanes: no onnxruntime counterpart

    def write(self) -> str:
        """Write ``<prefix>_<date>.json`` (onnxruntime's name) and return its name."""
        stamp = self._started.strftime("%Y-%m-%d_%H-%M-%S")
        path = f"{self.prefix}_{stamp}.json"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.events(), f)
        return path


def _event(category: str, name: str, start_ns: int, end_ns: int, origin_ns: int, pid: int,
           tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"cat": category, "pid": pid, "tid": tid, "dur": (end_ns - start_ns) // 1000,
            "ts": (start_ns - origin_ns) // 1000, "ph": "X", "name": name, "args": args}

