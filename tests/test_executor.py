"""Bulk execution end to end: exact counters, identical outputs, env vars, devices, threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import segflow
from concurrency import run_in_threads
from segflow import models

ENGINES = ["inline", "threaded"]


@pytest.fixture(scope="module")
def resnet50():
    return models.build("resnet50")


@pytest.fixture(scope="module")
def resnet50_feeds():
    return models.example_inputs("resnet50")


def test_resnet50_bulk_is_one_segment_one_push_one_sync(resnet50, resnet50_feeds):
    for engine in ENGINES:
        sess = segflow.InferenceSession(resnet50, engine=engine, bulk=True)
        for _ in range(2):
            sess.run(None, resnet50_feeds)
            stats = sess.last_run_stats
            assert (stats.segments, stats.pushes, stats.syncs) == (1, 1, 1)
            assert stats.kernels == stats.nodes == sess.plan.compute_nodes
            assert stats.copies == 0
            assert stats.engine == engine


def test_resnet50_bulk_off_one_task_per_compute_node(resnet50, resnet50_feeds):
    sess = segflow.InferenceSession(resnet50, bulk=False)
    sess.run(None, resnet50_feeds)
    stats = sess.last_run_stats
    assert stats.segments == stats.pushes == stats.nodes == sess.plan.compute_nodes
    assert stats.nodes > 50  # 175 imported, 57 after BatchNorm/activation fusion
    assert stats.syncs == 1
    assert stats.settings["inference"] is False


def test_data_dependent_op_mid_graph_gives_three_tasks():
    sess = segflow.InferenceSession(models.build("nonzero_mid"))
    sess.run(None, models.example_inputs("nonzero_mid"))
    stats = sess.last_run_stats
    assert (stats.segments, stats.pushes) == (3, 3)
    # One host wait before the LOCAL op (it needs its input's values), one for the outputs.
    assert stats.syncs == 2
    segs = sess.plan.segments
    assert [s.exec_type.value for s in segs] == ["sync", "local", "sync"]
    assert "NonZero" in segs[0].reason and "NonZero" in segs[1].reason
    assert "NonZero" in sess.explain()


@pytest.mark.parametrize("name", ["nonzero_mid", "mlp_chain"])
def test_inline_runs_skip_the_engine_but_count_the_same(name, monkeypatch):
    """On the host, the inline engine's runs call the task functions directly (no Vars or
    pushes); counters and outputs stay those of the engine path."""
    from segflow.engine.inline import InlineEngine

    model, feeds = models.build(name), models.example_inputs(name)
    threaded = segflow.InferenceSession(model, engine="threaded")
    want = threaded.run(None, feeds)
    inline = segflow.InferenceSession(model, engine="inline")

    def no_push(*args, **kwargs):
        raise AssertionError("the inline run went through the engine")
    with monkeypatch.context() as patch:
        patch.setattr(InlineEngine, "push", no_push)
        got = inline.run(None, feeds)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    counters = ("nodes", "segments", "pushes", "syncs", "kernels", "copies")
    assert [getattr(inline.last_run_stats, c) for c in counters] == \
        [getattr(threaded.last_run_stats, c) for c in counters]
    with segflow.profile() as prof:  # a profiled run takes the engine path and its spans
        inline.run(None, feeds)
    assert any(e.name.startswith("push") for e in prof.events)
    threaded.close()


def _run_all_modes(name: str, compile: str = "codegen"
                   ) -> dict[tuple[str, bool], list[np.ndarray]]:
    model = models.build(name)
    feeds = models.example_inputs(name)
    results = {}
    for engine in ENGINES:
        for bulk in (True, False):
            sess = segflow.InferenceSession(model, engine=engine, bulk=bulk, compile=compile)
            results[(engine, bulk)] = sess.run(None, feeds)
            sess.close()
    return results


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "bert_tiny", "mlp_chain",
                                  "nonzero_mid", "resnet50", "bert_base"])
def test_outputs_bitwise_identical_across_engines_and_bulk(name):
    # Per-node backends (codegen here): bulk and engine change the schedule, never a number.
    results = _run_all_modes(name)
    reference = results[("inline", True)]
    for key, outs in results.items():
        for ref, out in zip(reference, outs):
            assert np.array_equal(ref, out), f"{name}: {key} differs from inline/bulk"


def test_fusing_backend_is_bitwise_across_engines_and_close_across_bulk():
    # oneDNN Graph fuses across the nodes of a segment, so a bulk segment (1x1 conv and
    # depthwise conv fused) and one segment per node may differ in the last bits.
    results = _run_all_modes("mobilenet_v2", compile="onednn")
    for bulk in (True, False):
        for ref, out in zip(results[("inline", bulk)], results[("threaded", bulk)]):
            assert np.array_equal(ref, out), f"bulk={bulk}: threaded differs from inline"
    for ref, out in zip(results[("inline", True)], results[("inline", False)]):
        np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)


ENV_CASES = [
    ({"SEGFLOW_BULK_INFERENCE": "0"}, "segments", "nodes"),
    ({"SEGFLOW_BULK_INFERENCE": "1"}, "segments", 1),
    ({"SEGFLOW_ENGINE": "inline"}, "engine", "inline"),
    ({"SEGFLOW_ENGINE": "threaded"}, "engine", "threaded"),
]

_CHILD = """
import json, segflow
from segflow import models
# The 6 layers stay nodes (no dense chain): bulking is what is under test.
sess = segflow.InferenceSession(models.build("mlp_chain", layers=6),
                                optimize={"dense_chain": False})
