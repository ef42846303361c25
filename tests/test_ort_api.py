"""SessionOptions and RunOptions mapped onto segflow's settings (runtime/ort_api.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow.errors import InvalidSetting
from segflow.runtime.ort_api import LEVEL_PASSES, merge_keywords


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _session(so: segflow.SessionOptions, **keywords: object) -> segflow.InferenceSession:
    return segflow.InferenceSession(_model(), so, **keywords)  # type: ignore[arg-type]


def test_levels_switch_the_passes() -> None:
    so = segflow.SessionOptions()
    so.graph_optimization_level = segflow.GraphOptimizationLevel.ORT_DISABLE_ALL
    options = _session(so).options
    assert not (options.fold_constants or options.fuse or options.dense_chain or options.layout)
    assert options.plan_memory          # memory planning follows enable_mem_pattern
    so.graph_optimization_level = segflow.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options = _session(so).options
    assert options.fold_constants and options.fuse and not options.layout
    assert "linear" in options.fuse_off and "batchnorm" not in options.fuse_off
    so.graph_optimization_level = segflow.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options = _session(so).options
    assert options.fuse and not options.fuse_off and not options.layout
    assert LEVEL_PASSES[segflow.GraphOptimizationLevel.ORT_ENABLE_ALL] is None


def test_fields_reach_the_session() -> None:
    so = segflow.SessionOptions()
    so.execution_mode = segflow.ExecutionMode.ORT_PARALLEL
    so.enable_mem_pattern = False
    so.enable_cpu_mem_arena = False
    sess = _session(so)
    assert sess.engine_name == "threaded"
    assert not sess.options.plan_memory and not sess.options.arena
    so.execution_mode = segflow.ExecutionMode.ORT_SEQUENTIAL
    assert _session(so).engine_name == "inline"
    assert segflow.SessionOptions().execution_mode is segflow.ExecutionMode.ORT_SEQUENTIAL


def test_config_entries_and_precedence() -> None:
    so = segflow.SessionOptions()
    so.add_session_config_entry("segflow.bulk", "0")
    so.add_session_config_entry("segflow.engine", "threaded")
    assert so.get_session_config_entry("segflow.bulk") == "0"
    sess = _session(so)
    assert not sess.settings.inference and sess.engine_name == "threaded"
    # A segflow keyword wins over the entry.
    assert _session(so, bulk=True, engine="inline").settings.inference
    with pytest.raises(InvalidSetting, match="'segflow.bulkk'"):
        so.add_session_config_entry("segflow.bulkk", "1")
    with pytest.raises(InvalidSetting, match="segflow.compile='fast'"):
        so.add_session_config_entry("segflow.compile", "fast")
    with pytest.warns(UserWarning, match="session.set_denormal_as_zero"):
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
    assert so.get_session_config_entry("session.set_denormal_as_zero") == "1"
    with pytest.raises(InvalidSetting, match="missing"):
        so.get_session_config_entry("missing")


def test_bad_values_name_the_field() -> None:
    so = segflow.SessionOptions()
    with pytest.raises(InvalidSetting, match="graph_optimization_level"):
        so.graph_optimization_level = 7  # type: ignore[assignment]
    with pytest.raises(InvalidSetting, match="intra_op_num_threads"):
        so.intra_op_num_threads = -1
    with pytest.raises(AttributeError):
        so.graph_optimisation_level = 1  # type: ignore[attr-defined]


def test_a_device_in_the_options_slot_is_refused() -> None:
    with pytest.raises(InvalidSetting, match="device='cuda:0'"):
        segflow.InferenceSession(_model(), "cuda:0")  # type: ignore[arg-type]
    with pytest.raises(InvalidSetting, match="sess_options"):
        merge_keywords(object(), {})  # type: ignore[arg-type]


def test_run_options() -> None:
    sess = segflow.InferenceSession(_model())
    x = np.ones((2, 4), np.float32)
    ro = segflow.RunOptions()
    ro.run_tag = "tag"
    assert ro.logid == "tag"
    ro.add_run_config_entry("k", "v")
    assert ro.get_run_config_entry("k") == "v"
    np.testing.assert_allclose(sess.run(None, {"x": x}, ro)[0], np.full((2, 4), 4.0))
    ro.terminate = True
    with pytest.raises(segflow.ExecutionError, match="terminate"):
        sess.run(None, {"x": x}, ro)
    with pytest.raises(InvalidSetting, match="run_options"):
        sess.run(None, {"x": x}, "fast")  # type: ignore[arg-type]
