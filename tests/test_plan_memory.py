"""Tests for passes/plan_memory.py: lifetimes, in-place legality, arena layout.

The property test builds random graphs of elementwise ops, views and matmuls,
plans them, checks that no two buffers alive at the same time share bytes, and
runs them (generated code with the plan's in-place ops) against onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models
from segflow.frontend.onnx_import import import_model
from segflow.passes.plan_memory import (
    FRESH_OUTPUT_OPS,
    MemoryPlan,
    PlansBySize,
    nbytes,
    plan_memory,
)

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=None):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, F32, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, F32, None) for n in outputs],
        initializer=[numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _plan(model, **kwargs) -> tuple[MemoryPlan, object]:
    graph = import_model(model)
    return plan_memory(graph, **kwargs), graph


def _inplace_ops(plan: MemoryPlan) -> dict[str, int]:
    return {node.op_type + ":" + node.outputs[0].name: slot for node, slot in plan.inplace.items()}


# -- targeted cases -----------------------------------------------------------------------
def test_relu_chain_runs_in_place_and_reuses_storage():
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Sigmoid", ["b"], ["c"]),
             helper.make_node("Neg", ["c"], ["out"])]
    plan, _ = _plan(_model(nodes, {"x": [64, 64]}, ["out"]))
    assert _inplace_ops(plan) == {"Relu:b": 0, "Sigmoid:c": 0, "Neg:out": 0}
    assert len(plan.buffers) == 1 and plan.buffers[0].values == ("a", "b", "c", "out")
    assert plan.arena_bytes == 64 * 64 * 4
    assert plan.naive_bytes == 4 * 64 * 64 * 4
    assert "in-place" in plan.summary()


def test_graph_inputs_outputs_and_shared_values_are_never_overwritten():
    nodes = [helper.make_node("Relu", ["x"], ["a"]),      # x is the caller's
             helper.make_node("Relu", ["a"], ["b"]),      # a is read again below
             helper.make_node("Add", ["a", "b"], ["c"]),  # a dies here: in place over a
             helper.make_node("Sigmoid", ["c"], ["out"])]
    plan, _ = _plan(_model(nodes, {"x": [8]}, ["out", "c"]))
    ops = _inplace_ops(plan)
    assert "Relu:a" not in ops and "Relu:b" not in ops
    assert ops.get("Add:c") in (0, 1)
    assert "Sigmoid:out" not in ops  # c is a graph output


def test_a_live_view_blocks_in_place():
    inits = {"shape": np.array([4, 2], np.int64)}
    nodes = [helper.make_node("Neg", ["x"], ["a"]),
             helper.make_node("Reshape", ["a", "shape"], ["view"]),
             helper.make_node("Relu", ["a"], ["b"]),          # view still alive: not in place
             helper.make_node("Reshape", ["b", "shape"], ["bv"]),
             helper.make_node("Add", ["view", "bv"], ["out"])]
    model = _model(nodes, {"x": [8]}, ["out"], inits)
    plan, _ = _plan(model)
    assert "Relu:b" not in _inplace_ops(plan)
    _run_against_ort(model, {"x": np.arange(8, dtype=np.float32) - 4})


def test_lifetimes_allow_reuse_between_disjoint_values():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]),
             helper.make_node("MatMul", ["a", "w"], ["b"]),
             helper.make_node("MatMul", ["b", "w"], ["c"]),
             helper.make_node("MatMul", ["c", "w"], ["out"])]
    plan, _ = _plan(_model(nodes, {"x": [16, 16]}, ["out"],
                           {"w": np.eye(16, dtype=np.float32)}))
    # a and c never live at the same time: two buffers' worth of arena, four naive.
    size = 16 * 16 * 4
    assert plan.naive_bytes == 4 * size
    assert plan.arena_bytes == 2 * size == plan.live_peak_bytes


def test_symbolic_dims_are_sized_as_one_by_default_and_on_request():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["out"])]
    model = _model(nodes, {"x": ["batch", 10]}, ["out", "a"])
    plan, graph = _plan(model)
    assert plan.dims == {"batch": 1} and plan.arena_bytes == 2 * 64  # 40 B aligned to 64
    plan8 = plan_memory(graph, dims={"batch": 8})
    assert plan8.arena_bytes == 2 * 320
    assert nbytes(graph.outputs[0], {"batch": 3}) == 120
    assert nbytes(graph.outputs[0]) is None


def test_dims_not_named_are_planned_at_one_and_a_session_plans_at_its_dims():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["out"])]
    model = _model(nodes, {"x": ["batch", "width"]}, ["out", "a"])
    plan, _ = _plan(model, dims={"width": 16})
    assert plan.dims == {"batch": 1, "width": 16} and plan.arena_bytes == 2 * 64
    sess = segflow.InferenceSession(model, dims={"batch": 4, "width": 16})
    assert sess.plan.memory is not None and sess.plan.memory.dims == {"batch": 4, "width": 16}
    assert sess.plan.memory.arena_bytes == 2 * 4 * 16 * 4
    assert "at batch=4, width=16" in sess.explain()
    x = np.ones((2, 3), np.float32)   # a run at other dims still re-plans for its own
    assert np.array_equal(sess.run(None, {"x": x})[0], -x)


def test_plans_by_size_keep_the_base_plan_and_a_bounded_cache():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["out"])]
    plan, graph = _plan(_model(nodes, {"x": ["batch", 16]}, ["out"]))
    sizes = PlansBySize(graph, plan)
    assert sizes.for_dims({"batch": 1}) is plan and sizes.for_dims({}) is plan
    for batch in range(2, 3 * PlansBySize.MAX_SIZES):
        assert sizes.for_dims({"batch": batch, "unrelated": 5}).arena_bytes == batch * 64
        assert len(sizes._plans) <= PlansBySize.MAX_SIZES
    assert sizes.for_dims({"batch": 1}) is plan
    assert sizes.for_dims({"batch": 3}).dims == {"batch": 3}


def test_plan_switch_and_report_in_session():
    model = models.build("resnet18", num_classes=10, image_size=32)
    feeds = models.example_inputs("resnet18", num_classes=10, image_size=32)
    sess = segflow.InferenceSession(model, engine="inline")
    sess.run(None, feeds)
    settings_ = sess.last_run_stats.settings
    assert 0 < settings_["memory_planned_peak_bytes"] < settings_["memory_naive_bytes"]
    assert settings_["memory_inplace_nodes"] > 0
    assert any(line.startswith("plan_memory: planned peak") for line in sess.plan.pass_log)
    off = segflow.InferenceSession(model, engine="inline", optimize={"plan_memory": False})
    assert "plan_memory: off" in off.plan.pass_log
    off.run(None, feeds)
    assert "memory_planned_peak_bytes" not in off.last_run_stats.settings
    np.testing.assert_allclose(off.run(None, feeds)[0], sess.run(None, feeds)[0],
                               atol=1e-4, rtol=1e-3)


def test_run_stats_report_the_plan_at_the_batch_of_the_run():
    model = models.build("resnet18", num_classes=10, image_size=32)
    sess = segflow.InferenceSession(model, engine="inline")

    def planned(batch: int) -> dict:
        sess.run(None, models.example_inputs("resnet18", batch_size=batch, num_classes=10,
                                             image_size=32))
        return sess.last_run_stats.settings

    at1, at4 = planned(1), planned(4)
    assert at1["memory_plan_dims"] == "batch=1" and at4["memory_plan_dims"] == "batch=4"
    expected = plan_memory(sess.graph, dims={"batch": 4})
    assert at4["memory_planned_peak_bytes"] == expected.arena_bytes
    assert at4["memory_naive_bytes"] == expected.naive_bytes
    assert at4["memory_planned_peak_bytes"] > 3 * at1["memory_planned_peak_bytes"]
    assert at4["memory_inplace_nodes"] == at1["memory_inplace_nodes"]  # decided symbolically
    assert planned(1)["memory_planned_peak_bytes"] == at1["memory_planned_peak_bytes"]
    # Counters and the other settings are those of the run itself.
    assert {k: v for k, v in at4.items() if not k.startswith("memory_")} == \
        {k: v for k, v in at1.items() if not k.startswith("memory_")}


def test_resnet_plan_is_far_below_naive():
    plan, _ = _plan(models.build("resnet50", num_classes=10, image_size=64))
    assert plan.unplanned == 0
    assert plan.arena_bytes < plan.naive_bytes / 3
    assert plan.live_peak_bytes <= plan.arena_bytes


def test_an_in_place_op_never_overwrites_a_view_that_is_still_needed():
    # Found by the property test below: Relu(v0) runs in place, so v1 lives in v0's
    # storage; v3 = Reshape(v1) is a view of it and a graph output. The Reshape joins
    # v1 with its shape constant in one group, whose root is not v1: the in-place
    # decision used to lose that group's end (the end of the graph) and pinning, and
    # then let Sigmoid(v1) overwrite the storage v3 still shows.
    nodes = [helper.make_node("Relu", ["x"], ["v0"]), helper.make_node("Relu", ["v0"], ["v1"]),
             helper.make_node("Reshape", ["v1", "s3"], ["v3"]),
             helper.make_node("Sigmoid", ["v1"], ["v4"]), helper.make_node("Relu", ["v3"], ["v10"])]
    model = _model(nodes, {"x": [4, 8], "y": [4, 8]}, ["v10", "v3", "v4"],
                   {"s3": np.array([8, 4], np.int64)})
    plan = plan_memory(import_model(model))
    assert "Sigmoid" not in {node.op_type for node in plan.inplace}
    rng = np.random.default_rng(0)
    _run_against_ort(model, {"x": rng.standard_normal((4, 8), dtype=np.float32),
                             "y": rng.standard_normal((4, 8), dtype=np.float32)})


# -- property test over random graphs --------------------------------------------------------
SHAPES = [(4, 8), (8, 4), (32,), (2, 16)]
UNARY = ["Relu", "Sigmoid", "Neg", "Tanh"]
BINARY = ["Add", "Mul", "Sub"]


@st.composite
def random_graphs(draw):
    """A random DAG over a few static shapes: elementwise ops, views, matmuls."""
    values: dict[str, tuple[int, ...]] = {"x": (4, 8), "y": (4, 8)}
    inits: dict[str, np.ndarray] = {}
    nodes = []
    for i in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["unary", "binary", "view", "transpose", "matmul",
                                     "identity"]))
        name = f"v{i}"
        src = draw(st.sampled_from(sorted(values)))
        shape = values[src]
        if kind == "unary":
            nodes.append(helper.make_node(draw(st.sampled_from(UNARY)), [src], [name]))
        elif kind == "binary":
            same = sorted(v for v, s in values.items() if s == shape)
            other = draw(st.sampled_from(same))
            nodes.append(helper.make_node(draw(st.sampled_from(BINARY)), [src, other], [name]))
        elif kind == "view":
            target = draw(st.sampled_from(SHAPES))
            inits[f"s{i}"] = np.array(target, np.int64)
            nodes.append(helper.make_node("Reshape", [src, f"s{i}"], [name]))
            shape = target
        elif kind == "transpose" and len(shape) == 2:
            nodes.append(helper.make_node("Transpose", [src], [name], perm=[1, 0]))
            shape = (shape[1], shape[0])
        elif kind == "matmul" and len(shape) == 2:
            w = f"w{i}"
            inits[w] = np.full((shape[1], shape[1]), 0.1, np.float32)
            nodes.append(helper.make_node("MatMul", [src, w], [name]))
        else:
            nodes.append(helper.make_node("Identity", [src], [name]))
        values[name] = shape
    produced = [n.output[0] for n in nodes]
    extra = draw(st.lists(st.sampled_from(produced), max_size=3, unique=True))
    outputs = list(dict.fromkeys([produced[-1], *extra]))
    return _model(nodes, {"x": [4, 8], "y": [4, 8]}, outputs, inits)


def _run_against_ort(model, feeds):
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    for kwargs in ({"compile": "codegen"}, {"compile": "none"}):
        got = segflow.InferenceSession(model, engine="inline", **kwargs).run(None, feeds)
        for r, g in zip(ref, got):
            np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_no_two_live_values_share_storage(model):
    graph = import_model(model)
    plan = plan_memory(graph)
    nodes = graph.nodes
    position = {node: i for i, node in enumerate(nodes)}
    buffers = plan.buffers
    for i, a in enumerate(buffers):
        for b in buffers[i + 1:]:
            if a.overlaps_in_time(b):
                assert not a.overlaps_in_space(b), (a, b)
    assert plan.live_peak_bytes <= plan.arena_bytes <= plan.naive_bytes
    # Every value stored in a buffer is read only while the buffer is alive.
    by_name = {v.name: v for v in graph.values()}
    for buf in buffers:
        for name in buf.values:
            value = by_name[name]
            assert buf.start <= position[value.producer]
            for use in value.uses:
                assert position[use] <= buf.end
            if value in graph.outputs:
                assert buf.end == len(nodes)
    # An overwritten input is dead afterwards, owns its storage, and is nobody's output.
    for node, slot in plan.inplace.items():
        target = node.inputs[slot]
        assert target is not None and target.producer is not None
        assert target.producer.op_type in FRESH_OUTPUT_OPS
        assert target not in graph.outputs
        assert all(position[use] <= position[node] for use in target.uses)
    # ... and so is everything else in that storage: the views of it (outputs of ops not
    # in FRESH_OUTPUT_OPS) and what earlier in-place ops wrote there.
    storage = {v: v for v in graph.values()}

    def home(v):
        while storage[v] is not v:
            v = storage[v]
        return v
    for node in nodes:
        slot = plan.inplace.get(node)
        if slot is not None:
            source = node.inputs[slot]
        elif node.op_type not in FRESH_OUTPUT_OPS and node.inputs:
            source = node.inputs[0]
        else:
            continue
        assert source is not None
        storage[home(node.outputs[0])] = home(source)
        if slot is None:
            continue
        for value in graph.values():
            if value.producer is not None and position[value.producer] < position[node] \
                    and home(value) is home(source):
                assert value not in graph.outputs, (node.op_type, value.name)
                assert all(position[use] <= position[node] for use in value.uses), \
                    (node.op_type, value.name)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 8), dtype=np.float32),
             "y": rng.standard_normal((4, 8), dtype=np.float32)}
    _run_against_ort(model, feeds)


def test_a_reduce_over_no_axes_does_not_hand_out_its_input_storage():
    # ReduceMean with noop_with_empty_axes is an identity; the plan counts a reduce's
    # output as new storage (FRESH_OUTPUT_OPS), so a kernel returning its input itself
    # let the in-place Relu after it overwrite the convolution output the Add still reads.
    w = np.random.default_rng(0).standard_normal((8, 8, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["c", "axes"], ["m"], keepdims=1,
                              noop_with_empty_axes=1),
             helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Add", ["r", "c"], ["y"])]
    shape = [1, 8, 8, 8]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F32, shape)],
        [helper.make_tensor_value_info("y", F32, shape)],
        initializer=[numpy_helper.from_array(w, "w"),
                     numpy_helper.from_array(np.zeros(0, np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    for compile in ("codegen", "none"):
        got = segflow.InferenceSession(model.SerializeToString(), compile=compile).run(
            None, feeds)[0]
        want = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3, err_msg=compile)


def test_the_plan_holds_the_memory_plan_its_consumers_read():
    # One memory plan per session: the Plan keeps it, and the compiler's in-place
    # decisions, the arena and the re-sizing for runs all read that same object.
    model = models.build("resnet18", num_classes=10, image_size=32)
    sess = segflow.InferenceSession(model)
    memory = sess.plan.memory
    assert memory is not None and sess.plan.memory_by_size is not None
    assert sess.plan.memory_by_size.base is memory
    arena = sess._executor.arena
    assert arena is None or arena.plans is sess.plan.memory_by_size
    off = segflow.InferenceSession(model, optimize={"plan_memory": False})
    assert off.plan.memory is None and off.plan.memory_by_size is None


def test_placement_reuses_space_of_buffers_that_do_not_overlap_in_time():
    from segflow.ir.memory import Buffer, align, block_bytes, place
    placed = place([Buffer(("a",), 128, 0, 1), Buffer(("b",), 64, 2, 3),
                    Buffer(("c",), 64, 1, 2)])
    assert [b.values[0] for b in placed] == ["a", "b", "c"]   # the order given
    assert placed[1].offset == 0 and placed[2].offset == 128
    assert block_bytes(placed) == 192 and align(65) == 128
