"""segflow.QConv (ops/qconv.py) and its libdnnl int8 kernel (kernels/onednn/qconv.py),
against onnxruntime running the same QDQ convolution.

onnxruntime runs a QDQ Conv as its QLinearConv (int32 accumulation plus the int32
bias, one float32 multiplication by x_scale * w_scale / y_scale, round half to even,
then the zero point). The reference kernel forms the definition in float64; the two
round nearly the same real number, so they agree exactly except where float32's
product of the scales lands a value on the other side of a rounding tie: at most one
step, and rarely (asserted: at most 1% of the outputs differ, by at most one step). The
libdnnl kernel does onnxruntime's arithmetic in its order and is asserted bit-exact,
over inputs large enough that values near rounding ties occur.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from tests.targets import count

import segflow
from segflow.kernels.choice import KernelKind
from segflow.kernels.onednn.library import Library

DNNL = Library.load()
needs_dnnl = pytest.mark.skipif(DNNL is None, reason="libdnnl is not installed")


def qdq_conv_model(*, cin: int = 8, cout: int = 16, kernel: int = 3, stride: int = 1,
                   pad: int = 1, group: int = 1, per_channel: bool = True, x_zp: int = 3,
                   y_zp: int = 7, relu: bool = False, bias: bool = True,
                   seed: int = 0, size: int = 12) -> tuple[onnx.ModelProto, float]:
    """``DQ(Q(x)) -> Conv(DQ(w_q), DQ(b_q)) -> [Relu] -> Q -> DQ``; returns the model and
    the output's quantization step."""
    rng = np.random.default_rng(seed)
    x_scale, y_scale = 0.05, 0.04
    w_q = rng.integers(-127, 128, (cout, cin // group, kernel, kernel)).astype(np.int8)
    w_scale = (rng.uniform(0.002, 0.02, cout) if per_channel
               else np.array([0.01])).astype(np.float32)
    inits = [
        numpy_helper.from_array(np.array(x_scale, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(x_zp, np.uint8), "x_zp"),
        numpy_helper.from_array(w_q, "w_q"),
        numpy_helper.from_array(w_scale if per_channel else w_scale.reshape(()), "w_scale"),
        numpy_helper.from_array(np.zeros(cout if per_channel else (), np.int8), "w_zp"),
        numpy_helper.from_array(np.array(y_scale, np.float32), "y_scale"),
        numpy_helper.from_array(np.array(y_zp, np.uint8), "y_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], axis=0),
    ]
    conv_inputs = ["x_dq", "w_dq"]
    if bias:
        b_scale = (x_scale * w_scale).astype(np.float32).reshape(-1)
        b_scale = np.broadcast_to(b_scale, (cout,)).copy()
        b_q = rng.integers(-2000, 2000, cout).astype(np.int32)
        inits += [numpy_helper.from_array(b_q, "b_q"),
                  numpy_helper.from_array(b_scale, "b_scale"),
                  numpy_helper.from_array(np.zeros(cout, np.int32), "b_zp")]
        nodes.append(helper.make_node("DequantizeLinear", ["b_q", "b_scale", "b_zp"], ["b_dq"],
                                      axis=0))
        conv_inputs.append("b_dq")
    nodes.append(helper.make_node("Conv", conv_inputs, ["conv"], kernel_shape=[kernel, kernel],
                                  strides=[stride, stride], pads=[pad] * 4, group=group))
    last = "conv"
    if relu:
        nodes.append(helper.make_node("Relu", ["conv"], ["relu"]))
        last = "relu"
    nodes += [helper.make_node("QuantizeLinear", [last, "y_scale", "y_zp"], ["y_q"]),
              helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zp"], ["y"])]
    graph = helper.make_graph(
        nodes, "qdq_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                          [1, cin, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model, y_scale


def _steps(model: onnx.ModelProto, step: float, optimize: dict[str, bool] | None = None,
           seed: int = 1) -> tuple[np.ndarray, segflow.InferenceSession]:
    """|segflow - onnxruntime| in output steps over a random input with NaN/Inf-free
    values spanning past the input's quantized range (so saturation is exercised)."""
    data = model.SerializeToString()
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(seed).uniform(-8, 14, dims).astype(np.float32)
    sess = segflow.InferenceSession(data, optimize=optimize)
    ours = sess.run(None, {"x": x})[0]
    theirs = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return np.abs(ours.astype(np.float64) - theirs) / step, sess


def _assert_close_to_ort(steps: np.ndarray) -> None:
    assert steps.max() <= 1.0 + 1e-4, f"off by {steps.max():.2f} steps"
    assert np.count_nonzero(steps > 1e-4) <= 0.01 * steps.size, "more than 1% off by a step"


CASES = {
    "per_channel": {},
    "per_tensor": {"per_channel": False},
    "zero_points_0": {"x_zp": 0, "y_zp": 0},
    "stride_2_pad_0": {"stride": 2, "pad": 0},
    "groups": {"group": 4},
    "depthwise": {"cin": 16, "group": 16},
    "relu": {"relu": True, "y_zp": 40},
    "relu_zero_point_0": {"relu": True, "y_zp": 0},
    "no_bias_1x1": {"bias": False, "kernel": 1, "pad": 0},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_onnxruntime(case: str) -> None:
    model, step = qdq_conv_model(**CASES[case])
    steps, sess = _steps(model, step, {"layout": False})
    assert count(sess, KernelKind.INT8_CONV) == 0
    assert "1 Conv -> QConv" in sess.explain()
    _assert_close_to_ort(steps)


@needs_dnnl
@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_kernel_equals_onnxruntime_bitwise(case: str) -> None:
    # 64 output channels over 40x40: ~100k outputs, where the three-rounding form of the
    # requantization (accumulator and bias scaled apart, zero point added before the
    # rounding) differed from onnxruntime at a few.
    model, step = qdq_conv_model(**CASES[case], cin=CASES[case].get("cin", 16),
                                 cout=64, size=40) if "cin" not in CASES[case] else \
        qdq_conv_model(**{**CASES[case], "cin": 64, "group": 64}, cout=64, size=40)
    steps, sess = _steps(model, step)
    assert count(sess, KernelKind.INT8_CONV) == 1
    report = "\n".join(sess.kernel_report())
    assert "1 calls int8" in report and "0 through the reference" in report, report
    if case == "relu":
        # A ReLU before a zero point above the range's bottom is not a clamp of the
        # quantized output, and onnxruntime then runs its own float form of the node.
        _assert_close_to_ort(steps)
    else:
        assert steps.max() == 0, f"{np.count_nonzero(steps)} of {steps.size} outputs differ"


def test_pass_off_runs_float_and_still_matches() -> None:
    model, step = qdq_conv_model()
    steps, sess = _steps(model, step, {"quantize": False})
    assert "quantize: off" in sess.explain()
    assert count(sess, KernelKind.INT8_CONV) == 0
    assert steps.max() <= 1.0 + 1e-4


@needs_dnnl
def test_int8_kernel_equals_reference_bitwise_or_one_step() -> None:
    """The kernel against the reference over many values (both from the same node)."""
    from segflow.ir.graph import Node, Value
    from segflow.kernels.onednn.qconv import Int8Conv
    from segflow.ops.qconv import QuantParams, qconv_reference

    rng = torch.Generator().manual_seed(3)
    cout = 32
    attrs = dict(pads=[1, 0, 1, 2], strides=[1, 2], dilations=[1, 1], group=1, x_scale=0.02,
                 x_zero_point=128, w_scale=torch.rand(cout, generator=rng).add(0.1).mul(0.01)
                 .tolist(), w_zero_point=[0] * cout, y_scale=0.05, y_zero_point=100,
                 y_dtype="uint8", relu=1, r_scale=0.03, r_zero_point=90, c_scale=0.04,
                 c_zero_point=120, c_dtype="uint8")
    params = QuantParams(Node("QConv", [], [Value("y")], attrs, domain="segflow"))
    w = torch.randint(-128, 128, (cout, 16, 3, 3), dtype=torch.int8, generator=rng)
    x = torch.randint(0, 256, (2, 16, 9, 11), dtype=torch.uint8, generator=rng)
    bias = torch.randn(cout, generator=rng)
    expected_shape = [2, cout, 9, 6]
    residual = torch.randint(0, 256, expected_shape, dtype=torch.uint8, generator=rng)
    op = Int8Conv(DNNL, "", params, w, bias, True)
    got = op(x, w, bias, residual)
    want = qconv_reference(params, x, w, bias, residual)
    assert op.native_calls == 1 and list(got.shape) == expected_shape
    diff = (got.to(torch.int32) - want.to(torch.int32)).abs()
    assert int(diff.max()) <= 1
    assert int(torch.count_nonzero(diff)) <= 0.01 * diff.numel()


def test_weight_zero_point_falls_back_to_reference() -> None:
    """libdnnl takes no weight zero point: such a node runs the reference, counted."""
    from segflow.ir.graph import Node, Value
    from segflow.kernels.onednn.qconv import Int8Conv
    from segflow.ops.qconv import QuantParams, qconv_reference

    attrs = dict(pads=[0] * 4, strides=[1, 1], dilations=[1, 1], group=1, x_scale=0.1,
                 x_zero_point=0, w_scale=[0.1] * 4, w_zero_point=[1, 0, 0, 0], y_scale=0.5,
                 y_zero_point=0, y_dtype="uint8", relu=0)
    params = QuantParams(Node("QConv", [], [Value("y")], attrs, domain="segflow"))
    w = torch.ones(4, 2, 1, 1, dtype=torch.int8)
    x = torch.full((1, 2, 3, 3), 7, dtype=torch.uint8)
    op = Int8Conv(DNNL, "no libdnnl", params, w, None, False)
    assert torch.equal(op(x, w), qconv_reference(params, x, w, None, None))
    assert op.native_calls == 0 and op.torch_calls == 1
    assert "weight zero point" in next(iter(op.why_torch))
