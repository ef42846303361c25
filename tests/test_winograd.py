"""Tests for 3x3 convolutions as Winograd F(4x4, 3x3) (kernels/winograd.py).

Every model is compared with onnxruntime at atol 1e-4, rtol 1e-3, the tolerance
of the other direct-kernel tests (Winograd's own error is ~1e-5 relative). Each
test also checks that the convolutions it means to cover did run as Winograd:
a test that silently fell back to the direct convolution would prove nothing.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import segflow
from concurrency import run_in_threads
from replays import replays
from segflow import models
from segflow.kernels import winograd
from segflow.kernels.choice import KernelKind
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.geometry import geometry
from segflow.kernels.onednn.library import Library
from segflow.kernels.onednn.replay import DirectReplay
from segflow.kernels.onednn.stretch import NativeStretch
from segflow.kernels.target import WINOGRAD_MIN_TILES, CpuTarget
from segflow.kernels.winograd import transform_weight
from segflow.passes.pipeline import OptimizeOptions
from targets import as_cpu, choice, count, kind

LIB = Library.load()
NATIVE, NATIVE_WHY = NativeLibrary.probe()
pytestmark = [pytest.mark.skipif(LIB is None, reason=f"libdnnl {Library.probe()[1]}"),
              pytest.mark.skipif(NATIVE is None, reason=f"native kernels {NATIVE_WHY}")]
ATOL, RTOL = 1e-4, 1e-3


@pytest.fixture(autouse=True)
def _winograd_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Winograd on where the default leaves it off (AVX-512 CPUs), so that the kernel is
    tested on every machine; a test that means otherwise sets the variable itself."""
    monkeypatch.setenv("SEGFLOW_WINOGRAD", "1")


def _model(n: int, c: int, k: int, h: int, w: int, pad: int, activation: str | None,
           residual: bool, seed: int = 0) -> onnx.ModelProto:
    """x -> Conv 1x1 (c -> c) -> Conv 3x3 (c -> k, pads ``pad``) [+ the 1x1's output]
    [-> activation]. The 1x1 convolution gives the 3x3 one a channels-last input."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((c, c, 1, 1)) / np.sqrt(c)).astype(np.float32)
    w3 = (rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    b3 = rng.standard_normal(k).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"]),
             helper.make_node("Conv", ["a", "w3", "b3"], ["y0"], kernel_shape=[3, 3],
                              pads=[pad] * 4)]
    last = "y0"
    if residual:
        nodes.append(helper.make_node("Add", [last, "a"], ["y1"]))
        last = "y1"
    consts = [(w1, "w1"), (w3, "w3"), (b3, "b3")]
    if activation == "Clip":          # ReLU6
        consts += [(np.array(0.0, np.float32), "lo"), (np.array(6.0, np.float32), "hi")]
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["y"]))
    elif activation is not None:
        attrs = {"alpha": 0.1} if activation == "LeakyRelu" else {}
        nodes.append(helper.make_node(activation, [last], ["y"], **attrs))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    graph = helper.make_graph(
        nodes, "winograd", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, name) for a, name in consts])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _direct_convs(sess: segflow.InferenceSession) -> list[tuple[str, DirectConv]]:
    return [(label, op) for label, op in sess._executor.kernel_ops
            if isinstance(op, DirectConv)]


def _winograd_calls(sess: segflow.InferenceSession) -> int:
    """Input layouts built as Winograd over the session's convolutions."""
    return sum(1 for _, op in _direct_convs(sess) if op.winograd is not None
               for call in op.calls.values() if call is not None and call.run is not None)


