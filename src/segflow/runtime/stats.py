"""RunStats: the counters returned for every run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class RunStats:
    """What one ``run`` did. The counters are exact and deterministic.

    ``pushes``, ``syncs``, ``kernels`` and ``native_calls`` are counted where the
    thing happens (:class:`segflow.engine.counters.RunCounters`), not derived from
    the plan: a kernel that synchronizes, or calls one more kernel, shows here.

    - ``nodes``: compute nodes in the plan (COPY nodes excluded)
    - ``segments``: engine tasks in the plan (bulk segments plus non-SYNC tasks)
    - ``pushes``: engine pushes this run made (counted by the engine)
    - ``syncs``: host waits on a device or worker, each once: the engine's (the
      output wait, a LOCAL task's wait for its inputs) and the device
      synchronizations made through the stream backend (on CUDA one per SYNC/COPY
      task in ``sync_mode="stream"``, one per event a CPU-device task waits for,
      one per CUDA-graph capture; see :mod:`segflow.runtime.completion`)
    - ``kernels``: kernel calls the run made for its top-level nodes (counted by the
      step runner, by generated segments and by replays, which count every step
      they run; a captured CUDA graph's replay counts the kernels it launches)
    - ``copies``: cross-device copies
    - ``forward_segments``, ``backward_segments``: the training plan's tasks per phase
      (0 for inference); ``updates``: optimizer/statistics tasks a training step pushed
    - ``allreduces``, ``allreduce_bytes``: gradient all-reduces a data-parallel step
      finished and the bytes they reduced (counted as each completes; 0 otherwise)
    - ``native_calls``: calls from Python into native code that replays made (a
      replayed run is one call for many kernels; the same run the usual way one per
      kernel); 0 where no replay ran. Not part of :meth:`counters`: it depends on
      whether the native library loads on the machine.
    """

    nodes: int
    segments: int
    pushes: int
    syncs: int
    kernels: int
    copies: int
    engine: str
    settings: dict[str, Any] = field(default_factory=dict)
    wall_time_s: float = 0.0
    forward_segments: int = 0
    backward_segments: int = 0
    updates: int = 0
    native_calls: int = 0
    allreduces: int = 0
    allreduce_bytes: int = 0

    def counters(self) -> dict[str, int]:
        """The deterministic counters only (what the benchmark gate compares)."""
        return {"segments": self.segments, "pushes": self.pushes, "syncs": self.syncs,
                "kernels": self.kernels, "copies": self.copies}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
