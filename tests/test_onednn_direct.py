"""Tests for kernels/onednn/: convolutions called straight into libdnnl.

Each DirectConv is checked against torch's ``F.conv2d``/``F.conv3d`` (float32,
atol/rtol 1e-4: the same oneDNN kernels, summed in a possibly different order)
and asserted to have run through the library, not through its fallback. The
session-level tests compare whole models with onnxruntime (the repository's
model tests already run every builder model with the direct path on).
"""

from __future__ import annotations

import ctypes
import gc
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import segflow
from concurrency import run_in_threads
from segflow import models
from segflow.frontend.onnx_import import import_model
from segflow.ir.types import Device, DeviceKind
from segflow.kernels import conv as conv_kernels
from segflow.kernels.choice import KernelChoices, KernelKind
from segflow.kernels.onednn import conv as onednn_conv
from segflow.kernels.onednn import geometry as onednn_geometry
from segflow.kernels.onednn import library as onednn_library
from segflow.kernels.onednn import pool as onednn_pool
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.geometry import geometry
from segflow.kernels.onednn.library import Library, onednn_eltwise
from segflow.kernels.onednn.op import DirectKernel, DirectOp
from segflow.kernels.target import CpuTarget
from segflow.ops import fused
from segflow.passes.pack_weights import PackParams, pack_conv
from segflow.passes.pipeline import OptimizeOptions, run_pipeline
from targets import kind

LIB = Library.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"libdnnl {Library.probe()[1]}")
ATOL = RTOL = 1e-4
CPU = Device(DeviceKind.CPU, 0)


