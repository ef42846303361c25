"""Tests for segflow.profiler: recording, counts vs RunStats, tables, summary, CUDA path."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import segflow
from segflow import models
from segflow.ir.types import Device
from segflow.profiler import ACTIVE, Category, Profiler, active_sink
from segflow.profiler.cuda import device_marker
from segflow.profiler.tables import format_tables, op_stats

SMALL = {"mlp_chain": {"layers": 3}, "nonzero_mid": {}}


def _session(name: str, **kwargs: Any) -> tuple[segflow.InferenceSession, dict[str, Any]]:
    opts = SMALL[name]
    return (segflow.InferenceSession(models.build(name, **opts), **kwargs),
            models.example_inputs(name, **opts))


def _count(prof: Profiler, category: Category) -> int:
    return sum(1 for e in prof.events if e.category is category)


def test_profile_sets_and_resets_the_active_sink() -> None:
    assert active_sink() is None
    with segflow.profile() as outer:
        assert active_sink() is outer
        with segflow.profile() as inner:
            assert ACTIVE.get() is inner
        assert active_sink() is outer
    assert active_sink() is None


def test_profiler_cannot_be_entered_twice() -> None:
    prof = segflow.profile()
    with prof, pytest.raises(RuntimeError, match="already active"):
        prof.__enter__()


@pytest.mark.parametrize("engine", ["inline", "threaded"])
@pytest.mark.parametrize("bulk", [True, False])
@pytest.mark.parametrize("name", ["mlp_chain", "nonzero_mid"])
def test_event_counts_match_run_stats(name: str, bulk: bool, engine: str) -> None:
    sess, feeds = _session(name, bulk=bulk, engine=engine)
    sess.run(None, feeds)  # not profiled
    runs = 3
    with segflow.profile() as prof:
        for _ in range(runs):
            sess.run(None, feeds)
    stats = sess.last_run_stats
    assert stats is not None
    assert _count(prof, Category.RUN) == runs
    assert _count(prof, Category.PUSH) == stats.pushes * runs
    assert _count(prof, Category.SYNC) == stats.syncs * runs
    assert _count(prof, Category.NODE) == stats.kernels * runs
    tasks = _count(prof, Category.SEGMENT) + _count(prof, Category.LOCAL) + \
        _count(prof, Category.COPY)
    assert tasks == stats.segments * runs
    summary = prof.summary()
    assert (summary["runs"], summary["pushes"], summary["syncs"]) == (
        runs, stats.pushes * runs, stats.syncs * runs)


def test_nothing_is_recorded_outside_the_block() -> None:
    sess, feeds = _session("mlp_chain")
    prof = segflow.profile()
    sess.run(None, feeds)
    assert prof.events == []
    with prof:
        sess.run(None, feeds)
    n = len(prof.events)
    sess.run(None, feeds)
    assert len(prof.events) == n > 0


def test_threads_and_devices_are_recorded() -> None:
    sess, feeds = _session("nonzero_mid", engine="threaded")
    with segflow.profile() as prof:
        sess.run(None, feeds)
    by_cat: dict[Category, set[str]] = {}
    for e in prof.events:
        by_cat.setdefault(e.category, set()).add(e.thread)
        assert e.end_ns >= e.start_ns
    main = threading.current_thread().name
    assert by_cat[Category.SEGMENT] == {"segflow-cpu:0"}   # bulk segments on the worker
    assert by_cat[Category.LOCAL] == {main}                 # LOCAL runs on the pushing thread
    assert by_cat[Category.PUSH] == by_cat[Category.SYNC] == {main}
    assert {e.device for e in prof.events if e.category is Category.NODE} == {"cpu:0"}
    local_waits = [e for e in prof.events if e.category is Category.SYNC
                   and e.name.startswith("wait for inputs of")]
    assert local_waits, "the LOCAL task's host wait is a sync span"


def test_spans_from_many_threads_are_all_kept() -> None:
    prof = Profiler()
    per_thread = 2000

    def work(i: int) -> None:
        for k in range(per_thread):
            prof.span("node", f"n{k}", k, k + 1, device="cpu:0", args={"op": "Relu"})

    threads = [threading.Thread(target=work, args=(i,), name=f"w{i}") for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = prof.events
    assert len(events) == 6 * per_thread
    assert {e.thread for e in events} == {f"w{i}" for i in range(6)}


def test_table_and_summary() -> None:
    sess, feeds = _session("nonzero_mid", bulk=False)
    with segflow.profile() as prof:
        sess.run(None, feeds)
        sess.run(None, feeds)
    text = prof.table()
    for word in ("Engine calls", "push", "sync", "kernel", "Ops by type", "Gemm", "NonZero",
                 "Calls", "Avg(us)", "Share"):
        assert word in text
    ops = op_stats(prof.events)
    assert abs(sum(r.share for r in ops) - 1.0) < 1e-9
    assert ops == sorted(ops, key=lambda r: -r.total_ns)
    assert all(r.min_ns <= r.avg_ns <= r.max_ns for r in ops)
    summary = prof.summary()
    assert summary["ops"]["FusedGemm"]["calls"] == 4
    assert summary["engine"]["run"]["share"] == pytest.approx(1.0)
    assert set(summary) >= {"runs", "pushes", "syncs", "kernels", "engine", "ops", "threads"}
    limited = prof.table(limit=2)
    assert "top 2 of" in limited
    assert "no profiler events" in format_tables([])


def test_clear_forgets_events() -> None:
    sess, feeds = _session("mlp_chain")
    with segflow.profile() as prof:
        sess.run(None, feeds)
        assert prof.events
        prof.clear()
        assert prof.events == []
        sess.run(None, feeds)
    assert _count(prof, Category.RUN) == 1


# -- the CUDA path, with fakes (no GPU needed) ------------------------------------------------
class _FakeEvent:
    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: _FakeEvent) -> float:
        return other.ms - self.ms


class _FakeClock:
    def __init__(self) -> None:
        self.synced = 0

    def anchor(self, device: str) -> tuple[_FakeEvent, int]:
        return _FakeEvent(10.0), 5_000_000   # the anchor event completed at host 5 ms

    def synchronize(self) -> None:
        self.synced += 1


def test_device_spans_are_mapped_onto_the_host_timeline() -> None:
    clock = _FakeClock()
    prof = Profiler(device_clock=clock)
    prof.device_span("device", "conv1", _FakeEvent(11.0), _FakeEvent(11.5), device="cuda:0",
                     args={"op": "Conv", "segment": 0})
    prof.device_span("device", "relu1", _FakeEvent(9.0), _FakeEvent(9.25), device="cuda:0",
                     args={"op": "Relu", "segment": 0})
    events = prof.events
    assert clock.synced == 1
    conv = next(e for e in events if e.name == "conv1")
    relu = next(e for e in events if e.name == "relu1")
    assert (conv.start_ns, conv.end_ns) == (6_000_000, 6_500_000)  # 5 ms + (11 - 10) ms
    assert (relu.start_ns, relu.end_ns) == (4_000_000, 4_250_000)  # before the anchor: signed
    assert conv.category is Category.DEVICE and conv.thread == "cuda:0 (device)"
    assert conv.thread_id < 0
    assert "device time" in prof.table()
    assert prof.summary()["device_ops"]["Conv"]["calls"] == 1


def test_device_marker_only_for_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    prof = Profiler()
    assert device_marker(prof, Device.parse("cpu")) is None
    assert device_marker(prof, None) is None
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert device_marker(prof, Device.parse("cuda:0")) is None
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)

    class HostOnly:
        def span(self, *args: Any, **kwargs: Any) -> None:
            pass

    assert device_marker(HostOnly(), Device.parse("cuda:0")) is None
    assert device_marker(prof, Device.parse("cuda:0")) is not None


def test_unknown_categories_are_kept_as_other() -> None:
    prof = Profiler()
    prof.span("compile", "segment 0", 0, 10)
    (event,) = prof.events
    assert event.category is Category.OTHER
    assert "other" in prof.table()
