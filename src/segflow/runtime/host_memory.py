"""Host memory between runs: keep freed activation memory for the next run.

torch allocates every CPU tensor through malloc, and a run frees its activations
when it ends. glibc serves a block above its mmap threshold (dynamic, at most
32 MiB) with fresh ``mmap`` pages and returns free memory at the top of the heap
beyond its trim threshold to the OS, so once activations reach a few MiB each run
faults its memory in again, page by page, zero-filled by the kernel, inside the
kernels that first write the pages. Activations of tens of MiB (convolutions at
batch 8 and up) fault tens of thousands of pages a run; batch-1 activations stay
under the thresholds and fault none (``ru_minflt`` per run; the figures are in
docs/performance.md and docs/benchmarking.md).

``retain`` (the default for CPU sessions) raises both glibc thresholds
(``mallopt``), so freed blocks stay in the heap and the next run reuses them: the
process keeps its high-water mark of activation memory, as onnxruntime's arena
does, plus what the heap loses to fragmentation. torch allocates 64-byte aligned
blocks, and a freed block fenced in by small allocations cannot always take the
next aligned request of its own size, so glibc still grows the heap now and
then: a 1x1 convolution over 32 MiB activations, 300 runs, faulted fresh pages
in 1-3 runs instead of every run, and its process held 546 MiB against 386 MiB
(``tests/test_host_memory.py`` has the probe).

Loading a model frees a lot at once: the imported weights that the layout pass
replaced by their packed copies, the intermediate tensors of folded constants.
Under ``retain`` nothing would give those pages back, so a session ends its load
with :func:`release_free_heap` (glibc's ``malloc_trim(0)``), whatever the policy:
a model's load can leave about as much free heap as its packed weights take, and the
trim takes tens of milliseconds.

``system`` leaves malloc as it is. The setting is process-wide (malloc has one
configuration per process) and one-way: a later ``system`` session does not
undo an earlier ``retain``. On a C library other than glibc, ``retain`` reports
``system``.
"""

from __future__ import annotations

import ctypes
import enum
import os
import platform
from collections.abc import Callable, Mapping

from segflow.ir.types import Device, DeviceKind
from segflow.settings import ENV_HOST_MEMORY, host_memory, parse_choice

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Blocks up to 1 GiB come from the heap; a larger one is still mapped on its own
# (and unmapped when freed). Free heap memory is never trimmed on free().
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1   # mallopt takes an int


class HostMemory(enum.Enum):
    """What happens to a run's freed host memory."""

    RETAIN = "retain"    # kept in the heap for the next run
    SYSTEM = "system"    # malloc's own policy (may go back to the OS)

    @classmethod
    def resolve(cls, value: str | HostMemory | None,
                env: Mapping[str, str] | None = None) -> HostMemory:
        """The API value first, then ``SEGFLOW_HOST_MEMORY``, then ``retain``."""
        if value is not None:
            return parse_choice(cls, value, "host_memory")
        return parse_choice(cls, host_memory(env), ENV_HOST_MEMORY)


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt  # type: ignore[no-any-return]


def apply_host_memory(mode: HostMemory, device: Device) -> HostMemory:
    """Apply ``mode`` for a session on ``device``; returns the policy in force for it.

    Only CPU sessions change malloc (CUDA activations live in torch's caching
    allocator already). Calling it again with ``retain`` sets the same values.
    """
    if mode is HostMemory.SYSTEM or device.kind is not DeviceKind.CPU:
        return HostMemory.SYSTEM
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return HostMemory.SYSTEM
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    return HostMemory.RETAIN if ok else HostMemory.SYSTEM


def release_free_heap() -> int:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim(0)``); returns
    how many bytes the process's resident set shrank by (0 where there is no glibc)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return 0
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return 0
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    before = _resident_bytes()
    trim(0)
    return max(0, before - _resident_bytes())


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
