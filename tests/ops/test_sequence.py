"""sequence.py (SequenceConstruct/Empty/At/Insert/Erase/Length, SplitToSequence,
ConcatFromSequence, SequenceMap) against onnxruntime; sequences through Loop, the
session's feeds and outputs, their placement as LOCAL tasks, and the passes that must
leave them alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from seq_compare import assert_matches_ort, assert_same, model, seq, tensor

import segflow
from segflow.engine.base import ExecType
from segflow.engine.streams import FakeBackend
from segflow.errors import ExecutionError, InvalidInput

RNG = np.random.default_rng(0)
INT64 = TensorProto.INT64


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _i64(value: int) -> np.ndarray:
    return np.array(value, dtype=np.int64)


# -- the ops, one against onnxruntime each ------------------------------------------------

@pytest.mark.parametrize("position", [0, 2, -1, -3])
def test_construct_at_length(position: int) -> None:
    nodes = [helper.make_node("SequenceConstruct", ["a", "b", "c"], ["s"]),
             helper.make_node("SequenceAt", ["s", "p"], ["y"]),
             helper.make_node("SequenceLength", ["s"], ["n"])]
    proto = model(nodes, [tensor("a", shape=[2, 3]), tensor("b", shape=[4, 3]),
                          tensor("c", shape=[1, 3]), tensor("p", INT64, [])],
                  [tensor("y"), tensor("n", INT64), seq("s")])
    assert_matches_ort(proto, {"a": _f32(2, 3), "b": _f32(4, 3), "c": _f32(1, 3),
                               "p": _i64(position)})


@pytest.mark.parametrize("position", [None, 0, 1, 3, -1, -3])
def test_insert(position: int | None) -> None:
    inputs = ["s", "t"] + ([] if position is None else ["p"])
    nodes = [helper.make_node("SequenceInsert", inputs, ["y"])]
    declared = [seq("s"), tensor("t")] + ([] if position is None else [tensor("p", INT64, [])])
    feeds: dict[str, Any] = {"s": [_f32(2), _f32(3), _f32(1)], "t": _f32(5)}
    if position is not None:
        feeds["p"] = _i64(position)
    assert_matches_ort(model(nodes, declared, [seq("y")]), feeds)


@pytest.mark.parametrize("position", [None, 0, -2, 2])
def test_erase(position: int | None) -> None:
    inputs = ["s"] + ([] if position is None else ["p"])
    nodes = [helper.make_node("SequenceErase", inputs, ["y"])]
    declared = [seq("s")] + ([] if position is None else [tensor("p", INT64, [])])
    feeds: dict[str, Any] = {"s": [_f32(2), _f32(3), _f32(1)]}
    if position is not None:
        feeds["p"] = _i64(position)
    assert_matches_ort(model(nodes, declared, [seq("y")]), feeds)


def test_empty_then_insert() -> None:
    nodes = [helper.make_node("SequenceEmpty", [], ["e"], dtype=INT64),
             helper.make_node("SequenceLength", ["e"], ["n0"]),
             helper.make_node("SequenceInsert", ["e", "t"], ["s"]),
             helper.make_node("SequenceLength", ["s"], ["n1"])]
    proto = model(nodes, [tensor("t", INT64, [2])],
                  [tensor("n0", INT64), tensor("n1", INT64), seq("e", INT64), seq("s", INT64)])
    got = assert_matches_ort(proto, {"t": np.array([4, 5], dtype=np.int64)})
    assert got[2] == []


@pytest.mark.parametrize(("split", "attrs"), [
    (None, {}), (None, {"axis": 1, "keepdims": 0}), (None, {"axis": -1}),
    (np.array(2, dtype=np.int64), {"axis": 1}),          # 5 = 2 + 2 + 1
    (np.array([1, 3, 1], dtype=np.int64), {"axis": 1}),
    (np.array([3, 1], dtype=np.int32), {"axis": 0, "keepdims": 0}),  # keepdims: no effect
])
def test_split_to_sequence(split: np.ndarray | None, attrs: dict[str, Any]) -> None:
    inputs = ["x"] + ([] if split is None else ["split"])
    nodes = [helper.make_node("SplitToSequence", inputs, ["s"], **attrs)]
    declared = [tensor("x", shape=[4, 5])]
    feeds = {"x": _f32(4, 5)}
    if split is not None:
        declared.append(tensor("split", helper.np_dtype_to_tensor_dtype(split.dtype),
                               list(split.shape)))
        feeds["split"] = split
    assert_matches_ort(model(nodes, declared, [seq("s")]), feeds)


@pytest.mark.parametrize(("axis", "new_axis"), [(0, 0), (1, 0), (-1, 0), (0, 1), (2, 1),
                                               (-1, 1), (-3, 1)])
def test_concat_from_sequence(axis: int, new_axis: int) -> None:
    nodes = [helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=axis, new_axis=new_axis)]
    proto = model(nodes, [seq("s", shape=[2, 3])], [tensor("y")])
    assert_matches_ort(proto, {"s": [_f32(2, 3), _f32(2, 3), _f32(2, 3)]})


def test_concat_from_sequence_of_varying_lengths() -> None:
    nodes = [helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0)]
    proto = model(nodes, [seq("s", shape=["n", 3])], [tensor("y")])
    assert_matches_ort(proto, {"s": [_f32(1, 3), _f32(4, 3), _f32(2, 3)]})


def _map_body() -> onnx.GraphProto:
    body = [helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Shape", ["a"], ["shape"])]
    return helper.make_graph(body, "map", [tensor("a", shape=["n"]), tensor("b", shape=["n"])],
                             [tensor("sum"), tensor("shape", INT64)])


@pytest.mark.parametrize("two_sequences", [False, True])
def test_sequence_map(two_sequences: bool) -> None:
    nodes = [helper.make_node("SequenceMap", ["s", "b"], ["sums", "shapes"],
                              body=_map_body())]
    b = seq("b") if two_sequences else tensor("b", shape=[3])
    feeds = {"s": [_f32(3), _f32(3)],
             "b": [_f32(3), _f32(3)] if two_sequences else _f32(3)}
    assert_matches_ort(model(nodes, [seq("s"), b], [seq("sums"), seq("shapes", INT64)]), feeds)


def test_sequence_map_of_an_empty_sequence() -> None:
    nodes = [helper.make_node("SequenceMap", ["s", "b"], ["sums", "shapes"],
                              body=_map_body())]
    proto = model(nodes, [seq("s"), tensor("b", shape=[3])], [seq("sums"), seq("shapes", INT64)])
    sums, shapes = segflow.InferenceSession(proto).run(None, {"s": [], "b": _f32(3)})
    assert sums == [] and shapes == []


# -- control flow carrying sequences ------------------------------------------------------

def test_loop_accumulates_a_sequence_then_concatenates() -> None:
    """The export pattern of detection and speech models: a Loop inserts one tensor per
    iteration into a carried sequence; ConcatFromSequence joins them afterwards."""
    body_nodes = [
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "i_f"], ["scaled"]),
        helper.make_node("SequenceInsert", ["acc_in", "scaled"], ["acc_out"]),
    ]
    body = helper.make_graph(body_nodes, "body",
                             [tensor("i", INT64, []), tensor("cond_in", TensorProto.BOOL, []),
                              seq("acc_in")],
                             [tensor("cond_out", TensorProto.BOOL, []), seq("acc_out")])
    nodes = [helper.make_node("SequenceEmpty", [], ["empty"]),
             helper.make_node("Loop", ["trips", "", "empty"], ["acc"], body=body),
             helper.make_node("ConcatFromSequence", ["acc"], ["y"], axis=0, new_axis=1),
             helper.make_node("SequenceLength", ["acc"], ["n"])]
    proto = model(nodes, [tensor("x", shape=[2, 3]), tensor("trips", INT64, [])],
                  [tensor("y"), tensor("n", INT64)])
    x = _f32(2, 3)
    y, n = assert_matches_ort(proto, {"x": x, "trips": _i64(4)})
    assert y.shape == (4, 2, 3) and int(n) == 4
    np.testing.assert_allclose(y[3], 3 * x, rtol=1e-6)


def test_loop_keeps_the_sequence_it_was_given() -> None:
    """Insert and erase return new lists: the sequence fed to the Loop is unchanged, so a
    second reader after it sees the feed."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]),
         helper.make_node("SequenceErase", ["s_in"], ["s_out"])], "body",
        [tensor("i", INT64, []), tensor("c", TensorProto.BOOL, []), seq("s_in")],
        [tensor("c_out", TensorProto.BOOL, []), seq("s_out")])
    nodes = [helper.make_node("Loop", ["trips", "", "s"], ["left"], body=body),
             helper.make_node("SequenceLength", ["s"], ["n"])]
    proto = model(nodes, [seq("s"), tensor("trips", INT64, [])],
                  [seq("left"), tensor("n", INT64)])
    left, n = assert_matches_ort(proto, {"s": [_f32(2), _f32(2), _f32(2)], "trips": _i64(2)})
    assert len(left) == 1 and int(n) == 3


