"""CUDA instrumentation for profiled runs: NVTX ranges and CUDA-event device timing.

Every raw ``torch.cuda`` call of the profiler lives here. Nothing here runs
unless a profiler is active and a task's device is CUDA: node and segment
names go to NVTX ranges (visible in Nsight Systems), and each node's device
time is measured between two CUDA events recorded on the device's current
stream, so asynchronous kernels are timed where they run, not at launch.
"""

from __future__ import annotations

import time
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
