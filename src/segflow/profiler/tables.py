"""Aggregate tables over profiler events, like nvprof's API summary.

Two views: per engine call (run, push, sync, segment/local/copy tasks,
kernel = one node's kernel call) and per op type. Each row has calls, total,
average, min, max and share. Engine-call shares are of the total run time
(so "sync 40%" means the host spent 40% of the run waiting); op shares are of
the total kernel time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from segflow.profiler.events import Category, Event

# Engine-call rows in display order, with the label the table uses.
ENGINE_ROWS: tuple[tuple[Category, str], ...] = (
    (Category.RUN, "run"),
    (Category.PUSH, "push"),
    (Category.SYNC, "sync"),
    (Category.SEGMENT, "segment"),
    (Category.LOCAL, "local"),
    (Category.COPY, "copy"),
    (Category.COMM, "all-reduce"),
    (Category.NODE, "kernel"),
    (Category.DEVICE, "kernel (device)"),
    (Category.OTHER, "other"),
)


@dataclass(frozen=True, slots=True)
class SpanStats:
    """Aggregate of a group of spans (times in nanoseconds)."""

    name: str
    calls: int
    total_ns: int
    min_ns: int
    max_ns: int
    share: float

    @property
    def avg_ns(self) -> float:
        return self.total_ns / self.calls if self.calls else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "total_ms": self.total_ns / 1e6,
                "avg_us": self.avg_ns / 1e3, "min_us": self.min_ns / 1e3,
                "max_us": self.max_ns / 1e3, "share": self.share}


def _aggregate(name: str, durations: Sequence[int], whole_ns: int) -> SpanStats:
    total = sum(durations)
    return SpanStats(name, len(durations), total, min(durations, default=0),
                     max(durations, default=0), total / whole_ns if whole_ns > 0 else 0.0)


def wall_ns(events: Sequence[Event]) -> int:
    """Time from the first span's start to the last span's end."""
    if not events:
        return 0
    return max(e.end_ns for e in events) - min(e.start_ns for e in events)


def run_ns(events: Sequence[Event]) -> int:
    """Total time inside runs (the whole profile when no run spans were recorded)."""
    runs = [e.duration_ns for e in events if e.category is Category.RUN]
    return sum(runs) if runs else wall_ns(events)


def engine_stats(events: Sequence[Event]) -> list[SpanStats]:
    """One row per engine-call category present, in :data:`ENGINE_ROWS` order."""
    whole = run_ns(events)
    by_cat: dict[Category, list[int]] = {}
    for e in events:
        by_cat.setdefault(e.category, []).append(e.duration_ns)
    return [_aggregate(label, by_cat[cat], whole) for cat, label in ENGINE_ROWS if cat in by_cat]


def op_stats(events: Iterable[Event], category: Category = Category.NODE) -> list[SpanStats]:
    """One row per op type over ``category`` spans, largest total first."""
    by_op: dict[str, list[int]] = {}
    for e in events:
        if e.category is category and e.op_type:
            by_op.setdefault(e.op_type, []).append(e.duration_ns)
    whole = sum(sum(d) for d in by_op.values())
    rows = [_aggregate(op, durations, whole) for op, durations in by_op.items()]
    return sorted(rows, key=lambda r: (-r.total_ns, r.name))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 right: Sequence[bool] | None = None) -> str:
    """A plain fixed-width text table (columns right-aligned where ``right`` says)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = right if right is not None else [False] + [True] * (len(headers) - 1)
    lines = []
    for n, row in enumerate(cells):
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _stats_rows(stats: Sequence[SpanStats]) -> list[list[str]]:
    return [[s.name, str(s.calls), f"{s.total_ns / 1e6:.3f}", f"{s.avg_ns / 1e3:.1f}",
             f"{s.min_ns / 1e3:.1f}", f"{s.max_ns / 1e3:.1f}", f"{100 * s.share:.1f}%"]
            for s in stats]


def format_tables(events: Sequence[Event], *, sections: Sequence[str] = ("engine", "op"),
                  limit: int | None = None) -> str:
    """The text the profiler's ``table()`` returns."""
    if not events:
        return "(no profiler events: was a session run inside `with segflow.profile()`?)"
    out = []
    for section in sections:
        if section == "engine":
            title = (f"Engine calls ({_count(events, Category.RUN)} runs, "
                     f"{run_ns(events) / 1e6:.3f} ms in runs; share = of run time)")
            out += [title, format_table(["Type", "Calls", "Total(ms)", "Avg(us)", "Min(us)",
                                         "Max(us)", "Share"], _stats_rows(engine_stats(events)))]
        elif section == "op":
            for category, what in ((Category.NODE, "host time"), (Category.DEVICE, "device time")):
                rows = op_stats(events, category)
                if not rows:
                    continue
                shown = rows[:limit] if limit else rows
                title = f"Ops by type ({what}; share = of all kernel time)"
                if len(shown) < len(rows):
                    title += f", top {len(shown)} of {len(rows)}"
                out += [title, format_table(["Op", "Calls", "Total(ms)", "Avg(us)", "Min(us)",
                                             "Max(us)", "Share"], _stats_rows(shown))]
        else:
            raise ValueError(f"unknown table section {section!r}; expected 'engine' or 'op'")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _count(events: Iterable[Event], category: Category) -> int:
    return sum(1 for e in events if e.category is category)


def summarize(events: Sequence[Event]) -> dict[str, Any]:
    """Counts and aggregates as plain data (what ``Profiler.summary()`` returns)."""
    return {
        "runs": _count(events, Category.RUN),
        "pushes": _count(events, Category.PUSH),
        "syncs": _count(events, Category.SYNC),
        "segments": _count(events, Category.SEGMENT),
        "local_tasks": _count(events, Category.LOCAL),
        "copies": _count(events, Category.COPY),
        "kernels": _count(events, Category.NODE),
        "events": len(events),
        "wall_ms": wall_ns(events) / 1e6,
        "run_ms": run_ns(events) / 1e6,
        "threads": sorted({e.thread for e in events}),
        "engine": {s.name: s.as_dict() for s in engine_stats(events)},
        "ops": {s.name: s.as_dict() for s in op_stats(events)},
        "device_ops": {s.name: s.as_dict() for s in op_stats(events, Category.DEVICE)},
    }