# -- planning: LOCAL tasks, passes that leave sequences alone -------------------------------

def _relu_sequence_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("SequenceConstruct", ["r", "x"], ["s"]),
             helper.make_node("Identity", ["s"], ["s2"]),
             helper.make_node("SequenceLength", ["s2"], ["n"]),
             helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             # r's last tensor reader, after every task reading it: Add could write over
             # r in place, were the sequence not holding r.
             helper.make_node("Add", ["r", "nf"], ["a"]),
             helper.make_node("ConcatFromSequence", ["s2"], ["c"], axis=0),
             helper.make_node("Add", ["c", "c"], ["y"])]
    proto = model(nodes, [tensor("x", shape=[2, 3])], [tensor("y", shape=[4, 3]),
                                                       tensor("a", shape=[2, 3])])
    return proto, {"x": _f32(2, 3)}


def test_sequence_nodes_run_as_local_tasks() -> None:
    proto, feeds = _relu_sequence_model()
    assert_matches_ort(proto, feeds)
    sess = segflow.InferenceSession(proto)
    plan = sess.plan
    kinds = {n.op_type: plan.opdefs[n].exec_type_of(n) for n in plan.graph.nodes}
    # Identity is SYNC for a tensor; over a sequence it runs on the host too.
    assert kinds["SequenceConstruct"] is ExecType.LOCAL
    assert kinds["ConcatFromSequence"] is ExecType.LOCAL
    assert kinds.get("Identity", ExecType.LOCAL) is ExecType.LOCAL
    assert kinds["Add"] is ExecType.SYNC
    assert all(s.exec_type is ExecType.SYNC or len(s.nodes) == 1 for s in plan.segments)


