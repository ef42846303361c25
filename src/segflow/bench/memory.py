"""Peak extra memory of one call: CUDA allocator peak on CUDA, RSS high-water mark on CPU.

Both report how far memory rose above its level before the call (MiB), so
weights and models loaded earlier in the process do not count. On Linux the
RSS high-water mark is reset through ``/proc/self/clear_refs``; where that is
not possible the probe reports None rather than a misleading number.

The CPU figure is approximate: free heap memory is first handed back to the
OS (glibc ``malloc_trim``), but memory a worker thread's malloc arena keeps
cached is reused without growing RSS, so threaded-engine runs can read low.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from collections.abc import Callable
from pathlib import Path

import torch

from segflow.ir.types import Device, DeviceKind

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MIB = 1024 * 1024


def status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``...), None where unreadable."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # "5" resets the peak RSS (Linux >= 4.0)
    except OSError:
        return False
    return True


def _trim_heap() -> None:
    """Return free heap memory to the OS so the run's own growth shows in RSS."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def peak_extra_mib(call: Callable[[], object], device: Device) -> float | None:
    """Run ``call`` once; return the peak memory above the level before it, in MiB."""
    if device.kind is DeviceKind.CUDA and torch.cuda.is_available():
        torch.cuda.synchronize(device.torch)
        before = torch.cuda.memory_allocated(device.torch)
        torch.cuda.reset_peak_memory_stats(device.torch)
        call()
        torch.cuda.synchronize(device.torch)
        return (torch.cuda.max_memory_allocated(device.torch) - before) / _MIB
    _trim_heap()
    before_kib = status_kib("VmRSS")
    if before_kib is None or not _reset_rss_peak():
        call()
        return None
    call()
    peak_kib = status_kib("VmHWM")
    if peak_kib is None:
        return None
    return max(0, peak_kib - before_kib) / 1024


def memory_kind(device: Device) -> str:
    """What :func:`peak_extra_mib` measures on ``device``, for records and tables."""
    if device.kind is DeviceKind.CUDA:
        return "cuda allocator peak above pre-run allocation (torch-managed memory only)"
    return "process RSS peak above pre-run RSS after malloc_trim (approximate)"
