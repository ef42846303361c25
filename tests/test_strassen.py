"""Tests for the Strassen path of NativeLinear (kernels/native/strassen.c): one level of
Strassen over the classic kernel's packed panels, for large linears whose weight and
rows are alike in scale.

Accuracy is measured as the error against float64 over the magnitude of each output's
terms (``|x| @ |W|^T + |b|``), the measure a float32 sum of products is bounded by;
the classic kernel's error on the same data is the yardstick. Where the path must not
run (rows or output columns unlike in scale, values not finite, shapes it does not
take) the tests check that the call ran the classic kernel, bit for bit.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

import segflow
from concurrency import on_one_and_more_threads
from linear_model import linear_model, session_switched_off
from segflow.kernels.choice import KernelKind
from segflow.kernels.linear import (
    ACT_NONE,
    NativeLinear,
    _Args,
    kernel_activation,
    pack,
    panel_width,
    strassen_preferred,
    strassen_spread,
)
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import openmp_entry_points
from segflow.kernels.target import CpuTarget
from segflow.ops import fused
from targets import as_cpu, choice, kind

LIB, WHY = NativeLibrary.probe()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"native kernels {WHY}")
RNG = np.random.default_rng(0)


def _ops(w: torch.Tensor, act: str = "", params: tuple[float, ...] = (0.0, 0.0),
         paired: int | None = None) -> tuple[NativeLinear, NativeLinear, torch.Tensor]:
    """(the op allowed Strassen, the classic one, the packed weight). ``paired``: the
    outputs in the halves' whole panels (all of them unless told)."""
    assert LIB is not None
    activation = fused.ACTIVATIONS[act]
    n, k = w.shape
    packed, wmax = _packed(w)
    assert wmax is not None and wmax == w[:paired].abs().max().item()
    made = [NativeLinear(LIB, k, n, kernel_activation(act, params), None,
                         lambda y: activation.apply(y, params), cap)
            for cap in (wmax, None)]
    return made[0], made[1], packed


def _packed(w: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """``w`` packed, and its Strassen check (from the outputs' largest ``|W|``, taken
    while packing, as the layout pass does)."""
    assert LIB is not None
    top = torch.empty(w.shape[0])
    packed = pack(LIB, w, top)
    return packed, strassen_spread(LIB, top, *w.shape)


def _spread(w: torch.Tensor) -> float | None:
    return _packed(w)[1]


def _scaled_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                  b: torch.Tensor | None) -> float:
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    exact = x64 @ w64.t() + (0 if b is None else b.double())
    terms = x64.abs() @ w64.abs().t() + (0 if b is None else b.double().abs())
    return ((y.double().reshape(exact.shape) - exact).abs() / terms).max().item()


@pytest.mark.parametrize("rows,n,k", [(32, 768, 768), (64, 768, 1536), (128, 2304, 768),
                                      (40, 816, 770), (34, 800, 768), (39, 1024, 1024),
                                      (37, 1000, 800)])
