"""Tests for replayed runs of direct libdnnl kernels (kernels/onednn/replay.py).

Whole models run with a new random feed every call and are compared with
onnxruntime (atol 1e-4, rtol 1e-3, as the other direct-kernel tests): a replay
that kept an old address would read the previous feed and fail. ``replays``
(calls that replayed) is counted exactly.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

import segflow
from concurrency import run_in_threads
from replays import replays
from segflow import models
from segflow.kernels.choice import KernelKind
from segflow.kernels.linear import NativeLinear
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import DnnlError, Library
from segflow.kernels.onednn.op import DirectOp
from segflow.kernels.onednn.replay import DirectReplay
from segflow.kernels.onednn.stretch import TAIL_LINEAR, VIEW, NativeStretch

LIB = Library.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"libdnnl {Library.probe()[1]}")
NATIVE, NATIVE_WHY = NativeLibrary.probe()
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"native kernels {NATIVE_WHY}")
SMALL = {"image_size": 64}
ATOL, RTOL = 1e-4, 1e-3


def _resnet18(native_stem: bool = False) -> tuple[Any, segflow.InferenceSession, DirectReplay]:
    """onnxruntime's session, segflow's (codegen), and its one replayed run; its stem
    staged for libdnnl (a step that runs as before inside the replay), or with
    ``native_stem`` the native stem kernel (kernels/stem.py)."""
    model = models.build("resnet18", **SMALL)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile="codegen",
                                    optimize={"layout.native_stem": native_stem})
    (replay,) = replays(sess)
    return ref, sess, replay


def _new_tensor_from(monkeypatch: pytest.MonkeyPatch, op: Any) -> None:
    """Make ``op`` return a copy of its output (a new tensor each call)."""
    real = type(op).__call__

    def copied(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        return out.clone(memory_format=torch.channels_last) if self is op else out
    monkeypatch.setattr(type(op), "__call__", copied)


def _check(ref: Any, sess: segflow.InferenceSession, name: str, batches: Sequence[int],
           replay: DirectReplay | None = None) -> list[int]:
    """Run at these batch sizes, each with a new random feed, against onnxruntime;
    ``replay.replays`` after each run."""
    counts = []
    for seed, batch in enumerate(batches):
        feeds = _feeds(name, batch, seed)
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   atol=ATOL, rtol=RTOL)
        counts.append(replay.replays if replay is not None else 0)
    return counts


def _feeds(name: str, batch: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(np.float32)
            for k, v in models.example_inputs(name, batch_size=batch, **SMALL).items()}


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False],
                         ids=["native", "python"])
@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet18"])
def test_replays_from_the_second_run_with_each_new_feed_and_size(name, native):
    model = models.build(name, **SMALL)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile="codegen")
    (replay,) = replays(sess)
    if not native:
        replay.native = None           # Python's loop over the executes, not the C one
    assert len(replay.steps) >= 20     # the convolutions (and poolings) in one call
    counts = _check(ref, sess, name, (1, 1, 1, 3, 3, 3, 1, 1, 1), replay)
    # Recorded at the first run, and again at the second run of a new size (another
    # arena block); replayed after.
    assert counts == [0, 1, 2, 2, 2, 3, 3, 3, 4]
    # Between runs the recording keeps no feed (nor any tensor a step allocated) alive.
    rec = replay._recording
    assert rec is not None and rec.transient
    assert all(rec.values[i] is None for i in rec.transient)
    assert 0 in rec.transient      # the image, the run's only input that is not a weight
    # The classifier after the run (Flatten, native linear) is in the replay too, from
    # recorded arguments into a new result each call (not kept between calls).
    # (ResNet-18's 512 x 1000 classifier is below the native linear's packing size.)
    classifier = isinstance(replay.steps[-1].op, NativeLinear)
    assert classifier == (NATIVE is not None and name == "mobilenet_v2")
    tail = [entry[1] for entry in rec.plan[-2:]] if classifier else []
    assert tail == ([VIEW, TAIL_LINEAR] if classifier else [])
    if classifier:
        assert replay.steps[-1].output in rec.transient
    executes = [entry for entry in rec.plan[:len(rec.plan) - len(tail)]
                if entry[1] is not None]
    # A stem that stages the NCHW feed into channels-last runs as before; the native stem
    # kernel (AVX-512 CPUs) reads it in place, an execute like the others.
    stem_native = sess.plan.choices.counts()[KernelKind.NATIVE_STEM] > 0
    if native:
        # Every execute is in one C call (a stretch): a stem that stages the NCHW feed
        # (ResNet-18's, below, unless native; MobileNetV2's unless native or its first
        # layers are a blocked region) runs before the stretch.
        staged = [i for i, entry in enumerate(rec.plan) if entry[1] is None]
        if name == "resnet18":
            assert staged == ([] if stem_native else [0])
        else:
            assert staged in ([], [0]) and not (stem_native and staged)
        (stretch,) = [e for e in rec.program if isinstance(e, NativeStretch)]
        assert len(stretch.entries) == len(executes) == len(rec.plan) - len(staged) - len(tail)
    else:
        assert rec.program == rec.plan
    if name == "resnet18" and not stem_native:
        # The stem stages the NCHW feed into channels-last first: it runs as before,
        # inside the replay, and the rest is replayed.
        assert rec.plan[0][1] is None
        assert all(entry[1] is not None for entry in rec.plan[1:])


def test_alternating_sizes_keep_the_first_recording():
    # Two sizes in turn (as two threads with their own arena blocks would be): the
    # recording is not made again at every call; the first size keeps replaying.
    model = models.build("mobilenet_v2", **SMALL)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile="codegen")
    (replay,) = replays(sess)
    assert _check(ref, sess, "mobilenet_v2", (1, 2, 1, 2, 1, 2), replay) == [0, 0, 1, 1, 2, 2]


def test_the_switch_turns_it_off(monkeypatch):
    model = models.build("mobilenet_v2", **SMALL)
    monkeypatch.setenv("SEGFLOW_ONEDNN_REPLAY", "0")
    sess = segflow.InferenceSession(model, compile="codegen")
    assert replays(sess) == []
    assert sess.run(None, _feeds("mobilenet_v2", 1, 0))[0].shape == (1, 1000)
    monkeypatch.delenv("SEGFLOW_ONEDNN_REPLAY")
    assert len(replays(segflow.InferenceSession(model, compile="codegen"))) == 1


def test_the_native_switch_keeps_the_executes_in_python(monkeypatch):
    # SEGFLOW_NATIVE=0 when the session is made: its replay calls each execute from
    # Python (and says so), even where another session in the process has the C loop.
    monkeypatch.setenv("SEGFLOW_NATIVE", "0")
    ref, sess, replay = _resnet18()
    monkeypatch.delenv("SEGFLOW_NATIVE")
    assert _check(ref, sess, "resnet18", (1, 1, 1), replay) == [0, 1, 2]
    rec = replay._recording
    assert rec is not None and rec.program == rec.plan
    assert "called from Python: native kernels are off (SEGFLOW_NATIVE=0)" in sess.explain()


def test_nothing_is_recorded_without_an_arena(monkeypatch):
    monkeypatch.setenv("SEGFLOW_ARENA", "0")
    ref, sess, replay = _resnet18()
    assert _check(ref, sess, "resnet18", (1, 1, 1), replay) == [0, 0, 0]
    assert replay.replays == 0 and replay._recording is None


def test_concurrent_runs_match_onnxruntime():
    model = models.build("mobilenet_v2", **SMALL)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile="codegen", engine="threaded")

    def worker(i: int) -> None:
        for seed in range(6):
            feeds = _feeds("mobilenet_v2", 1 + (seed + i) % 2, 100 * i + seed)
            np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                       atol=ATOL, rtol=RTOL)
    run_in_threads(worker, 3)


def test_a_step_that_falls_back_runs_as_before_inside_the_replay(monkeypatch):
    # One convolution's primitive fails to build: it runs torch's op every time, inside
    # the replay, between replayed ones (its output lands in the run's planned storage).
    assert LIB is not None
    convolution = LIB.convolution
    built = [0]

    def refuse_the_fifth(*args: Any, create: bool = True, **kwargs: Any) -> Any:
        if create:
            built[0] += 1
            if built[0] == 5:
                raise DnnlError("refused for the test")
        return convolution(*args, create=create, **kwargs)
    monkeypatch.setattr(LIB, "convolution", refuse_the_fifth)
    monkeypatch.setenv("SEGFLOW_WINOGRAD", "0")   # every convolution a oneDNN primitive
    ref, sess, replay = _resnet18()
    _check(ref, sess, "resnet18", (1, 1, 1, 1))
    assert any("fell back" in line for line in sess.kernel_report())
    assert replay.replays == 3
    rec = replay._recording
    assert rec is not None
    assert sum(entry[1] is None for entry in rec.plan) == 2      # the stem and that one
    if NATIVE is not None:
        # The executes before and after that one are two C calls.
        assert sum(isinstance(e, NativeStretch) for e in rec.program) == 2


def test_a_step_whose_output_moves_ends_the_replay_there(monkeypatch):
    # A step that runs as before but returns a tensor other than the recorded one: the
    # steps after it cannot use their recorded addresses, so they run the usual way,
    # the answer stays right, and the next run records again.
    ref, sess, replay = _resnet18()
    for seed in range(2):
        feeds = _feeds("resnet18", 1, seed)
        sess.run(None, feeds)
    assert replay.replays == 1
    _new_tensor_from(monkeypatch, replay.steps[0].op)      # the stem
    feeds = _feeds("resnet18", 1, 7)
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                               atol=ATOL, rtol=RTOL)
    assert replay.replays == 1 and replay._recording is None


def test_a_step_that_makes_a_new_tensor_each_run_cuts_the_recording(monkeypatch):
    # From the first run on, the third step returns a new tensor (as an activation run
    # after the kernel, out of place, would): the recording ends before it, the steps
    # before it are replayed, and it and the rest run as before.
    ref, sess, replay = _resnet18()
    _new_tensor_from(monkeypatch, replay.steps[2].op)
    _check(ref, sess, "resnet18", (1, 1, 1))
    rec = replay._recording
    assert rec is not None and rec.rest == 2 and len(rec.plan) == 2
    assert replay.replays == 2


class _BusyOnce:
    """A lock that another thread seems to hold when tried without waiting."""

    def __init__(self) -> None:
        self.tries = 0

    def acquire(self, blocking: bool = True) -> bool:
        self.tries += 1
        return blocking

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        pass


@needs_native
def test_a_stretch_whose_lock_is_held_runs_op_by_op(monkeypatch):
    # One op's lock is busy (another thread's run): the C call is not made, and the
    # stretch's executes go through DirectOp.execute_at one at a time, waiting for it.
    ref, sess, replay = _resnet18()
    busy = _BusyOnce()
    replay.steps[5].op.lock = busy              # type: ignore[assignment]
    executed = []
    real = DirectOp.execute_at

    def counted(self: DirectOp, *args: Any) -> None:
        executed.append(self)
        real(self, *args)
    monkeypatch.setattr(DirectOp, "execute_at", counted)
    _check(ref, sess, "resnet18", (1,))          # the first run records, no replay yet
    executed.clear()
    _check(ref, sess, "resnet18", (1,))
    rec = replay._recording
    assert rec is not None and replay.replays == 1 and busy.tries == 1
    (stretch,) = [e for e in rec.program if isinstance(e, NativeStretch)]
    assert len(executed) == len(stretch.entries) + 1      # and the stem, the usual way
    assert all(not lock.locked() for lock in stretch.locks if lock is not busy)


@needs_native
def test_a_failing_execute_names_the_op_and_frees_the_locks(monkeypatch):
    monkeypatch.setenv("SEGFLOW_WINOGRAD", "0")   # every step libdnnl's execute
    ref, sess, replay = _resnet18()
    _check(ref, sess, "resnet18", (1, 1))
    rec = replay._recording
    assert rec is not None
    (stretch,) = [e for e in rec.program if isinstance(e, NativeStretch)]
    calls = [0]

    def third_fails(primitive: int, stream: int, nargs: int, args: int) -> int:
        calls[0] += 1
        return 5 if calls[0] == 3 else 0
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p)
    failing = prototype(third_fails)
    steps, n, _, set_handle, status = stretch._args
    stretch._args = (steps, n, ctypes.cast(failing, ctypes.c_void_p).value, set_handle, status)
    op, call, _ = stretch.entries[2]
    label = re.escape(stretch.labels[2])     # the third node of the stretch, not the first
    with pytest.raises(segflow.ExecutionError,
                       match=rf"^While executing {label}: DnnlError: {op.kind} "
                             rf"\({re.escape(call.impl)}\): oneDNN status 5$"):
        sess.run(None, _feeds("resnet18", 1, 3))
    assert calls[0] == 3
    assert not any(lock.locked() for lock in stretch.locks)


def test_an_error_in_a_python_replayed_step_names_its_node(monkeypatch):
    ref, sess, replay = _resnet18()
    replay.native = None
    bad = replay.steps[4]
    real = DirectOp.execute_at
    armed = [False]

    def fails_at_bad(self: DirectOp, *args: Any) -> None:
        if armed[0] and self is bad.op:
            raise DnnlError("refused for the test")
        real(self, *args)
    monkeypatch.setattr(DirectOp, "execute_at", fails_at_bad)   # before it is recorded
    _check(ref, sess, "resnet18", (1, 1))
    assert replay.replays == 1
    armed[0] = True
    with pytest.raises(segflow.ExecutionError, match=rf"^While executing {re.escape(bad.label)}: "
                                                     r"DnnlError: refused for the test$"):
        sess.run(None, _feeds("resnet18", 1, 3))
    assert bad.label and bad.label != replay.steps[0].label


@needs_native
def test_the_classifier_runs_as_the_c_calls_last_step_or_after_the_ops_one_by_one():
    # MobileNetV2's classifier (Flatten, 1280 -> 1000 native linear) runs inside the
    # replay from recorded arguments, as the stretch's last step (segflow_call_execute):
    # its result, its own tensor each call, is allocated before the C call and read
    # after it. With one op's lock busy the stretch runs op by op, and then the linear
    # through its op, the same way.
    model = models.build("mobilenet_v2", **SMALL)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile="codegen")
    (replay,) = replays(sess)
    _check(ref, sess, "mobilenet_v2", (1, 1))
    rec = replay._recording
    assert rec is not None
    (stretch,) = [e for e in rec.program if isinstance(e, NativeStretch)]
    assert stretch.tail is not None
    index, prepared, label = stretch.tail
    assert index == replay.steps[-1].output and label == replay.steps[-1].label
    assert len(stretch._steps) == len(stretch.entries) + 1
    op = prepared.op
    before = op.native_calls
    outs = []
    for seed in range(2):
        feeds = _feeds("mobilenet_v2", 1, seed)
        outs.append((sess.run_tensors({k: torch.from_numpy(v) for k, v in feeds.items()})[0],
                     ref.run(None, feeds)[0]))
    busy = _BusyOnce()
    stretch.entries[3][0].lock = busy               # type: ignore[assignment]
    stretch.locks = (busy, *stretch.locks[1:])
    feeds = _feeds("mobilenet_v2", 1, 5)
    outs.append((sess.run_tensors({k: torch.from_numpy(v) for k, v in feeds.items()})[0],
                 ref.run(None, feeds)[0]))
    assert busy.tries == 1 and replay.replays == 4
    assert op.native_calls == before + 3       # every replayed call counted, either way
    for got, want in outs:     # each its own tensor: no later call wrote over an earlier one
        np.testing.assert_allclose(got.numpy(), want, atol=ATOL, rtol=RTOL)
    assert len({got.data_ptr() for got, _ in outs}) == 3
    assert ("the pooled linear tail native from recorded arguments as the native call's "
            "last step") in sess.explain()
