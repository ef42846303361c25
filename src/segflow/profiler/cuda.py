"""CUDA instrumentation for profiled runs: NVTX ranges and CUDA-event device timing.

Every raw ``torch.cuda`` call of the profiler lives here. Nothing here runs
unless a profiler is active and a task's device is CUDA: node and segment
names go to NVTX ranges (visible in Nsight Systems), and each node's device
time is measured between two CUDA events recorded on the device's current
stream, so asynchronous kernels are timed where they run, not at launch.

:func:`device_activity` counts what CUPTI saw over a window of runs (host
waits, launches, kernels, device busy time) for the GPU check and the CUDA
tests.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from segflow.ir.types import Device, DeviceKind
from segflow.profiler.sink import DeviceSpanSink


class CudaMarker:
    """Marks the nodes of one task on one CUDA device."""

    __slots__ = ("_sink", "_device", "_torch_device")

    def __init__(self, sink: DeviceSpanSink, device: Device) -> None:
        self._sink = sink
        self._device = str(device)
        self._torch_device = device.torch

    def push_range(self, name: str) -> None:
        """Open an NVTX range (a task's)."""
        torch.cuda.nvtx.range_push(name)

    def pop_range(self) -> None:
        torch.cuda.nvtx.range_pop()

    def begin(self, name: str) -> Any:
        """Open an NVTX range and record the start event; returns the event."""
        torch.cuda.nvtx.range_push(name)
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._torch_device))
        return event

    def end(self, start: Any, category: str, name: str, args: dict[str, Any]) -> None:
        """Record the end event, close the NVTX range and hand both events to the sink."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._torch_device))
        torch.cuda.nvtx.range_pop()
        self._sink.device_span(category, name, start, event, device=self._device, args=args)


def device_marker(sink: object, device: Device | None) -> CudaMarker | None:
    """A marker for tasks on a CUDA ``device`` when ``sink`` takes device spans, else None."""
    if device is None or device.kind is not DeviceKind.CUDA:
        return None
    if not isinstance(sink, DeviceSpanSink) or not torch.cuda.is_available():
        return None
    return CudaMarker(sink, device)


class DeviceClock(Protocol):
    """Anchors device events to the host clock (a fake one is used in CPU tests)."""

    def anchor(self, device: str) -> tuple[Any, int]:
        """An event recorded on ``device`` and the host ``perf_counter_ns`` it completed at."""
        ...

    def synchronize(self) -> None:
        """Wait for every recorded event to complete."""
        ...


class CudaClock:
    """The real clock: a synchronize, then an anchor event whose host time is known."""

    def anchor(self, device: str) -> tuple[Any, int]:
        dev = torch.device(device)
        torch.cuda.synchronize(dev)
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(dev))
        event.synchronize()
        return event, time.perf_counter_ns()

    def synchronize(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)


def initialized_cuda_devices() -> list[str]:
    """CUDA devices worth anchoring at profile start (none unless CUDA is already in use)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [str(Device(DeviceKind.CUDA, i)) for i in range(torch.cuda.device_count())]


# -- what CUPTI saw over a window of runs ---------------------------------------------------

SYNC_APIS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cudaMemcpy2D", "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
    "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuMemcpy",
})
"""Runtime and driver calls that block the host until the device catches up."""
LAUNCH_APIS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cuLaunchKernel",
    "cuLaunchKernelEx", "cudaGraphLaunch", "cuGraphLaunch",
})
GRAPH_LAUNCH_APIS = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True, slots=True)
class DeviceActivity:
    """Per-run averages over a profiled window: host waits and launches (API calls),
    device kernels, and device busy time (union of kernel and copy intervals)."""

    host_syncs: float
    launches: float
    graph_launches: float
    kernels: float
    busy_us: float


def summarize_trace(events: Iterable[Mapping[str, Any]], runs: int,
                    baseline: DeviceActivity | None = None) -> DeviceActivity:
    """Count a Chrome trace's syncs, launches and kernels and merge its device intervals,
    per run; ``baseline`` (a window without runs) is subtracted from the totals first."""
    syncs = launches = graph_launches = kernels = 0
    intervals: list[tuple[float, float]] = []
    for event in events:
        if event.get("ph") != "X":
            continue
        category = str(event.get("cat", "")).lower()
        name = str(event.get("name", ""))
        if category in ("cuda_runtime", "cuda_driver", "runtime", "driver"):
            syncs += name in SYNC_APIS
            launches += name in LAUNCH_APIS
            graph_launches += name in GRAPH_LAUNCH_APIS
        elif category in DEVICE_CATEGORIES:
            kernels += category == "kernel"
            start = float(event.get("ts", 0.0))
            intervals.append((start, start + float(event.get("dur", 0.0))))
    busy = 0.0
    end = float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    base = baseline or DeviceActivity(0, 0, 0, 0, 0)
    n = max(runs, 1)
    return DeviceActivity((syncs - base.host_syncs) / n, (launches - base.launches) / n,
                          (graph_launches - base.graph_launches) / n,
                          (kernels - base.kernels) / n, (busy - base.busy_us) / n)


def _trace_events(fn: Callable[[], object], runs: int) -> list[Mapping[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def device_activity(fn: Callable[[], object], runs: int) -> DeviceActivity:
    """Run ``fn`` ``runs`` times under ``torch.profiler`` (CPU and CUDA activity).

    What the profiler itself does (stopping it synchronizes the device once) is
    measured over an empty window and subtracted, so a bulk inference reads as
    exactly its own host waits.
    """
    torch.cuda.synchronize()
    empty = summarize_trace(_trace_events(lambda: None, 0), 1)
    return summarize_trace(_trace_events(fn, runs), runs, baseline=DeviceActivity(
        empty.host_syncs, empty.launches, empty.graph_launches, empty.kernels, 0.0))
