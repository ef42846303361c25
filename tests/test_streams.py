"""Stream pool and completion strategies, accounted exactly on the CPU through FakeBackend.

The fake backend claims CPU devices, so a CPU plan runs the same stream/event
path a CUDA plan runs; every backend call is recorded. The invariant under
test: ``RunStats.syncs`` counts host waits exactly in both sync modes.
"""

from __future__ import annotations

import numpy as np
import pytest

import segflow
from concurrency import run_in_threads
from segflow import models
from segflow.engine.streams import FakeBackend, StreamPool, StreamRole
from segflow.ir.types import Device
from segflow.runtime.completion import HostCompletion, StreamCompletion, SyncMode

ENGINES = ["inline", "threaded"]
LAYERS = 4  # mlp_chain: 4 x (Gemm, Relu)


@pytest.fixture(autouse=True)
def _layers_stay_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count per-node work (kernels, tasks, syncs) over a small MLP; the
    dense_chain pass would make all its layers one node (tests/test_dense_chain.py)."""
    monkeypatch.setenv("SEGFLOW_NO_DENSE_CHAIN", "1")


@pytest.fixture(scope="module")
def mlp():
    return models.build("mlp_chain", layers=LAYERS, width=8)


@pytest.fixture(scope="module")
def mlp_feeds():
    return models.example_inputs("mlp_chain", batch_size=2, layers=LAYERS, width=8)


@pytest.fixture(scope="module")
def mlp_reference(mlp, mlp_feeds):
    # Module scope runs before the function-scoped environment fixture: say it here too.
    return segflow.InferenceSession(mlp, engine="inline",
                                    optimize={"dense_chain": False}).run(None, mlp_feeds)


def _session(model, fake, copy_stream=False, **kwargs):
    """``copy_stream``: copy feeds and outputs on the copy stream, as plans with several
    devices do, instead of on the one compute stream of these single-device plans."""
    sess = segflow.InferenceSession(model, stream_backend=fake, **kwargs)
    if copy_stream:
        sess._executor.completion.io_on_compute = False
    return sess


def _steady(sess, fake, feeds, runs=2):
    """Warm up, then record the backend calls of one run."""
    for _ in range(runs):
        sess.run(None, feeds)
    fake.clear()
    outputs = sess.run(None, feeds)
    return outputs, sess.last_run_stats


# -- the pool -----------------------------------------------------------------------------


class _Stream:
    def __init__(self, stream_id: int, device_index: int) -> None:
        self.stream_id, self.device_index, self.device_type = stream_id, device_index, 1


def test_current_stream_switch_restores_the_previous_stream(monkeypatch):
    from segflow.engine import streams

    calls = []
    current = {0: (7, 0, 1)}
    monkeypatch.setattr(streams, "_GET_DEVICE", lambda: 0)
    monkeypatch.setattr(streams, "_GET_STREAM", lambda index: current[index])

    def set_stream(stream_id, device_index, device_type):
        calls.append(stream_id)
        current[device_index] = (stream_id, device_index, device_type)

    monkeypatch.setattr(streams, "_SET_STREAM", set_stream)
    with streams._CurrentStream(_Stream(42, 0)):
        assert current[0] == (42, 0, 1)
    assert calls == [42, 7] and current[0] == (7, 0, 1)
    with pytest.raises(RuntimeError), streams._CurrentStream(_Stream(43, 0)):
        raise RuntimeError("a kernel failed")
    assert current[0] == (7, 0, 1)  # restored on errors too


def test_current_stream_switch_on_another_device_takes_torchs_context(monkeypatch):
    from segflow.engine import streams

    used = []

    class Public:
        def __init__(self, stream):
            used.append(("init", stream.stream_id))

        def __enter__(self):
            used.append("enter")

        def __exit__(self, *exc):
            used.append("exit")

    monkeypatch.setattr(streams, "_GET_DEVICE", lambda: 0)
    monkeypatch.setattr(streams, "_SET_STREAM", lambda **kw: pytest.fail("fast path taken"))
    monkeypatch.setattr(streams.torch.cuda, "stream", Public)
    with streams._CurrentStream(_Stream(5, 1)):  # a stream of cuda:1 while cuda:0 is current
        pass
    assert used == [("init", 5), "enter", "exit"]


def test_pool_creates_each_stream_once():
    fake = FakeBackend()
    pool = StreamPool(fake)
    dev = Device.parse("cuda:0")
    assert pool.compute(dev) is pool.compute(dev)
    assert pool.copy(dev) is pool.copy(dev)
    assert pool.capture(dev) is pool.capture(dev)
    assert pool.compute(dev) is not pool.copy(dev)
    assert pool.created == fake.count("create_stream") == 3
    roles = [call.args[2] for call in fake.calls]
    assert roles == [StreamRole.COMPUTE.value, StreamRole.COPY.value, StreamRole.CAPTURE.value]


def test_pool_lanes_wrap_and_validate():
    pool = StreamPool(FakeBackend(), compute_streams=2)
    dev = Device.parse("cuda:0")
    assert pool.compute(dev, 0) is pool.compute(dev, 2)
    assert pool.compute(dev, 0) is not pool.compute(dev, 1)
    with pytest.raises(ValueError, match="compute_streams"):
        StreamPool(FakeBackend(), compute_streams=0)


def test_session_streams_are_created_once_not_per_run(mlp, mlp_feeds):
    fake = FakeBackend()
    sess = _session(mlp, fake, engine="inline")
    for _ in range(3):
        sess.run(None, mlp_feeds)
    # One compute stream: one device, so its copies need no copy stream.
    assert fake.count("create_stream") == 1
    other = FakeBackend()
    _session(mlp, other, engine="inline", copy_stream=True).run(None, mlp_feeds)
    assert other.count("create_stream") == 2  # pools belong to sessions, not the module


# -- strategy choice ----------------------------------------------------------------------


def test_cpu_device_without_fake_uses_host_completion(mlp, mlp_feeds):
    sess = segflow.InferenceSession(mlp, engine="inline", bulk=True)
    assert isinstance(sess._executor.completion, HostCompletion)
    sess.run(None, mlp_feeds)
    stats = sess.last_run_stats
    assert (stats.segments, stats.pushes, stats.syncs) == (1, 1, 1)
    assert stats.settings["sync_mode"] == "event"
    assert stats.settings["cuda_graphs"] is False
    assert "sync mode" not in sess.explain()  # CPU explain output is unchanged


def test_fake_backend_that_claims_nothing_falls_back_to_host(mlp):
    fake = FakeBackend(managed=lambda device: False)
    sess = _session(mlp, fake)
    assert isinstance(sess._executor.completion, HostCompletion)


def test_sync_mode_is_parsed_and_recorded(mlp, mlp_feeds):
    assert SyncMode.parse("STREAM") is SyncMode.STREAM
    assert SyncMode.parse(SyncMode.EVENT) is SyncMode.EVENT
    with pytest.raises(ValueError, match="sync_mode='eventual'"):
        SyncMode.parse("eventual")
    with pytest.raises(ValueError, match="expected 'event' or 'stream'"):
        segflow.InferenceSession(mlp, sync_mode="bogus")
    sess = _session(mlp, FakeBackend(), sync_mode="stream")
    assert isinstance(sess._executor.completion, StreamCompletion)
    sess.run(None, mlp_feeds)
    assert sess.last_run_stats.settings["sync_mode"] == "stream"


# -- exact accounting ---------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_bulk_event_mode_one_host_wait(mlp, mlp_feeds, mlp_reference, engine):
    fake = FakeBackend()
    sess = _session(mlp, fake, engine=engine, bulk=True, sync_mode="event")
    assert sess._executor.completion.io_on_compute
    outputs, stats = _steady(sess, fake, mlp_feeds)
    np.testing.assert_array_equal(outputs[0], mlp_reference[0])
    assert (stats.segments, stats.pushes, stats.syncs) == (1, 1, 1)
    assert fake.host_waits == stats.syncs == 1
    assert fake.ops() == [
        "to_device",                                     # the feed, on the compute stream
        "use_stream", "record_event",                    # the segment, then its event
        "to_host", "record_event", "synchronize_event",  # the output; the one host wait
    ]
    assert "copies: feeds and outputs through pinned memory on the compute stream" \
        in sess.explain()


@pytest.mark.parametrize("engine", ENGINES)
def test_bulk_event_mode_on_the_copy_stream_one_host_wait(mlp, mlp_feeds, mlp_reference,
                                                          engine):
    fake = FakeBackend()
    sess = _session(mlp, fake, copy_stream=True, engine=engine, bulk=True, sync_mode="event")
    outputs, stats = _steady(sess, fake, mlp_feeds)
    np.testing.assert_array_equal(outputs[0], mlp_reference[0])
    assert (stats.segments, stats.pushes, stats.syncs) == (1, 1, 1)
    assert fake.host_waits == stats.syncs == 1
    assert fake.count("synchronize_stream") == 0
    assert fake.ops() == [
        "to_device", "record_event", "record_stream",   # upload the feed on the copy stream
        "use_stream", "wait_event", "record_event",     # the segment: wait for the feed, run
        "wait_event", "wait_event", "to_host",           # copy stream waits output + feed
        "record_event", "synchronize_event",             # the one host wait
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_bulk_off_event_mode_still_one_host_wait(mlp, mlp_feeds, mlp_reference, engine):
    fake = FakeBackend()
    sess = _session(mlp, fake, engine=engine, bulk=False, sync_mode="event")
    outputs, stats = _steady(sess, fake, mlp_feeds)
    np.testing.assert_array_equal(outputs[0], mlp_reference[0])
    nodes = sess.plan.compute_nodes  # one task per node (passes may fuse Gemm+Relu)
    assert nodes >= LAYERS
    assert stats.pushes == stats.segments == nodes
    assert stats.syncs == fake.host_waits == 1
    # One event per task plus the download's; the feed and the output are copied on the
    # compute stream every task runs on, so nothing waits on the device.
    assert fake.count("record_event") == nodes + 1
    assert fake.count("wait_event") == 0
    assert fake.count("use_stream") == nodes


@pytest.mark.parametrize("engine", ENGINES)
def test_bulk_off_stream_mode_syncs_every_task(mlp, mlp_feeds, mlp_reference, engine):
    fake = FakeBackend()
    sess = _session(mlp, fake, engine=engine, bulk=False, sync_mode="stream")
    outputs, stats = _steady(sess, fake, mlp_feeds)
    np.testing.assert_array_equal(outputs[0], mlp_reference[0])
    nodes = sess.plan.compute_nodes
    assert nodes >= LAYERS and stats.segments == nodes
    # The founding incident, counted: one synchronization per compute node, plus the output.
    assert stats.syncs == nodes + 1
    assert fake.count("synchronize_stream") == nodes
    assert fake.host_waits == stats.syncs
    assert fake.count("record_event") == 1  # the download's (the upload needs none)


def test_bulk_stream_mode_one_task_sync_plus_output(mlp, mlp_feeds):
    fake = FakeBackend()
    sess = _session(mlp, fake, engine="inline", bulk=True, sync_mode="stream")
    _, stats = _steady(sess, fake, mlp_feeds)
    assert stats.syncs == 2 == fake.host_waits
    assert fake.count("synchronize_stream") == 1


@pytest.mark.parametrize("mode,syncs,host_waits", [("event", 2, 2), ("stream", 4, 3)])
@pytest.mark.parametrize("engine", ENGINES)
def test_local_op_accounting(mode, syncs, host_waits, engine):
    """nonzero_mid: SYNC segment, LOCAL NonZero, SYNC segment.

    event: the LOCAL task's host wait (one synchronize_event) + the output wait.
    stream: two segment stream syncs + the LOCAL task's wait on the engine (its
    producer already synchronized, so no device call) + the output wait.
    """
    model = models.build("nonzero_mid")
    feeds = models.example_inputs("nonzero_mid", batch_size=3)
    expected = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    fake = FakeBackend()
    sess = _session(model, fake, engine=engine, sync_mode=mode)
    outputs, stats = _steady(sess, fake, feeds)
    np.testing.assert_array_equal(outputs[0], expected[0])
    assert stats.syncs == syncs
    assert fake.host_waits == host_waits


def test_run_tensors_waits_once_without_download(mlp, mlp_feeds):
    import torch

    fake = FakeBackend()
    sess = _session(mlp, fake, engine="inline")
    feeds = {k: torch.from_numpy(v) for k, v in mlp_feeds.items()}
    sess.run_tensors(feeds)
    fake.clear()
    (out,) = sess.run_tensors(feeds)
    assert sess.last_run_stats.syncs == 1 == fake.host_waits
    assert fake.count("to_host") == 0
    assert fake.count("synchronize_event") == 1
    assert out.shape == (2, 8)


@pytest.mark.parametrize("copy_stream", [False, True])
def test_tasks_run_on_the_compute_stream_and_copies_where_they_can_overlap(
        mlp, mlp_feeds, copy_stream):
    fake = FakeBackend()
    sess = _session(mlp, fake, copy_stream=copy_stream, engine="inline", bulk=False)
    sess.run(None, mlp_feeds)
    streams = {call.args[0]: call.args[2] for call in fake.calls if call.op == "create_stream"}
    used = {streams[call.args[0]] for call in fake.calls if call.op == "use_stream"}
    assert used == {"compute"}
    moved = {streams[call.args[0]] for call in fake.calls if call.op in ("to_device", "to_host")}
    assert moved == ({"copy"} if copy_stream else {"compute"})


def test_copies_use_the_copy_stream_when_a_plan_spans_devices(mlp):
    fake = FakeBackend(managed=lambda device: device.index == 0)
    sess = _session(mlp, fake, engine="threaded", placement={"layers.2.*": "cpu:1"})
    assert not sess._executor.completion.io_on_compute
    assert "copies: feeds and outputs through pinned memory on the copy stream" \
        in sess.explain()


@pytest.mark.parametrize("mode,syncs", [("event", 2), ("stream", 5)])
def test_cross_device_copies_and_host_tasks(mlp, mlp_feeds, mlp_reference, mode, syncs):
    """cpu:0 has (fake) streams, cpu:1 does not: copies, device waits and host waits.

    Tasks: layers 0-1 (cpu:0), copy to cpu:1, layer 2 (cpu:1, a host task), copy back,
    layer 3 (cpu:0). event: the host task waits for the first copy's event (+1) and the
    outputs (+1). stream: 4 SYNC/COPY tasks on cpu:0 synchronize (+4) and the outputs (+1).
    """
    fake = FakeBackend(managed=lambda device: device.index == 0)
    sess = _session(mlp, fake, engine="threaded", sync_mode=mode,
                    placement={"layers.2.*": "cpu:1"})
    outputs, stats = _steady(sess, fake, mlp_feeds)
    np.testing.assert_array_equal(outputs[0], mlp_reference[0])
    assert stats.copies == 2 and stats.segments == 5
    assert stats.syncs == syncs == fake.host_waits
    if mode == "event":
        # The last segment waits on the device for the copy back (another stream).
        assert fake.count("wait_event") >= 2


def test_explain_names_mode_and_streams(mlp):
    sess = _session(mlp, FakeBackend(), sync_mode="stream")
    text = sess.explain()
    assert "sync mode: stream on cpu:0" in text
    assert "fake streams" in text


def test_concurrent_runs_share_the_pool(mlp, mlp_feeds, mlp_reference):
    fake = FakeBackend()
    sess = _session(mlp, fake, engine="threaded", bulk=False)

    def worker(i: int) -> None:
        for _ in range(5):
            out = sess.run(None, mlp_feeds)
            np.testing.assert_array_equal(out[0], mlp_reference[0])
            assert sess.last_run_stats.syncs == 1

    run_in_threads(worker, 3)
    assert fake.count("create_stream") == 1


# -- run_async: the output wait, deferred -------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_run_async_defers_the_one_host_wait_to_result(mlp, mlp_feeds, mlp_reference, engine):
    fake = FakeBackend()
    sess = _session(mlp, fake, engine=engine, sync_mode="event")
    sess.run(None, mlp_feeds)
    fake.clear()
    pending = sess.run_async(None, mlp_feeds)
    assert fake.host_waits == 0 and fake.count("to_host") == 1  # copied, not yet waited for
    assert pending.stats.syncs == 1 == sess.last_run_stats.syncs
    out = pending.result()
    assert fake.host_waits == 1 and fake.ops()[-1] == "synchronize_event"
    np.testing.assert_array_equal(out[0], mlp_reference[0])
    assert pending.result() is out and fake.host_waits == 1  # waited once


def test_run_async_keeps_two_runs_in_flight_apart(mlp, mlp_feeds):
    fake = FakeBackend()
    sess = _session(mlp, fake, engine="inline", cuda_graphs=True)
    other = {"x": mlp_feeds["x"] * 2}
    want = [sess.run(None, mlp_feeds)[0], sess.run(None, other)[0]]
    for _ in range(3):  # through warm-up, capture and replays
        waited = fake.count("synchronize_event")
        first = sess.run_async(None, mlp_feeds)
        second = sess.run_async(None, other)
        assert fake.count("synchronize_event") == waited  # both in flight, neither waited
        np.testing.assert_array_equal(second.result()[0], want[1])
        np.testing.assert_array_equal(first.result()[0], want[0])


def test_run_async_on_the_host_and_when_profiled_is_complete_on_return(mlp, mlp_feeds,
                                                                      mlp_reference):
    plain = segflow.InferenceSession(mlp, engine="inline", optimize={"dense_chain": False})
    np.testing.assert_array_equal(plain.run_async(None, mlp_feeds).result()[0],
                                  mlp_reference[0])
    fake = FakeBackend()
    sess = _session(mlp, fake, engine="inline")
    with segflow.profile():
        pending = sess.run_async(None, mlp_feeds)
        waits = fake.host_waits
    assert waits == 1  # a profiled run closes its spans, its wait included, inside the run
    np.testing.assert_array_equal(pending.result()[0], mlp_reference[0])
    assert fake.host_waits == 1
