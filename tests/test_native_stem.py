"""Tests for the native stem convolution (kernels/stem.py, kernels/native/stem.c).

Each geometry runs a one-convolution model (with its activation) against onnxruntime,
atol 1e-4 and rtol 1e-3 as the other direct-kernel tests: the kernel sums the taps in
its own order, at float32 rounding of libdnnl's. ``optimize={"layout.native_stem":
True}`` asks for the kernel on any CPU (its default is AVX-512 CPUs only), so these
run on AVX2 machines too, with that build's 8-wide vectors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import segflow
from concurrency import on_one_and_more_threads, run_in_threads
from replays import replays
from segflow import models
from segflow.kernels import stem as native_stem
from segflow.kernels.choice import KernelKind
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.library import Library
from segflow.kernels.onednn.stretch import NativeStretch
from segflow.kernels.stem import vector_width
from targets import count, kind

NATIVE, NATIVE_WHY = NativeLibrary.probe()
pytestmark = [
    pytest.mark.skipif(Library.load() is None, reason=f"libdnnl {Library.probe()[1]}"),
    pytest.mark.skipif(NATIVE is None, reason=f"native kernels {NATIVE_WHY}")]
WIDTH = vector_width(NATIVE) if NATIVE is not None else 16
ATOL, RTOL = 1e-4, 1e-3
ON = {"layout.native_stem": True}


def _conv_model(cin: int, cout: int, kernel: int, stride: int, pads: list[int],
                size: tuple[int, int], activation: str | None, dilation: int = 1,
                batch: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(cin * 100 + cout + kernel)
    w = (rng.standard_normal((cout, cin, kernel, kernel)) * 0.2).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if activation else "y"],
                              strides=[stride, stride], pads=pads,
                              dilations=[dilation, dilation])]
    if activation == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    elif activation == "clip":
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    elif activation == "leaky":
        nodes.append(helper.make_node("LeakyRelu", ["c"], ["y"], alpha=0.1))
    elif activation == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["c"], ["y"]))
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
    graph = helper.make_graph(
        nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                      ["batch", cin, *size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _stem_calls(sess: segflow.InferenceSession) -> list[Any]:
    """The built calls of the session's direct convolutions that run the stem kernel."""
    return [call for _, op in sess._executor.kernel_ops if isinstance(op, DirectConv)
            for call in op.calls.values()
            if call is not None and call.impl.startswith("native stem")]


def _check(model: onnx.ModelProto, sess: segflow.InferenceSession, shape: tuple[int, ...],
           runs: int = 3) -> None:
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seed in range(runs):
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("cin,cout,kernel,stride,pads,size,activation,batch", [
    (3, 32, 3, 2, [1, 1, 1, 1], (224, 224), "clip", 1),     # MobileNetV2's
    (3, 64, 7, 2, [3, 3, 3, 3], (64, 64), "relu", 1),       # ResNet's, a smaller image
    (3, 64, 7, 2, [3, 3, 3, 3], (37, 53), "relu", 2),       # odd sizes, two images
    (1, 16, 5, 1, [2, 2, 2, 2], (20, 31), None, 1),         # grey, no activation
    (4, 48, 3, 1, [0, 0, 0, 0], (17, 9), "leaky", 3),       # RGBA, valid padding
    (3, 96, 3, 2, [1, 1, 1, 1], (33, 33), "relu", 1),       # 6 vectors: 4 + 2 at a time
    (3, 16, 1, 1, [0, 0, 0, 0], (8, 8), "clip", 1),         # a 1x1 stem
    (3, 32, 11, 4, [2, 2, 2, 2], (67, 67), "relu", 1),      # AlexNet-like, stride 4
    (2, 32, 3, 1, [1, 1, 1, 1], (3, 2), None, 1),           # an image smaller than a block
    # TensorFlow's "same": the end padded only (even sizes), or more than the begin (odd)
    (3, 32, 3, 2, [0, 0, 1, 1], (224, 224), "clip", 1),     # transformers' MobileNetV2
    (3, 32, 3, 2, [0, 0, 1, 1], (64, 64), "clip", 3),
    (3, 32, 3, 2, [1, 0, 2, 1], (37, 30), "relu", 2),
    (3, 64, 7, 2, [2, 3, 3, 2], (41, 40), None, 1),
])
def test_matches_onnxruntime(cin, cout, kernel, stride, pads, size, activation, batch):
    model = _conv_model(cin, cout, kernel, stride, pads, size, activation)
    sess = segflow.InferenceSession(model, compile="codegen", optimize=ON)
    if cout % WIDTH:
        assert count(sess, KernelKind.NATIVE_STEM) == 0
        _check(model, sess, (batch, cin, *size))
        return
    assert [kind(sess, n) for n in sess.graph.nodes
            if n.op_type == "FusedConv"] == [KernelKind.NATIVE_STEM]
    _check(model, sess, (batch, cin, *size))
    calls = _stem_calls(sess)
    if cin == 1:
        # One channel: NCHW is channels-last already, which libdnnl reads in place.
        assert not calls
    else:
        # Batch 1's built while loading, the run's batch's at its first run.
        assert len(calls) == (1 if batch == 1 else 2)
        assert {call.impl for call in calls} == {f"native stem {kernel}x{kernel}"}
        assert all(call.in_format is None for call in calls)
    # Nothing staged: the kernel reads the feed in place.
    assert "NCHW input staged into channels-last: 1 node; 0 calls native, 0 through torch" \
        in sess.explain()