def _compare(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
             sess: segflow.InferenceSession, runs: int = 2) -> None:
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    for _ in range(runs):
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("n, c, k, h, w, pad, activation, residual", [
    (1, 16, 16, 14, 14, 1, "Relu", False),     # tiles fill the output exactly
    (1, 8, 24, 9, 7, 1, None, False),          # partial tiles on both edges
    (2, 16, 16, 13, 11, 1, "Relu", True),      # batch 2, residual and ReLU fused
    (1, 32, 32, 7, 7, 1, None, True),          # ResNet-50's last stage, in small
    (1, 16, 8, 10, 6, 0, "Relu", False),       # no padding: a smaller output
    (3, 8, 8, 1, 1, 1, "Relu", False),         # a 1x1 image: one tile, mostly padding
    (1, 16, 16, 9, 9, 1, "LeakyRelu", True),   # LeakyReLU (slope 0.1) after the residual
    (2, 8, 16, 6, 10, 1, "Clip", False),       # ReLU6
])
def test_a_convolution_matches_onnxruntime(n, c, k, h, w, pad, activation, residual):
    model = _model(n, c, k, h, w, pad, activation, residual)
    sess = segflow.InferenceSession(model, compile="codegen")
    x = np.random.default_rng(1).standard_normal((n, c, h, w)).astype(np.float32)
    _compare(model, {"x": x}, sess, runs=3)
    assert _winograd_calls(sess) == 1
    (label, op), = [(label, op) for label, op in _direct_convs(sess) if op.winograd is not None]
    (call,) = [c for c in op.calls.values() if c is not None]
    assert call.impl.startswith("winograd F(4x4,3x3) + ")
    assert "1 3x3 convolutions as Winograd F(4x4,3x3)" in sess.explain()


def test_chunks_of_tiles_and_a_shorter_last_chunk(monkeypatch):
    # Batch 2 of 12x20 outputs: 2 x 3 x 5 = 30 tiles; at most 4 a chunk: 7 chunks of 4
    # and one of 2, each its own matmul (two primitives), with ReLU and a residual.
    monkeypatch.setattr(winograd, "CHUNK_BYTES", 1)
    monkeypatch.setattr(winograd, "MIN_CHUNK", 4)
    assert winograd.chunk_tiles(30, 16, 16) == 4
    model = _model(2, 16, 16, 12, 20, 1, "Relu", True)
    sess = segflow.InferenceSession(model, compile="codegen")
    x = np.random.default_rng(4).standard_normal((2, 16, 12, 20)).astype(np.float32)
    _compare(model, {"x": x}, sess, runs=3)
    (call,) = [c for _, op in _direct_convs(sess) for c in op.calls.values()
               if c is not None and c.run is not None]
    plan = call.keep[0]                # type: ignore[index]
    assert plan.chunk == 4 and all(m.primitive for m in plan.matmul)


def test_chunk_sizes_are_even_and_bounded():
    assert winograd.chunk_tiles(16, 256, 256) == 16          # one chunk: fits the budget
    assert winograd.chunk_tiles(196, 64, 64) == 49           # 56x56 at 64 channels: 4 chunks
    assert winograd.chunk_tiles(4, 512, 512) == 4
    assert winograd.chunk_tiles(1000, 512, 512) == winograd.MIN_CHUNK   # the floor: 32 rows
    for tiles in (1, 7, 33, 196, 1568):
        chunk = winograd.chunk_tiles(tiles, 64, 128)
        assert 1 <= chunk <= tiles and -(-tiles // chunk) * chunk - tiles < -(-tiles // chunk)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 2), c=st.sampled_from([8, 16, 24]), k=st.sampled_from([8, 16, 40]),
       h=st.integers(1, 13), w=st.integers(1, 13), pad=st.integers(0, 1),
       activation=st.sampled_from([None, "Relu", "LeakyRelu", "Clip"]), residual=st.booleans())
def test_random_shapes_match_onnxruntime(n, c, k, h, w, pad, activation, residual):
    assume(pad == 1 or (h >= 3 and w >= 3))
    assume(not residual or (k == c and pad == 1))    # the residual is the conv's input
    model = _model(n, c, k, h, w, pad, activation, residual, seed=h * 16 + w)
    sess = segflow.InferenceSession(model, compile="codegen")
    x = np.random.default_rng(n * c + k).standard_normal((n, c, h, w)).astype(np.float32)
    _compare(model, {"x": x}, sess)
    assert _winograd_calls(sess) == 1


def test_the_transforms_compute_a_3x3_correlation_of_a_6x6_window():
    # Y = A^T [U * (B^T d B)] A with U = G g G^T: the matrices winograd.c hard-codes.
    bt = torch.tensor([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                       [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
                      dtype=torch.float64)
    at = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0],
                       [0, 1, -1, 8, -8, 1]], dtype=torch.float64)
    w = torch.randn(1, 1, 3, 3, dtype=torch.float64)
    window = torch.randn(6, 6, dtype=torch.float64)
    u = transform_weight(w).double().reshape(6, 6)
    y = at @ (u * (bt @ window @ bt.T)) @ at.T
    expected = torch.nn.functional.conv2d(window[None, None], w)[0, 0]
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_the_weight_transform_is_g_g_gt_laid_out_as_36_c_k():
    # 40 input channels: two whole blocks of 16 and a shorter one.
    g = torch.randn(24, 40, 3, 3)
    u = transform_weight(g)
    assert u.shape == (36, 40, 24) and u.is_contiguous() and u.dtype == torch.float32
    expected = torch.einsum("ia,kcab,jb->ijck", winograd._G, g.double(), winograd._G)
    torch.testing.assert_close(u.double(), expected.reshape(36, 40, 24), atol=1e-6, rtol=1e-6)


