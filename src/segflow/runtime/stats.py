"""RunStats: the counters returned for every run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class RunStats:
    """What one ``run`` did. The counters are exact and deterministic.

    - ``nodes``: compute nodes in the plan (COPY nodes excluded)
    - ``segments``: engine tasks in the plan (bulk segments plus non-SYNC tasks)
    - ``pushes``: engine pushes this run made
    - ``syncs``: host waits on a device or worker: the output wait (1), one per
      LOCAL task with inputs, and on CUDA one per SYNC/COPY task in
      ``sync_mode="stream"``, one per event a CPU-device task waits for, and one
      per CUDA-graph capture (see :mod:`segflow.runtime.completion`)
    - ``kernels``: kernel invocations of top-level nodes
    - ``copies``: cross-device copies
    - ``forward_segments``, ``backward_segments``: the training plan's tasks per phase
      (0 for inference); ``updates``: optimizer/statistics tasks a training step pushed
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

    def counters(self) -> dict[str, int]:
        """The deterministic counters only (what the benchmark gate compares)."""
        return {"segments": self.segments, "pushes": self.pushes, "syncs": self.syncs,
                "kernels": self.kernels, "copies": self.copies}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
