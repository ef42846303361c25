"""The 8-bit integer matmul (ops/_integer_matmul.py): the int8 GEMM path equals exact
integer arithmetic for every operand type and zero-point form, at the int8 range's
extremes, and the nodes that use it take it for constant weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper
from ort_compare import make_model

import segflow
from segflow.ops._integer_matmul import _MAX_K, PreparedB, _reference, integer_matmul

RNG = np.random.default_rng(11)
RANGE = {np.uint8: (0, 255), np.int8: (-128, 127)}


def _q(shape: tuple[int, ...], dtype: type, extreme: bool = False) -> np.ndarray:
    lo, hi = RANGE[dtype]
    if extreme:   # only the range's ends: the largest products and sums
        return RNG.choice(np.array([lo, hi], dtype), shape)
    return RNG.integers(lo, hi + 1, shape).astype(dtype)


def _exact(a: np.ndarray, b: np.ndarray, a_zp: np.ndarray | None,
           b_zp: np.ndarray | None) -> np.ndarray:
    ac = a.astype(np.int64) - (0 if a_zp is None else a_zp.astype(np.int64))
    bc = b.astype(np.int64) - (0 if b_zp is None else b_zp.astype(np.int64).reshape(-1))
    return (ac @ bc).astype(np.int32)


def _zp(form: str, dtype: type, n: int) -> np.ndarray | None:
    if form == "none":
        return None
    return _q(() if form == "scalar" else (n,), dtype)


@pytest.mark.parametrize("a_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("b_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("a_zp_form", ["none", "scalar"])
@pytest.mark.parametrize("b_zp_form", ["none", "scalar", "column"])
@pytest.mark.parametrize("extreme", [False, True])
def test_int8_gemm_equals_exact_integers(a_dtype: type, b_dtype: type, a_zp_form: str,
                                         b_zp_form: str, extreme: bool) -> None:
    a = _q((2, 3, 96), a_dtype, extreme)
    b = _q((96, 7), b_dtype, extreme)
    a_zp, b_zp = _zp(a_zp_form, a_dtype, 1), _zp(b_zp_form, b_dtype, 7)
    t = [None if v is None else torch.from_numpy(np.asarray(v)) for v in (a_zp, b_zp)]
    prepared = PreparedB(torch.from_numpy(b), t[1])
    assert prepared.b8 is not None            # the int8 GEMM path, not the reference
    got = integer_matmul(torch.from_numpy(a), prepared.b, t[0], t[1], prepared)
    assert got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), _exact(a, b, a_zp, b_zp))


def test_largest_sums_at_the_int32_bound() -> None:
    # K at the bound, every product at its largest magnitude: the corrections and the
    # product together must not wrap.
    k = _MAX_K
    a = np.zeros((2, k), np.uint8)                        # a - 255 = -255
    b = np.full((k, 3), 255, np.uint8)                    # b - 0 = 255
    a_zp, b_zp = np.array(255, np.uint8), np.array(0, np.uint8)
    got = integer_matmul(torch.from_numpy(a), torch.from_numpy(b),
                         torch.from_numpy(a_zp), torch.from_numpy(b_zp))
    np.testing.assert_array_equal(got.numpy(), _exact(a, b, a_zp, b_zp))


@pytest.mark.parametrize("case", ["batched_b", "vector_a", "row_zero_point", "wide_k"])
def test_other_forms_take_the_exact_reference(case: str) -> None:
    a, b = _q((2, 4, 8), np.uint8), _q((8, 5), np.int8)
    a_zp: np.ndarray | None = None
    if case == "batched_b":
        b = _q((2, 8, 5), np.int8)
    elif case == "vector_a":
        a = _q((8,), np.uint8)
    elif case == "row_zero_point":
        a_zp = _q((4,), np.uint8)
    else:
        a, b = _q((1, _MAX_K + 1), np.uint8), _q((_MAX_K + 1, 2), np.int8)
    ta = torch.from_numpy(a)
    zp = None if a_zp is None else torch.from_numpy(a_zp)
    got = integer_matmul(ta, torch.from_numpy(b), zp)
    want = _reference(ta, torch.from_numpy(b), zp, None)
    assert torch.equal(got, want)
    if case != "row_zero_point":     # numpy's per-row form needs the reshape the op does
        np.testing.assert_array_equal(got.numpy(), _exact(a, b, a_zp, None))


def _dynamic_linear_model(k: int, n: int) -> tuple[object, dict[str, np.ndarray]]:
    """What ``quantize_dynamic`` writes for a linear: DynamicQuantizeLinear ->
    MatMulInteger (constant s8 weight) -> Cast -> Mul by the two scales."""
    feeds = {"x": RNG.standard_normal((3, k)).astype(np.float32)}
    w = _q((k, n), np.int8)
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"]),
        helper.make_node("MatMulInteger", ["xq", "w", "xzp"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=1),
        helper.make_node("Mul", ["xs", "ws"], ["s"]),
        helper.make_node("Mul", ["accf", "s"], ["y"]),
    ]
    model = make_model(nodes, feeds, ["y"], 13,
                       initializers={"w": w, "ws": np.array(0.01, np.float32)})
    return model, feeds


def test_dynamic_quantized_linear_matches_onnxruntime_exactly() -> None:
    import onnxruntime as ort

    model, feeds = _dynamic_linear_model(64, 24)
    want = ort.InferenceSession(model.SerializeToString(),  # type: ignore[attr-defined]
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    (got,) = segflow.InferenceSession(model).run(None, feeds)
    # The integer product is exact on both sides, the scaling the same float32 ops.
    np.testing.assert_array_equal(got, want)


def test_constant_weight_is_prepared_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from segflow.ops import _integer_matmul as module

    made: list[int] = []
    original = module.PreparedB.__init__

    def counting(self: PreparedB, b: torch.Tensor, b_zp: torch.Tensor | None) -> None:
        made.append(1)
        original(self, b, b_zp)
    monkeypatch.setattr(module.PreparedB, "__init__", counting)
    model, feeds = _dynamic_linear_model(32, 8)
    sess = segflow.InferenceSession(model)
    before = len(made)
    assert before >= 1            # made when the kernel was bound
    for _ in range(3):
        sess.run(None, feeds)
    assert len(made) == before     # runs reuse the weight prepared at bind time
