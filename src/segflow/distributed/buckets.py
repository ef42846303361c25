"""Gradient buckets: which gradients are all-reduced together, in the order they appear.

The training plan's backward segments end after every parameter gradient
(``passes/segment.py``), so each such segment is a point where communication can
start. :func:`plan_buckets` walks those segments in plan order (the order the
backward pass produces them) and packs their gradients into buckets of at most
``cap_bytes`` (a segment's gradients stay together; a bucket holds one dtype), as
torch's DistributedDataParallel packs parameters by ``bucket_cap_mb``. A bucket's
all-reduce can start as soon as the last segment it reads has run.

>>> group = GradientGroup(3, ("fc.weight",), (7,), ((10, 64),), torch.float32)
>>> [b.nbytes for b in plan_buckets([group], 25 << 20)]
[2560]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class GradientGroup:
    """The gradients one task of the plan produces (``task`` None: no task, a constant)."""

    task: int | None
    names: tuple[str, ...]
    slots: tuple[int, ...]            # the gradients' env slots
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Bucket:
    """Gradient groups all-reduced as one flat tensor; ``offsets[i]`` is where group i's
    gradients start in it (in elements)."""

    index: int
    groups: tuple[GradientGroup, ...]
    offsets: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.groups[-1].numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def tasks(self) -> tuple[int, ...]:
        """The plan tasks whose gradients it reads."""
        return tuple(g.task for g in self.groups if g.task is not None)


def plan_buckets(groups: Sequence[GradientGroup], cap_bytes: int) -> list[Bucket]:
    """Pack ``groups`` (in backward order) into buckets of at most ``cap_bytes``.

    A bucket closes when the next group would take it past the cap or has another
    dtype; a group larger than the cap gets a bucket of its own. Groups without a task
    (gradients known before the step runs) go to the first bucket.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {cap_bytes} bytes")
    ordered = sorted(groups, key=lambda g: -1 if g.task is None else g.task)
    packed: list[list[GradientGroup]] = []
    size = 0
    for group in ordered:
        current = packed[-1] if packed else None
        fits = (current is not None and current[0].dtype == group.dtype
                and size + group.nbytes <= cap_bytes)
        if fits:
            assert current is not None
            current.append(group)
            size += group.nbytes
        else:
            packed.append([group])
            size = group.nbytes
    buckets = []
    for index, members in enumerate(packed):
        offsets, at = [], 0
        for group in members:
            offsets.append(at)
            at += group.numel
        buckets.append(Bucket(index, tuple(members), tuple(offsets), members[0].dtype))
    return buckets