def test_the_inverse_transform_recovers_the_weight():
    g = torch.randn(72, 16, 3, 3) * 3
    u = transform_weight(g)
    assert u.shape == (36, 16, 72) and u.is_contiguous()
    # Within a few float32 ulps of the original: U was rounded to float32 once.
    torch.testing.assert_close(winograd.inverse_transform(u), g, atol=4e-6, rtol=0)
    with pytest.raises(ValueError, match="36 points"):
        winograd.inverse_transform(torch.zeros(16, 4, 4))


def test_a_winograd_convolution_holds_its_weight_once():
    model = _model(1, 16, 24, 10, 10, 1, "Relu", False)
    sess = segflow.InferenceSession(model, compile="codegen")
    (node,) = [n for n in sess.graph.nodes if kind(sess, n) is KernelKind.WINOGRAD]
    weight = node.inputs[1]
    assert weight.const is not None and tuple(weight.const.shape) == (36, 16, 24)
    assert weight.spec.shape == (24, 16, 3, 3)      # the logical weight, as before
    # Neither the dense weight nor a packed copy of it is left in the graph.
    held = [v for v in sess.graph.initializers.values() if v.const is not None
            and v.const.numel() in (24 * 16 * 9,) and v is not weight]
    assert held == [] and weight.name.endswith(".winograd")
    assert not choice(sess, node).libdnnl_packed
    _compare(model, {"x": np.random.default_rng(5).standard_normal(
        (1, 16, 10, 10)).astype(np.float32)}, sess)
    assert _winograd_calls(sess) == 1


def test_a_declined_call_runs_the_fallback_over_the_recovered_weight(monkeypatch):
    monkeypatch.setattr(winograd.Winograd, "make_call",
                        lambda self, *args: (None, "declined for the test"))
    model = _model(2, 16, 16, 9, 9, 1, "Relu", True)
    sess = segflow.InferenceSession(model, compile="codegen")
    feeds = {"x": np.random.default_rng(6).standard_normal((2, 16, 9, 9)).astype(np.float32)}
    _compare(model, feeds, sess)
    assert _winograd_calls(sess) == 0
    (op,) = [op for _, op in _direct_convs(sess) if op.winograd is not None]
    assert list(op.winograd_not.values()) == ["declined for the test"]
    assert "declined for the test" in sess.explain()


@pytest.mark.parametrize("change, why", [
    ({"activation": "Sigmoid"}, "an activation other than ReLU, LeakyReLU (slope 0 to 1) or Clip"),
    ({"c": 12}, "channels not a multiple of 8"),
])
def test_convolutions_that_do_not_fit_stay_direct(change, why):
    spec: dict[str, Any] = {"n": 1, "c": 16, "k": 16, "h": 8, "w": 8, "pad": 1,
                            "activation": "Relu", "residual": False, **change}
    model = _model(**spec)
    sess = segflow.InferenceSession(model, compile="codegen")
    x = np.random.default_rng(2).standard_normal((1, spec["c"], 8, 8)).astype(np.float32)
    _compare(model, {"x": x}, sess)
    assert _winograd_calls(sess) == 0
    assert "as Winograd" not in sess.explain()
    assert all(op.direct_layouts == 1 for _, op in _direct_convs(sess))
    eltwise = {"Relu": (32, 0.0, 0.0), "Sigmoid": (41, 0.0, 0.0)}[spec["activation"]]
    geo = geometry([spec["k"], spec["c"], 3, 3], (1, 1), (1, 1), (1, 1), 1)
    assert winograd.unfit(geo, spec["c"], eltwise) == why


