"""Tests for the Chrome trace export and its validator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import segflow
from segflow import models
from segflow.profiler import Profiler
from segflow.profiler.chrome_trace import check_trace, to_chrome_trace


def _profiled(name: str, bulk: bool, engine: str, runs: int = 2) -> tuple[Profiler, Any]:
    opts = {"layers": 3} if name == "mlp_chain" else {}
    # The MLP's layers stay nodes (no dense chain): the trace tests count per-node spans.
    sess = segflow.InferenceSession(models.build(name, **opts), bulk=bulk, engine=engine,
                                    optimize={"dense_chain": False})
    feeds = models.example_inputs(name, **opts)
    with segflow.profile() as prof:
        for _ in range(runs):
            sess.run(None, feeds)
    return prof, sess.last_run_stats


@pytest.mark.parametrize("engine", ["inline", "threaded"])
@pytest.mark.parametrize("bulk", [True, False])
def test_exported_trace_is_valid(tmp_path: Path, bulk: bool, engine: str) -> None:
    prof, stats = _profiled("nonzero_mid", bulk, engine)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(path)
    trace = json.loads(path.read_text())
    assert check_trace(trace) == []
    events = trace["traceEvents"]
    phases = {e["ph"] for e in events}
    assert phases <= {"X", "C", "M"}  # complete events only: no B/E to balance
    # One lane per thread, each named.
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    used = {e["tid"] for e in events if e["ph"] == "X"}
    assert used == set(names)
    expected = {"MainThread"} | ({"segflow-cpu:0"} if engine == "threaded" else set())
    assert set(names.values()) == expected
    # Counters end at the run totals.
    counters = [e for e in events if e["ph"] == "C"]
    assert counters[-1]["args"] == {"pushes": 2 * stats.pushes, "syncs": 2 * stats.syncs}
    assert [c["args"]["pushes"] + c["args"]["syncs"] for c in counters] == list(
        range(1, len(counters) + 1))


def test_segment_spans_contain_their_nodes() -> None:
    prof, stats = _profiled("mlp_chain", True, "threaded")
    trace = prof.chrome_trace()
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    segments = [e for e in spans if e["cat"] == "segment"]
    nodes = [e for e in spans if e["cat"] == "node"]
    assert len(segments) == 2 and len(nodes) == 2 * stats.kernels
    for node in nodes:
        owners = [s for s in segments if s["tid"] == node["tid"]
                  and s["ts"] <= node["ts"] and node["ts"] + node["dur"] <= s["ts"] + s["dur"]]
        assert len(owners) == 1
        assert owners[0]["args"]["segment"] == node["args"]["segment"]
    assert all(node["args"]["op"] == "FusedGemm" for node in nodes)  # Gemm+Relu, fused


def test_trace_survives_json_of_any_args() -> None:
    prof = Profiler()
    prof.span("node", "n", 1000, 2000, device="cpu:0", args={"op": "Add", "obj": object(),
                                                             "shape": (1, 2)})
    text = json.dumps(prof.chrome_trace())
    assert '"shape":[1,2]' in text.replace(" ", "")


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "segment",
       **args: Any) -> dict[str, Any]:
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat,
            "args": args}


_META = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "main"}}]


def test_check_trace_accepts_balanced_begin_end() -> None:
    trace = {"traceEvents": _META + [
        {"name": "a", "ph": "B", "ts": 0, "pid": 1, "tid": 1},
        {"name": "a", "ph": "E", "ts": 5, "pid": 1, "tid": 1}]}
    assert check_trace(trace) == []


@pytest.mark.parametrize("events,problem", [
    ([{"name": "a", "ph": "B", "ts": 0, "pid": 1, "tid": 1}], "has no E"),
    ([{"name": "a", "ph": "E", "ts": 0, "pid": 1, "tid": 1}], "E without a matching B"),
    ([_x("a", 0, 10), _x("b", 5, 10)], "without nesting"),
    ([_x("s", 0, 10, segment=0), _x("n", 20, 1, cat="node", segment=0)],
     "not inside a task span"),
    ([_x("s", 0, 10, segment=1), _x("n", 2, 1, cat="node", segment=0)],
     "not inside a task span"),
    ([_x("a", 0, 10, tid=7)], "no thread_name"),
    ([{"name": "a", "ph": "Q", "ts": 0, "pid": 1}], "unknown phase"),
    ([{"name": "a", "ph": "X", "ts": 0, "pid": 1, "tid": 1}], "dur"),
])
def test_check_trace_finds_problems(events: list[dict[str, Any]], problem: str) -> None:
    problems = check_trace({"traceEvents": _META + events})
    assert any(problem in p for p in problems), problems


def test_check_trace_needs_trace_events() -> None:
    assert check_trace({}) == ["traceEvents is missing or not a list"]


def test_empty_profile_exports_an_empty_valid_trace() -> None:
    trace = to_chrome_trace([])
    assert check_trace(trace) == []
    assert [e["ph"] for e in trace["traceEvents"]] == ["M"]
