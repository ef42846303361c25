"""Quantized com.microsoft ops (ops/contrib_quant.py) against onnxruntime: exact integer
outputs (tolerance 0), uint8 and int8, zero points, rounding ties and saturation."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from ort_compare import make_model, run_both

import segflow
from segflow.errors import UnsupportedOp

MS = {"com.microsoft": 1}
RNG = np.random.default_rng(7)
QTYPES = [np.uint8, np.int8]


def _q(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max + 1, shape).astype(dtype)


def _ms(op: str, inputs: list[str], outputs: list[str], **attrs: object):  # type: ignore[no-untyped-def]
    return helper.make_node(op, inputs, outputs, domain="com.microsoft", **attrs)


def _exact(model, feeds, max_off: int = 0) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    """Every output equal to onnxruntime's in dtype and shape; integers within ``max_off``
    steps (0: identical)."""
    expected, got = run_both(model, feeds)
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
        if np.issubdtype(e.dtype, np.integer):
            diff = np.abs(e.astype(np.int64) - g.astype(np.int64))
            assert diff.max(initial=0) <= max_off, f"{(diff > 0).sum()} differ, max {diff.max()}"
        else:
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    return got


def _params(dtype: type, scales: dict[str, float], zps: dict[str, int]) -> dict[str, np.ndarray]:
    out = {k: np.array(v, np.float32) for k, v in scales.items()}
    out.update({k: np.array(v, dtype) for k, v in zps.items()})
    return out


@pytest.mark.parametrize("dtype", QTYPES)
@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("shapes", [((3, 40), (3, 40)), ((2, 3, 8), (8,)), ((2, 3, 8), (3, 1)),
                                    ((1,), (4, 5)), ((4, 5), ()),
                                    # past 65536 elements: the kernel's table of byte pairs
                                    ((2, 300, 128), (2, 300, 128)), ((2, 300, 128), (300, 1))])
def test_qlinear_binary(op: str, dtype: type, shapes: tuple[tuple[int, ...], ...]) -> None:
    zp = {np.uint8: (128, 120, 131), np.int8: (-3, 5, 1)}[dtype]
    params = _params(dtype, {"as": 0.037, "bs": 0.021, "cs": 0.02},
                     {"az": zp[0], "bz": zp[1], "cz": zp[2]})
    feeds = {"a": _q(shapes[0], dtype), "b": _q(shapes[1], dtype)}
    node = _ms(op, ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["c"])
    got = _exact(make_model([node], feeds, ["c"], 17, params, MS), feeds)
    info = np.iinfo(dtype)
    if shapes[0] == shapes[1]:
        assert got[0].min() == info.min or got[0].max() == info.max  # saturation exercised


@pytest.mark.parametrize("dtype", QTYPES)
@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_qlinear_binary_every_pair_of_values(op: str, dtype: type) -> None:
    # All 65536 (a, b) pairs: every rounding tie these scales and zero points make.
    zp = {np.uint8: (128, 120, 131), np.int8: (-3, 5, 1)}[dtype]
    params = _params(dtype, {"as": 0.037, "bs": 0.021, "cs": 0.02},
                     {"az": zp[0], "bz": zp[1], "cz": zp[2]})
    info = np.iinfo(dtype)
    values = np.arange(info.min, info.max + 1).astype(dtype)
    feeds = {"a": np.repeat(values, 256).reshape(256, 256), "b": np.tile(values, (256, 1))}
    node = _ms(op, ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["c"])
    _exact(make_model([node], feeds, ["c"], 17, params, MS), feeds)


@pytest.mark.parametrize("dtype", QTYPES)
def test_qlinear_add_rounding_ties(dtype: type) -> None:
    # Scale ratios of 1/2: every odd sum lands on a tie, which rounds to even.
    params = _params(dtype, {"as": 0.5, "bs": 0.5, "cs": 1.0}, {"az": 0, "bz": 0, "cz": 0})
    a = np.arange(-20, 20).astype(dtype) if dtype is np.int8 else np.arange(40).astype(dtype)
    feeds = {"a": a, "b": np.zeros_like(a) + 1}
    node = _ms("QLinearAdd", ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["c"])
    got = _exact(make_model([node], feeds, ["c"], 17, params, MS), feeds)
    expected = np.rint((a.astype(np.float64) + 1) / 2)
    np.testing.assert_array_equal(got[0].astype(np.float64), expected)


@pytest.mark.parametrize("dtype", QTYPES)
def test_qlinear_concat(dtype: type) -> None:
    zp = 128 if dtype is np.uint8 else 0
    params = {"ys": np.array(0.05, np.float32), "yz": np.array(zp, dtype),
              "s0": np.array(0.05, np.float32), "z0": np.array(zp, dtype),
              "s1": np.array(0.11, np.float32), "z1": np.array(zp - 7, dtype),
              "s2": np.array(0.013, np.float32), "z2": np.array(zp + 3, dtype)}
    feeds = {"x0": _q((2, 3, 4), dtype), "x1": _q((2, 5, 4), dtype), "x2": _q((2, 1, 4), dtype)}
    node = _ms("QLinearConcat", ["ys", "yz", "x0", "s0", "z0", "x1", "s1", "z1", "x2", "s2", "z2"],
               ["y"], axis=1)
    got = _exact(make_model([node], feeds, ["y"], 17, params, MS), feeds)
    np.testing.assert_array_equal(got[0][:, :3], feeds["x0"])  # same parameters: copied


@pytest.mark.parametrize("dtype", QTYPES)
@pytest.mark.parametrize("channels_last", [0, 1])
def test_qlinear_global_average_pool(dtype: type, channels_last: int) -> None:
    zp = (100, 90) if dtype is np.uint8 else (-5, 3)
    params = _params(dtype, {"xs": 0.04, "ys": 0.01}, {"xz": zp[0], "yz": zp[1]})
    feeds = {"x": _q((2, 5, 7, 3), dtype)}
    node = _ms("QLinearGlobalAveragePool", ["x", "xs", "xz", "ys", "yz"], ["y"],
               channels_last=channels_last)
    got = _exact(make_model([node], feeds, ["y"], 17, params, MS), feeds)
    assert got[0].shape == ((2, 1, 1, 3) if channels_last else (2, 5, 1, 1))


@pytest.mark.parametrize("dtype", QTYPES)
@pytest.mark.parametrize("attrs", [dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
                                   dict(kernel_shape=[2, 3], count_include_pad=1,
                                        pads=[0, 1, 0, 1]),
                                   dict(kernel_shape=[3, 3], channels_last=1)])
def test_qlinear_average_pool(dtype: type, attrs: dict[str, object]) -> None:
    zp = (128, 120) if dtype is np.uint8 else (2, -4)
    params = _params(dtype, {"xs": 0.03, "ys": 0.02}, {"xz": zp[0], "yz": zp[1]})
    feeds = {"x": _q((2, 4, 9, 8), dtype)}
    node = _ms("QLinearAveragePool", ["x", "xs", "xz", "ys", "yz"], ["y"], **attrs)
    _exact(make_model([node], feeds, ["y"], 17, params, MS), feeds)


@pytest.mark.parametrize("dtype", QTYPES)
@pytest.mark.parametrize("op", ["QLinearSigmoid", "QLinearLeakyRelu"])
def test_qlinear_lookup_ops(op: str, dtype: type) -> None:
    zp = (128, 0) if dtype is np.uint8 else (0, -128)
    params = _params(dtype, {"xs": 0.06, "ys": 1 / 256 if op == "QLinearSigmoid" else 0.05},
                     {"xz": zp[0], "yz": zp[1]})
    info = np.iinfo(dtype)
    feeds = {"x": np.arange(info.min, info.max + 1).astype(dtype).reshape(4, 64)}  # every value
    attrs = {"alpha": 0.13} if op == "QLinearLeakyRelu" else {}
    node = _ms(op, ["x", "xs", "xz", "ys", "yz"], ["y"], **attrs)
    _exact(make_model([node], feeds, ["y"], 17, params, MS), feeds)


@pytest.mark.parametrize("dtype", QTYPES)
@pytest.mark.parametrize("opset,axis", [(13, -1), (13, 1), (12, 1)])
def test_qlinear_softmax(dtype: type, opset: int, axis: int) -> None:
    zp = (128, 0) if dtype is np.uint8 else (0, -128)
    params = _params(dtype, {"xs": 0.08, "ys": 1 / 256}, {"xz": zp[0], "yz": zp[1]})
    feeds = {"x": _q((3, 6, 10), dtype)}
    node = _ms("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], opset=opset, axis=axis)
    _exact(make_model([node], feeds, ["y"], 17, params, MS), feeds)


@pytest.mark.parametrize("b_dtype", QTYPES)
@pytest.mark.parametrize("quantized_output", [True, False])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_qgemm(b_dtype: type, quantized_output: bool, trans_b: int) -> None:
    a_dtype = np.uint8 if b_dtype is np.uint8 else np.int8
    m, k, n = 5, 24, 7
    b = _q((n, k) if trans_b else (k, n), b_dtype)
    inits = {"as": np.array(0.02, np.float32), "az": np.array(3, a_dtype),
             "b": b, "bs": RNG.uniform(0.001, 0.01, n).astype(np.float32),
             "bz": np.zeros(n, b_dtype) if b_dtype is np.int8 else
             RNG.integers(100, 150, n).astype(b_dtype),
             "c": RNG.integers(-2000, 2000, n).astype(np.int32)}
    inputs = ["a", "as", "az", "b", "bs", "bz", "c"]
    if quantized_output:
        inits["ys"] = np.array(0.03, np.float32)
        inits["yz"] = np.array(5, a_dtype)
        inputs += ["ys", "yz"]
    feeds = {"a": _q((m, k), a_dtype)}
    node = _ms("QGemm", inputs, ["y"], alpha=1.5, transB=trans_b)
    _exact(make_model([node], feeds, ["y"], 17, inits, MS), feeds)


@pytest.mark.parametrize("b_dtype", QTYPES)
@pytest.mark.parametrize("per_column", [False, True])
def test_dynamic_quantize_matmul(b_dtype: type, per_column: bool) -> None:
    k, n = 32, 6
    inits = {"b": _q((k, n), b_dtype),
             "bs": (RNG.uniform(0.001, 0.01, n) if per_column else np.array(0.004))
             .astype(np.float32),
             "bz": (np.zeros(n) if per_column else np.array(0)).astype(b_dtype),
             "bias": RNG.standard_normal(n).astype(np.float32)}
    feeds = {"a": RNG.standard_normal((2, 3, k)).astype(np.float32)}
    node = _ms("DynamicQuantizeMatMul", ["a", "b", "bs", "bz", "bias"], ["y"])
    expected, got = run_both(make_model([node], feeds, ["y"], 17, inits, MS), feeds)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a_dtype,b_dtype", [(np.uint8, np.int8), (np.uint8, np.uint8),
                                             (np.int8, np.int8)])
def test_matmul_integer_to_float(a_dtype: type, b_dtype: type) -> None:
    k, n = 20, 5
    inits = {"b": _q((k, n), b_dtype), "as": np.array(0.01, np.float32),
             "bs": RNG.uniform(0.001, 0.01, n).astype(np.float32),
             "az": np.array(7, a_dtype), "bz": RNG.integers(0, 9, n).astype(b_dtype),
             "bias": RNG.standard_normal(n).astype(np.float32)}
    feeds = {"a": _q((2, 4, k), a_dtype)}
    node = _ms("MatMulIntegerToFloat", ["a", "b", "as", "bs", "az", "bz", "bias"], ["y"])
    expected, got = run_both(make_model([node], feeds, ["y"], 17, inits, MS), feeds)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)


def test_ms_quantize_dequantize_linear() -> None:
    x = RNG.uniform(-30, 30, (3, 4)).astype(np.float32)
    x[0, :3] = [0.5, 1.5, -2.5]   # ties round to even
    x[1, 0], x[1, 1] = 1e4, -1e4  # saturate
    inits = {"s": np.array([0.1, 0.2, 0.5], np.float32), "z": np.array([1, -2, 0], np.int8)}
    q = _ms("QuantizeLinear", ["x", "s", "z"], ["q"], axis=0)
    d = _ms("DequantizeLinear", ["q", "s", "z"], ["y"], axis=0)
    feeds = {"x": x}
    _exact(make_model([q, d], feeds, ["q", "y"], 17, inits, MS), feeds)


def test_unknown_contrib_op_is_refused_by_name() -> None:
    feeds = {"x": np.zeros((2, 2), np.float32)}
    node = _ms("NoSuchContribOp", ["x"], ["y"])
    with pytest.raises(UnsupportedOp, match="NoSuchContribOp.*com.microsoft"):
        segflow.InferenceSession(make_model([node], feeds, ["y"], 17, None, MS))


@pytest.mark.parametrize("dtype,y_zp", [(np.int8, -128), (np.int8, 0), (np.uint8, 10)])
def test_qlinear_softmax_saturates(dtype: type, y_zp: int) -> None:
    # A row whose maximum takes all the mass rounds to 256 steps: saturated to the type.
    params = _params(dtype, {"xs": 0.08, "ys": 1 / 256}, {"xz": 0, "yz": y_zp})
    top = 100 if dtype is np.int8 else 250
    feeds = {"x": np.array([[top, 0, 0], [100, 99, 98], [0, 0, 0]]).astype(dtype)}
    node = _ms("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], opset=13, axis=-1)
    got = _exact(make_model([node], feeds, ["y"], 17, params, MS), feeds)
    assert got[0][0, 0] == np.iinfo(dtype).max


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearSigmoid"])
def test_a_sixteen_bit_quantized_input_is_refused_at_load_naming_the_node(op: str) -> None:
    feeds = {"a": _q((2, 4), np.uint16), "b": _q((2, 4), np.uint16)}
    params = _params(np.uint16, {"as": 0.1, "bs": 0.1, "cs": 0.1},
                     {"az": 0, "bz": 0, "cz": 0})
    inputs = ["a", "as", "az", "b", "bs", "bz", "cs", "cz"] if op == "QLinearAdd" \
        else ["a", "as", "az", "cs", "cz"]
    if op != "QLinearAdd":
        del feeds["b"]
    node = _ms(op, inputs, ["c"], name="wide")
    model = make_model([node], feeds, ["c"], 17, params, MS)
    with pytest.raises(UnsupportedOp, match=r"wide.*uint16 is not supported"):
        segflow.InferenceSession(model)
