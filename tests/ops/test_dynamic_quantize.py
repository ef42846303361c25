"""DynamicQuantizeLinear's native kernel (kernels/dynamic_quantize.py): the reference's
bytes, scale and zero point for every input, the reference for NaN, counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper
from ort_compare import assert_matches_ort, make_model

import segflow
from segflow.kernels.choice import KernelKind
from segflow.kernels.dynamic_quantize import DynamicQuantize
from segflow.kernels.native.build import NativeLibrary
from segflow.ops.quant import dynamic_quantize_u8

RNG = np.random.default_rng(5)


def _native() -> DynamicQuantize:
    library, why = NativeLibrary.probe()
    if library is None:
        pytest.skip(f"native kernels {why}")
    return DynamicQuantize(library, why)


def _inputs() -> list[np.ndarray]:
    cases = [RNG.standard_normal((128, 768)), RNG.uniform(2, 9, (3, 77)),     # all positive
             RNG.uniform(-9, -2, (5, 13)), np.zeros((4, 4)), -np.zeros((7,)),   # empty ranges
             RNG.standard_normal(1), RNG.standard_normal(9) * 1e-30,            # tiny values
             RNG.standard_normal((2, 3, 5)) * 3e4]
    # Values at a rounding tie of x / scale: 255 steps over [0, 255], halves between.
    cases.append(np.concatenate([[0.0, 255.0], np.arange(0.5, 255.0, 1.0)]))
    return [c.astype(np.float32) for c in cases]


@pytest.mark.parametrize("index", range(9))
def test_native_equals_the_reference_byte_for_byte(index: int) -> None:
    op = _native()
    x = torch.from_numpy(_inputs()[index])
    got, want = op(x), dynamic_quantize_u8(x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)
    assert op.native_calls == 1 and op.torch_calls == 0


@pytest.mark.parametrize("where", [0, 100, 1027])   # in a vector block, and in the tail
def test_a_nan_takes_the_reference(where: int) -> None:
    op = _native()
    x = torch.from_numpy(RNG.standard_normal(1030).astype(np.float32))
    x[where] = float("nan")
    got, want = op(x), dynamic_quantize_u8(x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w) or (g.is_floating_point() and bool(torch.isnan(g).all()))
    assert op.torch_calls == 1 and op.why_torch == {"a NaN in the input": 1}


def test_a_session_runs_it_natively_and_matches_onnxruntime() -> None:
    x = RNG.standard_normal((6, 50)).astype(np.float32)
    feeds = {"x": x}
    model = make_model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "zp"])],
                       feeds, ["y", "s", "zp"], 11)
    assert_matches_ort(model, feeds)
    sess = segflow.InferenceSession(model)
    assert sess.plan.choices.counts()[KernelKind.NATIVE_DYNAMIC_QUANTIZE] == 1
    sess.run(None, feeds)
    if NativeLibrary.probe()[0] is not None:
        assert "dynamic quantization: 1 node; 1 calls native, 0 through torch" in sess.explain()
