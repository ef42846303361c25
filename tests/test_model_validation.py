"""Invalid models are refused at load, naming the node, where onnxruntime refuses them;
the models onnxruntime accepts (a -1 dim, byte-swapped or bfloat16 feeds) run and match it.

Each invalid model is small and handmade; the test asserts segflow's exception type and
message and that onnxruntime refuses the same model (at session creation, or at its
first run where its kernels check what segflow checks at load).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import segflow
from segflow.errors import InvalidModel, UnsupportedOp

ATOL, RTOL = 1e-5, 1e-4


def _vi(name: str, shape=(1, 4, 8, 8), elem: int = T.FLOAT) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset: int | None = 17, value_info=(),
           extra_opsets=()) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "g", inputs, outputs, initializer=list(inits),
                         value_info=list(value_info))
    opsets = ([h.make_opsetid("", opset)] if opset else []) + list(extra_opsets)
    return h.make_model(graph, opset_imports=opsets)


def _weight(shape, name: str = "w") -> onnx.TensorProto:
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return onnx.numpy_helper.from_array(data, name)


def _conv(op: str = "Conv", x=(1, 4, 8, 8), w=(6, 4, 3, 3), **attrs) -> onnx.ModelProto:
    node = h.make_node(op, ["x", "w"], ["y"], name="conv1", **attrs)
    return _model([node], [_vi("x", x)], [_vi("y", None)], [_weight(w)])


def _pool(op: str, x=(1, 4, 8, 8), **attrs) -> onnx.ModelProto:
    node = h.make_node(op, ["x"], ["y"], name="pool1", **attrs)
    return _model([node], [_vi("x", x)], [_vi("y", None)], opset=18)


def _relu(opset: int | None = 17, **kwargs) -> onnx.ModelProto:
    return _model([h.make_node("Relu", ["x"], ["y"], name="relu1")], [_vi("x")], [_vi("y")],
                  opset=opset, **kwargs)


def _if(then_nodes, then_out: str, outer_nodes=()) -> onnx.ModelProto:
    then = h.make_graph(then_nodes, "then", [], [_vi(then_out, (2,))])
    other = h.make_graph([h.make_node("Relu", ["x"], ["e_out"], name="else1")], "else", [],
                         [_vi("e_out", (2,))])
    node = h.make_node("If", ["c"], ["y"], name="if1", then_branch=then, else_branch=other)
    return _model([*outer_nodes, node], [_vi("x", (2,)), _vi("c", (), T.BOOL)],
                  [_vi("y", (2,))])


def _slice_steps_zero() -> onnx.ModelProto:
    consts = [h.make_tensor(n, T.INT64, [1], [v])
              for n, v in (("starts", 0), ("ends", 2), ("axes", 0), ("steps", 0))]
    node = h.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"], name="slice1")
    return _model([node], [_vi("x", (4, 3))], [_vi("y", None)], consts)


@dataclass
class Case:
    build: Callable[[], onnx.ModelProto]
    error: type[Exception]
    names: tuple[str, ...]           # what the message must name
    feeds: dict[str, np.ndarray] = field(default_factory=dict)  # onnxruntime's first run
    invalid: bool = True  # False: valid, but segflow does not implement it (onnxruntime runs it)


IMAGE = {"x": np.ones((1, 4, 8, 8), np.float32)}

INVALID = {
    # a value defined twice
    "two nodes write one name": Case(lambda: _model(
        [h.make_node("Relu", ["x"], ["y"], name="a"), h.make_node("Neg", ["x"], ["y"], name="b")],
        [_vi("x")], [_vi("y")]), InvalidModel, ("'b'", "Neg", "'y'", "node 'a'")),
    "node output reuses a graph input": Case(lambda: _model(
        [h.make_node("Relu", ["x"], ["x"], name="a")], [_vi("x")], [_vi("x")]),
        InvalidModel, ("'a'", "Relu", "'x'", "graph input")),
    "node output reuses an initializer": Case(lambda: _model(
        [h.make_node("Relu", ["x"], ["w"], name="a")], [_vi("x")], [_vi("w", (1,))],
        [h.make_tensor("w", T.FLOAT, [1], [1.0])]), InvalidModel, ("'a'", "'w'", "initializer")),
    "duplicate graph inputs": Case(lambda: _model(
        [h.make_node("Relu", ["x"], ["y"], name="a")], [_vi("x"), _vi("x")], [_vi("y")]),
        InvalidModel, ("graph input 'x'", "twice")),
    "subgraph writes twice": Case(lambda: _if(
        [h.make_node("Neg", ["x"], ["t"], name="t1"), h.make_node("Relu", ["x"], ["t"], name="t2")],
        "t"), InvalidModel, ("'t2'", "'t'", "'t1'")),
    "subgraph writes an outer input": Case(lambda: _if(
        [h.make_node("Neg", ["x"], ["x"], name="t1")], "x"), InvalidModel, ("'t1'", "'x'")),
    "subgraph writes an earlier outer value": Case(lambda: _if(
        [h.make_node("Neg", ["x"], ["z"], name="t1")], "z",
        [h.make_node("Relu", ["x"], ["z"], name="outer_z")]), InvalidModel,
        ("'t1'", "'z'", "'outer_z'")),
    # opsets
    "no opset_import": Case(lambda: _relu(opset=None), InvalidModel,
                            ("'relu1'", "opset_import")),
    "opset newer than implemented": Case(lambda: _relu(opset=29), UnsupportedOp,
                                         ("'relu1'", "opset 29", "28")),
    # Conv / ConvTranspose attributes and shapes
    "conv strides 0": Case(lambda: _conv(strides=[0, 1]), InvalidModel, ("'conv1'", "strides")),
    "conv strides negative": Case(lambda: _conv(strides=[-1, 1]), InvalidModel,
                                  ("'conv1'", "strides")),
    "conv dilations 0": Case(lambda: _conv(dilations=[0, 1]), InvalidModel,
                             ("'conv1'", "dilations")),
    "conv pads negative": Case(lambda: _conv(pads=[-1, 0, 0, 0]), InvalidModel,
                               ("'conv1'", "pads")),
    "conv pads length": Case(lambda: _conv(pads=[1, 1]), InvalidModel, ("'conv1'", "pads")),
    "conv strides length": Case(lambda: _conv(strides=[1]), InvalidModel,
                                ("'conv1'", "strides")),
    "conv group 0": Case(lambda: _conv(group=0), InvalidModel, ("'conv1'", "Conv", "group"),
                         IMAGE),
    "conv group negative": Case(lambda: _conv(group=-1), InvalidModel, ("'conv1'", "group"),
                                IMAGE),
    "conv channels != group x weight channels": Case(lambda: _conv(group=2), InvalidModel,
                                                     ("'conv1'", "channels", "group"), IMAGE),
    "conv output channels % group": Case(lambda: _conv(w=(6, 1, 3, 3), group=4), InvalidModel,
                                         ("'conv1'", "divisible"), IMAGE),
    "conv weight channels": Case(lambda: _conv(w=(6, 3, 3, 3)), InvalidModel,
                                 ("'conv1'", "channels"), IMAGE),
    "conv kernel larger than input": Case(lambda: _conv(w=(6, 4, 9, 9)), InvalidModel,
                                          ("'conv1'", "larger than the padded input"), IMAGE),
    "conv kernel_shape contradicts weight": Case(lambda: _conv(kernel_shape=[5, 5]),
                                                 InvalidModel, ("'conv1'", "kernel_shape"),
                                                 IMAGE),
    "conv auto_pad unknown": Case(lambda: _conv(auto_pad="FOO"), InvalidModel,
                                  ("'conv1'", "auto_pad")),
    "convtranspose group 0": Case(lambda: _conv("ConvTranspose", w=(4, 6, 3, 3), group=0),
                                  InvalidModel, ("'conv1'", "ConvTranspose", "group")),
    "convtranspose weight channels": Case(lambda: _conv("ConvTranspose", w=(3, 6, 3, 3)),
                                          InvalidModel, ("'conv1'", "channels"), IMAGE),
    "convtranspose channels % group": Case(
        lambda: _conv("ConvTranspose", w=(4, 2, 3, 3), group=3), InvalidModel,
        ("'conv1'", "group")),
    "convtranspose strides 0": Case(lambda: _conv("ConvTranspose", w=(4, 6, 3, 3),
                                                  strides=[0, 1]), InvalidModel,
                                    ("'conv1'", "strides")),
    "convtranspose output_padding": Case(
        lambda: _conv("ConvTranspose", w=(4, 6, 3, 3), strides=[2, 1], output_padding=[3, 0]),
        InvalidModel, ("'conv1'", "output_padding"), IMAGE),
    # Slice, value_info
    "slice steps 0": Case(_slice_steps_zero, InvalidModel, ("'slice1'", "Slice", "step")),
    "value_info dtype contradicts producer": Case(lambda: _model(
        [h.make_node("Relu", ["x"], ["y"], name="a"), h.make_node("Neg", ["y"], ["z"], name="b")],
        [_vi("x")], [_vi("z")], value_info=[_vi("y", elem=T.INT64)]), InvalidModel,
        ("'a'", "Relu", "tensor(float)", "tensor(int64)")),
    "output dtype contradicts producer": Case(lambda: _model(
        [h.make_node("Relu", ["x"], ["y"], name="a")], [_vi("x")], [_vi("y", elem=T.INT64)]),
        InvalidModel, ("'a'", "Relu")),
    # graph inputs
    "op without a string form over strings": Case(lambda: _model(
        [h.make_node("ReverseSequence", ["x", "n"], ["y"], name="a")],
        [_vi("x", (2, 2), T.STRING)], [_vi("y", (2, 2), T.STRING)],
        [onnx.numpy_helper.from_array(np.array([1, 2], np.int64), "n")]), UnsupportedOp,
        ("'a'", "ReverseSequence", "string"),
        {"x": np.array([["a", "b"], ["c", "d"]], dtype=object)}, invalid=False),
    # schema and type constraints (onnxruntime verifies every node against its schema)
    "unknown attribute": Case(lambda: _model(
        [h.make_node("Relu", ["x"], ["y"], name="a", foo=1)], [_vi("x")], [_vi("y")]),
        InvalidModel, ("'a'", "Relu", "foo")),
    "too many inputs": Case(lambda: _model(
        [h.make_node("Relu", ["x", "x"], ["y"], name="a")], [_vi("x")], [_vi("y")]),
        InvalidModel, ("'a'", "Relu", "input")),
    "input type outside the constraint": Case(lambda: _model(
        [h.make_node("Sqrt", ["x"], ["y"], name="a")], [_vi("x", (2,), T.INT64)],
        [_vi("y", (2,), T.INT64)]), InvalidModel, ("'a'", "Sqrt", "tensor(int64)")),
    "one type bound to two": Case(lambda: _model(
        [h.make_node("Add", ["x", "i"], ["y"], name="a")],
        [_vi("x", (2,)), _vi("i", (2,), T.INT64)], [_vi("y", (2,))]), InvalidModel,
        ("'a'", "Add", "'x'", "'i'")),
    "broadcast mismatch": Case(lambda: _model(
        [h.make_node("Add", ["x", "b"], ["y"], name="a")], [_vi("x", (2, 3))], [_vi("y", None)],
        [h.make_tensor("b", T.FLOAT, [4], [1, 2, 3, 4])]), InvalidModel, ("'a'", "Add")),
    "transpose perm repeated": Case(lambda: _model(
        [h.make_node("Transpose", ["x"], ["y"], name="a", perm=[0, 0, 1, 2])], [_vi("x")],
        [_vi("y", None)]), InvalidModel, ("'a'", "Transpose", "perm")),
}

for _op in ("MaxPool", "AveragePool", "LpPool"):
    INVALID |= {
        f"{_op} strides 0": Case(lambda op=_op: _pool(op, kernel_shape=[2, 2], strides=[0, 1]),
                                 InvalidModel, ("'pool1'", _op, "strides")),
        f"{_op} kernel_shape missing": Case(lambda op=_op: _pool(op), InvalidModel,
                                            ("'pool1'", _op, "kernel_shape")),
        f"{_op} kernel_shape 0": Case(lambda op=_op: _pool(op, kernel_shape=[0, 2]),
                                      InvalidModel, ("'pool1'", "kernel_shape")),
        f"{_op} pads negative": Case(
            lambda op=_op: _pool(op, kernel_shape=[2, 2], pads=[-1, 0, 0, 0]), InvalidModel,
            ("'pool1'", "pads")),
        f"{_op} kernel_shape length": Case(lambda op=_op: _pool(op, kernel_shape=[2]),
                                           InvalidModel, ("'pool1'", "kernel_shape")),
        f"{_op} pads not smaller than kernel": Case(
            lambda op=_op: _pool(op, kernel_shape=[2, 2], pads=[2, 2, 2, 2]), InvalidModel,
            ("'pool1'", "pads", "kernel_shape")),
    }
for _op, _axis in (("LayerNormalization", 4), ("Softmax", -5), ("LogSoftmax", 4),
                   ("Hardmax", 4), ("Flatten", 5)):
    INVALID[f"{_op} axis out of range"] = Case(
        lambda op=_op, axis=_axis: _model(
            [h.make_node(op, ["x", "g"] if op == "LayerNormalization" else ["x"], ["y"],
                         name="ax1", axis=axis)], [_vi("x")], [_vi("y", None)],
            [h.make_tensor("g", T.FLOAT, [8], [1.0] * 8)] if op == "LayerNormalization" else ()),
        InvalidModel, ("'ax1'", _op, "axis"))
INVALID |= {
    "conv bias of the wrong size": Case(lambda: _model(
        [h.make_node("Conv", ["x", "w", "b"], ["y"], name="conv1")], [_vi("x")],
        [_vi("y", None)], [_weight((6, 4, 3, 3)), h.make_tensor("b", T.FLOAT, [4], [0.0] * 4)]),
        InvalidModel, ("'conv1'", "'b'", "[6]"), IMAGE),
    "batch norm scale of the wrong size": Case(lambda: _model(
        [h.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn1")],
        [_vi("x")], [_vi("y", None)],
        [h.make_tensor(n, T.FLOAT, [k], [1.0] * k) for n, k in
         (("s", 3), ("b", 4), ("m", 4), ("v", 4))]), InvalidModel,
        ("'bn1'", "BatchNormalization"), IMAGE),
    "layer norm scale that does not broadcast": Case(lambda: _model(
        [h.make_node("LayerNormalization", ["x", "g"], ["y"], name="ln1")], [_vi("x")],
        [_vi("y", None)], [h.make_tensor("g", T.FLOAT, [7], [1.0] * 7)]), InvalidModel,
        ("'ln1'", "'g'"), IMAGE),
    "gemm C that does not broadcast": Case(lambda: _model(
        [h.make_node("Gemm", ["x", "w", "c"], ["y"], name="gemm1")], [_vi("x", (2, 8))],
        [_vi("y", None)], [_weight((8, 5)), h.make_tensor("c", T.FLOAT, [4], [0.0] * 4)]),
        InvalidModel, ("'gemm1'", "'c'"), {"x": np.ones((2, 8), np.float32)}),
}
INVALID["MaxPool dilations 0"] = Case(
    lambda: _pool("MaxPool", kernel_shape=[2, 2], dilations=[0, 1]), InvalidModel,
    ("'pool1'", "dilations"))
INVALID["AveragePool dilations before opset 19"] = Case(
    lambda: _pool("AveragePool", kernel_shape=[2, 2], dilations=[1, 1]), InvalidModel,
    ("'pool1'", "dilations"))

MS = [h.make_opsetid("com.microsoft", 1)]


def _contrib(op: str, inputs: list[str], inits=(), **attrs) -> onnx.ModelProto:
    node = h.make_node(op, inputs, ["y"], name="ms1", domain="com.microsoft", **attrs)
    return _model([node], [_vi("x", (2, 3, 8))], [_vi("y", None)], inits, extra_opsets=MS)


_SCALE = [h.make_tensor(n, T.FLOAT, [], [0.1]) for n in ("s", "t")]
INVALID |= {
    "contrib op unknown to segflow": Case(
        lambda: _contrib("NoSuchContribOp", ["x"]), UnsupportedOp,
        ("NoSuchContribOp", "com.microsoft", "'ms1'")),
    "Attention without num_heads": Case(
        lambda: _contrib("Attention", ["x", "w"], [_weight((8, 24))]), InvalidModel,
        ("'ms1'", "Attention", "num_heads")),
    "SkipLayerNormalization without gamma": Case(
        lambda: _contrib("SkipLayerNormalization", ["x", "x"]), InvalidModel,
        ("'ms1'", "SkipLayerNormalization", "input 2")),
    "MatMulNBits without block_size": Case(
        lambda: _contrib("MatMulNBits", ["x", "b", "s"],
                         [h.make_tensor("b", T.UINT8, [4, 1, 4], [0] * 16), _SCALE[0]],
                         K=8, N=4), InvalidModel, ("'ms1'", "MatMulNBits", "block_size")),
    "QLinearConcat with a broken triple": Case(
        lambda: _contrib("QLinearConcat", ["s", "z", "x", "t", "z", "x", "t"],
                         [*_SCALE, h.make_tensor("z", T.UINT8, [], [0])], axis=0),
        InvalidModel, ("'ms1'", "QLinearConcat", "triples")),
}


def _ort_refuses(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> bool:
    """Whether onnxruntime refuses ``model`` at session creation (or, given feeds, at
    its first run)."""
    try:
        sess = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    except Exception:
        return True
    if not feeds:
        return False
    try:
        sess.run(None, feeds)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("case", INVALID.values(), ids=INVALID.keys())
def test_invalid_model_is_refused_at_load_naming_the_node(case: Case) -> None:
    model = case.build()
    with pytest.raises(case.error) as info:
        segflow.InferenceSession(model)
    message = str(info.value)
    assert "\n" not in message
    for name in case.names:
        assert name in message, message
    assert _ort_refuses(model, case.feeds) == case.invalid


def test_default_domain_not_imported_is_refused() -> None:
    # onnxruntime fills a missing ai.onnx import with its newest opset; segflow refuses
    # to guess the opset a node means (onnx's checker refuses the model too).
    model = _relu(opset=None, extra_opsets=[h.make_opsetid("com.microsoft", 1)])
    with pytest.raises(InvalidModel, match="'relu1'.*Relu.*opset_import"):
        segflow.InferenceSession(model)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model)


def test_negative_declared_dim_other_than_minus_one_is_refused() -> None:
    # onnxruntime reads any negative dim as unknown; -1 is how exporters write it, any
    # other negative value is refused as a broken declaration.
    model = _model([h.make_node("Relu", ["x"], ["y"], name="a")], [_vi("x", (1, -3))],
                   [_vi("y", None)])
    with pytest.raises(InvalidModel, match=r"graph input 'x' declares dimension -3 at axis 1"):
        segflow.InferenceSession(model)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_pool_kernel_larger_than_padded_input_is_refused(op) -> None:
    # onnxruntime returns an empty tensor for it; segflow refuses the window at load.
    model = _pool(op, kernel_shape=[9, 9], pads=[0, 0, 0, 0])
    with pytest.raises(InvalidModel, match="'pool1'.*larger than the padded input"):
        segflow.InferenceSession(model)
    assert _ort(model, IMAGE)[0].shape == (1, 4, 0, 0)
    fits = _pool(op, kernel_shape=[9, 9], pads=[1, 1, 0, 0])  # 8 + 1 pad: one window
    np.testing.assert_allclose(segflow.InferenceSession(fits).run(None, IMAGE)[0],
                               _ort(fits, IMAGE)[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
@pytest.mark.parametrize("kernel,strides,pads", [
    (320, 320, [0, 0, 0, 0]),   # global pooling as a huge kernel (transformers' EfficientNet)
    (11, 4, [0, 0, 0, 0]),      # overhangs 8 by 3 < stride: one window, over what it covers
    (10, 2, [1, 1, 0, 0]),      # 9 padded, overhang 1 < stride 2
], ids=["global", "overhang", "padded"])
def test_ceil_mode_pool_overhanging_by_less_than_a_stride_runs(op, kernel, strides,
                                                                 pads) -> None:
    # ceil_mode rounds the output size up: the window overhangs the padded input and
    # pools the part it covers, in onnxruntime as in torch.
    model = _pool(op, kernel_shape=[kernel, kernel], strides=[strides, strides], pads=pads,
                  ceil_mode=1)
    x = {"x": np.random.default_rng(0).random((1, 4, 8, 8), dtype=np.float32)}
    expected = _ort(model, x)[0]
    assert expected.shape == (1, 4, 1, 1)
    np.testing.assert_allclose(segflow.InferenceSession(model).run(None, x)[0], expected,
                               atol=ATOL, rtol=RTOL)
    # One stride further and not even ceil_mode gives a window: refused as before.
    beyond = _pool(op, kernel_shape=[8 + sum(pads[::2]) + strides] * 2,
                   strides=[strides, strides], pads=pads, ceil_mode=1)
    with pytest.raises(InvalidModel, match="'pool1'.*larger than the padded input"):
        segflow.InferenceSession(beyond)


def _ort(model: onnx.ModelProto, feeds):
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def _conv_relu_pool(x_shape) -> onnx.ModelProto:
    nodes = [h.make_node("Conv", ["x", "w", "b"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
             h.make_node("Relu", ["c"], ["r"], name="relu1"),
             h.make_node("MaxPool", ["r"], ["y"], name="pool1", kernel_shape=[2, 2],
                         strides=[2, 2])]
    inits = [_weight((16, 3, 3, 3)), _weight((16,), "b")]
    return _model(nodes, [_vi("x", x_shape)], [_vi("y", None)], inits)


@pytest.mark.parametrize("optimize", [None, {"layout": False}], ids=["default", "layout-off"])
@pytest.mark.parametrize("x_shape", [(-1, 3, -1, -1), (-1, 3, 16, 16)],
                         ids=["all-unknown", "batch-unknown"])
def test_minus_one_dim_is_unknown(x_shape, optimize) -> None:
    model = _conv_relu_pool(x_shape)
    sess = segflow.InferenceSession(model, optimize=optimize)
    assert sess.get_inputs()[0].shape == [None if d == -1 else d for d in x_shape]
    rng = np.random.default_rng(1)
    for batch, size in ((1, 16), (3, 16 if x_shape[2] == 16 else 12)):
        x = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
        got = sess.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, _ort(model, {"x": x})[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [">f4", "<f4"])
def test_byte_swapped_feed_is_converted(dtype) -> None:
    model = _relu()
    x = np.random.default_rng(2).standard_normal((1, 4, 8, 8)).astype(dtype)
    sess = segflow.InferenceSession(model)
    for _ in range(2):  # the second run takes the fast path for the feeds seen before
        got = sess.run(None, {"x": x})[0]
        # onnxruntime reads a byte-swapped array's bytes as they lie: compare with the
        # same values in native order.
        np.testing.assert_array_equal(got, _ort(model, {"x": x.astype(np.float32)})[0])


def test_bfloat16_feed_and_output() -> None:
    # onnxruntime's Python API takes no ml_dtypes.bfloat16 array and returns no bfloat16
    # output ("No corresponding Numpy type"); segflow takes and returns them as onnx does.
    nodes = [h.make_node("Cast", ["x"], ["f"], name="up", to=T.FLOAT),
             h.make_node("Mul", ["f", "f"], ["sq"], name="mul"),
             h.make_node("Cast", ["sq"], ["y"], name="down", to=T.BFLOAT16)]
    model = _model(nodes, [_vi("x", (2, 3), T.BFLOAT16)], [_vi("y", (2, 3), T.BFLOAT16),
                                                            _vi("sq", (2, 3))])
    x = np.array([[1.5, -2.25, 3.0], [0.1, 7.0, -0.5]], dtype=ml_dtypes.bfloat16)
    y, sq = segflow.InferenceSession(model).run(None, {"x": x})
    assert y.dtype == np.dtype(ml_dtypes.bfloat16) and sq.dtype == np.float32
    expected = x.astype(np.float32) ** 2
    np.testing.assert_array_equal(sq, expected)
    np.testing.assert_array_equal(y, expected.astype(ml_dtypes.bfloat16))
    float_model = _model(nodes[1:2], [_vi("f", (2, 3))], [_vi("sq", (2, 3))])
    np.testing.assert_array_equal(_ort(float_model, {"f": x.astype(np.float32)})[0], sq)


def _loop_shadowing_outer_names() -> onnx.ModelProto:
    body = h.make_graph(
        [h.make_node("Identity", ["c"], ["c_out"], name="keep"),
         h.make_node("Neg", ["x"], ["x_out"], name="neg")], "body",
        [_vi("i", (), T.INT64), _vi("c", (), T.BOOL), _vi("x", (2,))],
        [_vi("c_out", (), T.BOOL), _vi("x_out", (2,))])
    node = h.make_node("Loop", ["n", "c", "x"], ["y"], name="loop1", body=body)
    return _model([node], [_vi("x", (2,)), _vi("c", (), T.BOOL), _vi("n", (), T.INT64)],
                  [_vi("y", (2,))])


def _duplicate_initializers() -> onnx.ModelProto:
    return _model([h.make_node("Add", ["x", "w"], ["y"], name="a")], [_vi("x", (1,))],
                  [_vi("y", (1,))], [h.make_tensor("w", T.FLOAT, [1], [1.0]),
                                     h.make_tensor("w", T.FLOAT, [1], [2.0])])


def _subgraph_output_named_like_its_node() -> onnx.ModelProto:
    return _if([h.make_node("Neg", ["x"], ["y"], name="t1")], "y")


VALID = {
    # a subgraph's inputs may shadow outer names
    "loop body inputs shadow outer names": (_loop_shadowing_outer_names, {
        "x": np.array([1, 2], np.float32), "c": np.array(True), "n": np.array(3)}),
    # onnxruntime warns and keeps the last one
    "duplicate initializers": (_duplicate_initializers, {"x": np.array([1], np.float32)}),
    "subgraph output named like the If's": (_subgraph_output_named_like_its_node, {
        "x": np.array([1, -2], np.float32), "c": np.array(True)}),
    # a declared output shape contradicting the inferred one: onnxruntime merges leniently
    "declared output shape contradicts": (lambda: _model(
        [h.make_node("Relu", ["x"], ["y"], name="a")], [_vi("x", (2,))], [_vi("y", (5,))]),
        {"x": np.array([1, -2], np.float32)}),
    "declared value_info shape contradicts": (lambda: _model(
        [h.make_node("Relu", ["x"], ["r"], name="a"), h.make_node("Neg", ["r"], ["y"], name="b"),
         h.make_node("Softmax", ["y"], ["z"], name="c")], [_vi("x", (2, 3))], [_vi("z", None)],
        value_info=[_vi("r", (4, 3)), _vi("y", (7,))]),
        {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}),
    # onnx's expansion of the op's function body fails with the default axes; onnxruntime
    # runs the op by its kernel
    "function op whose body onnx cannot infer": (lambda: _model(
        [h.make_node("MeanVarianceNormalization", ["x"], ["y"], name="mvn")],
        [_vi("x", (2, 3, 2, 2))], [_vi("y", (2, 3, 2, 2))]),
        {"x": np.random.default_rng(0).standard_normal((2, 3, 2, 2)).astype(np.float32)}),
}


@pytest.mark.filterwarnings("ignore:output '.' has shape")
@pytest.mark.parametrize("build,feeds", VALID.values(), ids=VALID.keys())
def test_valid_edge_cases_match_onnxruntime(build, feeds) -> None:
    model = build()
    got = segflow.InferenceSession(model).run(None, feeds)
    for a, b in zip(got, _ort(model, feeds), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL)


def test_feed_of_a_dtype_segflow_cannot_read_names_the_input() -> None:
    x = np.zeros((1, 4, 8, 8), dtype=ml_dtypes.float6_e2m3fn)
    with pytest.raises(segflow.InvalidInput, match="input 'x' has numpy dtype float6_e2m3fn"):
        segflow.InferenceSession(_relu()).run(None, {"x": x})
