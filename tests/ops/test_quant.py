"""Quantization ops against onnxruntime (exact integer outputs), or against exact
integer arithmetic where onnxruntime's own kernels saturate on this CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper
from ort_compare import assert_matches_ort, make_model

import segflow

RNG = np.random.default_rng(0)


def _q(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max + 1, shape).astype(dtype)


@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8, np.uint16, np.int16])
def test_quantize_linear_per_tensor(zp_dtype: type) -> None:
    x = RNG.uniform(-300, 300, (3, 4)).astype(np.float32)
    x[0, :3] = [0.5, 1.5, -2.5]  # ties round to even
    feeds = {"x": x, "s": np.array(2.0, np.float32), "zp": np.array(3, zp_dtype)}
    node = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 21), feeds, rtol=0, atol=0)


def test_quantize_linear_per_axis_and_default_uint8() -> None:
    x = RNG.uniform(-50, 50, (2, 3, 4)).astype(np.float32)
    feeds = {"x": x, "s": np.array([0.5, 1.0, 0.25], np.float32)}
    node = helper.make_node("QuantizeLinear", ["x", "s"], ["y"], axis=1)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds, rtol=0, atol=0)


def test_quantize_dequantize_blocked() -> None:
    x = RNG.uniform(-20, 20, (3, 8)).astype(np.float32)
    scale = RNG.uniform(0.1, 0.5, (3, 2)).astype(np.float32)
    zp = RNG.integers(-5, 5, (3, 2)).astype(np.int8)
    feeds = {"x": x, "s": scale, "zp": zp}
    q = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=1, block_size=4)
    d = helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=1, block_size=4)
    assert_matches_ort(make_model([q, d], feeds, ["q", "y"], 21), feeds)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32])
def test_dequantize_linear(dtype: type) -> None:
    x = _q((2, 5), dtype)
    feeds = {"x": x, "s": np.array([0.1, 0.02], np.float32)}
    inputs = ["x", "s"]
    if dtype is not np.int32:
        feeds["zp"] = np.array([1, 2], dtype)
        inputs.append("zp")
    node = helper.make_node("DequantizeLinear", inputs, ["y"], axis=0)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


@pytest.mark.parametrize("values", [(-4.0, 6.0), (1.0, 9.0), (-7.0, -1.0), (0.0, 0.0)])
def test_dynamic_quantize_linear(values: tuple[float, float]) -> None:
    lo, hi = values
    x = RNG.uniform(lo, hi, (3, 5)).astype(np.float32)
    feeds = {"x": x}
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "zp"])
    assert_matches_ort(make_model([node], feeds, ["y", "s", "zp"], 11), feeds)


def test_matmul_integer_with_row_and_column_zero_points() -> None:
    feeds = {"a": _q((2, 3, 4), np.uint8), "b": _q((4, 5), np.int8),
             "azp": np.array(7, np.uint8), "bzp": _q((5,), np.int8)}
    node = helper.make_node("MatMulInteger", ["a", "b", "azp", "bzp"], ["y"])
    # Exact integer arithmetic is the oracle here, not onnxruntime: on CPUs without VNNI
    # its u8 x s8 kernels sum product pairs in saturating int16 (AVX2 vpmaddubsw), and
    # on a Zen 3 machine it returned 640 where the product is -10052.
    (got,) = segflow.InferenceSession(make_model([node], feeds, ["y"], 10)).run(None, feeds)
    a = feeds["a"].astype(np.int64) - feeds["azp"].astype(np.int64)
    b = feeds["b"].astype(np.int64) - feeds["bzp"].astype(np.int64)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, (a @ b).astype(np.int32))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qlinear_matmul(dtype: type) -> None:
    feeds = {"a": _q((2, 3, 4), dtype), "as": np.array(0.05, np.float32),
             "azp": np.array(3, dtype), "b": _q((4, 5), dtype),
             "bs": np.array(0.02, np.float32), "bzp": np.array(-1 if dtype is np.int8 else 1,
                                                               dtype),
             "ys": np.array(0.3, np.float32), "yzp": np.array(5, dtype)}
    node = helper.make_node("QLinearMatMul", ["a", "as", "azp", "b", "bs", "bzp", "ys", "yzp"],
                            ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 10), feeds, rtol=0, atol=1)


def test_conv_integer_with_pads_and_zero_points() -> None:
    feeds = {"x": _q((1, 2, 5, 5), np.uint8), "w": _q((3, 2, 3, 3), np.uint8),
             "xzp": np.array(100, np.uint8), "wzp": np.array(120, np.uint8)}
    node = helper.make_node("ConvInteger", ["x", "w", "xzp", "wzp"], ["y"], pads=[1, 1, 1, 1],
                            strides=[2, 1])
    assert_matches_ort(make_model([node], feeds, ["y"], 10), feeds, rtol=0, atol=0)


def test_qlinear_conv_per_channel_with_bias() -> None:
    feeds = {"x": _q((1, 2, 6, 6), np.uint8), "xs": np.array(0.02, np.float32),
             "xzp": np.array(128, np.uint8), "w": _q((4, 2, 3, 3), np.int8),
             "ws": np.array([0.01, 0.02, 0.015, 0.03], np.float32),
             "wzp": np.zeros(4, np.int8), "ys": np.array(0.5, np.float32),
             "yzp": np.array(120, np.uint8),
             "b": RNG.integers(-200, 200, (4,)).astype(np.int32)}
    node = helper.make_node("QLinearConv", ["x", "xs", "xzp", "w", "ws", "wzp", "ys", "yzp", "b"],
                            ["y"], auto_pad="SAME_UPPER")
    # The quantization formula in float64 is the oracle (onnxruntime's u8 x s8 kernels
    # saturate int16 pair sums on CPUs without VNNI; see the MatMulInteger test); atol 1
    # for where float32 scaling rounds a half the other way.
    (got,) = segflow.InferenceSession(make_model([node], feeds, ["y"], 10)).run(None, feeds)
    x = torch.from_numpy(feeds["x"].astype(np.float64) - 128.0)
    w = torch.from_numpy(feeds["w"].astype(np.float64))
    acc = torch.nn.functional.conv2d(x, w, padding=1).numpy() + feeds["b"][None, :, None, None]
    scale = (0.02 * feeds["ws"].astype(np.float64) / 0.5)[None, :, None, None]
    expected = np.clip(np.rint(acc * scale) + 120, 0, 255).astype(np.uint8)
    assert got.dtype == np.uint8
    np.testing.assert_allclose(got.astype(np.int64), expected.astype(np.int64), rtol=0, atol=1)


@pytest.mark.parametrize("op", ["QLinearConv", "QLinearMatMul"])
def test_requantization_rounds_the_float32_product_as_onnxruntime(op: str) -> None:
    # 5 * float32(0.1) is 0.5000000075 in float64 but exactly 0.5 in float32, where the
    # tie rounds to even: onnxruntime's outputs are 0, 2, 2, 4, 4 here, not 1, 2, 3, 4, 5.
    x = np.array([5, 15, 25, 35, 45], np.uint8)
    one = np.array(1.0, np.float32)
    feeds = {"x": x.reshape(1, 1, 5, 1) if op == "QLinearConv" else x.reshape(5, 1),
             "xs": one, "xzp": np.array(0, np.uint8),
             "w": np.ones((1, 1, 1, 1) if op == "QLinearConv" else (1, 1), np.int8),
             "ws": np.array(0.1, np.float32), "wzp": np.array(0, np.int8),
             "ys": one, "yzp": np.array(0, np.uint8)}
    node = helper.make_node(op, list(feeds), ["y"])
    (got,) = assert_matches_ort(make_model([node], feeds, ["y"], 10), feeds, rtol=0, atol=0)
    assert got.reshape(-1).tolist() == [0, 2, 2, 4, 4]


def test_quantize_rejects_exotic_output_type() -> None:
    import segflow

    x = np.ones((2,), np.float32)
    node = helper.make_node("QuantizeLinear", ["x", "s"], ["y"],
                            output_dtype=TensorProto.FLOAT6E2M3)
    model = make_model([node], {"x": x, "s": np.array(1.0, np.float32)}, ["y"], 25)
    with pytest.raises(segflow.SegflowError):
        segflow.InferenceSession(model, engine="inline")
