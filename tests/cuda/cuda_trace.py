"""Helpers for the CUDA tests: what CUPTI saw while a function ran (host syncs, launches)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

SYNC_APIS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
})
LAUNCH_APIS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                         "cuLaunchKernelEx", "cudaGraphLaunch", "cuGraphLaunch"})

requires_cuda = torch.cuda.is_available()


@dataclass(frozen=True, slots=True)
class ApiCounts:
    syncs: int
    launches: int
    graph_launches: int
    kernels: int


def count_api_calls(fn: Callable[[], object], runs: int) -> ApiCounts:
    """Run ``fn`` ``runs`` times under torch.profiler; totals over the window."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    syncs = launches = graphs = kernels = 0
    for event in events:
        if event.get("ph") != "X":
            continue
        name, cat = event.get("name", ""), str(event.get("cat", "")).lower()
        if cat in ("cuda_runtime", "cuda_driver"):
            syncs += name in SYNC_APIS
            launches += name in LAUNCH_APIS
            graphs += name in ("cudaGraphLaunch", "cuGraphLaunch")
        elif cat == "kernel":
            kernels += 1
    return ApiCounts(syncs, launches, graphs, kernels)
