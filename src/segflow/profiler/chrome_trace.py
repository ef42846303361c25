"""Chrome trace-event export (opens in https://ui.perfetto.dev and chrome://tracing).

Layout: one process (the segflow host process), one lane (tid) per recording
thread -- the caller's thread with its run/push/sync/LOCAL spans, one lane per
engine worker with its segment spans enclosing their node spans -- plus one
lane per CUDA device for device-timed spans, and the communication lanes: a
data-parallel step's all-reduces, from launch to completion, whichever thread
completed them (a second lane where two are in flight at once). Every span is a complete ("X")
event, so nesting follows from time containment on a lane. A counter track
("C" events) shows pushes and syncs so far.

:func:`check_trace` validates a trace (used by the tests; handy for users).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from segflow.profiler.events import TASK_CATEGORIES, Category, Event

# First tid of device lanes, well clear of the host thread lanes (1, 2, ...).
_DEVICE_TID_BASE = 1000
# First tid of the communication lanes, between the host and the device lanes.
_COMM_TID_BASE = 900
# Tolerance for containment checks, in microseconds (timestamps are ns / 1000 floats).
_EPS_US = 1e-3


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def _lanes(events: Sequence[Event]) -> dict[int, tuple[int, str]]:
    """thread_id -> (tid, lane name); host threads in order of first span, devices last."""
    lanes: dict[int, tuple[int, str]] = {}
    host = device = 0
    for e in events:  # already ordered by start time
        if e.thread_id in lanes or e.category is Category.COMM:
            continue
        if e.category is Category.DEVICE or e.thread_id < 0:
            lanes[e.thread_id] = (_DEVICE_TID_BASE + device, e.thread)
            device += 1
        else:
            host += 1
            lanes[e.thread_id] = (host, e.thread)
    return lanes


def _comm_lanes(events: Sequence[Event]) -> dict[int, int]:
    """Event index -> tid of each all-reduce span: the first communication lane free at
    its start, so spans on one lane never overlap (collectives in flight together)."""
    ends: list[int] = []  # per communication lane, the end of its last span
    found = {}
    for i, e in enumerate(events):  # ordered by start time
        if e.category is not Category.COMM:
            continue
        lane = next((k for k, end in enumerate(ends) if end <= e.start_ns), len(ends))
        if lane == len(ends):
            ends.append(e.end_ns)
        else:
            ends[lane] = e.end_ns
        found[i] = _COMM_TID_BASE + lane
    return found


def to_chrome_trace(events: Sequence[Event], *, pid: int = 1,
                    process_name: str = "segflow") -> dict[str, Any]:
    """Events (ordered by start) -> a Chrome trace dict with ``traceEvents``."""
    events = sorted(events, key=lambda ev: (ev.start_ns, -ev.end_ns))
    t0 = min((e.start_ns for e in events), default=0)
    lanes = _lanes(events)
    comm = _comm_lanes(events)
    named = {*lanes.values(), *((tid, "communication" if tid == _COMM_TID_BASE else
                                 f"communication {tid - _COMM_TID_BASE + 1}")
                                for tid in set(comm.values()))}
    trace: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}}]
    for tid, name in sorted(named):
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                      "args": {"name": name}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                      "args": {"sort_index": tid}})
    for i, e in enumerate(events):
        args = {"device": e.device, **e.args} if e.device else dict(e.args)
        tid = comm[i] if i in comm else lanes[e.thread_id][0]
        trace.append({"name": e.name, "cat": e.category.value, "ph": "X",
                      "ts": (e.start_ns - t0) / 1e3, "dur": e.duration_ns / 1e3,
                      "pid": pid, "tid": tid, "args": _jsonable(args)})
    pushes = syncs = 0
    for e in sorted((e for e in events if e.category in (Category.PUSH, Category.SYNC)),
                    key=lambda ev: ev.end_ns):
        if e.category is Category.PUSH:
            pushes += 1
        else:
            syncs += 1
        trace.append({"name": "engine calls", "ph": "C", "ts": (e.end_ns - t0) / 1e3,
                      "pid": pid, "args": {"pushes": pushes, "syncs": syncs}})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"producer": "segflow", "clock": "perf_counter_ns"}}


def write_chrome_trace(events: Sequence[Event], path: str | os.PathLike[str], *,
                       pid: int = 1) -> None:
    """Write :func:`to_chrome_trace` as JSON to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(events, pid=pid), f, separators=(",", ":"))


# -- validation -----------------------------------------------------------------------------
_PHASES = {"X", "B", "E", "C", "M", "i", "I"}
_TASK_NAMES = {c.value for c in TASK_CATEGORIES}


def check_trace(trace: Mapping[str, Any]) -> list[str]:
    """Problems with a Chrome trace dict; an empty list means it is valid.

    Checks: required fields per phase; every "B" has its "E" on the same lane;
    "X" spans on a lane nest properly (no partial overlap); every lane with
    spans is named; every node span lies inside a task span of its segment
    on the same lane.
    """
    problems: list[str] = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is missing or not a list"]
    named: set[tuple[Any, Any]] = set()
    spans: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    open_b: dict[tuple[Any, Any], list[str]] = {}
    for i, ev in enumerate(events):
        ph = ev.get("ph")
        if ph not in _PHASES:
            problems.append(f"event {i}: unknown phase {ph!r}")
            continue
        if "name" not in ev or "pid" not in ev:
            problems.append(f"event {i}: missing name or pid")
            continue
        if ph == "M":
            if ev["name"] == "thread_name":
                named.add((ev["pid"], ev.get("tid")))
            continue
        if not isinstance(ev.get("ts"), (int, float)):
            problems.append(f"event {i} ({ev['name']}): missing numeric ts")
            continue
        lane = (ev["pid"], ev.get("tid"))
        if ph == "X":
            if not isinstance(ev.get("dur"), (int, float)) or ev["dur"] < 0:
                problems.append(f"event {i} ({ev['name']}): X event needs dur >= 0")
                continue
            spans.setdefault(lane, []).append(ev)
        elif ph == "B":
            open_b.setdefault(lane, []).append(ev["name"])
        elif ph == "E":
            stack = open_b.get(lane)
            if not stack:
                problems.append(f"event {i} ({ev['name']}): E without a matching B")
            else:
                stack.pop()
    for lane, stack in open_b.items():
        problems.extend(f"lane {lane}: B event {name!r} has no E" for name in stack)
    for lane, lane_spans in spans.items():
        if lane not in named:
            problems.append(f"lane {lane}: no thread_name metadata")
        problems.extend(_check_nesting(lane, lane_spans))
    return problems


def _check_nesting(lane: tuple[Any, Any], spans: list[dict[str, Any]]) -> list[str]:
    problems = []
    stack: list[dict[str, Any]] = []
    for ev in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        start, end = ev["ts"], ev["ts"] + ev["dur"]
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= start + _EPS_US:
            stack.pop()
        if stack and end > stack[-1]["ts"] + stack[-1]["dur"] + _EPS_US:
            problems.append(f"lane {lane}: {ev['name']!r} at {start:.3f}us overlaps "
                            f"{stack[-1]['name']!r} without nesting inside it")
        if ev.get("cat") == Category.NODE.value:
            segment = ev.get("args", {}).get("segment")
            if not any(p.get("cat") in _TASK_NAMES and p.get("args", {}).get("segment") == segment
                       for p in stack):
                problems.append(f"lane {lane}: node {ev['name']!r} is not inside a task span "
                                f"of its segment {segment}")
        stack.append(ev)
    return problems
