"""Tests for NativeLinear (kernels/linear.py, kernels/native/gemm.c): large linears over
a weight the layout pass packs into panels of 24 output columns (48 in an AVX-512
build).

Numerics are checked against ``F.linear`` on the dense weight (float32: atol/rtol 1e-4
for sums of up to ~1000 products of unit-scale values) and, at session level, against
onnxruntime. The kernel's edges are exercised on purpose: row counts that are not a
multiple of its 4- or 8-row block, output widths that are not a multiple of its 24- or
48-column panel, and input widths above and between its 384-column blocks. Whether the
layout pass chooses this path depends on the build (``native_linear_preferred``: AVX2
+ FMA); the tests that need one choice or the other set it.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import segflow
from concurrency import on_one_and_more_threads, runs_match_in_threads
from linear_model import linear_model, session_switched_off
from segflow.kernels.choice import KernelKind
from segflow.kernels.linear import (
    NativeLinear,
    kernel_activation,
    pack,
    packed_size,
    panel_width,
    unpack,
)
from segflow.kernels.native.build import NativeLibrary
from segflow.ops import fused
from targets import as_cpu, choice, kind

LIB, WHY = NativeLibrary.probe()
P = panel_width(LIB) if LIB is not None else 24   # output columns per panel
pytestmark = pytest.mark.skipif(LIB is None, reason=f"native kernels {WHY}")
ATOL = RTOL = 1e-4
RNG = np.random.default_rng(0)


def _op(w: torch.Tensor, act: str = "", params: tuple[float, ...] = (0.0, 0.0)
        ) -> tuple[NativeLinear, torch.Tensor]:
    assert LIB is not None
    activation = fused.ACTIVATIONS[act]
    kernel_act = kernel_activation(act, params)
    after = None
    if act and kernel_act is None:
        def after(y: torch.Tensor) -> torch.Tensor:
            return activation.apply(y, params)
    n, k = w.shape
    op = NativeLinear(LIB, k, n, kernel_act, after, lambda y: activation.apply(y, params))
    return op, pack(LIB, w)


@pytest.mark.parametrize("n,k", [(1, 1), (23, 5), (24, 384), (25, 385), (47, 9), (48, 800),
                                 (49, 383), (100, 1000)])
def test_pack_pads_panels_with_zeros_and_unpacks_to_the_same_bits(n, k):
    assert LIB is not None
    w = torch.randn(n, k)
    packed = pack(LIB, w)
    assert P in (24, 48)
    panels = math.ceil(n / P)
    assert packed.shape == (panels * P * k,) == (packed_size(LIB, n, k),)
    # Panel p, column j holds row P p + j of W along k; the rows past n are zeros.
    rows = packed.reshape(panels, k, P).permute(0, 2, 1).reshape(panels * P, k)
    assert torch.equal(rows[:n], w) and not rows[n:].any()
    assert torch.equal(unpack(LIB, packed, n, k), w)
    # A strided (transposed) weight packs the same: the transpose of a [K, N] matrix
    # (a MatMul's weight) is copied from by rows, with or without a row stride past N.
    assert torch.equal(pack(LIB, w.t().contiguous().t()), packed)
    wider = torch.randn(k, n + 5)
    wider[:, :n] = w.t()
    assert torch.equal(pack(LIB, wider[:, :n].t()), packed)
    assert torch.equal(pack(LIB, w[:, ::2]), pack(LIB, w[:, ::2].contiguous()))
    # Each output's largest |W|, taken while packing by either path; NaN where it has one.
    w[n // 2, k // 3] = math.nan
    want = w.abs().amax(dim=1)
    for dense in (w, w.t().contiguous().t()):
        top = torch.empty(n)
        pack(LIB, dense, top)
        torch.testing.assert_close(top, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 15, 128, 130])
@pytest.mark.parametrize("n,k", [(1, 3), (23, 64), (24, 384), (50, 385), (97, 96),
                                 (1000, 800)])
def test_matches_f_linear_at_every_edge_of_the_blocking(rows, n, k):
    w = torch.randn(n, k) / math.sqrt(k)
    b = torch.randn(n)
    op, packed = _op(w)
    x = torch.randn(rows, k)
    torch.testing.assert_close(op(x, packed, b), F.linear(x, w, b), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(op(x, packed, None), F.linear(x, w), atol=ATOL, rtol=RTOL)
    assert op.native_calls == 2 and op.torch_calls == 0


@pytest.mark.parametrize("act,params", [("Relu", (0.0, 0.0)), ("LeakyRelu", (0.1, 0.0)),
                                        ("Clip", (-0.5, 0.25)), ("Clip", (0.0, math.inf)),
                                        ("LeakyRelu", (1.5, 0.0)), ("Sigmoid", (0.0, 0.0)),
                                        ("Gelu", (0.0, 0.0)), ("GeluTanh", (0.0, 0.0))])
def test_activations_fused_or_applied_after(act, params):
    w = torch.randn(72, 800) / math.sqrt(800)
    b = torch.randn(72)
    op, packed = _op(w, act, params)
    x = torch.randn(9, 800)
    want = fused.ACTIVATIONS[act].apply(F.linear(x, w, b), params)
    torch.testing.assert_close(op(x, packed, b), want, atol=ATOL, rtol=RTOL)
    # ReLU, LeakyReLU with a slope in [0, 1], Clip and erf-GELU are the kernel's; the
    # rest (tanh-GELU too) run after.
    assert (op.after is None) == (act in ("Relu", "Clip", "Gelu") or (act == "LeakyRelu"
                                                                      and params[0] <= 1))


def test_nan_stays_nan_through_the_fused_activations():
    w = torch.randn(24, 16)
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    for act, params in (("Relu", (0.0, 0.0)), ("LeakyRelu", (0.2, 0.0)), ("Clip", (-1.0, 1.0))):
        op, packed = _op(w, act, params)
        y = op(x, packed, None)
        assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2, 3]]).any()


def test_fused_gelu_is_within_its_stated_bound_of_the_exact_function():
    # A zero weight makes each output its bias, so the kernel's GELU is applied to
    # chosen values: a dense sweep over [-12, 12] against float64, and the edges: 0 for a
    # large negative x, x for a large positive one, NaN for -inf and NaN.
    n = 48
    op, packed = _op(torch.zeros(n, 8), "Gelu")
    assert op.after is None
    sweep = torch.linspace(-12.0, 12.0, 96_000)
    got = torch.cat([op(torch.zeros(1, 8), packed, b)[0] for b in sweep.split(n)])
    exact = F.gelu(sweep.double())
    assert (got.double() - exact).abs().max().item() < 1.2e-6
    special = torch.tensor([-math.inf, math.inf, math.nan, -1e30, 1e30, -1000.0, -6.0,
                            -5.5, -0.0, 0.0, 1e-30, -1e-30, 5.5, 6.0, 3.4e38]
                           + [0.0] * (n - 15))
    got = op(torch.zeros(1, 8), packed, special)[0]
    # Against the float64 GELU: torch's float32 one is the CPU's (its AVX-512 kernel
    # gives NaN for +inf and overflows to inf at 3.4e38).
    torch.testing.assert_close(got, F.gelu(special.double()).float(), atol=2e-7, rtol=1e-6,
                               equal_nan=True)
    assert got[0].isnan() and got[2].isnan() and got[1] == math.inf
    assert (got[[3, 5, 6]] == 0.0).all() and got[4] == 1e30 and got[14] == special[14]


def test_inputs_of_any_rank_and_row_stride():
    w = torch.randn(96, 384) / 20
    b = torch.randn(96)
    op, packed = _op(w, "Relu")
    x3 = torch.randn(2, 33, 384)
    torch.testing.assert_close(op(x3, packed, b), torch.relu(F.linear(x3, w, b)),
                               atol=ATOL, rtol=RTOL)
    wide = torch.randn(10, 500)
    rows = wide[:, 7:391]             # rows 500 floats apart: read in place
    torch.testing.assert_close(op(rows, packed, b), torch.relu(F.linear(rows, w, b)),
                               atol=ATOL, rtol=RTOL)
    columns = torch.randn(384, 6).t()  # columns not contiguous: copied first
    torch.testing.assert_close(op(columns, packed, b), torch.relu(F.linear(columns, w, b)),
                               atol=ATOL, rtol=RTOL)
    empty = torch.randn(0, 384)
    assert op(empty, packed, b).shape == (0, 96)
    assert op.torch_calls == 0


def test_the_split_between_threads_does_not_change_a_bit():
    w = torch.randn(1000, 800) / 30
    b = torch.randn(1000)
    op, packed = _op(w)
    x = torch.randn(130, 800)
    one, many = on_one_and_more_threads(lambda: op(x, packed, b))
    # Each output is summed by one thread in the same order, however the panels are split.
    assert torch.equal(one, many)


@pytest.mark.parametrize("act", ["", "Relu", "Gelu"])
def test_a_single_row_sums_as_it_would_in_a_batch(act):
    # One row (a GEMV) reads several panels at once, each whole; a row of a batch goes
    # through the register block, a 384- or 128-input block at a time. Each output is
    # still the bias plus its products in input order: the same bits either way.
    w = torch.randn(1000, 800) / 30
    b = torch.randn(1000)
    op, packed = _op(w, act)
    x = torch.randn(9, 800)
    for bias in (b, None):
        batch = op(x, packed, bias)
        for i in (0, 8):
            row = x[i:i + 1]
            one, many = on_one_and_more_threads(lambda row=row, bias=bias: op(row, packed, bias))
            assert torch.equal(one, batch[i:i + 1]) and torch.equal(many, one)


def test_what_the_kernel_does_not_take_runs_f_linear_over_the_unpacked_weight():
    w = torch.randn(48, 64) / 8
    b = torch.randn(48)
    op, packed = _op(w, "Gelu")
    x64 = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(op(x64, packed, b), F.gelu(F.linear(x64, w.double(), b.double())))
    assert op.torch_calls == 1 and op.why_torch == {"input torch.float64 on cpu": 1}
    assert torch.equal(op.dense_weight(packed), w)
    with pytest.raises(ValueError, match=r"linear expects \[\.\.\., 64\], got \[3, 65\]"):
        op(torch.randn(3, 65), packed, b)
    # A strided bias is read contiguous; a float64 one falls back, and says so.
    x = torch.randn(3, 64)
    strided = torch.randn(96)[::2]
    torch.testing.assert_close(op(x, packed, strided), F.gelu(F.linear(x, w, strided)),
                               atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(op(x, packed, b.double()), F.gelu(F.linear(x, w, b)),
                               atol=ATOL, rtol=RTOL)
    assert op.why_torch["bias torch.float64 on cpu"] == 1 and op.native_calls == 1


def test_bad_packing_arguments_are_one_line_errors():
    assert LIB is not None
    with pytest.raises(ValueError, match="need a 2-D float32 CPU weight"):
        pack(LIB, torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="top must hold 4 contiguous float32 values"):
        pack(LIB, torch.randn(4, 4), torch.empty(3))
    with pytest.raises(ValueError, match=r"not the packing of a \[24, 4\] weight"):
        unpack(LIB, torch.randn(95), 24, 4)


def _linear_model(k: int, n: int, act: str | None, batch: str | int = "batch"):
    return linear_model(RNG, k, n, act, batch)


@pytest.fixture
def preferred(monkeypatch):
    """This CPU as one the native linear is preferred on (the kernel itself runs on any)."""
    as_cpu(monkeypatch, avx512=False)
    monkeypatch.delenv("SEGFLOW_NATIVE_LINEAR", raising=False)
    assert LIB is not None
    if not LIB.dll.segflow_linear_vector_fma():
        pytest.skip("the native library was built without AVX2 and FMA")


@pytest.mark.parametrize("compile_mode", ["codegen", "none"])
@pytest.mark.parametrize("act", [None, "Relu", "Tanh"])
def test_session_packs_large_linears_for_the_native_kernel(preferred, compile_mode, act):
    model, w = _linear_model(768, 1000, act)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile=compile_mode)
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.NATIVE_LINEAR
    assert choice(sess, node).reads_own_format
    # The panels are the model's only copy of the weight (1000 columns padded to 1008,
    # 21 panels of 48 or 42 of 24).
    consts = [v.const for v in sess.graph.initializers.values() if v.const is not None]
    assert math.ceil(1000 / P) * P == 1008
    assert sum(c.numel() * c.element_size() for c in consts) == 1008 * 768 * 4 + 1000 * 4
    assert any("1 linear packed for the native kernel" in line for line in sess.plan.pass_log)
    for batch in (1, 3, 1):
        x = RNG.standard_normal((batch, 16, 768)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   atol=ATOL, rtol=RTOL)
    assert any(line.startswith("native linears: 1 node (") and line.endswith(
        "3 calls native, 0 through torch") for line in sess.kernel_report())
    assert sess.last_run_stats.settings["native_linear"] == "auto"


@pytest.mark.parametrize("how", ["api", "env"])
def test_the_switch_sends_linears_to_libdnnl(preferred, monkeypatch, how):
    model, _ = _linear_model(768, 768, "Relu")
    sess = session_switched_off(model, how, monkeypatch, "SEGFLOW_NATIVE_LINEAR",
                                "layout.native_linear")
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.DIRECT_LINEAR
    x = RNG.standard_normal((2, 16, 768)).astype(np.float32)
    sess.run(None, {"x": x})
    assert sess.last_run_stats.settings["native_linear"] is False


def test_by_default_the_build_decides(monkeypatch):
    # Preferred wherever the library was built with AVX2 and FMA (its 4 x 24 block, or
    # AVX-512's 8 x 48), whatever else the CPU has; SEGFLOW_NATIVE_LINEAR=1 forces it.
    assert LIB is not None
    model, _ = _linear_model(768, 768, None)
    monkeypatch.delenv("SEGFLOW_NATIVE_LINEAR", raising=False)
    sess = segflow.InferenceSession(model)
    (node,) = sess.graph.nodes
    assert (kind(sess, node) is KernelKind.NATIVE_LINEAR) == bool(
        LIB.dll.segflow_linear_vector_fma())
    monkeypatch.setenv("SEGFLOW_NATIVE_LINEAR", "1")
    sess = segflow.InferenceSession(model)
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.NATIVE_LINEAR


def test_without_native_kernels_linears_go_to_libdnnl(preferred, monkeypatch):
    monkeypatch.setenv("SEGFLOW_NATIVE", "0")
    model, _ = _linear_model(768, 768, None)
    sess = segflow.InferenceSession(model)
    (node,) = sess.graph.nodes
    assert kind(sess, node) is not KernelKind.NATIVE_LINEAR


def test_a_small_linear_stays_dense(preferred):
    model, _ = _linear_model(64, 64, "Relu")
    sess = segflow.InferenceSession(model)
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.REFERENCE


def test_concurrent_runs_of_one_session_match_onnxruntime(preferred):
    model, _ = _linear_model(768, 1024, "Relu")
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, engine="threaded")
    assert kind(sess, sess.graph.nodes[0]) is KernelKind.NATIVE_LINEAR
    runs_match_in_threads(sess, ref, 768, atol=ATOL, rtol=RTOL)


def test_a_segment_with_a_native_linear_never_looks_for_an_inductor_package(preferred):
    from segflow.runtime.compile import uses_cached_package

    model, _ = _linear_model(768, 768, "Relu")
    sess = segflow.InferenceSession(model)
    steps = [step for task in sess._executor.tasks for step in task.steps]
    assert kind(sess, steps[0].node) is KernelKind.NATIVE_LINEAR
    assert not uses_cached_package(steps)