def test_in_place_never_overwrites_a_tensor_a_sequence_holds() -> None:
    proto, feeds = _relu_sequence_model()
    y, a = assert_matches_ort(proto, feeds)
    relu = np.maximum(feeds["x"], 0)
    np.testing.assert_allclose(y[:2], 2 * relu, rtol=1e-6)


def test_constant_sequences_are_not_folded() -> None:
    w = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    nodes = [helper.make_node("SequenceConstruct", ["w", "w"], ["s"]),
             helper.make_node("ConcatFromSequence", ["s"], ["c"], axis=0),
             helper.make_node("Add", ["c", "x"], ["y"])]
    proto = model(nodes, [tensor("x", shape=[4])], [tensor("y", shape=[4])])
    proto.graph.initializer.append(w)
    assert_matches_ort(proto, {"x": _f32(4)})
    ops = [n.op_type for n in segflow.InferenceSession(proto).plan.graph.nodes]
    assert "SequenceConstruct" in ops


# -- feeds and outputs through InferenceSession --------------------------------------------

def _passthrough() -> onnx.ModelProto:
    nodes = [helper.make_node("SequenceInsert", ["s", "t"], ["out"]),
             helper.make_node("SequenceLength", ["s"], ["n"])]
    return model(nodes, [seq("s", shape=["n", 2]), tensor("t", shape=[1, 2])],
                 [seq("out"), tensor("n", INT64)])


