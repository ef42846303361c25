"""Tests for DirectLinear (kernels/onednn/): large linears through libdnnl's inner
product, with the weight packed once by the layout pass in the library's own format.

Numerics are checked against ``F.linear`` on the dense weight (float32, atol/rtol 1e-4)
and, at session level, against onnxruntime. Whether the layout pass chooses this path
depends on the CPU (``CpuTarget.direct_linear_preferred``: not on AVX-512) and on the
native linear (``SEGFLOW_NATIVE_LINEAR``, off here); the tests that need one choice or
the other set it.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import segflow
from concurrency import runs_match_in_threads
from linear_model import linear_model
from segflow.kernels.choice import KernelKind
from segflow.kernels.onednn.library import Library, onednn_eltwise
from segflow.kernels.onednn.linear import DirectLinear
from targets import as_cpu, kind

LIB = Library.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"libdnnl {Library.probe()[1]}")
ATOL = RTOL = 1e-4
RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _no_native_linears(monkeypatch):
    """Sessions here pack for libdnnl: segflow's own linear kernel, preferred where the
    native library loads, is tests/test_native_linear.py's."""
    monkeypatch.setenv("SEGFLOW_NATIVE_LINEAR", "0")


def _op(w: torch.Tensor, *, rows: int = 128, eltwise: tuple[int, float, float] | None = None,
        max_shapes: int = 32, max_copies: int = 2) -> tuple[DirectLinear, torch.Tensor]:
    assert LIB is not None
    packed = LIB.pack_linear(w, rows)
    assert packed is not None and packed.dtype == torch.uint8
    n, k = w.shape
    op = DirectLinear(LIB, k, n, rows, eltwise, None, lambda y: y, max_shapes, max_copies)
    return op, packed


