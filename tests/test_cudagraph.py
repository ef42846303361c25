"""CUDA-graph segments on the CPU: eligibility, host-only constants, cache keys, LRU, replay.

Capture and replay run through FakeBackend (a capture runs the segment's body,
a replay runs it again), so the runner's bookkeeping and numerics are checked
without a GPU; real captures are in tests/cuda/.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models
from segflow.engine.base import ExecType
from segflow.engine.streams import FakeBackend
from segflow.frontend.onnx_import import import_model
from segflow.ir.graph import Node, Value
from segflow.ir.types import Device
from segflow.ops import default_registry
from segflow.passes.segment import Phase, Segment
from segflow.runtime.binding import UploadInputs
from segflow.runtime.cudagraph import (
    CaptureKey,
    GraphCache,
    capture_decision,
    host_data_inputs,
    host_only_constants,
    host_values,
)
from segflow.runtime.plan import make_plan
from segflow.settings import BulkSettings

FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _plan(model, bulk=True):
    registry = default_registry()
    graph = import_model(model, registry)
    return make_plan(graph, registry, BulkSettings(inference=bulk), Device.parse("cpu"))


def _node(plan, name):
    return next(n for n in plan.graph.nodes if n.name == name)


def _host_reads(plan, name):
    node = _node(plan, name)
    return plan.opdefs[node].host_read_inputs(node)


# -- which inputs are read on the host ----------------------------------------------------


def _reshape_model(opset=17, shape_from_input=False):
    x = helper.make_tensor_value_info("x", FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", FLOAT, None)
    if shape_from_input:
        s = helper.make_tensor_value_info("s", INT64, [2])
        nodes = [helper.make_node("Reshape", ["x", "s"], ["y"], name="r")]
        return _model(nodes, [x, s], [y], opset=opset)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")]
    return _model(nodes, [x], [y], [_ints("shape", [3, 2])], opset=opset)


def test_host_read_inputs_follow_opset_and_index_rank():
    plan = _plan(_reshape_model())
    assert _host_reads(plan, "r") == (1,)
    x = helper.make_tensor_value_info("x", FLOAT, [4, 3])
    y = helper.make_tensor_value_info("y", FLOAT, None)
    z = helper.make_tensor_value_info("z", FLOAT, None)
    nodes = [helper.make_node("Gather", ["x", "i0"], ["y"], name="scalar", axis=0),
             helper.make_node("Gather", ["x", "i1"], ["z"], name="vector", axis=0)]
    plan = _plan(_model(nodes, [x], [y, z], [_ints("i0", 1), _ints("i1", [0, 2])]))
    assert _host_reads(plan, "scalar") == (1,)
    assert _host_reads(plan, "vector") == ()
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    plan = _plan(_model(nodes, [x], [y]))
    assert _host_reads(plan, "relu") == ()


def test_host_only_constants_excludes_constants_also_used_as_data():
    x = helper.make_tensor_value_info("x", FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", FLOAT, None)
    z = helper.make_tensor_value_info("z", FLOAT, None)
    r = helper.make_tensor_value_info("r", INT64, None)
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape"),
        helper.make_node("Reshape", ["x", "both"], ["xb"], name="reshape2"),
        helper.make_node("Cast", ["both"], ["bf"], name="cast", to=FLOAT),
        helper.make_node("ReduceSum", ["bf"], ["z"], name="sum", keepdims=0),
        helper.make_node("Range", ["start", "limit", "delta"], ["r"], name="range"),
    ]
    inits = [_ints("shape", [3, 2]), _ints("both", [6, 1]), _ints("start", 0),
             _ints("limit", 4), _ints("delta", 1)]
    plan = _plan(_model(nodes, [x], [y, z, r], inits))
    names = {v.name for v in plan.graph.initializers.values()
             if id(v) in host_only_constants(plan.graph.nodes, plan.opdefs)}
    # Range reads all three bounds on the host (its arange is made on the device);
    # `both` is also Reshape data through Cast, so it goes to the device.
    assert names == {"shape", "limit", "start", "delta"}


def test_shape_arithmetic_stays_on_the_host_and_its_data_reader_uploads():
    # nonzero_mid: Div(sum of rows, Add(Cast(Shape(nonzero)), 1)). On CUDA the count is
    # host memory; Cast and Add run there with their constant, and Div uploads it.
    plan = _plan(models.build("nonzero_mid"))
    nodes = plan.graph.nodes
    host = host_values(nodes)
    on_host = {n.name for n in nodes if any(id(v) in host for v in n.outputs)}
    assert on_host == {"count", "count_float", "count_plus_one"}
    uploads = {n.name: host_data_inputs(n, plan.opdefs[n], host) for n in nodes
               if host_data_inputs(n, plan.opdefs[n], host)}
    assert uploads == {"table_mean": (1,)}
    consts = {v.name for v in plan.graph.initializers.values()
              if id(v) in host_only_constants(nodes, plan.opdefs)}
    assert "float.1" in consts and "float.0" not in consts


def test_host_values_stop_at_device_data_and_growing_ops():
    x = helper.make_tensor_value_info("x", FLOAT, ["n", 2])   # Shape(x) broadcasts over x
    y = helper.make_tensor_value_info("y", FLOAT, None)
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Cast", ["s"], ["sf"], name="cast", to=FLOAT),
             helper.make_node("Mul", ["sf", "x"], ["m"], name="with_data"),   # device data
             helper.make_node("ConstantOfShape", ["s"], ["z"], name="fill"),  # grows: device
             helper.make_node("Add", ["m", "z"], ["y"], name="out")]
    plan = _plan(_model(nodes, [x], [y]))
    host = host_values(plan.graph.nodes)
    names = {v.name for n in plan.graph.nodes for v in n.outputs if id(v) in host}
    assert names == {"s", "sf"}
    by_name = {n.name: n for n in plan.graph.nodes}
    with_data, fill = by_name["with_data"], by_name["fill"]
    assert host_data_inputs(with_data, plan.opdefs[with_data], host) == (0,)
    assert host_data_inputs(fill, plan.opdefs[fill], host) == ()  # its shape is read on the host


def test_upload_inputs_moves_only_the_named_host_inputs():
    seen = []

    def kernel(inputs):
        seen.append([t.device.type for t in inputs])
        return [inputs[0]]

    upload = UploadInputs(kernel, (1,), torch.device("meta"))
    upload([torch.ones(2), torch.ones(1)])
    assert seen == [["cpu", "meta"]]


def test_executor_binds_host_only_constants_in_host_memory():
    sess = segflow.InferenceSession(_reshape_model(), engine="inline")
    shapes = [t for t in sess._executor.template if t is not None and t.dtype == torch.int64]
    assert shapes and all(t.device.type == "cpu" for t in shapes)
    out = sess.run(None, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    assert out[0].shape == (3, 2)


# -- eligibility --------------------------------------------------------------------------


def test_constant_shape_is_capturable():
    plan = _plan(_reshape_model())
    decision = capture_decision(plan.segments[0], managed=True, opdefs=plan.opdefs)
    assert decision.eligible and "capturable (1 nodes)" in decision.reason


def test_computed_shape_is_not_capturable():
    plan = _plan(_reshape_model(shape_from_input=True))
    decision = capture_decision(plan.segments[0], managed=True, opdefs=plan.opdefs)
    assert not decision.eligible
    assert "Reshape [r] reads computed input 1 ('s') on the host" in decision.reason


def test_shape_derived_values_are_static_per_key():
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape: fixed by the input shapes."""
    x = helper.make_tensor_value_info("x", FLOAT, ["b", 6])
    y = helper.make_tensor_value_info("y", FLOAT, None)
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], name="shape"),
        helper.make_node("Gather", ["shp", "zero"], ["batch"], name="batch", axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes0"], ["b1"], name="unsq"),
        helper.make_node("Concat", ["b1", "rest"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    inits = [_ints("zero", 0), _ints("axes0", [0]), _ints("rest", [2, 3])]
    plan = _plan(_model(nodes, [x], [y], inits))
    assert capture_decision(plan.segments[0], managed=True, opdefs=plan.opdefs).eligible


def test_data_derived_shape_breaks_eligibility():
    x = helper.make_tensor_value_info("x", FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", FLOAT, None)
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], name="max", keepdims=0),
        helper.make_node("Cast", ["m"], ["mi"], name="cast", to=INT64),
        helper.make_node("Unsqueeze", ["mi", "axes0"], ["k"], name="unsq"),
        helper.make_node("Expand", ["x", "k"], ["y"], name="expand"),
    ]
    plan = _plan(_model(nodes, [x], [y], [_ints("axes0", [0])]))
    decision = capture_decision(plan.segments[0], managed=True, opdefs=plan.opdefs)
    assert not decision.eligible and "Expand [expand]" in decision.reason


def test_local_random_and_unmanaged_segments_are_not_capturable():
    plan = _plan(models.build("nonzero_mid"))
    local = next(s for s in plan.segments if s.exec_type.value == "local")
    decision = capture_decision(local, managed=True, opdefs=plan.opdefs)
    assert not decision.eligible and "local task NonZero" in decision.reason
    sync = plan.segments[0]
    assert "has no CUDA streams" in capture_decision(sync, managed=False,
                                                opdefs=plan.opdefs).reason
    # Built directly: whether RandomNormalLike is registered does not matter here.
    x, noise, y = Value("x"), Value("noise"), Value("y")
    random = Node("RandomNormalLike", [x], [noise], name="noise")
    add = Node("Add", [x, noise], [y], name="add")
    seg = Segment(0, (random, add), ExecType.SYNC, Device.parse("cuda:0"), Phase.INFERENCE,
                  "end of graph")
    decision = capture_decision(seg, managed=True, opdefs={})
    assert not decision.eligible and "random op RandomNormalLike [noise]" in decision.reason


# -- keys and the LRU cache ---------------------------------------------------------------


def test_capture_key_is_shape_dtype_device():
    a = torch.zeros(2, 3)
    key = CaptureKey.of([a, None, torch.zeros(4, dtype=torch.int64)])
    assert key == CaptureKey.of([torch.ones(2, 3), None, torch.ones(4, dtype=torch.int64)])
    assert key != CaptureKey.of([torch.zeros(3, 2), None, torch.zeros(4, dtype=torch.int64)])
    assert key != CaptureKey.of([a.double(), None, torch.zeros(4, dtype=torch.int64)])
    assert hash(key) == hash(CaptureKey.of([a.clone(), None, torch.zeros(4, dtype=torch.int64)]))
    assert key.inputs[0] == ((2, 3), "torch.float32", "cpu")
    assert key.describe() == "float32[2, 3], none[], int64[4]"


def test_graph_cache_is_a_bounded_lru():
    cache: GraphCache[str, int] = GraphCache(capacity=2)
    assert cache.put("a", 1) == [] and cache.put("b", 2) == []
    assert cache.get("a") == 1            # a is now the most recent
    assert cache.put("c", 3) == ["b"]     # so b is evicted
    assert cache.keys() == ["a", "c"]
    assert cache.get("b") is None
    assert (cache.hits, cache.misses, cache.evictions) == (1, 1, 1)
    assert cache.put("a", 10) == [] and cache.keys() == ["c", "a"]
    assert len(cache) == 2 and "a" in cache
    with pytest.raises(ValueError, match="capacity"):
        GraphCache(capacity=0)


# -- capture and replay through the fake backend -----------------------------------------


@pytest.fixture(scope="module")
def mlp():
    return models.build("mlp_chain", layers=3, width=8)


def _feeds(batch):
    return models.example_inputs("mlp_chain", batch_size=batch, layers=3, width=8)


def _graph_session(model, fake, **kwargs):
    return segflow.InferenceSession(model, engine="inline", cuda_graphs=True,
                                    stream_backend=fake, **kwargs)


def test_warmup_then_capture_once_then_replay(mlp):
    fake = FakeBackend()
    sess = _graph_session(mlp, fake)
    reference = segflow.InferenceSession(mlp, engine="inline")
    graph = sess._executor.completion.graphs[0]
    syncs = []
    for _ in range(4):
        out = sess.run(None, _feeds(2))
        np.testing.assert_array_equal(out[0], reference.run(None, _feeds(2))[0])
        syncs.append(sess.last_run_stats.syncs)
    assert fake.count("capture") == 1 and graph.captures == 1
    assert fake.count("replay") == graph.replays == 3   # runs 2, 3, 4
    assert syncs == [1, 2, 1, 1]  # the capturing run synchronizes the device once more
    assert "segment 0: captured 1x, 1 cached shape(s)" in sess.explain()
    assert "cuda graphs: 1 of 1 segments capturable" in sess.explain()


def test_shape_change_recaptures_and_lru_evicts(mlp):
    fake = FakeBackend()
    sess = _graph_session(mlp, fake)
    graph = sess._executor.completion.graphs[0]
    graph.cache.capacity = 2
    reference = segflow.InferenceSession(mlp, engine="inline")
    for batch in (1, 1, 2, 2, 1, 3, 3, 1, 1):
        out = sess.run(None, _feeds(batch))
        np.testing.assert_array_equal(out[0], reference.run(None, _feeds(batch))[0])
    # batch 1 and 2 captured; batch 3 evicts batch 2 (least recent); batch 1 survives.
    assert graph.captures == 3
    assert graph.cache.evictions == 1
    keys = [k.inputs[0][0] for k in graph.cache.keys()]
    assert keys == [(3, 8), (1, 8)]


def test_replayed_outputs_do_not_alias_between_runs(mlp):
    fake = FakeBackend()
    sess = _graph_session(mlp, fake)
    first = [sess.run(None, _feeds(2))[0] for _ in range(3)][-1]
    kept = first.copy()
    sess.run(None, {"x": _feeds(2)["x"] * 2})
    np.testing.assert_array_equal(first, kept)


def test_failed_capture_falls_back_and_says_why(mlp):
    fake = FakeBackend(fail_capture=True)
    sess = _graph_session(mlp, fake)
    reference = segflow.InferenceSession(mlp, engine="inline")
    for _ in range(4):
        out = sess.run(None, _feeds(2))
        np.testing.assert_array_equal(out[0], reference.run(None, _feeds(2))[0])
    assert fake.count("capture") == 1 and fake.count("replay") == 0
    assert "not captured: capture failed: RuntimeError: operation not permitted" \
        in sess.explain()


def test_failed_capture_names_the_node_and_falls_back_to_the_compiled_segment(mlp):
    class BreaksInCapture(FakeBackend):
        capturing = False

        def capture(self, body, stream):
            self.capturing = True
            try:
                try:
                    body()
                finally:
                    self.capturing = False
            except Exception:  # what ending a broken CUDA capture raises
                raise RuntimeError("operation failed due to a previous error during "
                                   "capture") from None
            raise AssertionError("the body should have failed")

    fake = BreaksInCapture()
    sess = _graph_session(mlp, fake)
    reference = segflow.InferenceSession(mlp, engine="inline")
    graph = sess._executor.completion.graphs[0]
    step = graph.steps[0]
    calls = []

    def host_read(inputs):  # legal when run, illegal while capturing
        calls.append(fake.capturing)
        if fake.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return step.kernel(inputs)

    graph.steps[0] = dataclasses.replace(step, kernel=host_read)
    for _ in range(4):
        out = sess.run(None, _feeds(2))
        np.testing.assert_array_equal(out[0], reference.run(None, _feeds(2))[0])
    explained = sess.explain()
    assert f"not captured: capture failed: While executing {step.node.label}: RuntimeError: " \
        "operation not permitted when stream is capturing" in explained
    # Warm-up, failed capture, then runs 3 and 4: the generated function, not the steps.
    assert calls == [True] and sess._executor.compiled[0] is not None


def test_host_resident_input_is_not_captured(mlp):
    class HostInputs(FakeBackend):
        def on_device(self, tensor):
            return False

    fake = HostInputs()
    sess = _graph_session(mlp, fake)
    for _ in range(3):
        sess.run(None, _feeds(2))
    assert fake.count("capture") == 0
    assert "is on the host" in sess.explain()


def test_profiled_runs_stay_uncaptured(mlp):
    class Sink:
        def span(self, *args, **kwargs):
            pass

    fake = FakeBackend()
    sess = _graph_session(mlp, fake)
    sess.run(None, _feeds(2))
    tensors = [torch.from_numpy(_feeds(2)["x"])]
    for _ in range(3):
        sess._executor.run(tensors, Sink())
    assert fake.count("capture") == 0


def test_segments_around_a_local_op_are_captured_separately():
    model = models.build("nonzero_mid")
    feeds = models.example_inputs("nonzero_mid", batch_size=4)
    fake = FakeBackend()
    sess = _graph_session(model, fake)
    expected = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    for _ in range(3):
        np.testing.assert_array_equal(sess.run(None, feeds)[0], expected[0])
    text = sess.explain()
    assert "cuda graphs: 2 of 3 segments capturable" in text
    assert "segment 1: not captured: local task NonZero" in text
    # Per segment: run 1 warms up, run 2 captures and replays, run 3 replays.
    assert fake.count("capture") == 2 and fake.count("replay") == 4


def test_cpu_session_with_cuda_graphs_explains_why_nothing_is_captured(mlp):
    sess = segflow.InferenceSession(mlp, cuda_graphs=True)
    sess.run(None, _feeds(1))
    assert "no device of the plan has CUDA streams" in sess.explain()
    assert sess.last_run_stats.settings["cuda_graphs"] is True
