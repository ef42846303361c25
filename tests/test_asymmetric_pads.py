"""Tests for convolutions padded more at one end than the other (TensorFlow's "same").

A strided convolution over an even-sized input pads only its end ([0, 0, 1, 1] for a
3x3 stride-2 one, as transformers' MobileNetV2 and EfficientNet exports write).
``kernels/onednn/geometry.py`` carries the begin and end pads apart, so such a
convolution runs on the direct libdnnl path like any other: these tests check whole
graphs against onnxruntime (atol 1e-4, rtol 1e-3, as the other direct-kernel tests),
assert in the plan and in explain() that every convolution is a direct libdnnl kernel
in one replayed run, and check the paths that must pad the input themselves (torch's
oneDNN op: the fallback, and the kernel without libdnnl) and the kernels that refuse
asymmetric pads (Winograd).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import segflow
from replays import replays
from segflow.kernels import winograd
from segflow.kernels.choice import DIRECT_CONV_KINDS, KernelKind
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.geometry import geometry
from segflow.kernels.onednn.library import DnnlError, Library
from segflow.passes.pack_weights import PackParams
from targets import as_cpu, kind, patch_target

LIB = Library.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"libdnnl {Library.probe()[1]}")
ATOL, RTOL = 1e-4, 1e-3
SAME_END = [0, 0, 1, 1]      # TensorFlow's "same" for a 3x3 stride-2 conv, even input


def _model(size: tuple[int, int], pads: list[int] = SAME_END, pool: bool = False
           ) -> onnx.ModelProto:
    """A MobileNetV2-like entry: a 3->32 stride-2 stem and a depthwise stride-2
    convolution, both padded by ``pads`` and clipped to [0, 6], then a 1x1 to 16
    channels (and a global average pooling with ``pool``)."""
    rng = np.random.default_rng(7)

    def init(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32),
                                       name)
    inits = [init("w0", 32, 3, 3, 3), init("b0", 32), init("w1", 32, 1, 3, 3), init("b1", 32),
             init("w2", 16, 32, 1, 1), init("b2", 16),
             numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
    last = "p" if pool else "y"
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], strides=[2, 2], pads=pads),
        helper.make_node("Clip", ["c0", "lo", "hi"], ["a0"]),
        helper.make_node("Conv", ["a0", "w1", "b1"], ["c1"], strides=[2, 2], pads=pads,
                         group=32),
        helper.make_node("Clip", ["c1", "lo", "hi"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2", "b2"], [last])]
    if pool:
        nodes.append(helper.make_node("GlobalAveragePool", ["p"], ["y"]))
    graph = helper.make_graph(
        nodes, "same_pads", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                           ["batch", 3, *size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort(model: onnx.ModelProto) -> Any:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _feed(batch: int, size: tuple[int, int], seed: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((batch, 3, *size)).astype(np.float32)
    return {"x": x}


def _convs(sess: segflow.InferenceSession) -> list[Any]:
    return [n for n in sess.graph.nodes if n.op_type == "FusedConv"]


@pytest.mark.parametrize("size", [(32, 32), (33, 31)], ids=["even", "odd"])
def test_same_padding_runs_direct_in_one_replayed_run(size):
    model = _model(size)
    sess = segflow.InferenceSession(model, compile="codegen")
    assert [n.attrs["pads"] for n in _convs(sess)][:2] == [SAME_END, SAME_END]
    assert all(kind(sess, n) in DIRECT_CONV_KINDS for n in _convs(sess))
    ref = _ort(model)
    for seed, batch in enumerate((1, 3, 1)):
        feeds = _feed(batch, size, seed)
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   atol=ATOL, rtol=RTOL)
    text = sess.explain()
    assert "direct kernels (libdnnl): 3 convolutions;" in text
    assert "0 fell back to torch" in text
    # Batch 1's layouts built while loading: nothing breaks the chain from the feed.
    assert "prebuilt: 3 input layouts built while loading" in text
    assert "replayed runs (libdnnl): 1 run of direct kernels, 3 nodes" in text
    (replay,) = replays(sess)
    assert replay.replays > 0
    ops = [op for _, op in sess._executor.kernel_ops if isinstance(op, DirectConv)]
    assert len(ops) == 3 and all(not op.spec.symmetric for op in ops[:2])
    assert all(not op.why_not for op in ops)


def test_nonfinite_feeds_match_onnxruntime():
    # NaN and Inf feeds run the exact executor (runtime/nonfinite.py): its kernels must
    # take the asymmetric pads too, and keep NaN and Inf where onnxruntime does.
    size = (32, 32)
    model = _model(size)
    sess = segflow.InferenceSession(model, compile="codegen")
    ref = _ort(model)
    feeds = _feed(1, size, 3)
    x = feeds["x"]
    x[0, 0, 4, 4] = np.nan
    x[0, 1, 31, 31] = np.inf        # the last pixel: next to the end padding
    x[0, 2, 0, 9] = -np.inf
    got, want = sess.run(None, feeds)[0], ref.run(None, feeds)[0]
    assert np.isnan(want).any() and np.isnan(got).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert "runs exact kernels instead (1 so far)" in sess.explain()
    # Finite feeds keep the fast kernels, and still match.
    feeds = _feed(1, size, 4)
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("pads", [[1, 0, 2, 1], [2, 2, 0, 1]])
def test_other_asymmetric_pads_match_onnxruntime(pads):
    size = (19, 24)
    model = _model(size, pads)
    sess = segflow.InferenceSession(model, compile="codegen")
    assert all(kind(sess, n) in DIRECT_CONV_KINDS for n in _convs(sess))
    ref = _ort(model)
    for batch in (1, 3):
        feeds = _feed(batch, size, batch)
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   atol=ATOL, rtol=RTOL)


def test_the_torch_fallback_pads_the_input_itself(monkeypatch):
    # Every primitive refused: each call runs torch's oneDNN op (one pad per dim) over
    # torch's packing made from libdnnl's bytes, so the input must be padded first.
    monkeypatch.setenv("SEGFLOW_PREBUILD", "0")    # no primitive built before the refusal
    assert LIB is not None
    convolution = LIB.convolution

    def refuse_primitives(*args: Any, create: bool = True, **kwargs: Any) -> Any:
        if create:
            raise DnnlError("refused for the test")
        return convolution(*args, create=False, **kwargs)
    monkeypatch.setattr(LIB, "convolution", refuse_primitives)
    size = (32, 30)
    model = _model(size)
    sess = segflow.InferenceSession(model, compile="codegen",
                                    optimize={"layout.native_stem": False})
    ref = _ort(model)
    for batch in (1, 3):
        feeds = _feed(batch, size, batch)
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   atol=ATOL, rtol=RTOL)
    ops = [op for _, op in sess._executor.kernel_ops if isinstance(op, DirectConv)]
    assert len(ops) == 3 and all(op.direct_layouts == 0 and op.why_not for op in ops)


def test_without_libdnnl_torchs_op_runs_over_the_padded_input(monkeypatch):
    patch_target(monkeypatch, dnnl=None)
    size = (33, 32)
    model = _model(size)
    sess = segflow.InferenceSession(model, compile="codegen")
    assert [kind(sess, n) for n in _convs(sess)] == [KernelKind.ONEDNN_CONV] * 3
    ref = _ort(model)
    for batch in (1, 3):
        feeds = _feed(batch, size, batch)
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   atol=ATOL, rtol=RTOL)


def test_the_blocked_region_takes_asymmetric_pads(monkeypatch):
    # libdnnl's nChw8c kernels get the begin and end pads like its NHWC ones.
    as_cpu(monkeypatch, avx512=False)
    size = (32, 32)
    model = _model(size, pool=True)
    sess = segflow.InferenceSession(model, compile="codegen",
                                    optimize={"layout.native_stem": False})
    if "nChw8c" not in sess.explain():
        pytest.skip("no blocked region on this CPU")
    assert all(sess.plan.choices[n].blocked for n in _convs(sess))
    ref = _ort(model)
    for batch in (1, 3):
        feeds = _feed(batch, size, batch)
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   atol=ATOL, rtol=RTOL)


def test_winograd_refuses_asymmetric_pads():
    symmetric = geometry([32, 32, 3, 3], (1, 1), (1, 1, 1, 1), (1, 1), 1)
    assert symmetric.symmetric and winograd.unfit(symmetric, 32, None) is None
    end_only = geometry([32, 32, 3, 3], (1, 1), (0, 0, 1, 1), (1, 1), 1)
    assert not end_only.symmetric
    assert winograd.unfit(end_only, 32, None) == "asymmetric padding"
    # A session asked for Winograd runs it direct instead, and matches.
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array((rng.standard_normal((32, 32, 3, 3)) * 0.1)
                                .astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[0, 0, 1, 1])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = segflow.InferenceSession(model, compile="codegen",
                                    optimize={"layout.winograd": True})
    assert [kind(sess, n) for n in _convs(sess)] == [KernelKind.DIRECT_CONV]
    x = rng.standard_normal((1, 32, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], _ort(model).run(None, {"x": x})[0],
                               atol=ATOL, rtol=RTOL)


def test_geometry_carries_begin_and_end_pads():
    geo = geometry([32, 3, 3, 3], (2, 2), (0, 0, 1, 1), (1, 1), 1)
    assert (geo.pads_begin, geo.pads_end) == ((0, 0), (1, 1))
    assert geo.output_size((1, 3, 224, 224)) == (1, 32, 112, 112)
    assert geo.output_size((2, 3, 225, 224)) == (2, 32, 112, 112)
    # One pad per dim: alike at both ends.
    geo = geometry([8, 8, 3, 3], (1, 1), (1, 1), (1, 1), 1)
    assert geo.symmetric and geo.pads_end == (1, 1)
    with pytest.raises(ValueError, match="3 pads"):
        geometry([8, 8, 3, 3], (1, 1), (1, 1, 1), (1, 1), 1)
    # torch's packing of an asymmetric one: no pads, the padded input's size.
    params = PackParams((0, 0, 1, 1), (2, 2), (1, 1), 1, (1, 3, 224, 224))
    assert params.torch_form() == ([0, 0], [1, 3, 225, 225])
    params = PackParams((1, 1, 1, 1), (2, 2), (1, 1), 1, None)
    assert params.torch_form() == ([1, 1], None)
