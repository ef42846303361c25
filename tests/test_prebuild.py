"""runtime/prebuild.py: libdnnl's primitives built while a session loads, for the
layouts its first run brings; the runs then build none, and their results are the
results of a session that builds at its first run."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.library import Library
from segflow.kernels.onednn.op import DirectOp
from segflow.kernels.onednn.pool import DirectPool

LIB = Library.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"libdnnl {Library.probe()[1]}")
SMALL = {"image_size": 64}


def _direct(sess: segflow.InferenceSession) -> list[DirectOp]:
    return [op for _, op in sess._executor.kernel_ops if isinstance(op, (DirectConv, DirectPool))]


def _session(name: str, monkeypatch: pytest.MonkeyPatch, prebuild: bool = True,
             **kwargs: Any) -> segflow.InferenceSession:
    monkeypatch.setenv("SEGFLOW_PREBUILD", "1" if prebuild else "0")
    return segflow.InferenceSession(models.build(name, **SMALL).SerializeToString(), **kwargs)


def _ort(model: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet18"])
@pytest.mark.parametrize("compile", ["codegen", "none"])
def test_every_direct_kernel_is_built_at_load_and_no_run_builds_another(
        name: str, compile: str, monkeypatch: pytest.MonkeyPatch):
    sess = _session(name, monkeypatch, compile=compile)
    ops = _direct(sess)
    assert ops and all(len(op.calls) == op.built_at_load == 1 for op in ops)
    assert sess.prebuild_report is not None
    assert (sess.prebuild_report.built, sess.prebuild_report.left) == (len(ops), 0)
    feeds = models.example_inputs(name, batch_size=1, **SMALL)
    out = sess.run(None, feeds)[0]
    with segflow.profile():              # node by node: the same layouts again
        sess.run(None, feeds)
    assert all(len(op.calls) == 1 and not op.why_not for op in ops)
    np.testing.assert_allclose(out, _ort(models.build(name, **SMALL), feeds),
                               atol=1e-4, rtol=1e-3)
    lazy = _session(name, monkeypatch, prebuild=False, compile=compile)
    assert lazy.prebuild_report is None
    assert all(not op.calls and op.built_at_load == 0 for op in _direct(lazy))
    np.testing.assert_array_equal(lazy.run(None, feeds)[0], out)
    # The same primitives, built at the first run instead.
    assert [op.calls.keys() for op in _direct(lazy)] == [op.calls.keys() for op in ops]


def test_a_later_batch_builds_its_own_layouts_at_its_run(monkeypatch: pytest.MonkeyPatch):
    sess = _session("resnet18", monkeypatch)
    ops = _direct(sess)
    feeds = models.example_inputs("resnet18", batch_size=3, **SMALL)
    np.testing.assert_allclose(sess.run(None, feeds)[0],
                               _ort(models.build("resnet18", **SMALL), feeds),
                               atol=1e-4, rtol=1e-3)
    assert all(len(op.calls) == 2 and op.built_at_load == 1 for op in ops)
    assert "  prebuilt: 22 input layouts built while loading" in sess.explain()


def _conv_model(input_shape: list[int | str], scaled: bool) -> bytes:
    """x [-> Mul by 2] -> Conv 3x3 (unpadded: ONNX gives a symbolic height and width new
    names after it) -> Relu -> Conv 1x1: the first convolution reads the graph input, or
    (``scaled``) a torch op's output."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((16, 16, 1, 1)).astype(np.float32) * 0.1
    nodes = [helper.make_node("Mul", ["x", "two"], ["x2"])] if scaled else []
    nodes += [helper.make_node("Conv", ["x2" if scaled else "x", "w1"], ["c"]),
              helper.make_node("Relu", ["c"], ["r"]),
              helper.make_node("Conv", ["r", "w2"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, input_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
         numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.mark.parametrize(("shape", "scaled", "built"), [
    (["batch", 8, 12, 12], False, 2),     # a symbolic batch: built at batch 1
    ([2, 8, 12, 12], False, 2),           # static
    (["batch", 8, "h", "w"], False, 0),   # spatial dims unknown until a run
    (["batch", 8, 12, 12], True, 0),      # the first reads a torch op's output, the
])                                        # second the first's (both unknown at load)
def test_only_layouts_known_at_load_are_built_there(
        shape: list[int | str], scaled: bool, built: int, monkeypatch: pytest.MonkeyPatch):
    data = _conv_model(shape, scaled)
    monkeypatch.setenv("SEGFLOW_PREBUILD", "1")
    sess = segflow.InferenceSession(data)
    report = sess.prebuild_report
    assert report is not None and (report.built, report.left) == (built, 2 - built)
    batch = 2 if shape[0] == 2 else 1
    feeds = {"x": np.random.default_rng(1).standard_normal((batch, 8, 12, 12))
             .astype(np.float32)}
    ops = _direct(sess)
    assert len(ops) == 2 and sum(op.built_at_load for op in ops) == built
    np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(data, feeds),
                               atol=1e-4, rtol=1e-3)
    if not built:
        assert "; 2 kernels left to their first run" in sess.explain()
    # Spatial dims unknown until a run: the run gets a plan of its own, built (and its
    # layouts prebuilt) for its shape (passes/specialize.py).
    specialized = list(sess.specializations.values())
    assert len(specialized) == (1 if "h" in shape else 0)
    runner = specialized[0] if specialized else sess
    ran = _direct(runner)
    assert len(ran) == 2 and all(len(op.calls) == 1 for op in ran)
    if specialized:
        assert sum(op.built_at_load for op in ran) == 2


def test_segments_another_backend_compiles_are_not_prebuilt(monkeypatch: pytest.MonkeyPatch):
    sess = _session("mobilenet_v2", monkeypatch, compile="onednn")
    assert sess.prebuild_report is not None and sess.prebuild_report.built == 0
    assert all(not op.calls for op in _direct(sess))


def test_a_build_that_raises_at_load_leaves_the_kernel_to_its_run(
        monkeypatch: pytest.MonkeyPatch):
    make_call = DirectConv._make_call

    def meta_refused(self: DirectConv, x: Any, *args: Any) -> Any:
        if x.is_meta:
            raise RuntimeError("no meta tensors here")
        return make_call(self, x, *args)
    monkeypatch.setattr(DirectConv, "_make_call", meta_refused)
    sess = _session("resnet18", monkeypatch)
    report = sess.prebuild_report
    assert report is not None and report.built == 0 and report.left == len(_direct(sess))
    assert report.failure.endswith("RuntimeError: no meta tensors here")
    assert "(a build failed: " in sess.explain()
    feeds = models.example_inputs("resnet18", batch_size=1, **SMALL)
    np.testing.assert_allclose(sess.run(None, feeds)[0],
                               _ort(models.build("resnet18", **SMALL), feeds),
                               atol=1e-4, rtol=1e-3)
    assert all(len(op.calls) == 1 and op.built_at_load == 0 for op in _direct(sess))