def test_a_plain_input_is_staged_into_channels_last():
    # The 3x3 convolution reads the model's NCHW input directly.
    rng = np.random.default_rng(3)
    w3 = (rng.standard_normal((16, 8, 3, 3)) / 8).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w3"], ["y0"], kernel_shape=[3, 3], pads=[1] * 4),
         helper.make_node("Relu", ["y0"], ["y"])], "stem",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w3, "w3")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = segflow.InferenceSession(model, compile="codegen")
    _compare(model, {"x": rng.standard_normal((1, 8, 10, 10)).astype(np.float32)}, sess)
    assert _winograd_calls(sess) == 1


def test_segflow_winograd_0_turns_it_off(monkeypatch):
    model = _model(1, 16, 16, 12, 12, 1, "Relu", True)
    monkeypatch.setenv("SEGFLOW_WINOGRAD", "0")
    sess = segflow.InferenceSession(model, compile="codegen")
    _compare(model, {"x": np.ones((1, 16, 12, 12), np.float32)}, sess)
    assert _winograd_calls(sess) == 0
    assert count(sess, KernelKind.WINOGRAD) == 0
    assert sess.last_run_stats is not None
    assert sess.last_run_stats.settings["winograd"] is False


def test_unset_it_runs_where_it_was_measured_faster(monkeypatch):
    assert OptimizeOptions.resolve(env={}).winograd is None
    assert OptimizeOptions.resolve(env={}).as_record()["winograd"] == "auto"
    assert OptimizeOptions.resolve(env={"SEGFLOW_WINOGRAD": "1"}).winograd is True
    model = _model(1, 16, 16, 8, 8, 1, "Relu", False)
    monkeypatch.delenv("SEGFLOW_WINOGRAD")
    asked: list[int | None] = []

    def preferred(answer: bool):
        def ask(target: CpuTarget, tiles: int | None) -> bool:
            asked.append(tiles)
            return answer
        return ask
    monkeypatch.setattr(CpuTarget, "winograd_preferred", preferred(False))
    sess = segflow.InferenceSession(model, compile="codegen")
    assert count(sess, KernelKind.WINOGRAD) == 0
    assert 4 in asked           # the 3x3 convolution's 8x8 output: 2 x 2 tiles
    monkeypatch.setattr(CpuTarget, "winograd_preferred", preferred(True))
    sess = segflow.InferenceSession(model, compile="codegen")
    assert count(sess, KernelKind.WINOGRAD) == 1
    monkeypatch.setattr(CpuTarget, "winograd_preferred", preferred(False))
    monkeypatch.setenv("SEGFLOW_WINOGRAD", "1")                             # forced
    sess = segflow.InferenceSession(model, compile="codegen")
    assert count(sess, KernelKind.WINOGRAD) == 1


@pytest.mark.parametrize("avx512", [False, True])
def test_by_default_avx512_cpus_take_it_where_an_image_makes_enough_tiles(monkeypatch,
                                                                          avx512):
    # Without AVX-512 every convolution that fits; with it, those whose output an image
    # cuts into 32 or more 4x4 tiles (ResNet-50's 56x56 and 28x28 stages), and none
    # whose size is not known at load.
    monkeypatch.delenv("SEGFLOW_WINOGRAD")
    as_cpu(monkeypatch, avx512=avx512)
    target = CpuTarget.detect()
    assert target.winograd_preferred(None) is not avx512
    assert target.winograd_preferred(31) is not avx512
    assert target.winograd_preferred(WINOGRAD_MIN_TILES) is True
    for size, tiles in ((8, 4), (20, 25), (23, 36), (28, 49)):
        sess = segflow.InferenceSession(_model(1, 16, 16, size, size, 1, "Relu", False),
                                        compile="codegen")
        marked = count(sess, KernelKind.WINOGRAD)
        assert marked == (not avx512 or tiles >= WINOGRAD_MIN_TILES), size
    model = _model(1, 16, 16, 28, 28, 1, "Relu", False)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "height"
    sess = segflow.InferenceSession(model, compile="codegen")
    assert (count(sess, KernelKind.WINOGRAD) > 0) is not avx512


def _resnet18() -> tuple[onnx.ModelProto, segflow.InferenceSession]:
    model = models.build("resnet18", image_size=64)
    return model, segflow.InferenceSession(model, compile="codegen")


def _feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
    return models.example_inputs("resnet18", batch_size=batch, image_size=64, seed=seed)


def _replay(sess: segflow.InferenceSession) -> DirectReplay:
    (replay,) = replays(sess)
    return replay


