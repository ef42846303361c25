"""Counters are counted where the work happens, not derived from the plan.

The proof: the same session (the same plan) runs an op that secretly waits on
the device, or a kernel that calls one more kernel, and ``syncs`` or
``kernels`` go up by one; the fast path that calls task functions directly
counts what the inline engine counts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import segflow
from concurrency import run_in_threads
from replays import replays
from segflow import models
from segflow.engine import ExecType, InlineEngine, ThreadedEngine, Var
from segflow.engine.counters import RunCounters
from segflow.engine.streams import FakeBackend, FakeStream, StreamRole
from segflow.ir.types import Device
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import Library
from segflow.ops import default_registry
from segflow.ops.registry import OpDef, OpRegistry

ENGINES = ["inline", "threaded"]


class _Switch:
    """What the probe kernel does besides doubling its input."""

    def __init__(self) -> None:
        self.sync: FakeBackend | None = None  # synchronize this backend's stream:
        self.stream: FakeStream | None = None  # this one (None: the current one)
        self.extra_kernel = False             # call one more kernel (a relu)


class _ProbeKernel:
    """``y = 2 x``, counting its own kernel calls (``counts_own_calls``)."""

    counts_own_calls = True

    def __init__(self, switch: _Switch) -> None:
        self.switch = switch

    def __call__(self, inputs: Sequence[torch.Tensor | None],
                 counts: RunCounters | None = None) -> list[torch.Tensor]:
        x = inputs[0]
        assert x is not None
        out = x * 2
        calls = 1
        switch = self.switch
        if switch.sync is not None:
            # Behind the plan's back: a host wait on the device, as .item() would be.
            stream = switch.stream or switch.sync.current()
            assert stream is not None
            switch.sync.synchronize_stream(stream)
        if switch.extra_kernel:
            out = torch.relu(out) + torch.relu(-out) * 0  # same values, one more call
            calls += 1
        if counts is not None:
            counts.count_kernels(calls)
        return [out]


def _probe_model(switch: _Switch) -> tuple[bytes, OpRegistry]:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Probe", ["r"], ["p"], name="probe", domain="test"),
             helper.make_node("Neg", ["p"], ["y"], name="neg")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid("test", 1)])

    def bind(node, ctx):
        return _ProbeKernel(switch)

    return model.SerializeToString(), default_registry().extend(
        [OpDef("Probe", bind, domain="test")])


_X = {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 2}
_Y = -2 * np.maximum(_X["x"], 0)


def _run(sess: segflow.InferenceSession) -> segflow.RunStats:
    (out,) = sess.run(None, _X)
    np.testing.assert_array_equal(out, _Y)
    stats = sess.last_run_stats
    assert stats is not None
    return stats


def _counts(stats: segflow.RunStats) -> tuple[int, int, int, int]:
    return stats.segments, stats.pushes, stats.syncs, stats.kernels


# -- the proof -------------------------------------------------------------------------------


@pytest.mark.parametrize("sync_mode", ["event", "stream"])
@pytest.mark.parametrize("compile", ["none", "codegen"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_kernel_that_synchronizes_raises_syncs_with_the_plan_unchanged(engine, compile,
                                                                         sync_mode):
    switch = _Switch()
    model, registry = _probe_model(switch)
    fake = FakeBackend()
    sess = segflow.InferenceSession(model, engine=engine, registry=registry,
                                    stream_backend=fake, compile=compile,
                                    sync_mode=sync_mode)
    plan = sess.plan
    _run(sess)
    fake.clear()
    before = _run(sess)
    assert fake.host_waits == before.syncs
    switch.sync = fake
    fake.clear()
    after = _run(sess)
    assert sess.plan is plan
    assert after.syncs == before.syncs + 1
    assert fake.host_waits == after.syncs
    assert (after.segments, after.pushes, after.kernels) == \
        (before.segments, before.pushes, before.kernels)


@pytest.mark.parametrize("compile", ["none", "codegen"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_kernel_that_calls_an_extra_kernel_raises_kernels(engine, compile):
    switch = _Switch()
    model, registry = _probe_model(switch)
    sess = segflow.InferenceSession(model, engine=engine, registry=registry, compile=compile)
    before = _run(sess)
    assert before.kernels == before.nodes == 3
    switch.extra_kernel = True
    after = _run(sess)
    assert after.kernels == before.kernels + 1
    assert (after.segments, after.pushes, after.syncs) == \
        (before.segments, before.pushes, before.syncs)


def test_a_kernel_that_synchronizes_a_backend_the_session_does_not_use_is_not_its_sync():
    """Syncs are attributed to the run a thread works for through its own backend."""
    switch = _Switch()
    model, registry = _probe_model(switch)
    used, other = FakeBackend(), FakeBackend()
    sess = segflow.InferenceSession(model, registry=registry, stream_backend=used)
    before = _run(sess)
    switch.sync = other
    switch.stream = other.create_stream(Device.parse("cpu:0"), StreamRole.COMPUTE)
    after = _run(sess)
    assert after.syncs == before.syncs == 1 and used.host_waits == 2
    assert other.syncs == 1


# -- the direct path counts what the inline engine counts --------------------------------


@pytest.mark.parametrize("model_name", ["mlp_chain", "nonzero_mid"])
@pytest.mark.parametrize("compile", ["none", "codegen"])
def test_direct_calls_count_the_inline_engines_pushes_and_waits(model_name, compile):
    model = models.build(model_name)
    feeds = models.example_inputs(model_name, batch_size=3)
    direct = segflow.InferenceSession(model, engine="inline", compile=compile)
    pushed = segflow.InferenceSession(model, engine="inline", compile=compile)
    assert direct._executor._direct is not None
    pushed._executor._direct = None  # through InlineEngine.push and wait
    for sess in (direct, pushed):
        sess.run(None, feeds)
    a, b = direct.last_run_stats, pushed.last_run_stats
    assert a is not None and b is not None
    assert _counts(a) == _counts(b)
    assert a.pushes == a.segments
    assert a.kernels == a.nodes


@pytest.mark.parametrize("engine", ENGINES)
def test_counts_do_not_depend_on_the_engine(engine):
    model = models.build("nonzero_mid")
    feeds = models.example_inputs("nonzero_mid", batch_size=3)
    inline = segflow.InferenceSession(model, engine="inline")
    other = segflow.InferenceSession(model, engine=engine)
    inline.run(None, feeds)
    for _ in range(3):
        other.run(None, feeds)
        assert _counts(other.last_run_stats) == _counts(inline.last_run_stats)


# -- the engines -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [InlineEngine, ThreadedEngine])
def test_engines_count_pushes_and_host_waits(make):
    engine = make()
    try:
        counts = RunCounters()
        a, b, c = Var("a"), Var("b"), Var("c")
        engine.push(lambda: None, [], [a], counts=counts)
        engine.push(lambda: None, [a], [b], counts=counts)
        assert (counts.pushes, counts.waits) == (2, 0)
        engine.push(lambda: None, [b], [c], ExecType.LOCAL, counts=counts)  # waits for b
        engine.push(lambda: None, [Var("never written")], [Var()], ExecType.LOCAL,
                    counts=counts)                                        # nothing to wait for
        assert (counts.pushes, counts.waits) == (4, 1)
        engine.wait(a, c, counts=counts)  # one host wait for both
        assert counts.waits == 2 and counts.syncs == 2
        engine.wait(a)  # another caller's: not this run's
        engine.push(lambda: None, [], [Var()])
        assert (counts.pushes, counts.waits) == (4, 2)
    finally:
        engine.close()


def test_shared_counters_lose_nothing_across_threads():
    counts = RunCounters()

    def work(_: int) -> None:
        for _ in range(2000):
            counts.count_kernels()
            counts.count_device_sync(joined=True)

    run_in_threads(work, 4)
    assert counts.kernels == 8000
    assert counts.device_syncs == counts.joined_syncs == 8000
    assert counts.syncs == 0


# -- the stream backend ----------------------------------------------------------------------


def test_the_backend_counts_syncs_by_anyone_and_each_threads_into_its_run():
    fake = FakeBackend()
    stream = fake.create_stream(Device.parse("cpu:0"), StreamRole.COMPUTE)
    fake.synchronize_stream(stream)
    assert fake.syncs == 1
    counts = RunCounters()
    previous = fake.count_into(counts)
    assert previous is None
    fake.synchronize_event(fake.record_event(stream))
    seen: list[int] = []

    def elsewhere() -> None:  # another thread works for no run
        fake.synchronize_stream(stream)
        seen.append(fake.syncs)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert fake.count_into(previous) is counts
    fake.synchronize_stream(stream)
    assert counts.device_syncs == 1
    assert fake.syncs == 4 == fake.host_waits
    assert seen == [3]


def test_cuda_graph_replays_count_the_kernels_they_launch():
    """Warm-up, capture and replays: the same kernels each run; the capture's device
    synchronize is counted by the backend."""
    model = models.build("mlp_chain", layers=2, width=8)
    feeds = models.example_inputs("mlp_chain", batch_size=2, layers=2, width=8)
    fake = FakeBackend()
    sess = segflow.InferenceSession(model, engine="inline", stream_backend=fake,
                                    cuda_graphs=True)
    kernels, syncs, native = [], [], []
    for _ in range(4):
        sess.run(None, feeds)
        stats = sess.last_run_stats
        kernels.append(stats.kernels)
        syncs.append(stats.syncs)
        native.append(stats.native_calls)
    assert kernels == [stats.nodes] * 4
    assert syncs == [1, 2, 1, 1]
    assert native[-1] == 1  # one graph launch for the segment's kernels
    assert fake.count("replay") == 3  # the capturing run replays too
    assert "native_calls" in stats.as_dict()
    assert list(stats.counters()) == ["segments", "pushes", "syncs", "kernels", "copies"]


# -- replays -------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_replayed_run_counts_every_step_and_its_native_calls(native):
    """The first run calls each direct kernel from Python; later runs replay the recorded
    executes (one C call for a stretch where the native library loads): the same
    kernels, fewer calls into native code."""
    if Library.load() is None:
        pytest.skip("libdnnl unavailable")
    if native and NativeLibrary.probe()[0] is None:
        pytest.skip("native kernels unavailable")
    small = {"image_size": 64}
    model = models.build("resnet18", **small)
    feeds = models.example_inputs("resnet18", batch_size=1, **small)
    sess = segflow.InferenceSession(model, compile="codegen")
    (replay,) = replays(sess)
    if not native:
        replay.native = None
    runs = []
    for _ in range(3):
        sess.run(None, feeds)
        runs.append(sess.last_run_stats)
    assert replay.replays == 2
    assert [s.kernels for s in runs] == [runs[0].nodes] * 3
    first, replayed = runs[0].native_calls, runs[-1].native_calls
    executes = sum(1 for step in replay.steps if step.op is not None)
    assert first == executes
    if native:
        assert 1 <= replayed < first
    else:
        assert replayed == first  # each execute, from Python