@pytest.mark.parametrize("why,args", [
    ("more than 4 input channels", dict(cin=5, cout=32, kernel=3, stride=1)),
    ("dilated", dict(cin=3, cout=32, kernel=3, stride=1, dilation=2)),
    ("output channels not a multiple", dict(cin=3, cout=WIDTH + 4, kernel=3, stride=1)),
    ("an activation it does not apply", dict(cin=3, cout=32, kernel=3, stride=1,
                                              activation="sigmoid")),
])
def test_what_it_does_not_take_is_staged_for_libdnnl(why, args):
    model = _conv_model(args["cin"], args["cout"], args["kernel"], args["stride"],
                        [1, 1, 1, 1], (12, 12), args.get("activation", "relu"),
                        dilation=args.get("dilation", 1))
    sess = segflow.InferenceSession(model, compile="codegen", optimize=ON)
    assert count(sess, KernelKind.NATIVE_STEM) == 0, why
    _check(model, sess, (1, args["cin"], 12, 12))
    assert not _stem_calls(sess)
    assert "native stem" not in sess.explain()


def test_a_call_the_kernel_declines_is_staged_and_explained(monkeypatch):
    # Chosen by the kernel selection, declined when the call is built (a defence: the
    # selection checks what the kernel checks): that input is staged, and explain says why.
    monkeypatch.setattr(native_stem, "unfit", lambda *args: "refused for the test")
    model = _conv_model(3, 32, 3, 2, [1, 1, 1, 1], (24, 24), "relu")
    sess = segflow.InferenceSession(model, compile="codegen", optimize=ON)
    assert [kind(sess, n) for n in sess.graph.nodes
            if n.op_type == "FusedConv"] == [KernelKind.NATIVE_STEM]
    _check(model, sess, (1, 3, 24, 24))
    assert not _stem_calls(sess)
    text = sess.explain()
    assert "native stem (NCHW image read in place): 1 convolution, 0 input layouts built" in text
    assert "not the native stem: " in text and ": refused for the test" in text


def test_a_large_output_is_staged_for_libdnnl():
    # Over MAX_OUTPUT_BYTES (a large batch) libdnnl's kernel is the faster one: that
    # call stages the feed into the run's storage, planned for it, as without the
    # kernel; a small batch still runs the kernel.
    model = _conv_model(3, 32, 3, 1, [1, 1, 1, 1], (224, 224), "relu")
    sess = segflow.InferenceSession(model, compile="codegen", optimize=ON)
    per_image = 32 * 224 * 224 * 4
    batch = native_stem.MAX_OUTPUT_BYTES // per_image + 1
    _check(model, sess, (1, 3, 224, 224), runs=2)
    _check(model, sess, (batch, 3, 224, 224), runs=2)
    (op,) = [op for _, op in sess._executor.kernel_ops if isinstance(op, DirectConv)]
    impls = sorted(call.impl for call in op.calls.values() if call is not None)
    assert len(impls) == 2 and impls[1] == "native stem 3x3"
    assert not impls[0].startswith("native stem")
    ((key, why),) = op.stem_not.items()
    assert key[0][0] == batch and why.startswith(f"an output of {batch * per_image / 2**20:.1f}")
    assert op.stage is not None and op.stage.native_calls == 2   # the run's storage, natively
    assert "not the native stem: " in sess.explain()


