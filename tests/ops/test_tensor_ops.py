"""Spec checks of the kernels in tensor.py, elementwise.py and nn.py against onnxruntime
(Split, Slice, Cast, BitCast, unsigned arithmetic, Clip, Mod/Div, Max/Min, Pow, Swish,
SwiGLU, MaxPool indices, AveragePool, ConvTranspose, BatchNormalization training)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from ort_compare import assert_matches_ort, make_model

import segflow

RNG = np.random.default_rng(0)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return segflow.InferenceSession(model, engine="inline").run(None, feeds)


def _matches_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                       rtol: float = 1e-5, atol: float = 1e-6) -> None:
    expected = ReferenceEvaluator(model).run(None, feeds)
    got = _run(model, feeds)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)


# -- Split / Slice -------------------------------------------------------------------------

@pytest.mark.parametrize(("opset", "dim", "n_out", "split", "num_outputs"), [
    (18, 5, 3, None, 3), (18, 6, 2, [1, 5], None), (13, 6, 3, None, None),
    (13, 7, 2, [3, 4], None), (11, 6, 3, [1, 2, 3], None), (2, 4, 2, None, None)])
def test_split(opset: int, dim: int, n_out: int, split: list[int] | None,
               num_outputs: int | None) -> None:
    feeds = {"x": RNG.standard_normal((2, dim)).astype(np.float32)}
    outputs = [f"y{i}" for i in range(n_out)]
    inputs, inits = ["x"], {}
    attrs: dict[str, object] = {"axis": -1 if opset >= 11 else 1}
    if num_outputs is not None:
        attrs["num_outputs"] = num_outputs
    if split is not None and opset >= 13:
        inits["split"] = np.array(split, dtype=np.int64)
        inputs.append("split")
    elif split is not None:
        attrs["split"] = split
    node = helper.make_node("Split", inputs, outputs, **attrs)
    assert_matches_ort(make_model([node], feeds, outputs, opset, inits), feeds)


@pytest.mark.parametrize(("starts", "ends", "axes", "steps"), [
    ([3], [0], [1], [-1]), ([-1], [-100], [1], [-2]), ([0, 1], [100, -1], [0, 1], [2, 1]),
    ([5], [1], [-1], [-3]), ([2], [2], [0], [1]), ([-2], [10], [0], None)])
def test_slice(starts: list[int], ends: list[int], axes: list[int],
               steps: list[int] | None) -> None:
    feeds = {"x": RNG.standard_normal((4, 6)).astype(np.float32)}
    inits = {"s": np.array(starts, np.int64), "e": np.array(ends, np.int64),
             "a": np.array(axes, np.int64)}
    inputs = ["x", "s", "e", "a"]
    if steps is not None:
        inits["st"] = np.array(steps, np.int64)
        inputs.append("st")
    node = helper.make_node("Slice", inputs, ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 13, inits), feeds)


def test_slice_opset1_attributes() -> None:
    feeds = {"x": RNG.standard_normal((4, 6)).astype(np.float32)}
    node = helper.make_node("Slice", ["x"], ["y"], starts=[1, -3], ends=[3, 1000], axes=[0, 1])
    assert_matches_ort(make_model([node], feeds, ["y"], 9), feeds)


# -- Cast / BitCast ------------------------------------------------------------------------

CASTS = [
    (np.float32, TensorProto.BOOL), (np.bool_, TensorProto.FLOAT),
    (np.float32, TensorProto.FLOAT16), (np.float16, TensorProto.FLOAT),
    (np.int32, TensorProto.FLOAT16), (np.float32, TensorProto.INT32),
    (np.int64, TensorProto.UINT8), (np.uint8, TensorProto.INT64), (np.float64, TensorProto.FLOAT),
    (np.int8, TensorProto.BOOL),
]


@pytest.mark.parametrize(("src", "to"), CASTS)
def test_cast(src: type, to: int) -> None:
    values = np.array([0, 1, -1.5, 2.75, 100, -7, 0.0, 3], dtype=np.float64)
    if src is np.bool_:
        x = values > 0
    elif np.issubdtype(src, np.unsignedinteger):
        x = np.abs(values).astype(src)
    else:
        x = values.astype(src)
    feeds = {"x": x.reshape(2, 4)}
    node = helper.make_node("Cast", ["x"], ["y"], to=to)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


def test_cast_like() -> None:
    feeds = {"x": RNG.standard_normal(5).astype(np.float32), "like": np.zeros(1, np.float16)}
    node = helper.make_node("CastLike", ["x", "like"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 15), feeds)


@pytest.mark.parametrize(("src", "to"), [(np.float32, TensorProto.INT32),
                                         (np.int64, TensorProto.DOUBLE),
                                         (np.bool_, TensorProto.UINT8),
                                         (np.uint16, TensorProto.INT16)])
def test_bitcast(src: type, to: int) -> None:
    raw = np.array([1.0, -2.5, 3.75, 0.0], dtype=np.float64)
    x = raw > 0 if src is np.bool_ else (np.abs(raw) * 1000).astype(src)
    for shape in [(4,), (2, 2)]:
        feeds = {"x": x.reshape(shape)}
        node = helper.make_node("BitCast", ["x"], ["y"], to=to)
        _matches_reference(make_model([node], feeds, ["y"], 26), feeds)


# -- unsigned integer arithmetic (torch lacks most uint16/32/64 kernels) -------------------

UNSIGNED_BINARY: list[tuple[str, Callable[[np.ndarray, np.ndarray], np.ndarray]]] = [
    ("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply), ("Div", np.floor_divide),
    ("Mod", np.mod), ("Max", np.maximum), ("Min", np.minimum), ("Greater", np.greater),
    ("GreaterOrEqual", np.greater_equal), ("Less", np.less), ("LessOrEqual", np.less_equal),
    ("Equal", np.equal), ("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or),
    ("BitwiseXor", np.bitwise_xor),
]


@pytest.mark.parametrize(("op", "ref"), UNSIGNED_BINARY, ids=[o for o, _ in UNSIGNED_BINARY])
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_unsigned_binary(op: str, ref: Callable[[np.ndarray, np.ndarray], np.ndarray],
                         dtype: type) -> None:
    top = np.iinfo(dtype).max
    a = np.array([0, 1, 7, top, top - 3, top // 2 + 5, 12], dtype=dtype)
    b = np.array([3, 1, 9, 2, top, top // 2 + 1, 12], dtype=dtype)
    feeds = {"a": a, "b": b}
    node = helper.make_node(op, ["a", "b"], ["y"])
    got = _run(make_model([node], feeds, ["y"], 18), feeds)[0]
    with np.errstate(over="ignore"):
        expected = ref(a, b)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_bitshift_unsigned(direction: str, dtype: type) -> None:
    top = np.iinfo(dtype).max
    feeds = {"a": np.array([1, top, top // 2, 6], dtype=dtype),
             "b": np.array([1, 3, 0, 2], dtype=dtype)}
    node = helper.make_node("BitShift", ["a", "b"], ["y"], direction=direction)
    assert_matches_ort(make_model([node], feeds, ["y"], 11), feeds)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64, np.int32])
def test_bitwise_not(dtype: type) -> None:
    feeds = {"x": np.array([0, 1, 5, 100], dtype=dtype)}
    node = helper.make_node("BitwiseNot", ["x"], ["y"])
    got = _run(make_model([node], feeds, ["y"], 18), feeds)[0]
    np.testing.assert_array_equal(got, np.bitwise_not(feeds["x"]))


# -- elementwise semantics -----------------------------------------------------------------

@pytest.mark.parametrize(("dtype", "fmod"), [(np.int32, 0), (np.int64, 1), (np.float32, 1),
                                             (np.int8, 0)])
def test_mod(dtype: type, fmod: int) -> None:
    feeds = {"a": np.array([-7, 7, -7, 7, 5, -3], dtype=dtype),
             "b": np.array([3, -3, -3, 3, 2, 4], dtype=dtype)}
    node = helper.make_node("Mod", ["a", "b"], ["y"], fmod=fmod)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32])
def test_div(dtype: type) -> None:
    feeds = {"a": np.array([-7, 7, -7, 7, 6], dtype=dtype),
             "b": np.array([2, -2, -2, 2, 3], dtype=dtype)}
    node = helper.make_node("Div", ["a", "b"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


@pytest.mark.parametrize(("opset", "dtype", "lo", "hi"), [
    (13, np.int32, -2, 3), (13, np.float32, None, 0.5), (13, np.uint8, 3, None),
    (13, np.int64, None, None), (6, np.float32, -0.5, 0.5), (6, np.float32, None, None)])
def test_clip(opset: int, dtype: type, lo: float | None, hi: float | None) -> None:
    feeds = {"x": (RNG.standard_normal((3, 4)) * 5).astype(dtype)}
    if opset < 11:
        bounds = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
        node = helper.make_node("Clip", ["x"], ["y"], **bounds)
        inits = {}
    else:
        inits = {}
        inputs = ["x", "", ""]
        if lo is not None:
            inits["lo"] = np.array(lo, dtype=dtype)
            inputs[1] = "lo"
        if hi is not None:
            inits["hi"] = np.array(hi, dtype=dtype)
            inputs[2] = "hi"
        node = helper.make_node("Clip", inputs, ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], opset, inits), feeds)


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_variadic_broadcasting(op: str) -> None:
    feeds = {"a": RNG.standard_normal((2, 1, 4)).astype(np.float32),
             "b": RNG.standard_normal((3, 1)).astype(np.float32),
             "c": RNG.standard_normal((4,)).astype(np.float32)}
    node = helper.make_node(op, ["a", "b", "c"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


@pytest.mark.parametrize(("base", "exp"), [(np.float32, np.int64), (np.float32, np.float32),
                                           (np.int64, np.int64), (np.int32, np.float32),
                                           (np.float64, np.int32)])
def test_pow(base: type, exp: type) -> None:
    feeds = {"a": np.array([[1, 2, 3], [4, 5, 6]], dtype=base),
             "b": np.array([2, 0, 3], dtype=exp)}
    node = helper.make_node("Pow", ["a", "b"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 15), feeds)


def test_swish_and_swiglu() -> None:
    feeds = {"a": RNG.standard_normal((2, 5)).astype(np.float32),
             "b": RNG.standard_normal((2, 5)).astype(np.float32)}
    swish = helper.make_node("Swish", ["a"], ["s"], alpha=1.5)
    _matches_reference(make_model([swish], {"a": feeds["a"]}, ["s"], 24), {"a": feeds["a"]})
    swiglu = helper.make_node("SwiGLU", ["a", "b"], ["y"], alpha=0.7)
    _matches_reference(make_model([swiglu], feeds, ["y"], 28), feeds)


# -- pooling -------------------------------------------------------------------------------

MAXPOOL = [
    {"kernel_shape": [2, 2]},
    {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]},
    {"kernel_shape": [3, 2], "pads": [0, 1, 2, 0]},
    {"kernel_shape": [2, 2], "storage_order": 1, "pads": [1, 0, 0, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [2, 2], "dilations": [2, 2]},
    {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]},
]


@pytest.mark.parametrize("attrs", MAXPOOL)
@pytest.mark.parametrize("indices", [False, True])
def test_maxpool(attrs: dict[str, object], indices: bool) -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 7, 6)).astype(np.float32)}
    outputs = ["y", "i"] if indices else ["y"]
    node = helper.make_node("MaxPool", ["x"], outputs, **attrs)
    assert_matches_ort(make_model([node], feeds, outputs, 12), feeds)


AVGPOOL = [
    {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "count_include_pad": 1,
     "pads": [1, 1, 1, 1]},
    {"kernel_shape": [2, 3], "pads": [0, 1, 1, 0]},
    {"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"},
    {"kernel_shape": [2, 2], "dilations": [2, 1]},
]


@pytest.mark.parametrize("attrs", AVGPOOL)
def test_avgpool(attrs: dict[str, object]) -> None:
    feeds = {"x": RNG.standard_normal((1, 2, 7, 6)).astype(np.float32)}
    node = helper.make_node("AveragePool", ["x"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 19), feeds, rtol=1e-5, atol=1e-6)


# -- ConvTranspose -------------------------------------------------------------------------

CONV_T = [
    {"strides": [2, 2]},
    {"strides": [2, 2], "output_padding": [1, 1]},
    {"strides": [3, 2], "output_shape": [10, 8]},
    # An output_shape below the full output crops the larger half at the start.
    {"strides": [2, 2], "output_shape": [6, 5]},
    {"strides": [2, 2], "output_shape": [6, 6], "pads": [1, 1, 1, 1]},
    {"strides": [2, 2], "output_shape": [6, 7], "auto_pad": "SAME_UPPER"},
    {"strides": [2, 2], "output_shape": [5, 6], "auto_pad": "SAME_LOWER"},
    {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
    {"strides": [2, 2], "auto_pad": "SAME_LOWER"},
    {"pads": [1, 0, 0, 2]},
    {"strides": [2, 1], "dilations": [2, 2], "pads": [1, 1, 1, 1]},
    {"group": 2, "strides": [2, 2]},
]


@pytest.mark.parametrize("attrs", CONV_T)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose(attrs: dict[str, object], bias: bool) -> None:
    group = int(attrs.get("group", 1))  # type: ignore[call-overload]
    feeds = {"x": RNG.standard_normal((1, 4, 3, 3)).astype(np.float32),
             "w": RNG.standard_normal((4, 2, 3, 3)).astype(np.float32)}
    inputs = ["x", "w"]
    if bias:
        feeds["b"] = RNG.standard_normal(2 * group).astype(np.float32)
        inputs.append("b")
    node = helper.make_node("ConvTranspose", inputs, ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 11), feeds, rtol=1e-5, atol=1e-5)


# -- BatchNormalization --------------------------------------------------------------------

def test_batchnorm_training_outputs() -> None:
    feeds = {"x": RNG.standard_normal((4, 3, 2, 2)).astype(np.float32),
             "s": RNG.standard_normal(3).astype(np.float32),
             "b": RNG.standard_normal(3).astype(np.float32),
             "m": RNG.standard_normal(3).astype(np.float32),
             "v": RNG.uniform(0.5, 1.5, 3).astype(np.float32)}
    node = helper.make_node("BatchNormalization", list(feeds), ["y", "rm", "rv"],
                            training_mode=1, momentum=0.8)
    _matches_reference(make_model([node], feeds, ["y", "rm", "rv"], 15), feeds, rtol=1e-4,
                       atol=1e-5)


def test_batchnorm_inference() -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32),
             "s": RNG.standard_normal(3).astype(np.float32),
             "b": RNG.standard_normal(3).astype(np.float32),
             "m": RNG.standard_normal(3).astype(np.float32),
             "v": RNG.uniform(0.5, 1.5, 3).astype(np.float32)}
    node = helper.make_node("BatchNormalization", list(feeds), ["y"], epsilon=1e-3)
    assert_matches_ort(make_model([node], feeds, ["y"], 15), feeds, rtol=1e-5, atol=1e-5)



# -- LRN / NonZero -------------------------------------------------------------------------

def _lrn_reference(x: np.ndarray, size: int, alpha: float, beta: float,
                   bias: float) -> np.ndarray:
    """The spec's window: floor((size-1)/2) channels before, ceil((size-1)/2) after."""
    before, after = (size - 1) // 2, -(-(size - 1) // 2)
    sq = np.zeros_like(x)
    for c in range(x.shape[1]):
        sq[:, c] = np.sum(x[:, max(0, c - before): c + after + 1] ** 2, axis=1)
    return x / (bias + alpha / size * sq) ** beta


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_lrn(size: int) -> None:
    feeds = {"x": RNG.standard_normal((2, 6, 3, 3)).astype(np.float32)}
    node = helper.make_node("LRN", ["x"], ["y"], size=size, alpha=0.5, beta=0.75, bias=1.5)
    model = make_model([node], feeds, ["y"], 13)
    if size % 2:
        assert_matches_ort(model, feeds, rtol=1e-5, atol=1e-6)
    else:  # onnxruntime rejects even sizes
        np.testing.assert_allclose(_run(model, feeds)[0],
                                   _lrn_reference(feeds["x"], size, 0.5, 0.75, 1.5),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [0, 3])
