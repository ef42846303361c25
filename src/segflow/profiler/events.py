"""The profiler's event record: one completed span of runtime work."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class Category(enum.Enum):
    """What a span measures. The runtime passes these values as strings to the sink."""

    RUN = "run"          # one InferenceSession.run, on the calling thread
    PUSH = "push"        # handing a task to the engine (includes the task under ``inline``)
    SEGMENT = "segment"  # a bulk segment task, on its worker
    LOCAL = "local"      # a LOCAL task (host-side / data-dependent shape), on the pushing thread
    COPY = "copy"        # a cross-device copy task, on the copy worker
    NODE = "node"        # one node's kernel call, host clock
    DEVICE = "device"    # one node's device time (CUDA events), on a device lane
    SYNC = "sync"        # a host wait on a device or worker
    COMM = "comm"        # a data-parallel all-reduce, from its launch to its completion
    OTHER = "other"      # a category this profiler version does not know

    @classmethod
    def parse(cls, text: str) -> Category:
        try:
            return cls(text)
        except ValueError:
            return cls.OTHER


# Categories that are engine tasks (they enclose node spans on their thread).
TASK_CATEGORIES = frozenset({Category.SEGMENT, Category.LOCAL, Category.COPY})


def _no_args() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Event:
    """A completed span. Times are ``time.perf_counter_ns`` values (host clock).

    ``thread`` names the lane the span ran on: the recording thread for host
    spans (e.g. ``MainThread``, ``segflow-cpu:0``), the device for device spans.
    ``thread_id`` identifies the lane within one profile: 1, 2, ... per thread
    in order of first span, negative for device lanes.
    """

    category: Category
    name: str
    start_ns: int
    end_ns: int
    thread: str
    thread_id: int
    device: str = ""
    args: Mapping[str, Any] = field(default_factory=_no_args)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def op_type(self) -> str:
        """The op type of a node/device span ('' for other spans)."""
        return str(self.args.get("op", ""))
