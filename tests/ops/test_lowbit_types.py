"""float8, int4/uint4, int2/uint2 and float4e2m1: casts, (de)quantization, feeds and outputs.

The oracle is ONNX's reference implementation (ml_dtypes' rounding), compared bit for
bit, and onnxruntime where it runs the case.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from ort_compare import make_model, run_both

import segflow
from segflow.ir import lowbit
from segflow.ir.types import DType

FLOAT8 = {
    TensorProto.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn,
    TensorProto.FLOAT8E4M3FNUZ: ml_dtypes.float8_e4m3fnuz,
    TensorProto.FLOAT8E5M2: ml_dtypes.float8_e5m2,
    TensorProto.FLOAT8E5M2FNUZ: ml_dtypes.float8_e5m2fnuz,
}
SMALL_FLOATS = {**FLOAT8, TensorProto.FLOAT4E2M1: ml_dtypes.float4_e2m1fn}
SUB_BYTE_INTS = {
    TensorProto.INT4: ml_dtypes.int4,
    TensorProto.UINT4: ml_dtypes.uint4,
    TensorProto.INT2: ml_dtypes.int2,
    TensorProto.UINT2: ml_dtypes.uint2,
}
ALL_TYPES = {**SMALL_FLOATS, **SUB_BYTE_INTS, TensorProto.FLOAT8E8M0: ml_dtypes.float8_e8m0fnu}
_SUB_BYTE_DTYPES = frozenset(np.dtype(t) for t in SUB_BYTE_INTS.values())
_BIT_PATTERN_DTYPES = frozenset(np.dtype(t) for t in ALL_TYPES.values()) - _SUB_BYTE_DTYPES


def _cast_model(source: np.ndarray, to: int, opset: int = 25, **attrs: object) -> onnx.ModelProto:
    node = helper.make_node("Cast", ["x"], ["y"], to=to, **attrs)
    graph = helper.make_graph(
        [node], "cast",
        [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(source.dtype),
                                       source.shape)],
        [helper.make_tensor_value_info("y", to, source.shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _segflow(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return segflow.InferenceSession(model, engine="inline").run(None, feeds)


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return list(ReferenceEvaluator(model).run(None, feeds))


def _assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape
    if expected.dtype in _SUB_BYTE_DTYPES:
        np.testing.assert_array_equal(got.astype(np.int8), expected.astype(np.int8))
    elif expected.dtype in _BIT_PATTERN_DTYPES:   # float8/float4: the encodings, NaNs too
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
    else:
        np.testing.assert_array_equal(got, expected)   # NaN equals NaN here


def _edge_values(dtype: type) -> np.ndarray:
    """Every finite value of ``dtype``, each midpoint between neighbours (the ties), values
    past the largest finite one, the infinities, NaN, negative zero and half the smallest
    subnormal."""
    finfo = ml_dtypes.finfo(dtype)
    codes = np.arange(256 if np.dtype(dtype).name.startswith("float8") else 16, dtype=np.uint8)
    values = codes.view(dtype).astype(np.float32)
    finite = np.unique(values[np.isfinite(values)])
    midpoints = (finite[:-1] + finite[1:]) / 2
    extra = [float(finfo.max) * 1.01, float(finfo.max) * 4, 1e30, -1e30, np.inf, -np.inf,
             np.nan, -0.0, float(finfo.smallest_subnormal) / 2,
             -float(finfo.smallest_subnormal) / 2, float(finfo.smallest_subnormal) * 1.5]
    return np.concatenate([finite, midpoints, np.array(extra, np.float32)]).astype(np.float32)


@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("to", list(SMALL_FLOATS), ids=TensorProto.DataType.Name)
@pytest.mark.parametrize("source", [np.float32, np.float16])
def test_cast_to_small_floats_rounds_and_saturates_as_reference(to, saturate, source) -> None:
    x = _edge_values(SMALL_FLOATS[to])
    x = x[np.abs(x) < 6e4].astype(source) if source is np.float16 else x
    model = _cast_model(x, to, saturate=saturate)
    (got,) = _segflow(model, {"x": x})
    (expected,) = _reference(model, {"x": x})
    _assert_same_bits(got, expected)


@pytest.mark.parametrize("to", list(FLOAT8), ids=TensorProto.DataType.Name)
def test_cast_to_float8_matches_onnxruntime(to) -> None:
    # onnxruntime hands no float8 array to Python: the model casts back to float.
    x = _edge_values(FLOAT8[to])
    for saturate in (0, 1):
        nodes = [helper.make_node("Cast", ["x"], ["q"], to=to, saturate=saturate),
                 helper.make_node("Cast", ["q"], ["y"], to=TensorProto.FLOAT)]
        expected, got = run_both(make_model(nodes, {"x": x}, ["y"], 21), {"x": x})
        np.testing.assert_array_equal(got[0], expected[0])


def test_saturation_edges_of_e4m3fn() -> None:
    x = np.array([448, 500, 1e6, np.inf, -np.inf, np.nan, -0.0, 2.0**-10], np.float32)
    (sat,) = _segflow(_cast_model(x, TensorProto.FLOAT8E4M3FN, saturate=1), {"x": x})
    (raw,) = _segflow(_cast_model(x, TensorProto.FLOAT8E4M3FN, saturate=0), {"x": x})
    assert sat.astype(np.float32)[:5].tolist() == [448, 448, 448, 448, -448]
    assert np.isnan(raw.astype(np.float32)[1:5]).all()   # no infinity: overflow is NaN
    assert sat.view(np.uint8)[6] == 0x80   # negative zero kept
    assert sat.astype(np.float32)[7] == 0.0   # 2**-10 ties to the even neighbour, 0


@pytest.mark.parametrize("source", list(ALL_TYPES), ids=TensorProto.DataType.Name)
@pytest.mark.parametrize("to", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_every_encoding_casts_back_as_reference(source, to) -> None:
    dtype = np.dtype(ALL_TYPES[source])
    if dtype in _SUB_BYTE_DTYPES:
        info = ml_dtypes.iinfo(dtype)
        x = np.arange(info.min, info.max + 1).astype(dtype)
    else:
        count = 256 if dtype.name.startswith("float8") else 16
        x = np.arange(count, dtype=np.uint8).view(dtype)
    model = _cast_model(x, to)
    (got,) = _segflow(model, {"x": x})
    (expected,) = _reference(model, {"x": x})
    _assert_same_bits(got, expected)


@pytest.mark.parametrize("to", list(SUB_BYTE_INTS), ids=TensorProto.DataType.Name)
def test_cast_to_sub_byte_ints_wraps_as_reference(to) -> None:
    x = np.array([-9, -8, -2.5, -1.5, -0.5, 0, 0.5, 1.5, 2.5, 3, 4, 7, 8, 15, 16, 17, 100],
                 np.float32)
    model = _cast_model(x, to)
    (got,) = _segflow(model, {"x": x})
    (expected,) = _reference(model, {"x": x})
    _assert_same_bits(got, expected)
    (back,) = _segflow(_cast_model(got, TensorProto.INT8), {"x": got})
    assert back.dtype == np.int8


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [1, 0])
def test_cast_to_e8m0_round_modes_as_reference(round_mode, saturate) -> None:
    x = np.array([0, 2.0**-127, 0.124, 0.25, 0.375, 0.5, 1.1, 1.5, 1.75, 2, 3, 8, -4,
                  2.0**127, 2.0**127 * 1.5, 3e38, np.inf, np.nan], np.float32)
    model = _cast_model(x, TensorProto.FLOAT8E8M0, saturate=saturate, round_mode=round_mode)
    (got,) = _segflow(model, {"x": x})
    (expected,) = _reference(model, {"x": x})
    _assert_same_bits(got, expected)


def test_cast_rejects_an_unknown_round_mode() -> None:
    x = np.ones(2, np.float32)
    model = _cast_model(x, TensorProto.FLOAT8E8M0, round_mode="sideways")
    with pytest.raises(segflow.SegflowError, match="round_mode"):
        segflow.InferenceSession(model)


def test_castlike_takes_the_low_bit_type_of_its_second_input() -> None:
    x = np.array([0.3, 7.5, 1000], np.float32)
    like = np.zeros(1, ml_dtypes.float8_e5m2)
    node = helper.make_node("CastLike", ["x", "like"], ["y"])
    model = make_model([node], {"x": x, "like": like}, ["y"], 21)
    (got,) = _segflow(model, {"x": x, "like": like})
    np.testing.assert_array_equal(got.view(np.uint8),
                                  numpy_helper.saturate_cast(x, ml_dtypes.float8_e5m2)
                                  .view(np.uint8))


# -- feeds and outputs -------------------------------------------------------------------
def _identity_of(dtype: type, shape: tuple[int, ...]) -> onnx.ModelProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]),
         helper.make_node("Identity", ["r"], ["y"])], "id",
        [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_tensor_value_info("y", elem, None)],
        initializer=[numpy_helper.from_array(np.array([-1], np.int64), "shape")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])


@pytest.mark.parametrize("elem", list(ALL_TYPES), ids=TensorProto.DataType.Name)
def test_feeds_and_outputs_keep_their_ml_dtypes_type(elem) -> None:
    dtype = np.dtype(ALL_TYPES[elem])
    if dtype in _SUB_BYTE_DTYPES:
        info = ml_dtypes.iinfo(dtype)
        x = np.resize(np.arange(info.min, info.max + 1), 12).astype(dtype).reshape(3, 4)
    else:
        x = np.resize(np.arange(16, dtype=np.uint8), 12).view(dtype).reshape(3, 4)
    (got,) = segflow.InferenceSession(_identity_of(dtype.type, (3, 4))).run(None, {"x": x})
    assert got.dtype == dtype and got.shape == (12,)
    _assert_same_bits(got, x.reshape(-1))


def test_a_feed_of_another_low_bit_type_is_refused_naming_the_input() -> None:
    sess = segflow.InferenceSession(_identity_of(ml_dtypes.int4, (2,)))
    with pytest.raises(segflow.InvalidInput, match="input 'x' has dtype uint4, expected int4"):
        sess.run(None, {"x": np.zeros(2, ml_dtypes.uint4)})
    with pytest.raises(segflow.InvalidInput, match="input 'x' has dtype int8, expected int4"):
        sess.run(None, {"x": np.zeros(2, np.int8)})


def test_a_torch_container_feeds_a_sub_byte_input() -> None:
    sess = segflow.InferenceSession(_identity_of(ml_dtypes.int4, (3,)))
    (out,) = sess.run_tensors({"x": torch.tensor([-8, 0, 7], dtype=torch.int8)})
    assert out.tolist() == [-8, 0, 7]


def test_float8_initializer_feeds_a_dequantize_like_onnxruntime() -> None:
    w = np.array([[0.5, -2, 448], [-0.0, 3.5, 1e-3]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"]),
             helper.make_node("Add", ["x", "wf"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"], 21,
                       initializers={"w": w, "s": np.array(0.25, np.float32)})
    expected, got = run_both(model, {"x": x})
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[0], x + w.astype(np.float32) * 0.25)


def test_int4_constant_node_is_typed_int4() -> None:
    value = numpy_helper.from_array(np.array([-8, -1, 7], ml_dtypes.int4), "c")
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=value),
         helper.make_node("Cast", ["c"], ["y"], to=TensorProto.FLOAT)], "c", [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("c", TensorProto.INT4, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    y, c = segflow.InferenceSession(model).run(None, {})
    assert y.tolist() == [-8, -1, 7]
    assert c.dtype == np.dtype(ml_dtypes.int4) and c.astype(np.int8).tolist() == [-8, -1, 7]


# -- quantization ------------------------------------------------------------------------
def test_int4_per_axis_round_trip_matches_onnxruntime() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 8)) * 4).astype(np.float32)
    x[0, :3] = [100, -100, 0.25]   # saturated both ways; a tie at half a step
    scale = np.array([0.5, 0.25, 1.0], np.float32)
    zp = np.array([1, -2, 0], ml_dtypes.int4)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=0),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=0)]
    inits = {"s": scale, "zp": zp}
    # onnxruntime hands no int4 array to Python: it is compared on the round trip.
    expected, (y,) = run_both(make_model(nodes, {"x": x}, ["y"], 21, initializers=inits),
                              {"x": x})
    np.testing.assert_array_equal(y, expected[0])
    model = make_model(nodes, {"x": x}, ["q", "y"], 21, initializers=inits)
    q, y = _segflow(model, {"x": x})
    assert q.dtype == np.dtype(ml_dtypes.int4)
    _assert_same_bits(q, _reference(model, {"x": x})[0])
    want = np.clip(np.rint(x / scale[:, None]) + zp.astype(np.int32)[:, None], -8, 7)
    np.testing.assert_array_equal(q.astype(np.int32), want)
    np.testing.assert_array_equal(y, (want - zp.astype(np.float32)[:, None]) * scale[:, None])


@pytest.mark.parametrize("elem", [TensorProto.UINT4, TensorProto.INT4, TensorProto.INT2,
                                  TensorProto.UINT2, *SMALL_FLOATS],
                         ids=TensorProto.DataType.Name)
def test_blocked_quantize_dequantize_as_reference(elem) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 6)) * 30).astype(np.float32)
    scale = np.array([[0.5, 2.0, 4.0], [1.0, 0.125, 8.0]], np.float32)
    zp = np.zeros((2, 3), np.float32).astype(ALL_TYPES[elem])
    q_node = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=1, block_size=2)
    dq_node = helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=1,
                               block_size=2)
    model = make_model([q_node, dq_node], {"x": x}, ["q", "y"], 25,
                       initializers={"s": scale, "zp": zp})
    got = _segflow(model, {"x": x})
    expected = _reference(model, {"x": x})
    _assert_same_bits(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.parametrize("saturate", [1, 0])
def test_quantize_to_float8_honours_saturate(saturate) -> None:
    x = np.array([1, 300, 1e5, -1e5, np.inf, np.nan], np.float32)
    node = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], saturate=saturate)
    model = make_model([node], {"x": x}, ["q"], 21,
                       initializers={"s": np.array(2.0, np.float32),
                                     "zp": np.zeros((), ml_dtypes.float8_e4m3fn)})
    (got,) = _segflow(model, {"x": x})
    (expected,) = _reference(model, {"x": x})
    _assert_same_bits(got, expected)


def test_container_dtypes_map_back_to_ordinary_types() -> None:
    assert DType.from_torch(torch.int8) is DType.INT8
    assert DType.from_torch(torch.float8_e5m2) is DType.FLOAT8E5M2
    assert DType.from_container(torch.uint8, DType.FLOAT4E2M1) is DType.FLOAT4E2M1
    assert DType.from_container(torch.uint8, DType.INT4) is DType.UINT8   # not its container
    x = np.array([-6, -0.5, 0, 3], ml_dtypes.float4_e2m1fn)
    assert lowbit.to_tensor(x).tolist() == [15, 9, 0, 5]   # float4's bit patterns
    _assert_same_bits(lowbit.to_numpy(lowbit.to_tensor(x), DType.FLOAT4E2M1), x)


def test_folded_casts_keep_the_sub_byte_type() -> None:
    # Cast(to=float4) of an initializer folds into a constant held as uint8 bit patterns:
    # the Cast after it must still read them as float4.
    c = numpy_helper.from_array(np.array([0.5, 3.0, -6.0, 100], np.float32), "c")
    graph = helper.make_graph(
        [helper.make_node("Cast", ["c"], ["q"], to=TensorProto.FLOAT4E2M1),
         helper.make_node("Cast", ["q"], ["y"], to=TensorProto.FLOAT)], "fold", [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("q", TensorProto.FLOAT4E2M1, [4])], initializer=[c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    y, q = segflow.InferenceSession(model).run(None, {})
    assert y.tolist() == [0.5, 3.0, -6.0, 6.0]
    assert q.dtype == np.dtype(ml_dtypes.float4_e2m1fn)


def test_optimized_model_file_keeps_int4_initializers(tmp_path) -> None:
    w = np.array([[-8, 7, 3], [0, -1, 5]], ml_dtypes.int4)
    s = np.array(0.5, np.float32)   # a feed: the dequantization is not folded away
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["y"])]
    model = make_model(nodes, {"s": s}, ["y"], 21, initializers={"w": w})
    options = segflow.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "int4.onnx")
    (y,) = segflow.InferenceSession(model, options).run(None, {"s": s})
    np.testing.assert_array_equal(y, w.astype(np.float32) * 0.5)
    written = onnx.load(options.optimized_model_filepath)
    (init,) = [t for t in written.graph.initializer if t.name == "w"]
    assert init.data_type == TensorProto.INT4
    _assert_same_bits(numpy_helper.to_array(init), w)


def test_int4_qdq_convolution_stays_in_int4_ranges_like_onnxruntime() -> None:
    # The QDQ lowering would run this as an int8 convolution (int4 shares int8's container)
    # and saturate to int8's range; it must leave int4 regions to the float ops.
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 5, 5)).astype(np.float32) * 3
    w = rng.integers(-8, 8, (3, 2, 3, 3)).astype(ml_dtypes.int4)
    inits = {"w": w, "ws": np.array(0.5, np.float32), "s": np.array(0.25, np.float32),
             "zp": np.array(1, ml_dtypes.int4), "ys": np.array(0.5, np.float32),
             "yzp": np.array(-2, ml_dtypes.int4)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xf"]),
             helper.make_node("DequantizeLinear", ["w", "ws"], ["wf"]),
             helper.make_node("Conv", ["xf", "wf"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["c", "ys", "yzp"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "ys", "yzp"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"], 21, initializers=inits)
    expected, got = run_both(model, {"x": x})
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[0].max() <= (7 + 2) * 0.5 and got[0].min() >= (-8 + 2) * 0.5


def _chain(nodes: list[onnx.NodeProto], elem: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", elem, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_host_casts_are_their_own_tasks_and_their_waits_are_counted() -> None:
    # Rounding to float8 runs through ml_dtypes on the host: a LOCAL task each way, whose
    # wait for its input is a counted synchronization.
    model = _chain([helper.make_node("Relu", ["x"], ["a"]),
                    helper.make_node("Cast", ["a"], ["q"], to=TensorProto.FLOAT8E4M3FN),
                    helper.make_node("Cast", ["q"], ["b"], to=TensorProto.FLOAT),
                    helper.make_node("Relu", ["b"], ["y"])], TensorProto.FLOAT)
    sess = segflow.InferenceSession(model, engine="inline")
    (y,) = sess.run(None, {"x": np.array([-1, 0.3, 500, 2], np.float32)})
    assert y.tolist() == [0, 0.3125, 448, 2]
    stats = sess.last_run_stats
    assert (stats.segments, stats.pushes, stats.syncs) == (4, 4, 3)
    assert "non-sync op Cast (local)" in sess.explain()
    # An int4's value reads into float as a torch conversion: one bulk segment.
    model = _chain([helper.make_node("Cast", ["x"], ["a"], to=TensorProto.FLOAT),
                    helper.make_node("Relu", ["a"], ["y"])], TensorProto.INT4)
    sess = segflow.InferenceSession(model, engine="inline")
    (y,) = sess.run(None, {"x": np.array([-8, -1, 0, 7], ml_dtypes.int4)})
    assert y.tolist() == [0, 0, 0, 7]
    assert sess.last_run_stats.segments == 1