def test_switched_off_the_stem_is_staged_and_answers_the_same():
    model = _conv_model(3, 32, 3, 2, [1, 1, 1, 1], (40, 40), "clip")
    on = segflow.InferenceSession(model, compile="codegen", optimize=ON)
    off = segflow.InferenceSession(model, compile="codegen",
                                   optimize={"layout.native_stem": False})
    x = np.random.default_rng(3).standard_normal((1, 3, 40, 40)).astype(np.float32)
    np.testing.assert_allclose(on.run(None, {"x": x})[0], off.run(None, {"x": x})[0],
                               atol=ATOL, rtol=RTOL)
    assert _stem_calls(on) and not _stem_calls(off)
    assert "NCHW input staged into channels-last: 1 node" in off.explain()
    assert "1 stem convolution native (reading the NCHW image in place)" in on.explain()
    assert "native stem (NCHW image read in place): 1 convolution, 1 input layout built" \
        in on.explain()
    assert on.last_run_stats.settings["native_stem"] is True      # type: ignore[union-attr]


def test_a_channels_last_feed_is_declined_and_still_right():
    # A tensor already channels-last is not the kernel's NCHW input: that call is
    # staged for libdnnl (built as a second layout) and the answer is the same.
    model = _conv_model(3, 32, 3, 2, [1, 1, 1, 1], (24, 24), "relu")
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile="codegen", optimize=ON)
    x = np.random.default_rng(0).standard_normal((1, 3, 24, 24)).astype(np.float32)
    cl = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
    (got,) = sess.run_tensors({"x": cl})
    np.testing.assert_allclose(got.numpy(), ref.run(None, {"x": x})[0], atol=ATOL, rtol=RTOL)
    (op,) = [op for _, op in sess._executor.kernel_ops if isinstance(op, DirectConv)]
    assert op.stem is not None
    call = op.call_for(cl, None, False)
    assert call is not None and not call.impl.startswith("native stem")
    assert call.in_format is None        # channels-last already: libdnnl reads it
    assert len(_stem_calls(sess)) == 1   # the NCHW layout, built while loading


@pytest.mark.parametrize("native_loop", [True, False], ids=["c-loop", "python-loop"])
def test_resnet18_replays_its_stem_with_each_new_feed(native_loop):
    # The stem is an execute of the replayed run like the others (in its C loop), the
    # feed's address written in at every call: a kept address would read an old feed.
    model = models.build("resnet18", image_size=64)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile="codegen", optimize=ON)
    (replay,) = replays(sess)
    if not native_loop:
        replay.native = None
    for seed in range(5):
        feeds = {"input": np.random.default_rng(seed).standard_normal(
            (1, 3, 64, 64)).astype(np.float32)}
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   atol=ATOL, rtol=RTOL)
    assert replay.replays == 4        # recorded at the first run
    rec = replay._recording
    assert rec is not None
    assert all(entry[1] is not None for entry in rec.plan)      # nothing runs as before
    if native_loop:
        (stretch,) = [e for e in rec.program if isinstance(e, NativeStretch)]
        assert stretch.entries[0][1].impl == "native stem 7x7"
    assert len(_stem_calls(sess)) == 1


def test_concurrent_runs_and_one_or_two_threads_match_onnxruntime():
    # Three threads run one session at once (batch 1 and 2 in turn: each thread's run
    # has its own arena block and recording; the stem's op lock orders its calls), and
    # one intra-op thread gives what two give.
    model = models.build("resnet18", image_size=64)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile="codegen", optimize=ON)

    def worker(i: int) -> None:
        for seed in range(6):
            x = np.random.default_rng(100 * i + seed).standard_normal(
                (1 + (seed + i) % 2, 3, 64, 64)).astype(np.float32)
            np.testing.assert_allclose(sess.run(None, {"input": x})[0],
                                       ref.run(None, {"input": x})[0], atol=ATOL, rtol=RTOL)
    run_in_threads(worker, 3)
    x = np.random.default_rng(7).standard_normal((1, 3, 64, 64)).astype(np.float32)
    one, two = on_one_and_more_threads(lambda: sess.run(None, {"input": x})[0])
    np.testing.assert_allclose(one, two, atol=1e-5, rtol=1e-5)
    assert len(_stem_calls(sess)) == 2       # batch 1 and 2, each built once