def test_it_is_about_as_accurate_as_the_classic_kernel(rows, n, k):
    # 770 inputs: halves of 385, past one 384-column block and not a multiple of 8;
    # 816 outputs: halves of 17 panels (guided chunks of one panel pair at the end).
    # Rows past twice a multiple of 4 (34: 2 of them, 39: 7, 37: 5) and outputs past
    # twice whole panels (800: 32, 1024: 16, 1000: 40, the last panel padded) are
    # summed classically.
    w = torch.randn(n, k) / math.sqrt(k)
    b = torch.randn(n)
    op, classic, packed = _ops(w, paired=2 * (n // 48) * 24)
    x = torch.randn(rows, k)
    y, want = op(x, packed, b), classic(x, packed, b)
    assert op.strassen_calls == 1 and op.strassen_refused == 0 and op.native_calls == 1
    assert not torch.equal(y, want)       # it did run differently
    mine, theirs = _scaled_error(y, x, w, b), _scaled_error(want, x, w, b)
    assert mine < 2e-6 and mine < 4 * theirs, (mine, theirs)


@pytest.mark.parametrize("act,params", [("", (0.0, 0.0)), ("Relu", (0.0, 0.0)),
                                        ("LeakyRelu", (0.1, 0.0)), ("Clip", (-0.5, 0.25)),
                                        ("Gelu", (0.0, 0.0))])
def test_activations_and_a_missing_bias(act, params):
    # 66 rows and 792 outputs: 2 rows and 24 outputs summed classically, activated too.
    w = torch.randn(792, 768) / 28
    op, classic, packed = _ops(w, act, params, paired=768)
    x = torch.randn(66, 768)
    for b in (torch.randn(792), None):
        torch.testing.assert_close(op(x, packed, b), classic(x, packed, b),
                                   atol=1e-5, rtol=1e-5)
    assert op.strassen_calls == 2


def test_the_split_between_threads_does_not_change_a_bit():
    w = torch.randn(1536, 768) / 28
    b = torch.randn(1536)
    op, _, packed = _ops(w, "Gelu")
    x = torch.randn(96, 768)
    one, many = on_one_and_more_threads(lambda: op(x, packed, b))
    assert torch.equal(one, many) and op.strassen_calls == 2


def _refused(op: NativeLinear, classic: NativeLinear, x: torch.Tensor,
             packed: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``op`` ran ``x`` through the classic kernel (bit for bit) and said so."""
    before = op.strassen_refused
    y = op(x, packed, b)
    torch.testing.assert_close(y, classic(x, packed, b), atol=0, rtol=0, equal_nan=True)
    return op.strassen_refused == before + 1


def test_rows_unlike_in_scale_or_not_finite_run_the_classic_kernel():
    w = torch.randn(768, 768) / 28
    b = torch.randn(768)
    op, classic, packed = _ops(w)
    x = torch.randn(64, 768)
    # Row 40 is paired with row 8 (rows m/2 apart): 17x larger is past the bound.
    loud = x.clone()
    loud[40] *= 17 * loud[8].abs().max() / loud[40].abs().max()
    assert _refused(op, classic, loud, packed, b)
    # 15x is within it, and the error stays within that factor of the classic one's.
    loud[40] *= 15 / 17
    y = op(loud, packed, b)
    assert op.strassen_calls == 1
    assert _scaled_error(y, loud, w, b) < 16 * max(
        _scaled_error(classic(loud, packed, b), loud, w, b), 2e-7)
    # An infinity would make NaN of its partner row's outputs: refused, and only its
    # own row is touched.
    for bad in (math.inf, -math.inf, math.nan):
        odd = x.clone()
        odd[3, 700] = bad
        assert _refused(op, classic, odd, packed, b)
        y = op(odd, packed, b)
        assert torch.isfinite(y[torch.arange(64) != 3]).all()
        odd[35, 10] = bad                 # its partner too: still refused
        assert _refused(op, classic, odd, packed, b)
    # A zero row against a non-zero partner is refused; two zero rows are alike.
    quiet = x.clone()
    quiet[5] = 0
    assert _refused(op, classic, quiet, packed, b)
    quiet[37] = 0
    op(quiet, packed, b)
    assert op.strassen_calls == 2
    # Products near float32's overflow: refused (max |x| max |W| k >= 1e36).
    assert _refused(op, classic, x * 1e34, packed, b)


def test_weights_unlike_in_scale_or_shape_are_not_marked():
    assert LIB is not None
    w = torch.randn(768, 768)
    loud = w.clone()
    loud[400] *= 17 * w[16].abs().max() / w[400].abs().max()   # column 400 pairs with 16
    assert _spread(loud) is None
    loud[400] *= 15 / 17
    assert _spread(loud) == loud.abs().max().item()
    dead = w.clone()
    dead[20] = 0
    assert _spread(dead) is None
    nan = w.clone()
    nan[3, 3] = math.nan
    assert _spread(nan) is None
    # 768 or more outputs, and 768 or more inputs, an even count.
    for n, k in ((768, 767), (720, 768), (768, 766), (767, 1024)):
        assert _spread(torch.randn(n, k)) is None, (n, k)
    # Outputs past the paired panels (792: 24 of them) are not compared.
    odd = torch.randn(792, 768)
    odd[780] *= 100
    assert _spread(odd) == odd[:768].abs().max().item()


@pytest.mark.parametrize("rows", [1, 24, 31])
def test_row_counts_it_does_not_take_run_the_classic_kernel(rows):
    w = torch.randn(768, 768) / 28
    b = torch.randn(768)
    op, classic, packed = _ops(w)
    x = torch.randn(rows, 768)
    assert torch.equal(op(x, packed, b), classic(x, packed, b))
    assert op.strassen_calls == op.strassen_refused == 0


def test_rows_read_in_place_from_a_wider_tensor():
    w = torch.randn(768, 768) / 28
    b = torch.randn(768)
    op, classic, packed = _ops(w, "Relu")
    wide = torch.randn(64, 800)
    rows = wide[:, 7:775]                # rows 800 floats apart
    torch.testing.assert_close(op(rows, packed, b), classic(rows.contiguous(), packed, b),
                               atol=1e-5, rtol=1e-5)
    assert op.strassen_calls == 1


def test_scratch_for_fewer_threads_than_run_means_the_classic_kernel():
    assert LIB is not None
    omp = openmp_entry_points()
    if omp is None:
        pytest.skip("no OpenMP runtime to split the call")
    w = torch.randn(768, 768) / 28
    packed = pack(LIB, w)
    x = torch.randn(64, 768)
    fn = LIB.dll.segflow_linear
    fn.argtypes = [ctypes.c_void_p]
    threads = torch.get_num_threads()

    def call(scratch: torch.Tensor | None, room: int) -> tuple[torch.Tensor, int]:
        y = torch.empty(64, 768)
        args = _Args(x.data_ptr(), packed.data_ptr(), None, y.data_ptr(), 64, 768, 768, 768,
                     ACT_NONE, 1.0, -math.inf, math.inf, 0, *omp, 0,
                     None if scratch is None else scratch.data_ptr(), room,
                     w.abs().max().item(), 0, 0, 0, 0)
        fn(ctypes.byref(args))
        return y, args.strassen

    try:
        torch.set_num_threads(2)
        scratch = torch.empty(10 ** 6)
        classic, ran = call(None, 0)
        assert ran == 0
        y, ran = call(scratch, 1)       # room for one thread, two run
        assert ran == 0 and torch.equal(y, classic)
        y, ran = call(scratch, 2)
        assert ran == 1 and not torch.equal(y, classic)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def preferred(monkeypatch):
    """This build as one the native linear and Strassen are preferred on (the kernels
    themselves run on any)."""
    as_cpu(monkeypatch, avx512=False)
    monkeypatch.setattr(CpuTarget, "strassen_preferred", lambda target: True)
    monkeypatch.delenv("SEGFLOW_NATIVE_LINEAR", raising=False)
    monkeypatch.delenv("SEGFLOW_STRASSEN", raising=False)
    assert LIB is not None
    if not LIB.dll.segflow_linear_vector_fma():
        pytest.skip("the native library was built without AVX2 and FMA")


def test_by_default_it_runs_where_the_panels_are_the_avx2_builds(monkeypatch):
    # Measured faster with the AVX2 build's 24-column panels; with AVX-512's 48-column
    # ones Strassen's sums cost what its products save, so it is off unless told.
    assert LIB is not None
    monkeypatch.delenv("SEGFLOW_NATIVE_LINEAR", raising=False)
    monkeypatch.delenv("SEGFLOW_STRASSEN", raising=False)
    assert strassen_preferred(LIB) == (panel_width(LIB) == 24)
    model, _ = linear_model(RNG, 768, 768, None)
    sess = segflow.InferenceSession(model, optimize={"layout.native_linear": True})
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.NATIVE_LINEAR
    assert (choice(sess, node).strassen_wmax is not None) == strassen_preferred(LIB)
    sess.run(None, {"x": RNG.standard_normal((2, 16, 768)).astype(np.float32)})
    assert sess.last_run_stats.settings["strassen"] == "auto"
    monkeypatch.setenv("SEGFLOW_STRASSEN", "1")
    sess = segflow.InferenceSession(model, optimize={"layout.native_linear": True})
    (node,) = sess.graph.nodes
    assert choice(sess, node).strassen_wmax is not None


def test_a_session_marks_runs_and_explains_it(preferred):
    model, w = linear_model(RNG, 768, 768, "Relu")
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model)
    (node,) = sess.graph.nodes
    assert choice(sess, node).strassen_wmax == pytest.approx(float(np.abs(w).max()))
    for batch in (2, 1, 4):             # 32 rows, 16 (too few), 64
        x = RNG.standard_normal((batch, 16, 768)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   atol=1e-4, rtol=1e-4)
    (line,) = [line for line in sess.kernel_report() if "strassen" in line]
    assert "1 of 1 nodes' weights allow it; 2 calls ran so, 0 ran the classic" in line
    assert sess.last_run_stats.settings["strassen"] == "auto"


@pytest.mark.parametrize("how", ["api", "env"])
def test_the_switch_turns_it_off(preferred, monkeypatch, how):
    model, _ = linear_model(RNG, 768, 768, None)
    sess = session_switched_off(model, how, monkeypatch, "SEGFLOW_STRASSEN", "layout.strassen")
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.NATIVE_LINEAR
    assert choice(sess, node).strassen_wmax is None
    sess.run(None, {"x": RNG.standard_normal((2, 16, 768)).astype(np.float32)})
    assert not any("strassen" in line for line in sess.kernel_report())
    assert sess.last_run_stats.settings["strassen"] is False