class Fallback:
    """Stands in for torch's op and counts the calls that reach it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(1)


def _direct(w: torch.Tensor, x_shape: list[int], *, stride: int = 1, pad: int = 0,
            dilation: int = 1, group: int = 1, eltwise: tuple[int, float, float] | None = None,
            after: Callable[[torch.Tensor], torch.Tensor] | None = None,
            max_shapes: int = 32, max_copies: int = 2) -> tuple[DirectConv, torch.Tensor, Fallback]:
    spatial = w.dim() - 2
    packed = torch.ops.mkldnn._reorder_convolution_weight(
        w, [pad] * spatial, [stride] * spatial, [dilation] * spatial, group, x_shape)
    geo = geometry(list(w.shape), [stride] * spatial, [pad] * spatial, [dilation] * spatial,
                   group)
    fallback = Fallback()
    assert LIB is not None
    conv = DirectConv(LIB, geo, eltwise, after, fallback, max_shapes, max_copies)
    return conv, packed, fallback


ACTS: dict[str, tuple[tuple[str, list[float], str] | None, Callable[..., torch.Tensor]]] = {
    # torch's post-op (name, scalars, algorithm) -> the reference activation
    "none": (None, lambda y: y),
    "relu": (("relu", [], ""), torch.relu),
    "leaky_relu": (("leaky_relu", [0.1], ""), lambda y: F.leaky_relu(y, 0.1)),
    "hardtanh": (("hardtanh", [0.0, 6.0], ""), lambda y: torch.clamp(y, 0.0, 6.0)),
    "sigmoid": (("sigmoid", [], ""), torch.sigmoid),
    "tanh": (("tanh", [], ""), torch.tanh),
    "hardswish": (("hardswish", [], ""), F.hardswish),
    "hardsigmoid": (("hardsigmoid", [], ""), F.hardsigmoid),
    "gelu": (("gelu", [], "none"), F.gelu),
    "gelu_tanh": (("gelu", [], "tanh"), lambda y: F.gelu(y, approximate="tanh")),
}


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("case", [
    # (batch, ic, oc, size, kernel, stride, pad, dilation, group)
    (1, 16, 32, 10, 3, 1, 1, 1, 1),
    (2, 32, 16, 9, 1, 2, 0, 1, 1),
    (1, 24, 24, 12, 3, 1, 2, 2, 1),         # dilated
    (3, 32, 32, 8, 3, 2, 1, 1, 32),        # depthwise
    (1, 16, 32, 7, 3, 1, 1, 1, 4),         # grouped
])
def test_direct_conv_matches_torch(case: tuple[int, ...], act: str):
    n, ic, oc, size, k, stride, pad, dil, group = case
    post, ref_act = ACTS[act]
    torch.manual_seed(0)
    w = torch.randn(oc, ic // group, k, k) * 0.1
    b = torch.randn(oc)
    x = torch.randn(n, ic, size, size).contiguous(memory_format=torch.channels_last)
    conv, packed, fallback = _direct(
        w, list(x.shape), stride=stride, pad=pad, dilation=dil, group=group,
        eltwise=None if post is None else onednn_eltwise(*post))
    y = conv(x, packed, b)
    ref = ref_act(F.conv2d(x, w, b, stride, pad, dil, group))
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=RTOL)
    assert fallback.calls == 0 and conv.direct_layouts == 1
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(conv(x, packed, b), ref, atol=ATOL, rtol=RTOL)  # built once
    assert len(conv.calls) == 1


@pytest.mark.parametrize("inplace", [True, False])
def test_residual_add_then_relu(inplace: bool):
    torch.manual_seed(1)
    w = torch.randn(16, 16, 3, 3) * 0.1
    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    z = torch.randn(2, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    ref = torch.relu(F.conv2d(x, w, None, 1, 1) + z)
    conv, packed, fallback = _direct(w, list(x.shape), pad=1, eltwise=(32, 0.0, 0.0))
    z_before = z.clone()
    y = (conv.inplace_call if inplace else conv)(x, packed, None, z)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=RTOL)
    assert fallback.calls == 0
    if inplace:
        assert y.data_ptr() == z.data_ptr()       # the sum post-op wrote into the residual
    else:
        torch.testing.assert_close(z, z_before, atol=0, rtol=0)


def test_plain_nchw_input_and_an_activation_without_a_post_op():
    # A graph input arrives NCHW: it is converted (oneDNN has only reference kernels
    # for NCHW in, NHWC out). An activation oneDNN cannot fuse runs after the call.
    torch.manual_seed(2)
    w = torch.randn(8, 3, 7, 7) * 0.1
    x = torch.randn(1, 3, 20, 20)
    conv, packed, fallback = _direct(w, list(x.shape), stride=2, pad=3,
                                     after=lambda y: y.mul_(2.0))
    y = conv(x, packed)
    torch.testing.assert_close(y, F.conv2d(x, w, None, 2, 3) * 2.0, atol=ATOL, rtol=RTOL)
    assert fallback.calls == 0
    call = next(iter(conv.calls.values()))
    assert call is not None and call.in_format is torch.channels_last
    assert not call.impl.startswith("ref")


def test_conv3d():
    torch.manual_seed(3)
    w = torch.randn(8, 4, 3, 3, 3) * 0.1
    x = torch.randn(1, 4, 6, 6, 6).contiguous(memory_format=torch.channels_last_3d)
    conv, packed, fallback = _direct(w, list(x.shape), pad=1)
    torch.testing.assert_close(conv(x, packed), F.conv3d(x, w, None, 1, 1), atol=ATOL, rtol=RTOL)
    assert fallback.calls == 0


def test_new_shapes_build_new_primitives_until_max_shapes():
    torch.manual_seed(4)
    w = torch.randn(8, 8, 3, 3) * 0.1
    conv, packed, fallback = _direct(w, [1, 8, 6, 6], pad=1, max_shapes=2)
    for batch in (1, 2):
        x = torch.randn(batch, 8, 6, 6).contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(conv(x, packed), F.conv2d(x, w, None, 1, 1),
                                   atol=ATOL, rtol=RTOL)
    assert fallback.calls == 0 and conv.direct_layouts == 2
    conv(torch.randn(3, 8, 6, 6).contiguous(memory_format=torch.channels_last), packed)
    assert fallback.calls == 1
    assert list(conv.why_not.values()) == ["more than 2 input layouts"]


def test_a_broadcast_residual_falls_back():
    w = torch.randn(8, 8, 1, 1)
    conv, packed, fallback = _direct(w, [1, 8, 4, 4])
    x = torch.randn(1, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    conv(x, packed, None, torch.randn(1, 8, 1, 1))
    assert fallback.calls == 1
    assert list(conv.why_not.values()) == ["residual shape differs from the output's"]


def test_a_weight_format_unlike_torchs_is_copied_at_most_max_copies_times(
        monkeypatch: pytest.MonkeyPatch):
    # Pretend torch's packing never matches, and every shape wants another format.
    monkeypatch.setattr(onednn_conv, "same_bytes", lambda packed, mine: False)
    assert LIB is not None
    monkeypatch.setattr(LIB, "equal", lambda a, b: False)
    torch.manual_seed(5)
    w = torch.randn(8, 8, 3, 3) * 0.1
    conv, packed, fallback = _direct(w, [1, 8, 6, 6], pad=1, max_copies=2)
    for batch in (1, 2, 3):
        x = torch.randn(batch, 8, 6, 6).contiguous(memory_format=torch.channels_last)
        y = conv(x, packed)
        if batch < 3:
            torch.testing.assert_close(y, F.conv2d(x, w, None, 1, 1), atol=ATOL, rtol=RTOL)
    assert len(conv.copies) == 2 and fallback.calls == 1
    assert "own copies" in next(iter(conv.why_not.values()))


def test_same_bytes_compares_torchs_packed_buffer_byte_for_byte():
    packed = torch.ops.mkldnn._reorder_convolution_weight(
        torch.randn(32, 16, 3, 3), [1, 1], [1, 1], [1, 1], 1, [1, 16, 8, 8])
    size = torch.ops.mkldnn._nbytes(packed)
    raw = (ctypes.c_uint8 * size).from_address(torch.ops.mkldnn.data_ptr(packed))
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    assert onednn_geometry.same_bytes(packed, mine)
    flipped = mine.clone()
    flipped[size // 2] ^= 1
    assert not onednn_geometry.same_bytes(packed, flipped)
    assert not onednn_geometry.same_bytes(packed, mine[:-4])


def test_a_different_weight_tensor_goes_to_the_fallback():
    w = torch.randn(8, 8, 3, 3)
    conv, packed, fallback = _direct(w, [1, 8, 5, 5], pad=1)
    x = torch.randn(1, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    conv(x, packed)
    other = torch.ops.mkldnn._reorder_convolution_weight(w, [1, 1], [1, 1], [1, 1], 1,
                                                         [1, 8, 5, 5])
    conv(x, other)
    assert fallback.calls == 1


def test_concurrent_calls_on_one_convolution():
    torch.manual_seed(7)
    w = torch.randn(16, 16, 3, 3) * 0.1
    conv, packed, _ = _direct(w, [1, 16, 10, 10], pad=1)
    inputs = [torch.randn(1, 16, 10, 10).contiguous(memory_format=torch.channels_last)
              for _ in range(4)]
    refs = [F.conv2d(x, w, None, 1, 1) for x in inputs]
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(50):
            y = conv(inputs[i], packed)
            if not torch.allclose(y, refs[i], atol=ATOL, rtol=RTOL):
                errors.append(f"thread {i}")

    run_in_threads(work, 4)
    assert errors == []


def test_oneDNN_objects_are_freed_with_the_convolution():
    w = torch.randn(8, 8, 3, 3)
    conv, packed, _ = _direct(w, [1, 8, 5, 5], pad=1)
    conv(torch.randn(1, 8, 5, 5).contiguous(memory_format=torch.channels_last), packed)
    owned = conv._owned
    assert any(kind == "primitive" for kind, _ in owned)
    del conv
    gc.collect()
    assert owned == []


def test_eltwise_table_covers_every_fusable_activation():
    for name, act in fused.ACTIVATIONS.items():
        params = {"Clip": [0.0, 6.0], "LeakyRelu": [0.1], "HardSigmoid": [1 / 6, 0.5],
                  "Swish": [1.0]}.get(
            name, [])
        post = act.onednn(params)
        if post is not None and post[0] != "none":
            assert onednn_eltwise(*post) is not None, name


def test_library_not_found_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("SEGFLOW_DNNL_LIBRARY", str(tmp_path / "libdnnl.so.3"))
    lib, why = Library.find()
    assert lib is None and "pip install onednn-cpu-gomp" in why


def test_the_system_search_runs_only_when_the_wheels_library_is_absent(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``ctypes.util.find_library`` runs ``ldconfig`` and a compiler (~20 ms of a cold
    start): the library search asks it only after the environment's own file."""
    asked: list[str] = []
    monkeypatch.setattr(onednn_library.ctypes.util, "find_library",
                        lambda name: asked.append(name) or "libdnnl.so.3")
    monkeypatch.delenv("SEGFLOW_DNNL_LIBRARY", raising=False)
    candidates = onednn_library._library_candidates()
    assert next(candidates) == str(Path(sys.prefix) / "lib" / "libdnnl.so.3")
    assert asked == []
    assert list(candidates)[-1] == "libdnnl.so.3" and asked == ["dnnl"]
    lib, _ = Library.find()
    if lib is not None and lib.path.startswith(sys.prefix):
        assert asked == ["dnnl"]   # found in the environment: no second search


