"""How much of a step's communication ran while backward segments were running.

``communication_overlap`` reads a profile's spans: the union of the all-reduce spans
(category ``comm``, launch to completion) and the union of the backward segment spans;
the fraction is the time both were under way over the all-reduces' time. 1.0: every
all-reduce was hidden behind backward compute; 0.0: none was (they ran after it).

>>> with segflow.profile() as prof:                                   # doctest: +SKIP
...     sess.step(feeds)
>>> communication_overlap(prof.events, backward_segments(sess.plan))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from segflow.passes.segment import Phase
from segflow.profiler.events import Category, Event
from segflow.runtime.plan import Plan

Interval = tuple[int, int]


def backward_segments(plan: Plan) -> frozenset[int]:
    """The indices of a training plan's backward segments (as their spans name them)."""
    return frozenset(s.index for s in plan.segments if s.phase is Phase.BACKWARD)


def communication_overlap(events: Sequence[Event], backward_segments: Collection[int]) -> float:
    """The fraction of all-reduce time during which a backward segment ran (0 without
    all-reduces)."""
    comm = _union((e.start_ns, e.end_ns) for e in events if e.category is Category.COMM)
    backward = _union((e.start_ns, e.end_ns) for e in events
                      if e.category is Category.SEGMENT
                      and e.args.get("segment") in backward_segments)
    total = sum(end - start for start, end in comm)
    if total == 0:
        return 0.0
    return _intersection(comm, backward) / total


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(a: list[Interval], b: list[Interval]) -> int:
    """Total length both disjoint, sorted interval lists cover."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
