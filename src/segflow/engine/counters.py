"""RunCounters: what one run did, counted by the code that does it.

The engine counts its pushes and the host waits it serves, the stream backend
the device synchronizations made through it, the step runners and generated
segments the kernels they call, replays the host->native calls they make.
Nothing is derived from the plan: a change that adds a wait or a kernel the
plan does not show changes the counts.

One object per run. A run on the threaded engine counts from several threads
at once (the pushing thread and the workers), so each count is appended to a
list (one atomic operation, cheaper than taking a lock) and the counts are the
sums, read once the run is done.
"""

from __future__ import annotations


class RunCounters:
    """Per-run counts; :attr:`syncs` is what ``RunStats.syncs`` reports.

    ``pushes``: engine pushes; ``waits``: host waits the engine served (the output
    wait, a LOCAL task's wait for its inputs); ``device_syncs``: host waits on a
    device (stream or event synchronize, a graph capture); ``joined_syncs``:
    device waits that finish a wait the engine already counted (the output wait
    on a device is one wait for the worker, then the device), so that host wait
    counts once; ``kernels``: kernel calls; ``native_calls``: calls from Python
    into native code that replays made.
    """

    __slots__ = ("_pushes", "_waits", "_device_syncs", "_joined_syncs", "_kernels",
                 "_native_calls")

    def __init__(self) -> None:
        self._pushes: list[int] = []
        self._waits: list[int] = []
        self._device_syncs: list[int] = []
        self._joined_syncs: list[int] = []
        self._kernels: list[int] = []
        self._native_calls: list[int] = []

    # list.append is atomic: counting threads need no lock.
    def count_push(self, n: int = 1) -> None:
        self._pushes.append(n)

    def count_wait(self, n: int = 1) -> None:
        self._waits.append(n)

    def count_device_sync(self, n: int = 1, joined: bool = False) -> None:
        """``joined``: the sync completes a host wait the engine counted."""
        self._device_syncs.append(n)
        if joined:
            self._joined_syncs.append(n)

    def count_joined(self, n: int = 1) -> None:
        """``n`` device syncs already counted complete a host wait the engine counted."""
        self._joined_syncs.append(n)

    def count_kernels(self, n: int = 1) -> None:
        self._kernels.append(n)

    def count_native_calls(self, n: int = 1) -> None:
        self._native_calls.append(n)

    @property
    def pushes(self) -> int:
        return sum(self._pushes)

    @property
    def waits(self) -> int:
        return sum(self._waits)

    @property
    def device_syncs(self) -> int:
        return sum(self._device_syncs)

    @property
    def joined_syncs(self) -> int:
        return sum(self._joined_syncs)

    @property
    def kernels(self) -> int:
        return sum(self._kernels)

    @property
    def native_calls(self) -> int:
        return sum(self._native_calls)

    @property
    def syncs(self) -> int:
        """Host waits on a device or worker, each counted once."""
        return self.waits + self.device_syncs - self.joined_syncs

    def __repr__(self) -> str:
        return (f"RunCounters(pushes={self.pushes}, waits={self.waits}, "
                f"device_syncs={self.device_syncs}, joined_syncs={self.joined_syncs}, "
                f"kernels={self.kernels}, native_calls={self.native_calls})")