def test_nonzero_scalar(value: int) -> None:
    feeds = {"x": np.array(value, dtype=np.int32)}
    node = helper.make_node("NonZero", ["x"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


# -- Gather with a constant scalar index -----------------------------------------------------

@pytest.mark.parametrize(("axis", "index"), [(0, 1), (1, -1), (-1, 0), (1, -3)])
def test_gather_constant_scalar_index(axis: int, index: int) -> None:
    # Bound to a Python int at plan time (ops/tensor.py): same results as onnxruntime.
    feeds = {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)}
    node = helper.make_node("Gather", ["x", "k"], ["y"], axis=axis)
    inits = {"k": np.array(index, dtype=np.int64)}
    assert_matches_ort(make_model([node], feeds, ["y"], 13, inits), feeds)


def test_gather_constant_scalar_index_out_of_range() -> None:
    feeds = {"x": RNG.standard_normal((2, 3)).astype(np.float32)}
    node = helper.make_node("Gather", ["x", "k"], ["y"], axis=1)
    model = make_model([node], feeds, ["y"], 13, {"k": np.array(3, dtype=np.int64)})
    with pytest.raises(segflow.errors.ExecutionError, match="Gather index 3 is out of range"):
        _run(model, feeds)


# -- Gather with computed indices ----------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("indices", [[[0, 2], [1, 1]], [[-1, 0], [2, -2]], [-3]])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_gather_fed_indices_negative_or_not(axis: int, indices: list, dtype: type) -> None:
    # On the CPU the kernel tries index_select first, which refuses negative indices;
    # those are then wrapped. Either way the same results as onnxruntime.
    feeds = {"x": RNG.standard_normal((3, 3, 4)).astype(np.float32),
             "k": np.array(indices, dtype=dtype)}
    node = helper.make_node("Gather", ["x", "k"], ["y"], axis=axis)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


@pytest.mark.parametrize("bad", [3, -4])
def test_gather_fed_indices_out_of_range_name_the_index(bad: int) -> None:
    feeds = {"x": RNG.standard_normal((3, 2)).astype(np.float32),
             "k": np.array([0, bad, -1], dtype=np.int64)}
    node = helper.make_node("Gather", ["x", "k"], ["y"], axis=0)
    model = make_model([node], feeds, ["y"], 13)
    with pytest.raises(segflow.errors.ExecutionError,
                       match=f"Gather index {bad} is out of range for axis 0 of size 3"):
        _run(model, feeds)