def _resnet18_log(env: dict[str, str]) -> tuple[list[str], Any, KernelChoices]:
    graph = import_model(models.build("resnet18", num_classes=10, image_size=32))
    result = run_pipeline(graph, OptimizeOptions.resolve(compile="codegen", env=env),
                          device=CPU)
    return list(result.log), graph, result.choices


def test_layout_marks_convolutions_direct_and_the_option_turns_it_off():
    log, graph, choices = _resnet18_log({})
    convs = [n for n in graph.nodes if n.op_type == "FusedConv"]
    assert all(choices.calls_libdnnl(n) for n in convs)
    assert "direct calls into oneDNN" in log[4]
    log, graph, choices = _resnet18_log({"SEGFLOW_ONEDNN_DIRECT": "0"})
    assert not any(choices.calls_libdnnl(n) for n in graph.nodes)
    assert {choices.kind(n) for n in convs if n in choices} <= {KernelKind.ONEDNN_CONV}
    assert log[4] == "layout: prepacked for oneDNN: 20 convolutions (channels_last)"


@pytest.mark.parametrize("name,options", [("resnet18", {"image_size": 48}),
                                          ("mobilenet_v2", {"image_size": 64})])
@pytest.mark.parametrize("batch", [1, 3])
def test_models_match_onnxruntime_with_direct_calls(name: str, options: dict[str, int],
                                                    batch: int):
    model = models.build(name, **options)
    feeds = models.example_inputs(name, batch_size=batch, **options)
    sess = segflow.InferenceSession(model.SerializeToString(), compile="codegen")
    assert "direct calls into oneDNN" in sess.explain()
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    for _ in range(2):
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("shape,input_size", [
    ((1024, 256, 1, 1), (1, 256, 14, 14)),    # ResNet-50's: torch's batch-1 packing differs here
    ((64, 64, 3, 3), (1, 64, 56, 56)),
    ((32, 1, 3, 3), (1, 32, 28, 28)),         # depthwise
])
def test_layout_packs_a_direct_convolution_once_in_libdnnl_format(monkeypatch, shape,
                                                                   input_size):
    torch.manual_seed(8)
    dense = torch.randn(*shape)
    group = input_size[1] // shape[1]
    k = shape[-1]
    params = PackParams((k // 2,) * 4, (1, 1), (1, 1), group, input_size)
    assert LIB is not None
    geo = geometry(shape, (1, 1), (k // 2,) * 2, (1, 1), group)
    wanted = LIB.preferred_weight(dense, geo, input_size)

    def no_torch_packing(*args: Any) -> torch.Tensor:
        raise AssertionError("packed with torch too")
    with monkeypatch.context() as patch:
        patch.setattr(torch.ops.mkldnn, "_reorder_convolution_weight", no_torch_packing)
        packed, packed_for, verified, libdnnl_bytes = pack_conv(dense, params, CpuTarget.detect())
    assert libdnnl_bytes and packed_for == verified == input_size
    assert torch.equal(packed, wanted)
    torch.testing.assert_close(LIB.unpack_weight(packed, geo, input_size).reshape(shape),
                               dense)
    # Without libdnnl the weight is torch's packing, for torch's oneDNN op.
    packed, packed_for, verified, libdnnl_bytes = pack_conv(dense, params, None)
    assert packed.is_mkldnn and not libdnnl_bytes and verified is None
    torch.testing.assert_close(packed.to_dense(), dense)


def test_a_verified_torch_packing_is_read_without_comparing_bytes(
        monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(9)
    # DirectConv still reads torch's packing in place where told its bytes are libdnnl's
    # format for a size. ResNet-50's 3x3 convolutions; which formats the two libraries
    # agree on depends on the CPU (on the AMD EPYC CI machine: all of these).
    assert LIB is not None
    for channels, side in ((64, 56), (128, 28), (256, 14), (512, 7)):
        dense = torch.randn(channels, channels, 3, 3) * 0.1
        size = (1, channels, side, side)
        packed = torch.ops.mkldnn._reorder_convolution_weight(
            dense, [1, 1], [1, 1], [1, 1], 1, list(size))
        geo = geometry(dense.shape, (1, 1), (1, 1), (1, 1), 1)
        if onednn_geometry.same_bytes(packed, LIB.preferred_weight(dense, geo, size)):
            break
    else:
        pytest.skip("no torch packing of these weights is libdnnl's format on this CPU")

    def no_dense_copy(*args: Any) -> torch.Tensor:
        raise AssertionError("compared bytes although the weight was verified")
    monkeypatch.setattr(onednn_conv, "reorder_weight", no_dense_copy)
    conv = DirectConv(LIB, geo, None, None, Fallback(), 32, 2, list(size))
    x = torch.randn(*size).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(conv(x, packed), F.conv2d(x, dense, None, 1, 1),
                               atol=ATOL, rtol=RTOL)
    assert conv.direct_layouts == 1 and conv.copies == []


def _libdnnl_packed(w: torch.Tensor, size: list[int], pad: int) -> tuple[Any, torch.Tensor]:
    assert LIB is not None
    geo = geometry(list(w.shape), (1, 1), (pad, pad), (1, 1), 1)
    return geo, LIB.preferred_weight(w, geo, size)


def test_a_weight_in_libdnnl_packing_is_read_in_place(monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(10)
    w = torch.randn(16, 8, 3, 3) * 0.1
    size = [1, 8, 10, 10]
    geo, packed = _libdnnl_packed(w, size, 1)
    assert packed.dtype == torch.uint8

    def no_copy(*args: Any) -> torch.Tensor:
        raise AssertionError("made an own copy of a weight already in libdnnl's packing")
    monkeypatch.setattr(onednn_conv, "reorder_weight", no_copy)
    assert LIB is not None
    fallback = Fallback()
    conv = DirectConv(LIB, geo, None, None, fallback, 32, 2, size, libdnnl_packed=True)
    x = torch.randn(*size).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(conv(x, packed), F.conv2d(x, w, None, 1, 1),
                               atol=ATOL, rtol=RTOL)
    assert conv.direct_layouts == 1 and conv.copies == [] and fallback.calls == 0


def test_a_libdnnl_packed_weight_in_another_format_is_copied_from_its_values(
        monkeypatch: pytest.MonkeyPatch):
    # Pretend another input size wants another format: the copy is made from the
    # values the packed bytes hold, not from the bytes as they are.
    torch.manual_seed(11)
    w = torch.randn(16, 8, 3, 3) * 0.1
    size = [1, 8, 10, 10]
    geo, packed = _libdnnl_packed(w, size, 1)
    assert LIB is not None
    monkeypatch.setattr(LIB, "equal", lambda a, b: False)
    conv = DirectConv(LIB, geo, None, None, Fallback(), 32, 2, size, libdnnl_packed=True)
    x = torch.randn(2, 8, 10, 10).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(conv(x, packed), F.conv2d(x, w, None, 1, 1),
                               atol=ATOL, rtol=RTOL)
    assert len(conv.copies) == 1


def test_a_libdnnl_packed_weight_needs_its_input_size():
    assert LIB is not None
    geo = geometry([4, 4, 1, 1], (1, 1), (0, 0), (1, 1), 1)
    with pytest.raises(ValueError, match="input size"):
        DirectConv(LIB, geo, None, None, Fallback(), 32, 2, None, libdnnl_packed=True)


def test_torch_packing_is_made_once_from_libdnnl_bytes_for_a_fallback():
    torch.manual_seed(12)
    w = torch.randn(16, 8, 3, 3) * 0.1
    size = [1, 8, 10, 10]
    geo, packed = _libdnnl_packed(w, size, 1)
    spec = fused.ConvSpec(2, [1, 1], [1, 1], [], [1, 1], 1, False, False)
    make = conv_kernels.TorchPacking(spec, geo, size, lib=LIB)
    theirs = make(packed)
    assert theirs.is_mkldnn and make(packed) is theirs
    torch.testing.assert_close(theirs.to_dense(), w)
    x = torch.randn(*size).contiguous(memory_format=torch.channels_last)
    fallback = conv_kernels.onednn_conv_callable(spec, fused.ACTIVATIONS[""], [], False,
                                                 conv_kernels.WeightForInput(spec, size, make),
                                           ("none", [], ""))
    torch.testing.assert_close(fallback(x, packed, None), F.conv2d(x, w, None, 1, 1),
                               atol=ATOL, rtol=RTOL)


def test_models_match_onnxruntime_with_every_weight_in_libdnnl_packing(
        monkeypatch: pytest.MonkeyPatch):
    # Every direct convolution keeps libdnnl's own packing, reads it in place and holds
    # no copy of its weight. (Without Winograd, whose convolutions hold its transform
    # instead: tests/test_winograd.py.)
    monkeypatch.setenv("SEGFLOW_WINOGRAD", "0")
    options = {"image_size": 48}
    model = models.build("resnet18", **options)
    feeds = models.example_inputs("resnet18", batch_size=1, **options)
    sess = segflow.InferenceSession(model.SerializeToString(), compile="codegen")
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    for _ in range(2):
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=1e-4, rtol=1e-3)
    convs = [op for _, op in sess._executor.kernel_ops if isinstance(op, DirectConv)]
    assert len(convs) == 20 and all(c.libdnnl_packed for c in convs)
    assert all(c.copies == [] and c.direct_layouts == 1 for c in convs)
    # Another batch size: a new primitive per convolution, still correct.
    feeds = models.example_inputs("resnet18", batch_size=3, **options)
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=1e-4, rtol=1e-3)


def test_a_float64_input_falls_back_without_hiding_float32_calls_of_that_shape():
    w = torch.randn(8, 8, 3, 3)
    conv, packed, fallback = _direct(w, [1, 8, 5, 5], pad=1)
    x = torch.randn(1, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    conv(x.double(), packed)
    assert fallback.calls == 1
    torch.testing.assert_close(conv(x, packed), F.conv2d(x, w, None, 1, 1), atol=ATOL, rtol=RTOL)
    assert fallback.calls == 1 and conv.direct_layouts == 1


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_1x1_spatial_input_runs_direct(batch: int, inplace: bool):
    # A squeeze-excitation conv reads [N, C, 1, 1]: torch gives it NCHW strides although it
    # is channels-last too; with those oneDNN has only its reference kernel.
    torch.manual_seed(10)
    w = torch.randn(8, 16, 1, 1)
    x = torch.randn(batch, 16, 1, 1)
    z = torch.randn(batch, 8, 1, 1)
    ref = torch.sigmoid(F.conv2d(x, w) + z)
    conv, packed, fallback = _direct(w, list(x.shape), eltwise=(41, 0.0, 0.0))
    call = conv.inplace_call if inplace else conv
    torch.testing.assert_close(call(x, packed, None, z.clone()), ref, atol=ATOL, rtol=RTOL)
    assert fallback.calls == 0 and conv.why_not == {}


@pytest.mark.parametrize("engine", ["inline", "threaded"])
def test_concurrent_runs_of_one_session_match_onnxruntime(engine: str):
    model = models.build("resnet18", image_size=32).SerializeToString()
    sess = segflow.InferenceSession(model, engine=engine)
    oracle = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    errors: list[str] = []

    def work(seed: int) -> None:
        feeds = models.example_inputs("resnet18", batch_size=1 + seed, image_size=32, seed=seed)
        ref = oracle.run(None, feeds)[0]
        for _ in range(5):
            out = sess.run(None, feeds)[0]
            if not np.allclose(out, ref, atol=1e-4, rtol=1e-3):
                errors.append(f"seed {seed}: max error {np.abs(out - ref).max()}")

    run_in_threads(work, 3)
    assert errors == []


# -- max pooling ---------------------------------------------------------------------------
def _pool(kernel: list[int], strides: list[int], dilations: list[int], begin: list[int],
          end: list[int], *, ceil_mode: bool = False,
          destination: Callable[[], torch.Tensor | None] | None = None
          ) -> tuple[onednn_pool.DirectPool, Fallback]:
    fallback = Fallback()
    assert LIB is not None
    pool = onednn_pool.DirectPool(
        LIB, onednn_library.POOL_MAX, lambda x: (kernel, strides, dilations, begin, end),
        ceil_mode, fallback, 32, destination)
    return pool, fallback


def _torch_max_pool(x: torch.Tensor, kernel: list[int], strides: list[int],
                    dilations: list[int], begin: list[int], end: list[int]) -> torch.Tensor:
    pad = [p for b, e in zip(reversed(begin), reversed(end)) for p in (b, e)]
    padded = F.pad(x, pad, value=-float("inf"))
    fn = F.max_pool2d if x.dim() == 4 else F.max_pool3d
    return fn(padded, kernel, strides, 0, dilations)


@pytest.mark.parametrize("case", [
    # kernel, strides, dilations, begin pads, end pads, input shape
    ([3, 3], [2, 2], [1, 1], [1, 1], [1, 1], [1, 16, 28, 28]),   # ResNet's stem pool
    ([2, 2], [2, 2], [1, 1], [0, 0], [0, 0], [2, 8, 9, 9]),
    ([3, 3], [1, 1], [1, 1], [2, 2], [2, 2], [1, 8, 10, 10]),     # pads up to the kernel
    ([3, 2], [1, 2], [1, 1], [0, 1], [1, 0], [3, 5, 7, 6]),       # asymmetric pads
    ([2, 2, 2], [2, 2, 2], [1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 4, 6, 6, 6]),
])
def test_direct_max_pool_matches_torch(case):
    kernel, strides, dilations, begin, end, shape = case
    layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = torch.randn(shape).contiguous(memory_format=layout)
    pool, fallback = _pool(kernel, strides, dilations, begin, end)
    got = pool(x)
    assert fallback.calls == 0 and pool.why_not == {} and pool.direct_layouts == 1
    assert got.is_contiguous(memory_format=layout)
    torch.testing.assert_close(got, _torch_max_pool(x, kernel, strides, dilations, begin, end),
                               atol=0, rtol=0)


@pytest.mark.parametrize("why,x,ceil_mode", [
    ("not a channels-last float32 input", torch.randn(1, 8, 8, 8), False),
    ("not a channels-last float32 input",
     torch.randn(1, 8, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last),
     False),
    ("ceil_mode", torch.randn(1, 8, 8, 8).contiguous(memory_format=torch.channels_last), True),
])
def test_direct_max_pool_falls_back(why: str, x: torch.Tensor, ceil_mode: bool):
    pool, fallback = _pool([2, 2], [2, 2], [1, 1], [0, 0], [0, 0], ceil_mode=ceil_mode)
    pool(x)
    assert fallback.calls == 1 and list(pool.why_not.values()) == [why]


def test_a_dilated_max_pool_has_only_a_reference_kernel_and_falls_back():
    x = torch.randn(1, 8, 10, 10).contiguous(memory_format=torch.channels_last)
    pool, fallback = _pool([3, 3], [1, 1], [2, 2], [2, 2], [2, 2])
    pool(x)
    assert fallback.calls == 1
    assert list(pool.why_not.values())[0].startswith("only a reference implementation")


def test_direct_max_pool_writes_into_the_given_storage_when_it_fits():
    x = torch.randn(1, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    given = torch.full((1, 8, 4, 4), 7.0).contiguous(memory_format=torch.channels_last)
    pool, _ = _pool([2, 2], [2, 2], [1, 1], [0, 0], [0, 0], destination=lambda: given)
    got = pool(x)
    assert got is given
    torch.testing.assert_close(got, F.max_pool2d(x, 2, 2), atol=0, rtol=0)
    wrong = torch.empty(1, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    pool, _ = _pool([2, 2], [2, 2], [1, 1], [0, 0], [0, 0], destination=lambda: wrong)
    assert pool(x) is not wrong


def test_a_conv_copies_a_plain_input_into_the_staging_storage():
    w = torch.randn(8, 3, 3, 3)
    conv, packed, fallback = _direct(w, [1, 3, 10, 10], pad=1)
    staged = torch.empty(1, 3, 10, 10).contiguous(memory_format=torch.channels_last)
    conv.staging = lambda: staged
    x = torch.randn(1, 3, 10, 10)
    got = conv(x, packed)
    torch.testing.assert_close(staged, x)           # the channels-last copy went there
    torch.testing.assert_close(got, F.conv2d(x, w, padding=1), atol=ATOL, rtol=RTOL)
    assert fallback.calls == 0


@pytest.mark.parametrize("algorithm,reference", [
    ("POOL_AVG_EXCLUDE_PADDING", lambda x: x.mean((2, 3), keepdim=True)),
    ("POOL_MAX", lambda x: x.amax((2, 3), keepdim=True)),
])
@pytest.mark.parametrize("shape", [[1, 2048, 7, 7], [3, 16, 5, 4]])
def test_direct_global_pooling_matches_torch(algorithm: str, reference: Any, shape: list[int]):
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    fallback = Fallback()
    assert LIB is not None
    pool = onednn_pool.DirectPool(
        LIB, getattr(onednn_library, algorithm),
        lambda x: (list(x.shape[2:]), [1, 1], [1, 1], [0, 0], [0, 0]), False, fallback, 32)
    got = pool(x)
    assert fallback.calls == 0 and got.shape == (shape[0], shape[1], 1, 1)
    torch.testing.assert_close(got, reference(x), atol=1e-6, rtol=1e-5)


def test_layout_marks_the_pools_after_a_direct_convolution():
    log, graph, choices = _resnet18_log({})
    pools = [n for n in graph.nodes if n.op_type in ("MaxPool", "GlobalAveragePool")]
    assert len(pools) == 2
    assert all(choices.kind(n) is KernelKind.DIRECT_POOL for n in pools)
    assert "(and 2 poolings)" in log[4]
    _, graph, choices = _resnet18_log({"SEGFLOW_ONEDNN_DIRECT": "0"})
    assert not any(choices.calls_libdnnl(n) for n in graph.nodes)


@pytest.mark.parametrize("prebuild", [True, False])
def test_explain_counts_direct_kernels_and_names_each_fallback(
        prebuild: bool, monkeypatch: pytest.MonkeyPatch):
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((8, 8, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[3, 3],
                              dilations=[2, 2], pads=[2, 2, 2, 2])]   # dilated: no jit kernel
    shape = [1, 8, 10, 10]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                         shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    monkeypatch.setenv("SEGFLOW_PREBUILD", "1" if prebuild else "0")
    sess = segflow.InferenceSession(model.SerializeToString())
    if prebuild:   # built while loading: the pooling's refusal is known before any run
        lines = sess.explain().splitlines()
        at = lines.index("direct kernels (libdnnl): 1 convolution, 1 pooling; 1 input "
                         "layout built, 1 fell back to torch")
        assert re.fullmatch(r"  prebuilt: 1 input layout built while loading \(\d+ ms\); "
                            r"1 kernels left to their first run", lines[at + 1])
    else:
        assert ("direct kernels (libdnnl): 1 convolution, 1 pooling; no input layout built "
                "yet (each is built at its first run)") in sess.explain()
    feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref, atol=1e-4, rtol=1e-3)
    lines = sess.explain().splitlines()
    assert ("direct kernels (libdnnl): 1 convolution, 1 pooling; 1 input layout built, "
            "1 fell back to torch") in lines
    fallback = next(line for line in lines if line.startswith("  fallback: "))
    assert "MaxPool" in fallback and "[1, 8, 10, 10] torch.float32" in fallback
    assert "only a reference implementation" in fallback


def test_generated_code_calls_the_kernels_own_direct_convolution():
    model = models.build("resnet18", image_size=32)
    sess = segflow.InferenceSession(model.SerializeToString(), compile="codegen")
    sess.run(None, models.example_inputs("resnet18", batch_size=1, image_size=32))
    ops = [op for _, op in sess._executor.kernel_ops if isinstance(op, DirectOp)]
    # Every primitive was built by the op the kernel holds: none by a second copy.
    assert sum(op.direct_layouts for op in ops) == len(ops) == 22


@pytest.mark.parametrize("engine", ["inline", "threaded"])
def test_the_interpreter_and_profiled_runs_add_residuals_in_place_like_codegen(engine: str):
    """ResNet-18's 8 residual convolutions overwrite their dying residual (oneDNN's sum
    post-op) under compile="none" and in profiled runs too, not only in generated code."""
    from segflow.kernels.onednn.op import ResidualInPlaceKernel

    model = models.build("resnet18", image_size=48)
    feeds = models.example_inputs("resnet18", batch_size=2, image_size=48)
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    sess = segflow.InferenceSession(model, compile="none", engine=engine)
    steps = [step for task in sess._executor.tasks for step in task.steps]
    in_place = [s for s in steps if isinstance(s.kernel, ResidualInPlaceKernel)]
    assert len(in_place) == 8
    assert all(len(s.node.inputs) == 4 and s.node.inputs[3] is not None for s in in_place)
    for _ in range(2):
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref, atol=1e-4, rtol=1e-3)
    with segflow.profile():
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref, atol=1e-4, rtol=1e-3)


def test_a_residual_that_is_read_later_is_not_overwritten():
    # y = relu(conv(x) + r) where r is also a graph output: the plan pins r, so the
    # convolution adds it with a binary post-op and r comes back intact.
    from onnx import TensorProto, helper, numpy_helper

    from segflow.kernels.onednn.op import ResidualInPlaceKernel

    w = numpy_helper.from_array((np.random.default_rng(1).standard_normal((8, 8, 3, 3)) * 0.1)
                                .astype(np.float32), "w")
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Conv", ["r", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "r"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 8, 6, 6])
            for n in ("x", "y", "r")]
    graph = helper.make_graph(nodes, "g", [info[0]], [info[1], info[2]], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 8, 6, 6)).astype(np.float32)}
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = segflow.InferenceSession(model, compile="none")
    steps = [step for task in sess._executor.tasks for step in task.steps]
    (conv,) = [s for s in steps if s.node.op_type == "FusedConv"]
    assert len(conv.node.inputs) == 4 and conv.node.inputs[3] is not None  # residual fused
    assert isinstance(conv.kernel, DirectKernel)   # over libdnnl, but not in place
    assert not any(isinstance(s.kernel, ResidualInPlaceKernel) for s in steps)
    for got, want in zip(sess.run(None, feeds), ref):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_a_call_repoints_the_memories_only_where_the_address_changed(
        monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(13)
    w = torch.randn(8, 8, 3, 3) * 0.1
    conv, packed, _ = _direct(w, [1, 8, 6, 6], pad=1)
    assert LIB is not None
    pointed: list[int] = []
    set_handle = LIB.set_handle

    def counting(memory: Any, address: int) -> int:
        pointed.append(address)
        return int(set_handle(memory, address))
    monkeypatch.setattr(LIB, "set_handle", counting)
    xs = [torch.randn(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
          for _ in range(2)]
    out = torch.empty(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    conv.destination = lambda: out          # the same planned storage every call
    for x in (xs[0], xs[0], xs[1], xs[0]):
        torch.testing.assert_close(conv(x, packed).clone(), F.conv2d(x, w, None, 1, 1),
                                   atol=ATOL, rtol=RTOL)
    # src and dst at the first call; src again at each change of input only.
    assert pointed == [xs[0].data_ptr(), out.data_ptr(), xs[1].data_ptr(), xs[0].data_ptr()]


@pytest.mark.parametrize("winograd", ["0", "1"])
def test_a_weight_two_convolutions_share_is_released_after_its_last_reader(
        monkeypatch: pytest.MonkeyPatch, winograd: str):
    # The layout pass frees each dense weight as soon as its last reader has the packed
    # (or transformed) one. A weight read twice must survive the first of its readers.
    from onnx import TensorProto, helper, numpy_helper
    monkeypatch.setenv("SEGFLOW_WINOGRAD", winograd)
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((16, 16, 3, 3)) / 12).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["a"], kernel_shape=[3, 3], pads=[1] * 4),
         helper.make_node("Relu", ["a"], ["b"]),
         helper.make_node("Conv", ["b", "w"], ["c"], kernel_shape=[3, 3], pads=[1] * 4),
         helper.make_node("Conv", ["c", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4,
                          strides=[2, 2])],
        "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = segflow.InferenceSession(model.SerializeToString(), compile="codegen")
    feeds = {"x": rng.standard_normal((1, 16, 12, 12)).astype(np.float32)}
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=1e-4, rtol=1e-3)
    convs = [n for n in sess.graph.nodes if n.op_type == "FusedConv"]
    assert len(convs) == 3 and "w" not in sess.graph.initializers
    assert all(n.inputs[1] is not None and n.inputs[1].const is not None for n in convs)
    # The two stride-1 convolutions share one transformed (or packed) weight.
    assert convs[0].inputs[1] is convs[1].inputs[1]
    assert (kind(sess, convs[0]) is KernelKind.WINOGRAD) is (winograd == "1")
    assert kind(sess, convs[2]) is not KernelKind.WINOGRAD        # stride 2: packed


def test_the_preferred_weight_format_is_asked_of_libdnnl_once_per_geometry(
        monkeypatch: pytest.MonkeyPatch):
    lib = Library.load()
    assert lib is not None
    asked = []
    convolution = Library.convolution

    def counting(self: Library, *args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("create", True))
        return convolution(self, *args, **kwargs)

    monkeypatch.setattr(Library, "convolution", counting)
    spec = onednn_geometry.geometry([24, 40, 3, 3], (1, 1), (1, 1), (1, 1), 1)
    first = lib.preferred_desc(spec, [1, 40, 13, 11])
    second = lib.preferred_desc(spec, [1, 40, 13, 11])
    other = lib.preferred_desc(spec, [2, 40, 13, 11])
    assert asked == [False, False]              # the second answer was kept
    assert first.value != second.value          # each caller owns (destroys) its copy
    assert lib.equal(first, second)
    lib.destroy([("memory_desc", md) for md in (first, second, other)])
    # The kept answer outlives the copies: a weight packed with it unpacks exactly.
    dense = torch.randn(24, 40, 3, 3)
    packed = lib.preferred_weight(dense, spec, [1, 40, 13, 11])
    torch.testing.assert_close(lib.unpack_weight(packed, spec, [1, 40, 13, 11]), dense,
                               atol=0, rtol=0)
    assert asked == [False, False]


def test_a_vendored_libgomp_leaves_libdnnl_on() -> None:
    # scikit-learn's wheel ships its own libgomp under a hashed name; importing it before
    # segflow maps a second libgomp file into the process that nothing else binds to.
    import subprocess

    probe = ("from segflow.kernels.onednn.library import Library; "
             "print(Library.probe()[0] is not None)")
    alone = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=120)
    if alone.stdout.strip() != "True":
        pytest.skip("libdnnl is not used in this environment")
    after = subprocess.run([sys.executable, "-c", "import sklearn.tree; " + probe],
                           capture_output=True, text=True, timeout=120)
    assert after.stdout.strip() == "True", after.stderr
