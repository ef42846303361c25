"""Tests for runtime/onednn_graph.py: the TorchScript + oneDNN Graph segment backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import segflow
from segflow import models
from segflow.ir.types import Device
from segflow.kernels.onednn.library import Library
from segflow.kernels.target import onednn_graph_available
from segflow.passes.pipeline import CompileMode, choose_backend
from segflow.runtime.compile import CompileReport, generate
from segflow.runtime.onednn_graph import MAX_SIGNATURES, OneDnnGraphSegment

ATOL, RTOL = 1e-4, 1e-3

pytestmark = pytest.mark.skipif(not onednn_graph_available(),
                                reason="this torch has no oneDNN Graph fuser")

SMALL = {
    "resnet18": {"num_classes": 10, "image_size": 64},
    "mobilenet_v2": {"num_classes": 10, "image_size": 64},
    "mlp_chain": {"layers": 5},
    "nonzero_mid": {},
}


def _oracle(model, feeds):
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("name", list(SMALL))
def test_onednn_backend_matches_onnxruntime_across_batch_sizes(name):
    model = models.build(name, **SMALL[name])
    sess = segflow.InferenceSession(model, engine="inline", compile="onednn")
    assert "layout: skipped (oneDNN Graph" in sess.explain()
    for batch in (2, 1, 2):  # a new batch size is a new signature, compiled on its own
        feeds = models.example_inputs(name, batch_size=batch, **SMALL[name])
        ref = _oracle(model, feeds)
        for _ in range(2):
            for got, want in zip(sess.run(None, feeds), ref):
                np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    report = sess.compile_report
    assert report.backend == "onednn" and sess.last_run_stats.settings["compile"] == "onednn"
    assert report.first_run_compile_s > 0
    assert report.fallbacks == []
    if name == "nonzero_mid":
        # The segment after NonZero divides by a computed count (a NaN can arise there):
        # it is generated rather than lowered (runtime/nonfinite.py), so the first
        # segment alone compiled.
        assert {n.name for n in sess._nonfinite.exact or ()} == {"mix", "fc2"}


def test_a_failing_fusion_falls_back_to_codegen(monkeypatch):
    # On some CPUs (AVX-512 ones), oneDNN Graph cannot build a reorder for MobileNetV2's
    # smallest feature maps at 32x32; elsewhere it can, so the failure is made certain.
    from segflow.runtime import onednn_graph

    @contextlib.contextmanager
    def failing() -> Iterator[None]:
        raise RuntimeError("could not create a primitive descriptor for a reorder (simulated)")
        yield
    monkeypatch.setattr(onednn_graph, "onednn_fusion", failing)
    opts = {"num_classes": 10, "image_size": 32}
    model = models.build("mobilenet_v2", **opts)
    sess = segflow.InferenceSession(model, engine="inline", compile="onednn")
    feeds = models.example_inputs("mobilenet_v2", batch_size=2, **opts)
    for _ in range(2):
        np.testing.assert_allclose(sess.run(None, feeds)[0], _oracle(model, feeds)[0],
                                   atol=ATOL, rtol=RTOL)
    assert len(sess.compile_report.fallbacks) == 1
    assert "RuntimeError" in sess.compile_report.describe()


def test_auto_picks_onednn_for_depthwise_convolutions_only_without_libdnnl(monkeypatch):
    model = models.build("mobilenet_v2", **SMALL["mobilenet_v2"])
    direct = Library.load() is not None
    mobile = segflow.InferenceSession(model)
    if direct:   # convolutions straight into libdnnl: codegen, one copy of the weights
        assert mobile.compile_report.backend == "codegen"
        assert "compile: codegen (auto: 52 convolutions, 17 depthwise, called straight " \
            "into libdnnl" in mobile.explain()
    monkeypatch.setenv("SEGFLOW_ONEDNN_DIRECT", "0")
    mobile = segflow.InferenceSession(model)
    assert mobile.compile_report.backend == "onednn"
    assert "compile: onednn (auto: 52 convolutions, 17 depthwise" in mobile.explain()
    monkeypatch.delenv("SEGFLOW_ONEDNN_DIRECT")
    resnet = segflow.InferenceSession(models.build("resnet18", **SMALL["resnet18"]))
    assert resnet.compile_report.backend == "codegen"
    assert "compile: codegen (auto: no depthwise convolutions" in resnet.explain()
    assert "layout: prepacked for oneDNN" in resnet.explain()
    for name in ("mlp_chain", "bert_tiny"):
        sess = segflow.InferenceSession(models.build(name))
        assert sess.compile_report.backend == "codegen", name
        assert "compile: codegen (auto: no convolutions" in sess.explain()


def test_onednn_needs_a_cpu_device():
    graph = segflow.InferenceSession(models.build("mlp_chain", layers=1)).graph
    mode, why = choose_backend(graph, CompileMode.ONEDNN, Device.parse("cuda:0"))
    assert mode is CompileMode.CODEGEN and "needs a CPU device" in why
    assert choose_backend(graph, CompileMode.AUTO, Device.parse("cuda:0"))[0] \
        is CompileMode.CODEGEN
    assert choose_backend(graph, CompileMode.ONEDNN, Device.parse("cpu")) \
        == (CompileMode.ONEDNN, "requested")


def _value_dependent_model():
    """Reshape to a shape read from an input: a trace would bake the first shape in."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Reshape", ["a", "shape"], ["b"]),
             helper.make_node("Neg", ["b"], ["out"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [12]),
                     helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_trace_that_reads_input_values_falls_back_to_codegen():
    sess = segflow.InferenceSession(_value_dependent_model(), engine="inline", compile="onednn")
    x = np.linspace(-1, 1, 12, dtype=np.float32)
    for shape in ([3, 4], [4, 3], [2, 6]):  # same input signature, different values
        out = sess.run(None, {"x": x, "shape": np.array(shape, np.int64)})[0]
        np.testing.assert_array_equal(out, -np.maximum(x, 0).reshape(shape))
    fallbacks = sess.compile_report.fallbacks
    assert len(fallbacks) == 1 and "depends on input values" in fallbacks[0]


def _segment(sess, fallback=None):
    ex = sess._executor
    steps = ex.tasks[0].steps
    live = set(ex.output_slots)
    program = generate(steps, ex.template, live, None, pure=True, traceable=True)
    report = CompileReport("onednn")
    codegen = generate(steps, ex.template, live, None).fn
    return OneDnnGraphSegment(program, fallback or codegen, report), program, report


def test_outputs_that_differ_from_codegen_are_not_used():
    sess = segflow.InferenceSession(models.build("mlp_chain", layers=2, width=8),
                                    engine="inline", compile="none")
    slot = sess._executor.output_slots[0]

    def wrong(env):  # a "codegen" that disagrees: the compiled result must not be trusted
        env[slot] = torch.full((1, 8), 7.0)
    segment, program, report = _segment(sess, wrong)
    env = list(sess._executor.template)
    assert len(program.inputs) == 1
    env[program.inputs[0]] = torch.ones(1, 8)
    segment(env)
    assert len(report.fallbacks) == 1 and "differ from codegen" in report.fallbacks[0]
    assert torch.equal(env[slot], torch.full((1, 8), 7.0))


def test_signatures_are_bounded():
    sess = segflow.InferenceSession(models.build("mlp_chain", layers=1, width=4),
                                    engine="inline", compile="none")
    segment, program, report = _segment(sess)
    slot = sess._executor.output_slots[0]
    for rows in range(1, MAX_SIGNATURES + 3):
        env = list(sess._executor.template)
        x = torch.randn(rows, 4)
        env[program.inputs[0]] = x
        segment(env)
        assert env[slot].shape == (rows, 4)
    assert len(report.fallbacks) == 2
    assert all(f"more than {MAX_SIGNATURES} input signatures" in f for f in report.fallbacks)
