"""Buffers with lifetimes, and their placement in one block.

The one placement rule every planned block uses: the graph's memory plan
(``passes/plan_memory.py``), the activation arena's block (``runtime/arena.py``,
the plan's buffers for the outputs its kernels write) and a replayed run's block
(``kernels/replay.py``, the results that die inside the run). It knows nothing
of graphs or kernels, so each of them can import it.

>>> place([Buffer(("a",), 64, 0, 1), Buffer(("b",), 64, 2, 3)])[1].offset
0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALIGNMENT = 64


@dataclass(frozen=True, slots=True)
class Buffer:
    """One planned allocation: the values stored in it and where it sits in the block."""

    values: tuple[str, ...]   # the owner first, then in-place results stored over it
    nbytes: int
    start: int                # index of the step that writes it first
    end: int                  # index of its last reader
    offset: int = 0

    def overlaps_in_time(self, other: Buffer) -> bool:
        return self.start <= other.end and other.start <= self.end

    def overlaps_in_space(self, other: Buffer) -> bool:
        return (self.offset < other.offset + other.nbytes
                and other.offset < self.offset + self.nbytes)


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGNMENT` bytes (a cache line, and AVX-512's vector)."""
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def place(buffers: Sequence[Buffer]) -> list[Buffer]:
    """Greedy by size: largest first, at the lowest offset free for its whole lifetime.

    Returns the buffers in the order given, each with its offset.
    """
    order = sorted(range(len(buffers)), key=lambda i: (-buffers[i].nbytes, buffers[i].start))
    placed: list[Buffer] = []
    result: list[Buffer | None] = [None] * len(buffers)
    for i in order:
        buf = buffers[i]
        busy = sorted((p.offset, p.offset + p.nbytes) for p in placed if p.overlaps_in_time(buf))
        offset = 0
        for lo, hi in busy:
            if offset + buf.nbytes <= lo:
                break
            offset = max(offset, hi)
        done = Buffer(buf.values, buf.nbytes, buf.start, buf.end, offset)
        placed.append(done)
        result[i] = done
    return [b for b in result if b is not None]


def block_bytes(buffers: Sequence[Buffer]) -> int:
    """The size of the block that holds placed ``buffers``."""
    return max((b.offset + b.nbytes for b in buffers), default=0)
