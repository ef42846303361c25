"""Device streams and events: every raw ``torch.cuda`` call of execution lives here.

The runtime talks to a :class:`StreamBackend` (create a stream, record an
event, make a stream wait for an event, synchronize a stream or an event,
run code with a stream current, copy to and from pinned host memory, capture
and replay a CUDA graph). :class:`TorchCudaBackend` implements it with
``torch.cuda``; :class:`FakeBackend` implements it on the CPU and records
every call, so the stream/event accounting of both sync modes is tested
exactly on machines without a GPU.

A backend counts the host waits on the device made through it, by anyone
(:class:`SyncCount`): in all (``syncs``), and for the run a thread is working
for (:meth:`SyncCount.count_into`), so a kernel that synchronizes behind the
plan's back shows in its run's ``RunStats.syncs``.

Streams are created once per device and role and reused (:class:`StreamPool`,
owned by one executor): creating streams per run is a known, measurable cost.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from segflow.engine.counters import RunCounters
from segflow.ir.types import Device, DeviceKind

Tensor = torch.Tensor
StreamHandle = Any
"""A backend's stream object (``torch.cuda.Stream`` or :class:`FakeStream`)."""
EventHandle = Any
"""A backend's event object (``torch.cuda.Event`` or :class:`FakeEvent`)."""
GraphHandle = Any
"""A backend's captured graph (``torch.cuda.CUDAGraph`` or :class:`FakeGraph`)."""


class StreamRole(enum.Enum):
    """What a pooled stream is for."""

    COMPUTE = "compute"  # kernels of SYNC and LOCAL tasks
    COPY = "copy"        # host<->device and cross-device copies
    CAPTURE = "capture"  # CUDA-graph capture only (never runs ordinary work)


