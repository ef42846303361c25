"""Test helper: the replayed runs of direct kernels a session's generated code holds."""

from __future__ import annotations

import segflow
from segflow.kernels.onednn.replay import DirectReplay


def replays(sess: segflow.InferenceSession) -> list[DirectReplay]:
    """The session's replays, read from its generated segments' closures."""
    return [cell.cell_contents for fn in sess._executor.compiled
            for cell in getattr(fn, "__closure__", None) or ()
            if isinstance(cell.cell_contents, DirectReplay)]
