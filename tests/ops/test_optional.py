"""optional.py (Optional, OptionalHasElement, OptionalGetElement) against onnxruntime;
an If returning an optional, optional feeds (None or a value) and outputs (None)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from seq_compare import assert_matches_ort, model, optional, seq, tensor

import segflow
from segflow.engine.base import ExecType
from segflow.errors import ExecutionError, InvalidInput

RNG = np.random.default_rng(0)
BOOL = TensorProto.BOOL


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_optional_ops_on_tensors() -> None:
    """Opset 18 takes a plain tensor where an optional is expected; an omitted input is
    an empty optional."""
    nodes = [helper.make_node("OptionalHasElement", ["x"], ["has"]),
             helper.make_node("OptionalHasElement", [""], ["none"]),
             helper.make_node("OptionalGetElement", ["x"], ["y"])]
    proto = model(nodes, [tensor("x", shape=[3])],
                  [tensor("has", BOOL, []), tensor("none", BOOL, []), tensor("y")])
    has, none, y = assert_matches_ort(proto, {"x": _f32(3)})
    assert bool(has) and not bool(none)


def test_optional_wraps_and_unwraps() -> None:
    empty_type = helper.make_tensor_type_proto(TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Optional", ["x"], ["full"]),
             helper.make_node("Optional", [], ["empty"], type=empty_type),
             helper.make_node("OptionalHasElement", ["full"], ["has_full"]),
             helper.make_node("OptionalHasElement", ["empty"], ["has_empty"]),
             helper.make_node("OptionalGetElement", ["full"], ["y"])]
    proto = model(nodes, [tensor("x", shape=[2])],
                  [tensor("has_full", BOOL, []), tensor("has_empty", BOOL, []), tensor("y"),
                   optional("empty", shape=[2])])
    has_full, has_empty, y, empty = assert_matches_ort(proto, {"x": _f32(2)})
    assert bool(has_full) and not bool(has_empty) and empty is None


@pytest.mark.parametrize("present", [True, False])
def test_optional_feed(present: bool) -> None:
    """An optional input takes None (empty) or an array, as in onnxruntime."""
    nodes = [helper.make_node("OptionalHasElement", ["o"], ["has"]),
             helper.make_node("Identity", ["o"], ["same"])]
    proto = model(nodes, [optional("o", shape=[2])],
                  [tensor("has", BOOL, []), optional("same", shape=[2])])
    feed = _f32(2) if present else None
    has, same = assert_matches_ort(proto, {"o": feed})
    assert bool(has) is present and (same is None) is not present


def test_optional_sequence_feed() -> None:
    nodes = [helper.make_node("OptionalGetElement", ["o"], ["s"]),
             helper.make_node("SequenceLength", ["s"], ["n"])]
    proto = model(nodes, [optional("o", sequence=True)],
                  [seq("s"), tensor("n", TensorProto.INT64, [])])
    sess = segflow.InferenceSession(proto)
    assert sess.get_inputs()[0].type == "optional(seq(tensor(float)))"
    s, n = assert_matches_ort(proto, {"o": [_f32(2), _f32(3)]})
    assert len(s) == 2 and int(n) == 2
    with pytest.raises(ExecutionError, match="holds no value"):
        sess.run(None, {"o": None})


@pytest.mark.parametrize(("feed", "match"), [
    ([np.zeros(2, np.float32)], r"input 'o' is a list; expected an array or None"),
    (np.zeros(2, np.float64), r"dtype double, expected float"),
    (np.zeros(3, np.float32), r"dimension 3 at axis 0, expected 2"),
])
def test_wrong_kind_optional_feeds(feed: object, match: str) -> None:
    proto = model([helper.make_node("OptionalHasElement", ["o"], ["has"])],
                  [optional("o", shape=[2])], [tensor("has", BOOL, [])])
    with pytest.raises(InvalidInput, match=match):
        segflow.InferenceSession(proto).run(None, {"o": feed})


def _if_optional() -> onnx.ModelProto:
    """An If whose then branch returns ``x`` wrapped in an optional and whose else branch
    returns an empty one: how exporters write an optional result of control flow."""
    held = helper.make_tensor_type_proto(TensorProto.FLOAT, [3])
    then_branch = helper.make_graph(
        [helper.make_node("Optional", ["x"], ["then_out"])], "then", [],
        [optional("then_out", shape=[3])])
    else_branch = helper.make_graph(
        [helper.make_node("Optional", [], ["else_out"], type=held)], "else", [],
        [optional("else_out", shape=[3])])
    nodes = [helper.make_node("If", ["cond"], ["opt"], then_branch=then_branch,
                              else_branch=else_branch),
             helper.make_node("OptionalHasElement", ["opt"], ["has"])]
    return model(nodes, [tensor("cond", BOOL, []), tensor("x", shape=[3])],
                 [optional("opt", shape=[3]), tensor("has", BOOL, [])])


@pytest.mark.parametrize("cond", [True, False])
def test_if_returns_an_optional(cond: bool) -> None:
    x = _f32(3)
    opt, has = assert_matches_ort(_if_optional(), {"cond": np.array(cond), "x": x})
    assert bool(has) is cond
    if cond:
        np.testing.assert_array_equal(opt, x)
    else:
        assert opt is None


def test_optional_nodes_run_as_local_tasks() -> None:
    sess = segflow.InferenceSession(_if_optional())
    kinds = {n.op_type: sess.plan.opdefs[n].exec_type_of(n) for n in sess.plan.graph.nodes}
    assert kinds == {"If": ExecType.LOCAL, "OptionalHasElement": ExecType.LOCAL}
