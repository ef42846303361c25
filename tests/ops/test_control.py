"""If / Loop / Scan against onnxruntime, including values captured from the outer graph."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from ort_compare import assert_matches_ort, make_model

import segflow
from segflow.engine.base import ExecType

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _graph(name: str, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[onnx.ValueInfoProto]) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, inputs, outputs)


def _vi(name: str, elem: int = F, shape: list[int] | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _if_model() -> onnx.ModelProto:
    # Branches read x and y from the outer graph; else returns outer y unchanged.
    then_g = _graph("then", [helper.make_node("Add", ["x", "y"], ["t_out"])], [],
                    [_vi("t_out", F, [2, 3])])
    else_g = _graph("else", [helper.make_node("Identity", ["y"], ["e_out"])], [],
                    [_vi("e_out", F, [2, 3])])
    node = helper.make_node("If", ["c"], ["out"], then_branch=then_g, else_branch=else_g)
    feeds = {"c": np.array(True), "x": np.ones((2, 3), np.float32),
             "y": np.ones((2, 3), np.float32)}
    return make_model([node], feeds, ["out"], 13)


def test_if_both_branches_with_captured_values() -> None:
    model = _if_model()
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    y = RNG.standard_normal((2, 3)).astype(np.float32)
    for cond in (True, False):
        assert_matches_ort(model, {"c": np.array(cond), "x": x, "y": y})


def test_if_branch_returning_outer_value_directly() -> None:
    # A branch output that *is* an outer value (no node in the branch reads it).
    # onnxruntime rejects such models, so compare with numpy.
    then_g = _graph("then", [], [], [_vi("x", F, [3])])
    else_g = _graph("else", [helper.make_node("Neg", ["x"], ["neg"])], [], [_vi("neg", F, [3])])
    node = helper.make_node("If", ["c"], ["out"], then_branch=then_g, else_branch=else_g)
    x = np.arange(3, dtype=np.float32)
    sess = segflow.InferenceSession(make_model([node], {"c": np.array(True), "x": x}, ["out"], 13),
                                    engine="inline")
    np.testing.assert_array_equal(sess.run(None, {"c": np.array(True), "x": x})[0], x)
    np.testing.assert_array_equal(sess.run(None, {"c": np.array(False), "x": x})[0], -x)


def test_if_is_a_local_segment() -> None:
    sess = segflow.InferenceSession(_if_model(), engine="inline")
    kinds = [seg.exec_type for seg in sess.plan.segments]
    assert ExecType.LOCAL in kinds


def _loop_model(with_trip: bool, with_cond: bool) -> onnx.ModelProto:
    # body: acc += x * i ; cond_out = acc_sum < limit ; scan output acc
    body = _graph("body", [
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Mul", ["x", "fi"], ["xi"]),
        helper.make_node("Add", ["acc_in", "xi"], ["acc_out"]),
        helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
        helper.make_node("Less", ["total", "limit"], ["cond_out"]),
        helper.make_node("Identity", ["acc_out"], ["scan"]),
    ], [_vi("i", TensorProto.INT64, []), _vi("cond_in", TensorProto.BOOL, []),
        _vi("acc_in", F, [3])],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("acc_out", F, [3]), _vi("scan", F, [3])])
    node = helper.make_node("Loop", ["M" if with_trip else "", "cond" if with_cond else "",
                                     "acc0"], ["acc", "scans"], body=body)
    feeds = {"acc0": np.zeros(3, np.float32), "x": np.ones(3, np.float32),
             "limit": np.array(20.0, np.float32)}
    if with_trip:
        feeds["M"] = np.array(5, np.int64)
    if with_cond:
        feeds["cond"] = np.array(True)
    return make_model([node], feeds, ["acc", "scans"], 13)


def test_loop_trip_count_and_condition() -> None:
    x = np.array([1.0, 2.0, 0.5], np.float32)
    for with_trip, with_cond in ((True, True), (True, False), (False, True)):
        model = _loop_model(with_trip, with_cond)
        feeds = {"acc0": np.zeros(3, np.float32), "x": x, "limit": np.array(20.0, np.float32)}
        if with_trip:
            feeds["M"] = np.array(5, np.int64)
        if with_cond:
            feeds["cond"] = np.array(True)
        got = assert_matches_ort(model, feeds)
        assert got[1].shape[1:] == (3,)


def test_loop_condition_false_at_entry_runs_no_iteration() -> None:
    model = _loop_model(True, True)
    feeds = {"acc0": np.full(3, 7.0, np.float32), "x": np.ones(3, np.float32),
             "limit": np.array(20.0, np.float32), "M": np.array(5, np.int64),
             "cond": np.array(False)}
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    np.testing.assert_array_equal(got[0], feeds["acc0"])
    assert got[1].shape == (0, 3)


def test_if_nested_in_loop_reads_outermost_value() -> None:
    # Loop body holds an If whose branches read `scale` from the top-level graph.
    then_g = _graph("then", [helper.make_node("Mul", ["acc_in", "scale"], ["t"])], [],
                    [_vi("t", F, [2])])
    else_g = _graph("else", [helper.make_node("Add", ["acc_in", "scale"], ["e"])], [],
                    [_vi("e", F, [2])])
    body = _graph("body", [
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("", TensorProto.INT64,
                                                                        [], [2])),
        helper.make_node("Mod", ["i", "two"], ["parity"]),
        helper.make_node("Cast", ["parity"], ["odd"], to=TensorProto.BOOL),
        helper.make_node("If", ["odd"], ["acc_out"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ], [_vi("i", TensorProto.INT64, []), _vi("cond_in", TensorProto.BOOL, []),
        _vi("acc_in", F, [2])], [_vi("cond_out", TensorProto.BOOL, []), _vi("acc_out", F, [2])])
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc"], body=body)
    feeds = {"M": np.array(4, np.int64), "acc0": np.array([1.0, -2.0], np.float32),
             "scale": np.array([1.5, 3.0], np.float32)}
    assert_matches_ort(make_model([node], feeds, ["acc"], 13), feeds)


def test_scan9_axes_and_directions() -> None:
    # state: running sum over the scanned axis; scan inputs read along axis 1, one reversed.
    body = _graph("body", [
        helper.make_node("Add", ["s_in", "a"], ["s1"]),
        helper.make_node("Mul", ["s1", "b"], ["s_out"]),
        helper.make_node("Identity", ["s_out"], ["y1"]),
        helper.make_node("Neg", ["a"], ["y2"]),
    ], [_vi("s_in", F, [2]), _vi("a", F, [2]), _vi("b", F, [2])],
        [_vi("s_out", F, [2]), _vi("y1", F, [2]), _vi("y2", F, [2])])
    node = helper.make_node("Scan", ["s0", "A", "B"], ["s", "Y1", "Y2"], body=body,
                            num_scan_inputs=2, scan_input_axes=[1, 0],
                            scan_input_directions=[0, 1], scan_output_axes=[1, -1],
                            scan_output_directions=[1, 0])
    feeds = {"s0": np.zeros(2, np.float32),
             "A": RNG.standard_normal((2, 4)).astype(np.float32),
             "B": RNG.uniform(0.5, 1.5, (4, 2)).astype(np.float32)}
    assert_matches_ort(make_model([node], feeds, ["s", "Y1", "Y2"], 16), feeds)


def test_scan8_batch_and_sequence_lens() -> None:
    body = _graph("body", [
        helper.make_node("Add", ["s_in", "x"], ["s_out"]),
        helper.make_node("Identity", ["s_out"], ["y"]),
    ], [_vi("s_in", F, [2]), _vi("x", F, [2])], [_vi("s_out", F, [2]), _vi("y", F, [2])])
    node = helper.make_node("Scan", ["lens", "s0", "X"], ["s", "Y"], body=body,
                            num_scan_inputs=1, directions=[1])
    feeds = {"lens": np.array([3, 1], np.int64), "s0": np.zeros((2, 2), np.float32),
             "X": RNG.standard_normal((2, 3, 2)).astype(np.float32)}
    assert_matches_ort(make_model([node], feeds, ["s", "Y"], 8), feeds)
