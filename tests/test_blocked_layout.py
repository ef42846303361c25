"""Tests for the layout pass's blocked region: depthwise graphs on nChw8c activations.

Whole models are compared with onnxruntime (atol 1e-4, rtol 1e-3, as the other
direct-kernel tests); the region itself is checked on the plan (which nodes run
blocked, and that none of their outputs escapes to a node that reads plain
tensors), on the kernels libdnnl picked, and on the fallback, which must
reorder between layouts rather than read blocked bytes as NHWC.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import segflow
from segflow import models
from segflow.frontend.onnx_import import import_model
from segflow.ir.types import Device, DeviceKind
from segflow.kernels.choice import KernelChoices
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.geometry import geometry
from segflow.kernels.onednn.library import DnnlError, Library
from segflow.kernels.onednn.pool import DirectPool
from segflow.kernels.target import CpuTarget
from segflow.passes.pipeline import OptimizeOptions, run_pipeline

LIB = Library.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"libdnnl {Library.probe()[1]}")
CPU = Device(DeviceKind.CPU, 0)
MOBILENET = {"image_size": 64}


def _plan(name: str, env: dict[str, str], **options: Any
          ) -> tuple[list[str], Any, KernelChoices]:
    graph = import_model(models.build(name, **options))
    result = run_pipeline(graph, OptimizeOptions.resolve(compile="codegen", env=env),
                          device=CPU)
    return list(result.log), graph, result.choices


def _blocked_kernel_available() -> bool:
    assert LIB is not None
    if not CpuTarget.detect().blocked_layout_preferred():
        return False
    geo = geometry([16, 1, 3, 3], (1, 1), (1, 1), (1, 1), 16)
    return LIB.blocked_kernel(geo, (1, 16, 8, 8), False) is not None


def _ort(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def test_mobilenet_runs_blocked_and_resnet_does_not():
    if not _blocked_kernel_available():
        pytest.skip("this libdnnl has no nChw8c depthwise kernel on this CPU")
    log, graph, choices = _plan("mobilenet_v2", {}, **MOBILENET)
    convs = [n for n in graph.nodes if n.op_type == "FusedConv"]
    blocked = [n for n in convs if choices[n].blocked]
    assert len(blocked) == len(convs) == 52
    # The stem reads the plain graph input; every other convolution a blocked tensor.
    assert [n for n in blocked if not choices[n].blocked_input] == [convs[0]]
    pools = [n for n in graph.nodes if n.op_type == "GlobalAveragePool"]
    assert [choices[p].blocked_input for p in pools] == [True]
    assert "52 convolutions on nChw8c activations" in log[4]
    # No blocked tensor reaches a node outside the region.
    region = {id(n) for n in blocked}
    for node in blocked:
        for user in node.outputs[0].uses:
            assert id(user) in region or user.op_type == "GlobalAveragePool"
    _, graph, choices = _plan("resnet18", {}, num_classes=10, image_size=32)
    assert not any(choices[n].blocked for n in graph.nodes)


def test_the_option_turns_the_region_off():
    log, graph, choices = _plan("mobilenet_v2", {"SEGFLOW_ONEDNN_BLOCKED": "0"}, **MOBILENET)
    assert not any(choices[n].blocked for n in graph.nodes)
    assert "nChw8c" not in log[4]
    assert any(choices.calls_libdnnl(n) for n in graph.nodes)


def test_a_depthwise_output_that_is_a_graph_output_stays_plain():
    # Truncate MobileNetV2 after its first depthwise convolution: that value is now a
    # graph output, so it (and the stem that feeds it) leaves the region, which then
    # holds no depthwise convolution and is dropped.
    graph = import_model(models.build("mobilenet_v2", **MOBILENET))
    choices = run_pipeline(graph, OptimizeOptions.resolve(compile="codegen", env={}),
                           device=CPU).choices
    convs = [n for n in graph.nodes if n.op_type == "FusedConv"]
    if not choices[convs[1]].blocked:
        pytest.skip("no blocked region on this CPU")
    from onnx import shape_inference, utils
    model = shape_inference.infer_shapes(models.build("mobilenet_v2", **MOBILENET))
    first_dw = [n for n in model.graph.node if n.op_type == "Conv"][1]
    # The depthwise convolution's output after its BatchNormalization and Clip.
    value = first_dw.output[0]
    for op in ("BatchNormalization", "Clip"):
        value = next(n for n in model.graph.node if n.op_type == op and value in n.input
                     ).output[0]
    extracted = utils.Extractor(model).extract_model([model.graph.input[0].name], [value])
    feeds = {model.graph.input[0].name: np.random.default_rng(0).standard_normal(
        (1, 3, 64, 64)).astype(np.float32)}
    sess = segflow.InferenceSession(extracted.SerializeToString(), compile="codegen")
    assert "nChw8c" not in sess.explain()
    ref = _ort(extracted, feeds)
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("batch", [1, 3])
def test_mobilenet_matches_onnxruntime_with_and_without_the_region(batch: int):
    model = models.build("mobilenet_v2", **MOBILENET)
    feeds = models.example_inputs("mobilenet_v2", batch_size=batch, **MOBILENET)
    ref = _ort(model, feeds)
    for env in ({}, {"SEGFLOW_ONEDNN_BLOCKED": "0"}):
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            sess = segflow.InferenceSession(model.SerializeToString(), compile="codegen")
        for _ in range(2):
            np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=1e-4, rtol=1e-3)
        if batch == 1:   # the size packed for: each weight read in place
            convs = [op for _, op in sess._executor.kernel_ops if isinstance(op, DirectConv)]
            assert all(c.copies == [] for c in convs)


def test_a_blocked_convolution_that_cannot_build_falls_back_through_reorders(
        monkeypatch: pytest.MonkeyPatch):
    # Every primitive fails to build (descriptors alone, which unpacking a weight
    # needs, still work): each blocked convolution and the pooling take torch's
    # path, between reorders out of and back into nChw8c.
    model = models.build("mobilenet_v2", **MOBILENET)
    feeds = models.example_inputs("mobilenet_v2", batch_size=2, **MOBILENET)
    monkeypatch.setenv("SEGFLOW_PREBUILD", "0")    # no primitive built before the refusal
    sess = segflow.InferenceSession(model.SerializeToString(), compile="codegen")
    if "nChw8c" not in sess.explain():
        pytest.skip("no blocked region on this CPU")

    assert LIB is not None
    convolution = LIB.convolution

    def refuse_primitives(*args: Any, create: bool = True, **kwargs: Any) -> Any:
        if create:
            raise DnnlError("refused for the test")
        return convolution(*args, create=False, **kwargs)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise DnnlError("refused for the test")
    monkeypatch.setattr(LIB, "convolution", refuse_primitives)
    monkeypatch.setattr(LIB, "pooling", refuse)
    out = sess.run(None, feeds)[0]
    np.testing.assert_allclose(out, _ort(model, feeds)[0], atol=1e-4, rtol=1e-3)
    ops = [op for _, op in sess._executor.kernel_ops]
    assert ops and all(op.direct_layouts == 0 for op in ops
                       if isinstance(op, (DirectConv, DirectPool)))


def test_to_layout_round_trips_and_writes_nchw8c():
    assert LIB is not None
    x = torch.randn(2, 16, 3, 5).contiguous(memory_format=torch.channels_last)
    blocked = LIB.to_layout(x, blocked=True)
    expected = x.contiguous().reshape(2, 2, 8, 3, 5).permute(0, 1, 3, 4, 2).reshape(-1)
    assert torch.equal(blocked.as_strided((x.numel(),), (1,)), expected)   # its bytes
    assert torch.equal(LIB.to_layout(blocked, blocked=False), x)


def test_a_residual_in_blocked_layout_is_added_in_place_and_not():
    # Two 1x1 convolutions on nChw8c, the second adding the first's output.
    assert LIB is not None
    torch.manual_seed(3)
    w1, w2 = torch.randn(16, 16, 1, 1) * 0.2, torch.randn(16, 16, 1, 1) * 0.2
    x = torch.randn(1, 16, 6, 6).contiguous(memory_format=torch.channels_last)
    size = [1, 16, 6, 6]
    geo = geometry([16, 16, 1, 1], (1, 1), (0, 0), (1, 1), 1)
    if LIB.blocked_kernel(geo, size, False) is None:
        pytest.skip("no nChw8c 1x1 kernel here")

    def fallback(*args: Any) -> torch.Tensor:
        raise AssertionError("fell back")
    packed = [LIB.preferred_weight(w, geo, size, blocked=True) for w in (w1, w2)]
    conv = [DirectConv(LIB, geo, None, None, fallback, 8, 2, size, libdnnl_packed=True,
                       blocked=True, blocked_input=True) for _ in range(2)]
    xb = LIB.to_layout(x, blocked=True)
    z = conv[0](xb, packed[0])
    expected = F.conv2d(x, w1) + F.conv2d(F.conv2d(x, w1), w2)
    for inplace in (False, True):
        residual = z.clone()
        if inplace:
            y = conv[1].inplace_call(z, packed[1], None, residual)
            assert y is residual
        else:
            y = conv[1](z, packed[1], None, residual)
        torch.testing.assert_close(LIB.to_layout(y, blocked=False), expected,
                                   atol=1e-4, rtol=1e-4)

