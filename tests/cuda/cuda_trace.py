"""Helpers for the CUDA tests: what CUPTI saw while a function ran (host syncs, launches)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from segflow.profiler.cuda import device_activity

requires_cuda = torch.cuda.is_available()


@dataclass(frozen=True, slots=True)
class ApiCounts:
    syncs: int
    launches: int
    graph_launches: int
    kernels: int


def count_api_calls(fn: Callable[[], object], runs: int) -> ApiCounts:
    """Run ``fn`` ``runs`` times under torch.profiler; totals over the window, less what
    an empty window shows (the profiler's own synchronize)."""
    seen = device_activity(fn, runs)
    return ApiCounts(round(seen.host_syncs * runs), round(seen.launches * runs),
                     round(seen.graph_launches * runs), round(seen.kernels * runs))