class StreamBackend(Protocol):
    """The device operations the runtime needs; one implementation per device API."""

    name: str

    def manages(self, device: Device) -> bool:
        """Whether tasks on ``device`` run on this backend's streams."""
        ...

    def create_stream(self, device: Device, role: StreamRole) -> StreamHandle:
        ...

    def current_stream(self, device: Device) -> StreamHandle:
        """The calling thread's current stream on ``device`` (where a caller's work went)."""
        ...

    def record_event(self, stream: StreamHandle) -> EventHandle:
        """A new event marking the work enqueued on ``stream`` so far."""
        ...

    def wait_event(self, stream: StreamHandle, event: EventHandle) -> None:
        """Make ``stream`` wait for ``event`` on the device (no host wait)."""
        ...

    def synchronize_stream(self, stream: StreamHandle) -> None:
        """Host wait for all work on ``stream`` (counted)."""
        ...

    def synchronize_event(self, event: EventHandle) -> None:
        """Host wait for ``event`` (counted)."""
        ...

    @property
    def syncs(self) -> int:
        """Host waits on the device made through this backend so far, by anyone."""
        ...

    def count_into(self, counts: RunCounters | None) -> RunCounters | None:
        """Count the calling thread's host waits through this backend into ``counts``
        from now on (None: no run's); returns the counts they went to before."""
        ...

    def use_stream(self, stream: StreamHandle) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` current for the calling thread inside the block."""
        ...

    def on_device(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` lives in device memory (a graph may capture it)."""
        ...

    def needs_upload(self, tensor: Tensor, device: Device) -> bool:
        """Whether a feed must be copied to ``device`` before kernels read it."""
        ...

    def record_stream(self, tensor: Tensor, stream: StreamHandle) -> None:
        """Tell the allocator ``tensor`` is used on ``stream`` (no early reuse of its memory)."""
        ...

    def to_device(self, tensor: Tensor, device: Device, stream: StreamHandle) -> Tensor:
        """Non-blocking copy of a host tensor to ``device`` on ``stream`` (via pinned memory)."""
        ...

    def to_host(self, tensor: Tensor, stream: StreamHandle) -> Tensor:
        """Non-blocking copy into fresh pinned host memory on ``stream``."""
        ...

    def capture(self, body: Callable[[], None], stream: StreamHandle) -> GraphHandle:
        """Capture the device work of ``body`` on ``stream`` into a replayable graph
        (a capture begins with a device synchronize: counted)."""
        ...

    def replay(self, graph: GraphHandle) -> None:
        """Launch a captured graph on the current stream."""
        ...


_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_SET_STREAM = getattr(torch._C, "_cuda_setStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


class _CurrentStream:
    """``with torch.cuda.stream(s)`` for a stream of the current device, without the
    Python layers around it (device-index normalisation, ``Stream`` objects for the
    previous stream): those cost tens of microseconds a switch, and a run switches
    three times. Other devices, or a torch without these bindings, take the public
    context manager."""

    __slots__ = ("_stream", "_previous", "_public")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._previous: tuple[int, int, int] | None = None
        self._public: Any = None

    def __enter__(self) -> None:
        s = self._stream
        if _GET_STREAM is None or _SET_STREAM is None or _GET_DEVICE is None \
                or _GET_DEVICE() != s.device_index:
            self._public = torch.cuda.stream(s)
            self._public.__enter__()
            return
        self._previous = _GET_STREAM(s.device_index)
        _SET_STREAM(stream_id=s.stream_id, device_index=s.device_index,
                    device_type=s.device_type)

    def __exit__(self, *exc: object) -> None:
        if self._public is not None:
            self._public.__exit__(*exc)
            return
        assert self._previous is not None and _SET_STREAM is not None
        stream_id, index, kind = self._previous
        _SET_STREAM(stream_id=stream_id, device_index=index, device_type=kind)


class SyncCount:
    """The host waits on a device made through one backend: all of them, and each
    thread's into the run it works for. Thread-safe: the threaded engine's workers
    synchronize at once."""

    __slots__ = ("_lock", "_total", "_local")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0
        self._local = threading.local()

    @property
    def total(self) -> int:
        return self._total

    def count_into(self, counts: RunCounters | None) -> RunCounters | None:
        previous: RunCounters | None = getattr(self._local, "counts", None)
        self._local.counts = counts
        return previous

    def __call__(self) -> None:
        """One host wait, made now on the calling thread."""
        with self._lock:
            self._total += 1
        counts: RunCounters | None = getattr(self._local, "counts", None)
        if counts is not None:
            counts.count_device_sync()


class TorchCudaBackend:
    """The real backend: ``torch.cuda`` streams, events and graphs."""

    name = "cuda"

    def __init__(self) -> None:
        self._synced = SyncCount()

    @property
    def syncs(self) -> int:
        return self._synced.total

    def count_into(self, counts: RunCounters | None) -> RunCounters | None:
        return self._synced.count_into(counts)

    def manages(self, device: Device) -> bool:
        return device.kind is DeviceKind.CUDA

    def create_stream(self, device: Device, role: StreamRole) -> StreamHandle:
        return torch.cuda.Stream(device=device.torch)

    def current_stream(self, device: Device) -> StreamHandle:
        return torch.cuda.current_stream(device.torch)

    def record_event(self, stream: StreamHandle) -> EventHandle:
        # No timing: timing events are slower to record and to wait on.
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: StreamHandle, event: EventHandle) -> None:
        stream.wait_event(event)

    def synchronize_stream(self, stream: StreamHandle) -> None:
        self._synced()
        stream.synchronize()

    def synchronize_event(self, event: EventHandle) -> None:
        self._synced()
        event.synchronize()

    def use_stream(self, stream: StreamHandle) -> contextlib.AbstractContextManager[None]:
        return _CurrentStream(stream)

    def on_device(self, tensor: Tensor) -> bool:
        return tensor.is_cuda

    def needs_upload(self, tensor: Tensor, device: Device) -> bool:
        return tensor.device != device.torch

    def record_stream(self, tensor: Tensor, stream: StreamHandle) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def to_device(self, tensor: Tensor, device: Device, stream: StreamHandle) -> Tensor:
        source = tensor
        if source.device.type == "cpu" and not source.is_pinned():
            # Only copies from pinned memory are truly asynchronous; the caching host
            # allocator keeps this block until the copy that reads it has finished.
            source = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            source.copy_(tensor)
        with _CurrentStream(stream):
            return source.to(device.torch, non_blocking=True)

    def to_host(self, tensor: Tensor, stream: StreamHandle) -> Tensor:
        if not tensor.is_cuda:  # e.g. a Shape output: already host memory
            return tensor
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with _CurrentStream(stream):
            out.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)
        return out

    def capture(self, body: Callable[[], None], stream: StreamHandle) -> GraphHandle:
        graph = torch.cuda.CUDAGraph()
        self._synced()  # torch.cuda.graph synchronizes the device before capturing
        # thread_local: unsafe calls made by *other* threads (a LOCAL op's .item() on
        # the caller thread) must not invalidate this capture.
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            body()
        return graph

    def replay(self, graph: GraphHandle) -> None:
        graph.replay()


# -- the fake backend -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FakeStream:
    id: int
    device: Device
    role: StreamRole


@dataclass(frozen=True, slots=True)
class FakeEvent:
    id: int
    stream: int


@dataclass(frozen=True, slots=True)
class FakeCall:
    """One recorded backend call: ``op`` and its stream/event ids or other arguments."""

    op: str
    args: tuple[Any, ...] = ()


class FakeGraph:
    """A "captured graph" that replays by running the captured Python body again."""

    __slots__ = ("id", "body")

    def __init__(self, graph_id: int, body: Callable[[], None]) -> None:
        self.id = graph_id
        self.body = body


class FakeBackend:
    """A CPU stand-in for CUDA that records every call (tests and ``--dry-run``).

    ``managed`` chooses which devices it claims (default: every device, so a
    CPU plan exercises the stream path). Copies are clones; a capture runs the
    body once and a replay runs it again, so numerics stay checkable.
    ``fail_capture`` makes every capture raise (to test the uncaptured fallback).
    """

    HOST_WAITS = ("synchronize_stream", "synchronize_event", "capture")

    def __init__(self, managed: Callable[[Device], bool] | None = None, *,
                 fail_capture: bool = False) -> None:
        self.name = "fake"
        self._managed = managed or (lambda device: True)
        self.fail_capture = fail_capture
        self.calls: list[FakeCall] = []
        self._ids = itertools.count(1)
        self._local = threading.local()
        self._synced = SyncCount()

    # -- queries used by tests -----------------------------------------------------------
    def count(self, op: str) -> int:
        return sum(1 for call in self.calls if call.op == op)

    @property
    def host_waits(self) -> int:
        """Calls that block the host on the device (what RunStats.syncs counts)."""
        return sum(1 for call in self.calls if call.op in self.HOST_WAITS)

    def ops(self) -> list[str]:
        return [call.op for call in self.calls]

    @property
    def syncs(self) -> int:
        return self._synced.total

    def count_into(self, counts: RunCounters | None) -> RunCounters | None:
        return self._synced.count_into(counts)

    def clear(self) -> None:
        self.calls.clear()

    def current(self) -> FakeStream | None:
        """The calling thread's current fake stream (None outside ``use_stream``)."""
        return getattr(self._local, "stream", None)

    # -- the protocol --------------------------------------------------------------------
    def _log(self, op: str, *args: Any) -> None:
        self.calls.append(FakeCall(op, args))  # list.append is atomic under the GIL

    def manages(self, device: Device) -> bool:
        return self._managed(device)

    def create_stream(self, device: Device, role: StreamRole) -> StreamHandle:
        stream = FakeStream(next(self._ids), device, role)
        self._log("create_stream", stream.id, str(device), role.value)
        return stream

    def current_stream(self, device: Device) -> StreamHandle:
        stream = self.current()
        if stream is None:
            stream = FakeStream(0, device, StreamRole.COMPUTE)  # the "default stream"
        return stream

    def record_event(self, stream: StreamHandle) -> EventHandle:
        event = FakeEvent(next(self._ids), stream.id)
        self._log("record_event", stream.id, event.id)
        return event

    def wait_event(self, stream: StreamHandle, event: EventHandle) -> None:
        self._log("wait_event", stream.id, event.id)

    def synchronize_stream(self, stream: StreamHandle) -> None:
        self._synced()
        self._log("synchronize_stream", stream.id)

    def synchronize_event(self, event: EventHandle) -> None:
        self._synced()
        self._log("synchronize_event", event.id)

    @contextlib.contextmanager
    def _use(self, stream: FakeStream) -> Iterator[None]:
        previous = self.current()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def use_stream(self, stream: StreamHandle) -> contextlib.AbstractContextManager[None]:
        self._log("use_stream", stream.id)
        return self._use(stream)

    def on_device(self, tensor: Tensor) -> bool:
        return True

    def needs_upload(self, tensor: Tensor, device: Device) -> bool:
        # Every feed counts as host data, so the upload path is exercised on the CPU.
        return True

    def record_stream(self, tensor: Tensor, stream: StreamHandle) -> None:
        self._log("record_stream", stream.id)

    def to_device(self, tensor: Tensor, device: Device, stream: StreamHandle) -> Tensor:
        self._log("to_device", stream.id, tuple(tensor.shape))
        return tensor.clone()

    def to_host(self, tensor: Tensor, stream: StreamHandle) -> Tensor:
        self._log("to_host", stream.id, tuple(tensor.shape))
        return tensor.clone()

    def capture(self, body: Callable[[], None], stream: StreamHandle) -> GraphHandle:
        graph = FakeGraph(next(self._ids), body)
        self._synced()
        self._log("capture", stream.id, graph.id)
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing (fake)")
        with self._use(stream):
            body()
        return graph

    def replay(self, graph: GraphHandle) -> None:
        self._log("replay", graph.id)
        graph.body()