def test_resnet18_runs_its_3x3_convolutions_as_winograd_inside_the_native_replay():
    model, sess = _resnet18()
    # Transformed by the layout pass: the calls read the graph's constants in place.
    marked = [n for n in sess.graph.nodes if kind(sess, n) is KernelKind.WINOGRAD]
    constants = [n.inputs[1].const for n in marked]
    transformed = [op.winograd.weight for _, op in _direct_convs(sess) if op.winograd]
    assert len(transformed) == 13
    assert {id(t) for t in transformed} == {id(c) for c in constants}
    # Built while loading, for batch 1 (runtime/prebuild.py); the runs build none.
    assert "winograd F(4x4,3x3): 13 convolutions, 13 input layouts built" in sess.explain()
    for seed in range(3):
        _compare(model, _feeds(1, seed), sess, runs=1)
    assert all(len(op.calls) == op.built_at_load == 1 for _, op in _direct_convs(sess))
    # ResNet-18 has 16 3x3 convolutions after its stem; 3 have stride 2.
    assert _winograd_calls(sess) == 13
    now = [op.winograd.weight for _, op in _direct_convs(sess) if op.winograd]
    assert all(a is b for a, b in zip(now, transformed, strict=True))
    replay = _replay(sess)
    assert replay.replays == 2       # the first run recorded
    rec = replay._recording
    assert rec is not None
    (stretch,) = [e for e in rec.program if isinstance(e, NativeStretch)]
    winograd = {call.primitive.value for _, call, _ in stretch.entries
                if call.impl.startswith("winograd")}
    winograd_steps = [s for s in stretch._steps if s.run and s.primitive in winograd]
    assert len(winograd_steps) == 13
    workspace = _direct_convs(sess)[1][1].winograd
    assert workspace is not None
    assert workspace.workspace.lock in stretch.locks
    text = sess.explain()
    assert "13 3x3 convolutions as Winograd F(4x4,3x3)" in text
    assert re.search(r"winograd F\(4x4,3x3\): 13 convolutions, 13 input layouts built; "
                     r"transformed weights [\d.]+ MiB \(the weights themselves\), "
                     r"workspace [\d.]+ MiB", text)


def test_the_shared_workspace_grows_for_a_larger_batch_and_serves_the_smaller_one():
    model, sess = _resnet18()
    (workspace,) = {id(op.winograd.workspace): op.winograd.workspace
                    for _, op in _direct_convs(sess) if op.winograd is not None}.values()
    _compare(model, _feeds(1, 0), sess, runs=1)
    small = workspace.nbytes
    weights = [op.winograd.weight_bytes for _, op in _direct_convs(sess) if op.winograd]
    _compare(model, _feeds(3, 1), sess, runs=1)
    assert workspace.nbytes > small
    # The transformed weights serve every batch size as they are.
    assert [op.winograd.weight_bytes for _, op in _direct_convs(sess) if op.winograd] == weights
    _compare(model, _feeds(1, 2), sess, runs=3)     # built at batch 1, now a larger buffer
    assert _winograd_calls(sess) == 26


def test_threads_share_the_workspace_without_mixing_their_tiles():
    model, sess = _resnet18()
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def worker(i: int) -> None:
        for seed in range(5):
            feeds = _feeds(1 + (seed + i) % 2, 100 * i + seed)
            np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                       atol=ATOL, rtol=RTOL)
    run_in_threads(worker, 3)


def test_a_failing_matmul_names_the_node_and_frees_the_locks():
    model, sess = _resnet18()
    _compare(model, _feeds(1, 0), sess)
    label, op = [(label, op) for label, op in _direct_convs(sess) if op.winograd is not None][2]
    (call,) = [c for c in op.calls.values() if c is not None]
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p)
    failing = prototype(lambda *args: 5)
    plan = call.keep[0]                # type: ignore[index]
    real, plan.execute = plan.execute, ctypes.cast(failing, ctypes.c_void_p).value
    stretch = next(e for e in _replay(sess)._recording.program   # type: ignore[union-attr]
                   if isinstance(e, NativeStretch))
    try:
        with pytest.raises(segflow.ExecutionError,
                           match=rf"^While executing {re.escape(label)}: DnnlError: "
                                 r"convolution \(winograd F\(4x4,3x3\) \+ .*\): oneDNN status 5$"):
            sess.run(None, _feeds(1, 1))
        assert not any(lock.locked() for lock in stretch.locks)
    finally:
        plan.execute = real
    _compare(model, _feeds(1, 2), sess)