sess.run(None, models.example_inputs("mlp_chain", layers=6))
s = sess.last_run_stats
print(json.dumps({"segments": s.segments, "nodes": s.nodes, "engine": s.engine,
                  "settings": s.settings}))
"""


@pytest.mark.parametrize("env,field,expected", ENV_CASES)
def test_environment_variables_are_obeyed_in_a_fresh_process(env, field, expected):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SEGFLOW_")}
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**clean, **env},
                         capture_output=True, text=True, check=True, timeout=120)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    want = record[expected] if isinstance(expected, str) and expected in record else expected
    assert record[field] == want
    if "SEGFLOW_BULK_INFERENCE" in env:
        assert record["settings"]["inference"] is (env["SEGFLOW_BULK_INFERENCE"] == "1")
        assert record["nodes"] == 6  # 6 Gemm+Relu pairs, each fused into one FusedGemm


def test_auto_engine_is_threaded_only_across_devices(monkeypatch):
    monkeypatch.delenv("SEGFLOW_ENGINE", raising=False)
    model = models.build("mlp_chain", layers=4)
    feeds = models.example_inputs("mlp_chain", layers=4)
    single = segflow.InferenceSession(model)
    single.run(None, feeds)
    assert single.engine_name == "inline" and single.last_run_stats.engine == "inline"
    placed = segflow.InferenceSession(model, placement={"layers.2.*": "cpu:1"})
    placed.run(None, feeds)
    assert placed.engine_name == "threaded" and placed.last_run_stats.engine == "threaded"
    monkeypatch.setenv("SEGFLOW_ENGINE", "threaded")
    assert segflow.InferenceSession(model).engine_name == "threaded"


def test_bad_engine_environment_value(monkeypatch):
    monkeypatch.setenv("SEGFLOW_ENGINE", "warp")
    with pytest.raises(ValueError, match="SEGFLOW_ENGINE"):
        segflow.InferenceSession(models.build("mlp_chain", layers=2))


@pytest.mark.parametrize("engine", ENGINES)
def test_two_cpu_devices_with_copies(engine):
    model = models.build("mlp_chain", layers=10)
    feeds = models.example_inputs("mlp_chain", layers=10)
    # A custom placement keeps the imported nodes (no fusion, no dense chain): so does the
    # reference, so the two agree bit for bit.
    ref = segflow.InferenceSession(model, engine="inline", optimize=False).run(None, feeds)
    sess = segflow.InferenceSession(model, engine=engine, placement={"layers.5.*": "cpu:1"})
    out = sess.run(None, feeds)
    stats = sess.last_run_stats
    assert stats.copies == 2
    assert stats.segments == 5  # cpu:0 segment, copy, cpu:1 segment, copy, cpu:0 segment
    assert [str(s.device) for s in sess.plan.segments] == ["cpu:0", "cpu:1", "cpu:1", "cpu:0",
                                                           "cpu:0"]
    assert stats.nodes == 20
    np.testing.assert_array_equal(out[0], ref[0])


def test_placement_by_op_type():
    model = models.build("mlp_chain", layers=3)
    sess = segflow.InferenceSession(model, placement={"Relu": "cpu:1"})
    sess.run(None, models.example_inputs("mlp_chain", layers=3))
    # Gemm, Relu, Gemm, Relu, Gemm, Relu alternate devices: 5 crossings, 6 + 5 tasks.
    assert sess.last_run_stats.copies == 5
    assert sess.last_run_stats.segments == 11


def test_one_session_many_threads():
    model = models.build("mlp_chain", layers=20)
    sess = segflow.InferenceSession(model, engine="threaded")
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1 + i % 3, 64)).astype(np.float32)} for i in range(8)]
    reference = [sess.run(None, f)[0] for f in feeds]

    def worker(i: int) -> None:
        for _ in range(50):
            out = sess.run(None, feeds[i])[0]
            np.testing.assert_array_equal(out, reference[i])
            assert sess.last_run_stats.pushes == 1

    run_in_threads(worker, 8)


def test_kernel_error_names_the_node_and_session_stays_usable():
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="first"),
         helper.make_node("Reshape", ["r", "shape"], ["y"], name="bad_reshape")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"]),
              helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    # The reshape target is a graph input, so a bad value only shows at run time.
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for engine in ENGINES:
        sess = segflow.InferenceSession(model, engine=engine)
        with pytest.raises(segflow.ExecutionError, match="bad_reshape"):
            sess.run(None, {"x": np.ones(6, np.float32), "shape": np.array([4, 4])})
        out = sess.run(None, {"x": np.ones(6, np.float32), "shape": np.array([2, 3])})
        assert out[0].shape == (2, 3)


def test_a_kernel_that_cannot_bind_names_its_node():
    """A kernel factory that fails at load (an attribute or input its op cannot take) is
    InvalidModel naming the node, not the factory's IndexError."""
    from onnx import TensorProto, helper

    from segflow.ops import default_registry
    from segflow.ops.registry import OpDef

    def broken(node, ctx):
        raise IndexError("list index out of range")

    registry = default_registry()
    registry.rows[("", "Relu")] = [OpDef("Relu", broken)]
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="lonely_relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(segflow.InvalidModel, match=r"Cannot run %y = Relu\(%x\) \[lonely_relu\]: "
                                                   r"IndexError"):
        segflow.InferenceSession(model, registry=registry, optimize=False)
