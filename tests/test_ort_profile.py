"""onnxruntime-format profiles (profiler/ort_profile.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from segflow.profiler.ort_profile import SessionProfile


def test_events_and_file_name(tmp_path: Path) -> None:
    profile = SessionProfile(str(tmp_path / "prof"), "CPUExecutionProvider", start_ns=1_000_000)
    profile.session_span("session_initialization", 1_000_000, 3_000_000)
    sink = profile.profiler
    sink.span("run", "run", 4_000_000, 9_000_000, args={"syncs": 1})
    sink.span("push", "push segment 0", 4_000_000, 4_100_000)
    sink.span("node", "fc1", 5_000_000, 6_500_000, device="cpu:0",
              args={"op": "Gemm", "segment": 0})
    path = profile.write()
    assert re.fullmatch(re.escape(str(tmp_path / "prof")) + r"_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d"
                        r"\.json", path)
    with open(path, encoding="utf-8") as f:
        events = json.load(f)
    assert [(e["cat"], e["name"], e["ts"], e["dur"]) for e in events] == [
        ("Session", "session_initialization", 0, 2000), ("Session", "model_run", 3000, 5000),
        ("Node", "fc1_kernel_time", 4000, 1500)]
    node = events[-1]
    assert node["args"] == {"op_name": "Gemm", "provider": "CPUExecutionProvider",
                            "segment": "0"}
    assert all(e["ph"] == "X" and e["pid"] == os.getpid() for e in events)
