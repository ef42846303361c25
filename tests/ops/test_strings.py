"""String tensors (ops/strings.py) against onnxruntime: the string ops, the general ops
over strings, feeds and outputs through InferenceSession, and graphs mixing string and
float values."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from ort_compare import make_model

import segflow
from segflow.engine.streams import FakeBackend
from segflow.errors import ExecutionError, InvalidInput, InvalidModel, UnsupportedOp


def strings(*items: Any) -> np.ndarray:
    return np.array(items, dtype=object)


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    """Same dtypes and shapes; strings and integers equal, floats to 1e-6 (NaN equal)."""
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype, f"output {i}: dtype {g.dtype} != {e.dtype}"
        assert g.shape == e.shape, f"output {i}: shape {g.shape} != {e.shape}"
        if e.dtype == object:
            assert all(type(s) is str for s in g.flat), f"output {i}: not all str"
            assert g.tolist() == e.tolist(), f"output {i}"
        else:
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=0, err_msg=f"output {i}")


def check(nodes: list[onnx.NodeProto], feeds: dict[str, np.ndarray], outputs: list[str],
          opset: int = 21, initializers: dict[str, np.ndarray] | None = None,
          domains: dict[str, int] | None = None, oracle: str = "onnxruntime"
          ) -> list[np.ndarray]:
    """Run on segflow and on the oracle (onnxruntime, or onnx's reference implementation
    where onnxruntime is wrong) and compare every output."""
    model = make_model(nodes, feeds, outputs, opset, initializers, domains)
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    if oracle == "onnxruntime":
        expected = _ort(model, feeds)
    else:
        expected = [np.asarray(e) for e in ReferenceEvaluator(model).run(None, feeds)]
    assert_same(got, expected)
    return got


# -- string ops ------------------------------------------------------------------------------
WORDS = strings("Monday", "monday", "x monday y", "éß", "MONDAY", "İ", "ǅ", "ᾳŉ")


@pytest.mark.parametrize("sensitive", [0, 1])
@pytest.mark.parametrize("action", ["NONE", "UPPER", "LOWER"])
def test_string_normalizer_matches_onnxruntime(action, sensitive):
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action=action,
                            is_case_sensitive=sensitive, stopwords=["monday", "éSS"],
                            locale="C.UTF-8")
    try:
        _ort(make_model([node], {"x": WORDS}, ["y"], 21), {"x": WORDS})
    except Exception as exc:  # onnxruntime builds a C++ locale the host may not have
        pytest.skip(f"onnxruntime cannot run StringNormalizer here: {str(exc)[:80]}")
    check([node], {"x": WORDS}, ["y"])


def test_string_normalizer_cases_by_unicode_simple_mapping():
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="UPPER",
                            stopwords=["monday"])
    model = make_model([node], {"x": WORDS}, ["y"], 21)
    (y,) = segflow.InferenceSession(model).run(None, {"x": WORDS})
    # Stopwords are whole elements, compared case-folded; "ß" has no one-letter capital.
    assert y.tolist() == ["X MONDAY Y", "Éß", "İ", "Ǆ", "ᾼŉ"]


def test_string_normalizer_keeps_one_empty_string_when_all_are_stopwords():
    node = helper.make_node("StringNormalizer", ["x"], ["y"], stopwords=["a"])
    model = make_model([node], {"x": strings(["a", "A"])}, ["y"], 21)
    (y,) = segflow.InferenceSession(model).run(None, {"x": strings(["a", "A"])})
    assert y.dtype == object and y.tolist() == [[""]]


def test_string_normalizer_refuses_a_tensor_of_more_than_one_row():
    node = helper.make_node("StringNormalizer", ["x"], ["y"])
    x = strings(["a"], ["b"])
    sess = segflow.InferenceSession(make_model([node], {"x": x}, ["y"], 21))
    with pytest.raises(ExecutionError, match=r"\[C\] or \[1, C\]"):
        sess.run(None, {"x": x})


def test_string_concat_broadcasts_and_keeps_utf8():
    node = helper.make_node("StringConcat", ["x", "y"], ["z"])
    check([node], {"x": strings(["a", "é"], ["", "ℵ"]), "y": strings("-1", "🙂")}, ["z"])


@pytest.mark.parametrize("attrs", [{}, {"delimiter": "-"}, {"delimiter": "--", "maxsplit": 1},
                                   {"delimiter": ""}, {"maxsplit": 0}])
def test_string_split_matches_onnxruntime(attrs):
    node = helper.make_node("StringSplit", ["x"], ["y", "n"], **attrs)
    x = strings(["a-b--c", " two  words "], ["", "x--y-z"])
    check([node], {"x": x}, ["y", "n"])


def test_string_split_of_an_empty_tensor():
    node = helper.make_node("StringSplit", ["x"], ["y", "n"], delimiter=",")
    check([node], {"x": np.empty((0,), dtype=object)}, ["y", "n"])


@pytest.mark.parametrize("pattern", [r"[a-z0-9._%+-]+@[a-z0-9.-]+\.com", r"(?i)ab+c?",
                                     r"\d{2,3}|x*", r"(?P<w>\w)\w*", ""])
def test_regex_full_match_matches_onnxruntime(pattern):
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=pattern)
    x = strings(["me@mail.com", "ABBC", "12"], ["", "xxx", "1234"])
    check([node], {"x": x}, ["y"])


@pytest.mark.parametrize("pattern", [r"a(?=b)", r"(a)\1", r"(?>a)", r"a++", r"\p{L}",
                                     r"[[:alpha:]]"])
def test_regex_outside_the_re2_subset_is_refused_at_load(pattern):
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=pattern)
    model = make_model([node], {"x": strings("a")}, ["y"], 21)
    with pytest.raises(UnsupportedOp, match="RE2"):
        segflow.InferenceSession(model)


def test_regex_that_does_not_compile_is_an_invalid_model():
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], pattern="(a")
    with pytest.raises(InvalidModel, match="invalid pattern"):
        segflow.InferenceSession(make_model([node], {"x": strings("a")}, ["y"], 21))


def test_label_encoder_string_to_int_and_back():
    to_int = helper.make_node("LabelEncoder", ["x"], ["i"], domain="ai.onnx.ml",
                              keys_strings=["a", "b", "c"], values_int64s=[0, 1, 2],
                              default_int64=-7)
    back = helper.make_node("LabelEncoder", ["i"], ["y"], domain="ai.onnx.ml",
                            keys_int64s=[0, 2], values_strings=["zero", "two"])
    check([to_int, back], {"x": strings(["a", "c"], ["q", "b"])}, ["i", "y"],
          domains={"ai.onnx.ml": 4})


def test_label_encoder_with_tensor_attributes():
    node = helper.make_node(
        "LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml",
        keys_tensor=onnx.numpy_helper.from_array(strings("a", "b"), "k"),
        values_tensor=onnx.numpy_helper.from_array(np.array([1.5, 2.5], np.float32), "v"),
        default_tensor=onnx.numpy_helper.from_array(np.array([9.0], np.float32), "d"))
    check([node], {"x": strings("b", "z", "a")}, ["y"], domains={"ai.onnx.ml": 4})


# -- the general ops over strings ------------------------------------------------------------
GRID = strings(["a", "b", "c"], ["d", "e", "a"])


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.mark.parametrize(("node", "initializers"), [
    (helper.make_node("Identity", ["x"], ["y"]), {}),
    (helper.make_node("Reshape", ["x", "s"], ["y"]), {"s": _i64(0, 1, 3)}),
    (helper.make_node("Reshape", ["x", "s"], ["y"]), {"s": _i64(-1)}),
    (helper.make_node("Flatten", ["x"], ["y"], axis=0), {}),
    (helper.make_node("Transpose", ["x"], ["y"]), {}),
    (helper.make_node("Unsqueeze", ["x", "a"], ["y"]), {"a": _i64(0, -1)}),
    (helper.make_node("Gather", ["x", "i"], ["y"], axis=1), {"i": _i64(2, -1, 0)}),
    (helper.make_node("Concat", ["x", "x"], ["y"], axis=-1), {}),
    (helper.make_node("Slice", ["x", "s", "e"], ["y"]), {"s": _i64(0, 1), "e": _i64(9, -1)}),
    (helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"]),
     {"s": _i64(-1), "e": _i64(-100), "a": _i64(1), "t": _i64(-2)}),
    (helper.make_node("Expand", ["x", "s"], ["y"]), {"s": _i64(2, 1, 1)}),
    (helper.make_node("Tile", ["x", "r"], ["y"]), {"r": _i64(2, 1)}),
    (helper.make_node("Equal", ["x", "c"], ["y"]), {"c": strings("a", "e", "x")}),
    (helper.make_node("Shape", ["x"], ["y"], start=-1), {}),
    (helper.make_node("Size", ["x"], ["y"]), {}),
    (helper.make_node("Where", ["m", "x", "c"], ["y"]),
     {"m": np.array([True, False, True]), "c": strings("-")}),
], ids=lambda p: p.op_type if isinstance(p, onnx.NodeProto) else "")
def test_general_op_over_strings_matches_onnxruntime(node, initializers):
    check([node], {"x": GRID}, ["y"], initializers=initializers)


@pytest.mark.parametrize("indices", [[1, 0, -1], [[1], [0]]])
def test_gather_of_rows_of_strings_matches_onnx_reference(indices):
    # onnxruntime 1.32 gathers only the first string of each row along axis 0.
    node = helper.make_node("Gather", ["x", "i"], ["y"])
    check([node], {"x": GRID}, ["y"], initializers={"i": np.array(indices, np.int64)},
          oracle="reference")


def test_squeeze_over_strings():
    node = helper.make_node("Squeeze", ["x", "a"], ["y"])
    check([node], {"x": strings([["a"], ["b"]])}, ["y"], initializers={"a": _i64(-1)})


@pytest.mark.parametrize("keep_sorted", [0, 1])
def test_unique_over_strings_matches_onnxruntime(keep_sorted):
    node = helper.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"],
                            sorted=keep_sorted)
    check([node], {"x": strings("b", "a", "b", "c", "a", "")},
          ["y", "first", "inverse", "counts"])


def test_string_constant_node_and_initializer():
    const = helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(
        strings("!", "?"), "c"))
    word = helper.make_node("Constant", [], ["w"], value_strings=["<", ">"])
    nodes = [const, word, helper.make_node("StringConcat", ["x", "c"], ["t"]),
             helper.make_node("StringConcat", ["w", "t"], ["u"]),
             helper.make_node("StringConcat", ["u", "k"], ["y"])]
    check(nodes, {"x": strings("a", "b")}, ["y"], initializers={"k": strings(".")})


# -- Cast ------------------------------------------------------------------------------------
@pytest.mark.parametrize("to", ["FLOAT", "DOUBLE", "FLOAT16", "INT64", "INT32", "UINT8",
                                "INT8", "BOOL"])
def test_cast_from_strings_matches_onnxruntime(to):
    node = helper.make_node("Cast", ["x"], ["y"], to=getattr(TensorProto, to))
    numbers = ("1.5", "-3", "12", "0", " 7", "300", "1e3", "+2")
    specials = ("NaN", "INF", "-INF", "+INF", "inf", "nan", "0x10", "1e39") \
        if to in ("FLOAT", "DOUBLE", "FLOAT16") else ()
    check([node], {"x": strings(*numbers, *specials)}, ["y"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.int8,
                                   np.uint16, np.bool_])
def test_cast_to_strings_matches_onnxruntime(dtype):
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.STRING)
    values = [0.1, 1 / 3, 1e10, 1e-7, 100.0, -0.0, 3.0, 123456789.0, np.nan, np.inf, -np.inf]
    if np.dtype(dtype).kind in "iub":
        values = [0, 1, 7, 100, 3, 1]
    with np.errstate(over="ignore"):  # past float16's range: infinity, as a cast makes it
        x = np.array(values).astype(dtype)
    check([node], {"x": x}, ["y"])


def test_cast_between_strings_and_bfloat16_round_trips():
    to = helper.make_node("Cast", ["x"], ["b"], to=TensorProto.BFLOAT16)
    back = helper.make_node("Cast", ["b"], ["y"], to=TensorProto.STRING)
    x = strings("1.5", "-2", "NaN", "3.015625")
    model = make_model([to, back], {"x": x}, ["y"], 21)
    (y,) = segflow.InferenceSession(model).run(None, {"x": x})
    assert y.tolist() == ["1.5", "-2", "NaN", "3.015625"]  # all exact in bfloat16


def test_cast_of_a_word_to_a_number_is_a_clear_error():
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.INT64)
    sess = segflow.InferenceSession(make_model([node], {"x": strings("12")}, ["y"], 21))
    with pytest.raises(ExecutionError, match="cannot cast 'abc' to an integer"):
        sess.run(None, {"x": strings("abc")})


# -- sessions --------------------------------------------------------------------------------
def _mixed_model() -> onnx.ModelProto:
    """x: strings -> Cast float -> Add -> Relu; and back to strings, joined to a word."""
    nodes = [helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["f", "b"], ["g"]),
             helper.make_node("Relu", ["g"], ["r"]),
             helper.make_node("Cast", ["r"], ["s"], to=TensorProto.STRING),
             helper.make_node("StringConcat", ["s", "unit"], ["y"])]
    graph = helper.make_graph(
        nodes, "mixed", [helper.make_tensor_value_info("x", TensorProto.STRING, [2, 3])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("y", TensorProto.STRING, [2, 3])],
        initializer=[onnx.numpy_helper.from_array(np.full(3, 0.5, np.float32), "b"),
                     onnx.numpy_helper.from_array(strings(" kg"), "unit")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


MIXED_FEED = {"x": np.array([["1.5", "-4", "2e1"], ["0", "NaN", "-INF"]])}  # numpy str_


@pytest.mark.parametrize("engine", ["inline", "threaded"])
@pytest.mark.parametrize("compile", ["none", "codegen"])
def test_graph_mixing_string_and_float_ops_matches_onnxruntime(engine, compile):
    model = _mixed_model()
    sess = segflow.InferenceSession(model, engine=engine, compile=compile)
    expected = _ort(model, {"x": MIXED_FEED["x"].astype(object)})
    for _ in range(2):  # the second run takes the accepted-signature path
        assert_same(sess.run(None, MIXED_FEED), expected)
    # The string nodes run as host tasks between the float segment's bounds.
    stats = sess.last_run_stats
    assert stats.segments == 4 and stats.nodes == 5


def test_string_values_pass_the_stream_path_on_the_host():
    """With a backend that manages the device (FakeBackend), string feeds and outputs
    are never uploaded or copied back: only the float values are."""
    model = _mixed_model()
    fake = FakeBackend()
    sess = segflow.InferenceSession(model, engine="inline", stream_backend=fake)
    assert_same(sess.run(None, MIXED_FEED), _ort(model, {"x": MIXED_FEED["x"].astype(object)}))


def test_bytes_feeds_are_decoded_and_outputs_are_str_objects():
    node = helper.make_node("Identity", ["x"], ["y"])
    model = make_model([node], {"x": strings("a", "b")}, ["y"], 21)
    (y,) = segflow.InferenceSession(model).run(None, {"x": np.array([b"caf\xc3\xa9", b"x"])})
    assert y.dtype == object and y.tolist() == ["café", "x"]


def test_a_number_feed_for_a_string_input_is_refused():
    model = _mixed_model()
    sess = segflow.InferenceSession(model)
    with pytest.raises(InvalidInput, match="'x' has dtype float, expected string"):
        sess.run(None, {"x": np.zeros((2, 3), np.float32)})
    with pytest.raises(InvalidInput, match="an element is int"):
        sess.run(None, {"x": np.array([[1, "a", "b"]] * 2, dtype=object)})


def test_a_string_feed_for_a_float_input_is_refused():
    node = helper.make_node("Relu", ["x"], ["y"])
    sess = segflow.InferenceSession(make_model([node], {"x": np.zeros(2, np.float32)},
                                               ["y"], 21))
    with pytest.raises(InvalidInput, match="'x' has dtype string, expected float"):
        sess.run(None, {"x": strings("1", "2")})


def test_an_op_without_a_string_form_is_refused_at_load():
    node = helper.make_node("ReverseSequence", ["x", "n"], ["y"])
    model = make_model([node], {"x": GRID, "n": _i64(1, 2)}, ["y"], 21)
    with pytest.raises(UnsupportedOp, match="ReverseSequence over string tensors"):
        segflow.InferenceSession(model)


def test_a_string_value_placed_on_another_device_is_refused():
    nodes = [helper.make_node("Identity", ["x"], ["t"], name="first"),
             helper.make_node("StringConcat", ["t", "t"], ["y"], name="second")]
    model = make_model(nodes, {"x": strings("a")}, ["y"], 21)
    with pytest.raises(UnsupportedOp, match="string tensors stay on the host"):
        segflow.InferenceSession(model, placement={"second": "cpu:1"})


def test_onnx_backend_runs_string_models():
    from segflow.onnx_backend import SegflowBackend
    node = helper.make_node("StringConcat", ["x", "y"], ["z"])
    model = make_model([node], {"x": strings("a"), "y": strings("b")}, ["z"], 21)
    (z,) = SegflowBackend.run_model(model, [strings("a"), strings("b")])
    assert z.dtype == object and z.tolist() == ["ab"]


def test_explain_and_the_optimized_model_keep_string_values(tmp_path):
    path = tmp_path / "optimized.onnx"
    options = segflow.SessionOptions()
    options.optimized_model_filepath = str(path)
    sess = segflow.InferenceSession(_mixed_model(), options)
    assert "StringConcat" in sess.explain()
    written = onnx.load(str(path))
    unit = [t for t in written.graph.initializer if t.name == "unit"]
    assert onnx.numpy_helper.to_array(unit[0]).tolist() == [" kg"]
    again = segflow.InferenceSession(written)
    assert_same(again.run(None, MIXED_FEED), sess.run(None, MIXED_FEED))


def test_a_string_ortvalue_is_refused_with_a_clear_error():
    with pytest.raises(InvalidInput, match="string arrays are not bound as OrtValues"):
        segflow.OrtValue.ortvalue_from_numpy(strings("a"))
