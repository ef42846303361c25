"""RunCounters: what one run did, counted by the code that does it.

The engine counts its pushes and the host waits it serves, the stream backend
the device synchronizations made through it, the step runners and generated
segments the kernels they call, replays the host->native calls they make.
Nothing is derived from the plan: a change that adds a wait or a kernel the
plan does not show changes the counts.

One object per run. A run on the threaded engine counts from several threads
at once (the pushing thread and the workers): ``shared=True`` adds a lock. A
run whose tasks all run on the calling thread counts without one.
"""

from __future__ import annotations

import threading


class RunCounters:
    """Per-run counts; :attr:`syncs` is what ``RunStats.syncs`` reports.

    ``waits``: host waits the engine served (the output wait, a LOCAL task's
    wait for its inputs); ``device_syncs``: host waits on a device (stream or
    event synchronize, a graph capture); ``joined_syncs``: device waits that
    finish a wait the engine already counted (the output wait on a device is
    one wait for the worker, then the device), so they are not counted twice.
    """

    __slots__ = ("pushes", "waits", "device_syncs", "joined_syncs", "kernels",
                 "native_calls", "_lock")

    def __init__(self, shared: bool = False) -> None:
        self.pushes = 0
        self.waits = 0
        self.device_syncs = 0
        self.joined_syncs = 0
        self.kernels = 0
        self.native_calls = 0
        self._lock = threading.Lock() if shared else None

    @property
    def syncs(self) -> int:
        """Host waits on a device or worker, each counted once."""
        return self.waits + self.device_syncs - self.joined_syncs

    def count_push(self, n: int = 1) -> None:
        lock = self._lock
        if lock is None:
            self.pushes += n
            return
        with lock:
            self.pushes += n

    def count_wait(self, n: int = 1) -> None:
        lock = self._lock
        if lock is None:
            self.waits += n
            return
        with lock:
            self.waits += n

    def count_device_sync(self, n: int = 1, joined: bool = False) -> None:
        """``joined``: the sync completes a host wait the engine counted."""
        lock = self._lock
        if lock is None:
            self.device_syncs += n
            if joined:
                self.joined_syncs += n
            return
        with lock:
            self.device_syncs += n
            if joined:
                self.joined_syncs += n

    def count_joined(self, n: int = 1) -> None:
        """``n`` device syncs already counted complete a host wait the engine counted."""
        lock = self._lock
        if lock is None:
            self.joined_syncs += n
            return
        with lock:
            self.joined_syncs += n

    def count_kernels(self, n: int = 1) -> None:
        lock = self._lock
        if lock is None:
            self.kernels += n
            return
        with lock:
            self.kernels += n

    def count_native_calls(self, n: int = 1) -> None:
        lock = self._lock
        if lock is None:
            self.native_calls += n
            return
        with lock:
            self.native_calls += n

    def __repr__(self) -> str:
        return (f"RunCounters(pushes={self.pushes}, waits={self.waits}, "
                f"device_syncs={self.device_syncs}, joined_syncs={self.joined_syncs}, "
                f"kernels={self.kernels}, native_calls={self.native_calls})")