# -- the pool -----------------------------------------------------------------------------


class StreamPool:
    """Streams created once per (device, role) and reused by every run of one executor.

    ``compute_streams`` compute lanes per device (lane 0 unless a caller spreads
    independent work); one copy stream and one capture stream per device.
    """

    def __init__(self, backend: StreamBackend, compute_streams: int = 1) -> None:
        if compute_streams < 1:
            raise ValueError(f"compute_streams must be >= 1, got {compute_streams}")
        self.backend = backend
        self.compute_streams = compute_streams
        self._streams: dict[tuple[Device, StreamRole, int], StreamHandle] = {}
        self._lock = threading.Lock()
        self.created = 0

    def _get(self, device: Device, role: StreamRole, lane: int) -> StreamHandle:
        key = (device, role, lane)
        stream = self._streams.get(key)
        if stream is None:
            with self._lock:
                stream = self._streams.get(key)
                if stream is None:
                    stream = self.backend.create_stream(device, role)
                    self._streams[key] = stream
                    self.created += 1
        return stream

    def compute(self, device: Device, lane: int = 0) -> StreamHandle:
        return self._get(device, StreamRole.COMPUTE, lane % self.compute_streams)

    def copy(self, device: Device) -> StreamHandle:
        return self._get(device, StreamRole.COPY, 0)

    def capture(self, device: Device) -> StreamHandle:
        return self._get(device, StreamRole.CAPTURE, 0)


def default_backend() -> StreamBackend:
    """The backend for real devices (CUDA through torch)."""
    return TorchCudaBackend()
