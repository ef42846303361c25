"""The quantize pass (passes/quantize.py): QDQ convolutions lowered to segflow.QConv.

The model is a small residual CNN built here and quantized by onnxruntime's own
quantizer (QDQ, uint8 activations, int8 weights per channel), so the graph has the
shapes real quantized exports have: Relus removed where the output zero point is 0,
one DequantizeLinear feeding several consumers, a residual Add between Q/DQ pairs and
a pooling and classifier that stay float.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from tests.targets import count

import segflow
from segflow.frontend.onnx_import import import_model
from segflow.ir.graph import Graph
from segflow.kernels.choice import KernelKind
from segflow.kernels.onednn.library import Library
from segflow.passes.quantize import lower_qdq

DNNL = Library.load()
IMAGES = 64


def _float_cnn(path: Path) -> None:
    """conv(3->16, s2)+relu -> [conv+relu -> conv] + identity -> relu -> maxpool ->
    conv(16->32, s2)+relu -> global average pool -> flatten -> gemm(10)."""
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        fan_in = int(np.prod(shape[1:]))
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32), name)

    def bias(name: str, n: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(n) * 0.1).astype(np.float32), name)

    inits = [weight("w0", 16, 3, 3, 3), bias("b0", 16), weight("w1", 16, 16, 3, 3),
             bias("b1", 16), weight("w2", 16, 16, 3, 3), bias("b2", 16),
             weight("w3", 32, 16, 3, 3), bias("b3", 32), weight("wf", 10, 32), bias("bf", 10)]
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1] * 4, strides=[2, 2]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1] * 4),
        helper.make_node("Add", ["c2", "r0"], ["s"]),
        helper.make_node("Relu", ["s"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", "w3", "b3"], ["c3"], pads=[1] * 4, strides=[2, 2]),
        helper.make_node("Relu", ["c3"], ["r3"]),
        helper.make_node("GlobalAveragePool", ["r3"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)


def _images(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(count)]


@pytest.fixture(scope="module")
def qdq_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    root = tmp_path_factory.mktemp("qdq")
    float_path, out = root / "cnn.onnx", root / "cnn-qdq.onnx"
    _float_cnn(float_path)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter({"x": image} for image in _images(16, 7))

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    quantize_static(str(float_path), str(out), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    per_channel=True)
    return out


def _graph(path: Path) -> Graph:
    return import_model(str(path))


def test_lowering_structure(qdq_model: Path) -> None:
    graph = _graph(qdq_model)
    graph.validate()
    lowered, fused, kept = lower_qdq(graph)
    graph.validate()
    assert (lowered, fused, dict(kept)) == (4, 1, {})
    ops = [n.op_type for n in graph.nodes]
    assert ops.count("QConv") == 4 and "Conv" not in ops and "Add" not in ops
    # Q/DQ only at the region's edges: the image's Q and the float tail (global pool,
    # classifier) with its own Q/DQ pairs; the MaxPool runs on the uint8 tensor.
    assert ops.count("QuantizeLinear") == 1 + 3
    pool = next(n for n in graph.nodes if n.op_type == "MaxPool")
    assert pool.inputs[0].producer.op_type == "QConv"
    assert pool.outputs[0].uses[0].op_type == "QConv"
    qconvs = [n for n in graph.nodes if n.op_type == "QConv"]
    assert [len([v for v in n.inputs if v is not None]) for n in qconvs] == [3, 3, 4, 3]
    # Activations between two QConvs stay uint8: no node in between.
    assert qconvs[1].inputs[0].producer is qconvs[0]
    assert qconvs[2].inputs[0].producer is qconvs[1]


def test_residual_switch_leaves_add_float(qdq_model: Path) -> None:
    graph = _graph(qdq_model)
    lowered, fused, _ = lower_qdq(graph, residual=False)
    graph.validate()
    assert (lowered, fused) == (4, 0)
    assert [n.op_type for n in graph.nodes].count("QuantizeLinear") == 1 + 1 + 3
    assert [n.op_type for n in graph.nodes].count("Add") == 1


def test_float_graph_unchanged(tmp_path: Path) -> None:
    _float_cnn(tmp_path / "cnn.onnx")
    graph = _graph(tmp_path / "cnn.onnx")
    before = [n.op_type for n in graph.nodes]
    assert lower_qdq(graph) == (0, 0, {"input not from DequantizeLinear": 4})
    assert [n.op_type for n in graph.nodes] == before
    sess = segflow.InferenceSession(str(tmp_path / "cnn.onnx"))
    assert "quantize: no QuantizeLinear" in sess.explain()


@pytest.mark.parametrize("optimize", [None, {"quantize.residual": False}, {"layout": False}],
                         ids=["int8", "residual_off", "reference_kernels"])
def test_top1_agreement_with_onnxruntime(qdq_model: Path, optimize: dict | None) -> None:
    ours = segflow.InferenceSession(str(qdq_model), optimize=optimize)
    theirs = ort.InferenceSession(str(qdq_model), providers=["CPUExecutionProvider"])
    agree = 0
    for image in _images(IMAGES, 11):
        a = ours.run(None, {"x": image})[0]
        b = theirs.run(None, {"x": image})[0]
        agree += int(np.argmax(a) == np.argmax(b))
    assert agree >= 0.99 * IMAGES, f"top-1 agreement {agree}/{IMAGES}"
    int8 = count(ours, KernelKind.INT8_CONV)
    if optimize is None and DNNL is not None:
        assert int8 == 4
        assert f"{4 * IMAGES} calls int8" in "\n".join(ours.kernel_report())
    if optimize == {"layout": False}:
        assert int8 == 0


def test_pass_switched_off_by_environment(qdq_model: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEGFLOW_NO_QUANTIZE", "1")
    sess = segflow.InferenceSession(str(qdq_model))
    assert "quantize: off" in sess.explain()
    assert count(sess, KernelKind.INT8_CONV) == 0


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("pads", [[1, 1, 1, 1], [0, 0, 0, 0]])
def test_integer_max_pool_matches_onnxruntime(dtype: type, pads: list[int]) -> None:
    """MaxPool over 8-bit integers (what the pass leaves between two QConvs)."""
    elem = TensorProto.UINT8 if dtype is np.uint8 else TensorProto.INT8
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                            pads=pads)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info(
        "x", elem, [2, 8, 15, 15])], [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    info = np.iinfo(dtype)
    x = np.random.default_rng(0).integers(info.min, info.max + 1, (2, 8, 15, 15)).astype(dtype)
    data = model.SerializeToString()
    ours = segflow.InferenceSession(data).run(None, {"x": x})[0]
    theirs = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(ours, theirs)


def test_conv_left_float_is_named_with_why() -> None:
    """A Conv the pass cannot lower stays float and correct, and the log says why."""
    from tests.test_qconv import qdq_conv_model

    model, _ = qdq_conv_model(cin=8, cout=8, kernel=1, pad=0)
    w = np.random.default_rng(2).standard_normal((4, 8, 1, 1)).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(w, "w_float"))
    model.graph.node.append(helper.make_node("Conv", ["y", "w_float"], ["z"]))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    data = model.SerializeToString()
    sess = segflow.InferenceSession(data)
    assert "1 Conv -> QConv (int8); Conv left float: 1 (weight not from DequantizeLinear)" \
        in sess.explain()
    x = np.random.default_rng(3).uniform(-2, 6, (1, 8, 12, 12)).astype(np.float32)
    ours = sess.run(None, {"x": x})[0]
    theirs = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # One step of the QConv's output (0.04) times the float Conv's weights bounds the gap.
    np.testing.assert_allclose(ours, theirs, atol=0.04 * np.abs(w).sum(axis=1).max() + 1e-5)
