"""Per-shape kernel state with a cap: an LRU map from an input shape to what was built for it.

A session that sees many input sizes (a sequence length per request, a batch size per
call) would otherwise keep one entry per size it ever met: a built primitive, a memory
plan, an arena layout. :class:`ShapeCache` keeps the ``cap`` most recently used ones;
the owner of the cache (a kernel, a plan) holds it, so it is freed with that owner,
never with the process. ``on_evict(key, value)`` releases what an evicted entry holds
beyond Python memory; it runs outside the cache's lock.

:class:`RowAdmission` is for state kept *outside* segflow, where an entry cannot be
evicted: torch's oneDNN caches one primitive per input shape for the process, so a
kernel that calls it over many row counts passes its first ``exact`` row counts as they
are and rounds every other one up to one of a fixed set of buckets
(:func:`bucket_rows`), which bounds the shapes it ever hands torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Entries a per-shape cache keeps unless its owner says otherwise: a session cycling over
# more sizes than this rebuilds; what each entry holds, and what the cap bounds, is
# measured in docs/performance.md (benchmarks/shape_memory.py).
DEFAULT_CAP = 32


class ShapeCache(Generic[K, V]):
    """An LRU map of at most ``cap`` entries; ``get`` and ``put`` are thread-safe.

    >>> cache = ShapeCache[int, str](2)
    >>> cache.put(1, "a"); cache.put(2, "b"); cache.put(3, "c")
    >>> cache.get(1) is None, cache.get(3)
    (True, 'c')
    """

    __slots__ = ("cap", "on_evict", "hits", "misses", "evictions", "_entries", "_lock")

    def __init__(self, cap: int = DEFAULT_CAP,
                 on_evict: Callable[[K, V], object] | None = None) -> None:
        if cap < 1:
            raise ValueError(f"a shape cache needs a cap of at least 1, got {cap}")
        self.cap = cap
        self.on_evict = on_evict
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The entry for ``key``, now the most recently used (None: not cached)."""
        with self._lock:
            try:
                value = self._entries[key]
            except KeyError:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` for ``key`` as the most recent entry, evicting the least
        recently used ones beyond the cap."""
        evicted: list[tuple[K, V]] = []
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.cap:
                evicted.append(self._entries.popitem(last=False))
            self.evictions += len(evicted)
        if self.on_evict is not None:
            for old_key, old_value in evicted:
                self.on_evict(old_key, old_value)

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The entry for ``key``, made by ``make()`` (outside the lock) on a miss."""
        value = self.get(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value

    def values(self) -> list[V]:
        """The entries, least recently used first (a copy)."""
        with self._lock:
            return list(self._entries.values())

    def items(self) -> list[tuple[K, V]]:
        """``(key, entry)`` pairs, least recently used first (a copy)."""
        with self._lock:
            return list(self._entries.items())

    def clear(self) -> None:
        """Drop every entry (``on_evict`` runs for each)."""
        with self._lock:
            evicted = list(self._entries.items())
            self._entries.clear()
        if self.on_evict is not None:
            for key, value in evicted:
                self.on_evict(key, value)


# Buckets per doubling of the row count: a call runs at most 1/8 (12.5%) more rows than
# it has, and a row count has one of 8 buckets per power of two.
BUCKETS_PER_OCTAVE = 8


def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to the next of ``BUCKETS_PER_OCTAVE`` steps per power of two
    (exact up to ``2 * BUCKETS_PER_OCTAVE``): 100 -> 104, 128 -> 128, 129 -> 144."""
    if rows <= 2 * BUCKETS_PER_OCTAVE:
        return rows
    step = 1 << (rows.bit_length() - BUCKETS_PER_OCTAVE.bit_length())
    return -(-rows // step) * step


class RowAdmission:
    """Which row count a kernel hands a library that keeps per-shape state for the
    process: the first ``exact`` distinct row counts as they are (a session with a few
    steady sizes runs them unpadded), any other rounded up by :func:`bucket_rows`."""

    __slots__ = ("exact", "_seen", "_lock")

    def __init__(self, exact: int = 8) -> None:
        self.exact = exact
        self._seen: set[int] = set()
        self._lock = threading.Lock()

    def rows_for(self, rows: int) -> int:
        """The row count to run ``rows`` rows as (``>= rows``)."""
        seen = self._seen
        if rows in seen:
            return rows
        with self._lock:
            if len(seen) < self.exact:
                seen.add(rows)
                return rows
        return bucket_rows(rows)