@pytest.mark.parametrize("shape", [(1, 768), (7, 768), (1, 128, 768), (2, 33, 768)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_f_linear_and_reads_the_packed_weight_in_place(shape, bias):
    w = torch.randn(512, 768) * 0.05
    b = torch.randn(512) if bias else None
    op, packed = _op(w)
    x = torch.randn(*shape)
    for _ in range(2):   # the second call reuses the primitive
        torch.testing.assert_close(op(x, packed, b), F.linear(x, w, b), atol=ATOL, rtol=RTOL)
    assert op.direct_layouts == 1 and not op.why_not
    # The primitive is built over the packed format itself, so ``w`` is read in place even
    # where the library would have picked another format for this row count.
    (call,) = op.calls.values()
    assert call is not None and not call.impl.startswith("ref") and op.copies == []


def test_one_primitive_per_row_count_and_a_fused_relu():
    w = torch.randn(1024, 512) * 0.05
    b = torch.randn(1024)
    op, packed = _op(w, eltwise=onednn_eltwise("relu", [], ""))
    for rows in (1, 8, 128, 8):
        x = torch.randn(rows, 512)
        torch.testing.assert_close(op(x, packed, b), torch.relu(F.linear(x, w, b)),
                                   atol=ATOL, rtol=RTOL)
    assert op.direct_layouts == 3
    # A row count whose preferred format differs gets the op's own copy, never a wrong answer.
    assert len(op.copies) <= op.max_copies


def test_what_libdnnl_does_not_take_runs_f_linear_over_the_unpacked_weight():
    w = torch.randn(512, 768) * 0.05
    b = torch.randn(512)
    op, packed = _op(w, max_shapes=3)
    x = torch.randn(4, 768)
    torch.testing.assert_close(op(x, packed, b), F.linear(x, w, b), atol=ATOL, rtol=RTOL)
    # float64 and a strided view fall back, and so does a fourth layout (max_shapes=3).
    x64 = torch.randn(4, 768, dtype=torch.float64)
    torch.testing.assert_close(op(x64, packed, b), F.linear(x64, w.double(), b.double()),
                               atol=ATOL, rtol=RTOL)
    strided = torch.randn(768, 4).t()
    torch.testing.assert_close(op(strided, packed, b), F.linear(strided, w, b),
                               atol=ATOL, rtol=RTOL)
    other = torch.randn(9, 768)
    torch.testing.assert_close(op(other, packed, b), F.linear(other, w, b),
                               atol=ATOL, rtol=RTOL)
    assert op.direct_layouts == 1 and len(op.why_not) == 3
    # The unpacked weight is the dense one, bit for bit.
    assert torch.equal(op.dense_weight(packed), w)
    reasons = set(op.why_not.values())
    assert "not a contiguous float32 input of the weight's width" in reasons
    assert "more than 3 input layouts" in reasons


def _linear_model(k: int, n: int, act: str | None, batch: str | int = "batch"):
    return linear_model(RNG, k, n, act, batch)


@pytest.mark.parametrize("compile_mode", ["codegen", "none"])
@pytest.mark.parametrize("act", [None, "Relu", "Tanh"])
def test_session_runs_large_linears_through_libdnnl_where_preferred(monkeypatch, compile_mode,
                                                                    act):
    as_cpu(monkeypatch, avx512=False)
    model, w = _linear_model(768, 768, act)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, compile=compile_mode)
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.DIRECT_LINEAR
    weight = node.inputs[1]
    assert weight is not None and weight.const is not None
    # The packed bytes are the model's only copy of the weight: no dense or torch-packed one.
    assert weight.const.dtype == torch.uint8
    consts = [v.const for v in sess.graph.initializers.values() if v.const is not None]
    assert not any(c.is_mkldnn for c in consts)
    assert sum(c.numel() * c.element_size() for c in consts) < w.nbytes * 1.05 + 768 * 4
    assert any("1 linears (1 for libdnnl's inner product)" in line
               for line in sess.plan.pass_log)
    for batch in (1, 3, 1):   # rows 16, 48, 16: one primitive per row count
        x = RNG.standard_normal((batch, 16, 768)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   atol=ATOL, rtol=RTOL)
    assert any("direct kernels (libdnnl): 1 linear; 2 input layouts built, 0 fell back"
               in line for line in sess.kernel_report())


def test_avx512_cpus_and_the_switch_keep_torchs_packing(monkeypatch):
    model, _ = _linear_model(768, 768, "Relu", batch=2)
    as_cpu(monkeypatch, avx512=True)
    sess = segflow.InferenceSession(model)
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.ONEDNN_LINEAR
    assert node.inputs[1] is not None and node.inputs[1].const is not None
    assert node.inputs[1].const.is_mkldnn
    as_cpu(monkeypatch, avx512=False)
    monkeypatch.setenv("SEGFLOW_ONEDNN_DIRECT", "0")
    sess = segflow.InferenceSession(model)
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.ONEDNN_LINEAR


def test_a_small_linear_stays_dense_for_mkl(monkeypatch):
    as_cpu(monkeypatch, avx512=False)
    model, _ = _linear_model(64, 64, "Relu")
    sess = segflow.InferenceSession(model)
    (node,) = sess.graph.nodes
    assert kind(sess, node) is KernelKind.REFERENCE


def test_concurrent_runs_of_one_session_match_onnxruntime(monkeypatch):

    as_cpu(monkeypatch, avx512=False)
    model, _ = _linear_model(768, 1024, "Relu")
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, engine="threaded")
    assert kind(sess, sess.graph.nodes[0]) is KernelKind.DIRECT_LINEAR
    runs_match_in_threads(sess, ref, 768, atol=ATOL, rtol=RTOL)


def test_a_segment_with_a_direct_linear_never_looks_for_an_inductor_package(monkeypatch):
    from segflow.runtime.compile import uses_cached_package

    as_cpu(monkeypatch, avx512=False)
    model, _ = _linear_model(768, 768, "Relu")
    sess = segflow.InferenceSession(model)   # auto: 2.3 MiB of weights, under the size cap
    steps = [step for task in sess._executor.tasks for step in task.steps]
    assert kind(sess, steps[0].node) is KernelKind.DIRECT_LINEAR
    assert not uses_cached_package(steps)
    assert sess.compile_report.backend == "codegen"