def test_sequence_feed_and_output() -> None:
    sess = segflow.InferenceSession(_passthrough())
    assert [a.type for a in sess.get_inputs()] == ["seq(tensor(float))", "tensor(float)"]
    assert [a.type for a in sess.get_outputs()] == ["seq(tensor(float))", "tensor(int64)"]
    s = [_f32(3, 2), _f32(1, 2)]
    t = _f32(1, 2)
    out, n = sess.run(None, {"s": s, "t": t})
    assert_same(out, [s[0], s[1], t])
    assert int(n) == 2
    # The outputs are the caller's own: never the feeds' memory.
    assert not any(np.shares_memory(o, f) for o in out for f in [*s, t])
    out, n = sess.run(None, {"s": [], "t": t})   # an empty sequence
    assert_same(out, [t])
    assert int(n) == 0


@pytest.mark.parametrize(("feeds", "match"), [
    ({"s": np.zeros((1, 2), np.float32)}, r"input 's' is an array; expected a list"),
    ({"s": None}, r"input 's' is None; expected a list"),
    ({"s": [np.zeros((1, 2), np.float64)]}, r"dtype double, expected float.*element 0"),
    ({"s": [np.zeros((1, 2), np.float32), np.zeros((1, 3), np.float32)]},
     r"dimension 3 at axis 1, expected 2.*element 1"),
    ({"s": [np.zeros((1, 2), np.float32), [np.zeros(2)]]}, r"element 1 is a list"),
    ({"t": [np.zeros((1, 2), np.float32)]}, r"input 't' is a list of arrays \(a sequence\)"),
])
def test_wrong_kind_feeds(feeds: dict[str, object], match: str) -> None:
    sess = segflow.InferenceSession(_passthrough())
    full = {"s": [np.zeros((1, 2), np.float32)], "t": np.zeros((1, 2), np.float32), **feeds}
    with pytest.raises(InvalidInput, match=match):
        sess.run(None, full)


@pytest.mark.parametrize(("op", "inputs", "attrs", "match"), [
    ("SequenceAt", ["s", "p"], {}, "position 3 is out of range"),
    ("SequenceErase", ["s", "p"], {}, "position 3 is out of range"),
    ("SequenceInsert", ["s", "t", "p"], {}, None),    # 3 = len: inserting at the end is valid
])
def test_positions_out_of_range(op: str, inputs: list[str], attrs: dict[str, Any],
                                match: str | None) -> None:
    out = tensor("y") if op == "SequenceAt" else seq("y")
    declared = [seq("s"), tensor("p", INT64, [])] if "t" not in inputs \
        else [seq("s"), tensor("t"), tensor("p", INT64, [])]
    proto = model([helper.make_node(op, inputs, ["y"], **attrs)], declared, [out])
    feeds = {"s": [_f32(2), _f32(2), _f32(2)], "p": _i64(3), "t": _f32(2)}
    feeds = {k: v for k, v in feeds.items() if k in inputs}
    if match is None:
        assert_matches_ort(proto, feeds)
        return
    with pytest.raises(ExecutionError, match=match):
        segflow.InferenceSession(proto).run(None, feeds)


def test_threaded_engine_runs_sequences() -> None:
    proto, feeds = _relu_sequence_model()
    expected = segflow.InferenceSession(proto, engine="inline").run(None, feeds)
    got = segflow.InferenceSession(proto, engine="threaded").run(None, feeds)
    for g, e in zip(got, expected):
        assert_same(g, e)


@pytest.mark.parametrize("io_on_compute", [True, False])
def test_sequences_on_a_device_with_streams(io_on_compute: bool) -> None:
    """The stream path (CUDA's, on the CPU through FakeBackend): a sequence feed goes to
    the device tensor by tensor, with one event for the lot on the copy stream, and a
    sequence output comes back the same way."""
    fake = FakeBackend()
    sess = segflow.InferenceSession(_passthrough(), stream_backend=fake)
    sess._executor.completion.io_on_compute = io_on_compute
    s = [_f32(3, 2), _f32(1, 2)]
    t = _f32(1, 2)
    fake.calls.clear()
    out, n = sess.run(None, {"s": s, "t": t})
    assert_same(out, [s[0], s[1], t])
    assert int(n) == 2
    assert fake.count("to_device") == 3           # two tensors of the sequence, and t
    assert fake.count("to_host") == 4             # the three of the output, and n
    out, n = sess.run(None, {"s": [], "t": t})
    assert_same(out, [t])
