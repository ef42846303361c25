"""``import segflow as ort``: one onnxruntime script, run by both runtimes.

:func:`script` takes the runtime module and exercises the onnxruntime API a typical
script uses (SessionOptions, providers, the get_* answers, run with None / [] /
names, RunOptions, IOBinding and OrtValue, profiling, optimized_model_filepath,
get_modelmeta); it returns what it saw. The test runs it with ``onnxruntime`` and with
``segflow`` and compares: arrays with ``assert_allclose`` at rtol 1e-4 / atol 1e-5
(float32 kernels summing in different orders), everything else exactly.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models

RTOL, ATOL = 1e-4, 1e-5


def _mlp() -> onnx.ModelProto:
    """x [batch, 8] -> h = relu(x @ w1 + b1) * scale -> y = h @ w2; ``y``'s dims are left
    unnamed, ``scale`` is an initializer the graph also lists as an input."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array([0.5], np.float32), "scale")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["xw"], name="mm1"),
             helper.make_node("Add", ["xw", "b1"], ["pre"], name="bias"),
             helper.make_node("Relu", ["pre"], ["act"], name="relu"),
             helper.make_node("Mul", ["act", "scale"], ["h"], name="scale_mul"),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(
        nodes, "mlp_graph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 16])],
        initializer=inits, doc_string="a two-layer perceptron")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="compat-test", producer_version="1.0",
                              domain="test.segflow", model_version=3,
                              doc_string="the compatibility test's model")
    helper.set_model_props(model, {"author": "tests", "license": "MIT"})
    return model


def _conv_bn() -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu: the basic level folds the BatchNormalization."""
    rng = np.random.default_rng(1)
    c = 4
    inits = [numpy_helper.from_array(rng.standard_normal((c, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "beta"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "mean"),
             numpy_helper.from_array(rng.uniform(0.5, 2, c).astype(np.float32), "var")]
    nodes = [helper.make_node("Conv", ["img", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"],
                              ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["out"], name="relu")]
    graph = helper.make_graph(
        nodes, "conv_bn",
        [helper.make_tensor_value_info("img", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             producer_name="compat-test")


def _broadcast() -> onnx.ModelProto:
    """``a [?, 4] + b [batch, 4]``: shape inference cannot name the sum's first dim (onnx
    calls it ``unk__0``), so both runtimes report it as None."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"]),
         helper.make_node("Relu", ["sum"], ["out"])], "broadcast",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None, None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ops(path: str) -> list[str]:
    return [n.op_type for n in onnx.load(path).graph.node]


def _args(args: list[Any]) -> list[tuple[str, list[Any], str]]:
    return [(a.name, list(a.shape), a.type) for a in args]


def script(rt: ModuleType, workdir: Path) -> dict[str, Any]:
    """A typical onnxruntime script over the runtime ``rt``; returns what it saw."""
    seen: dict[str, Any] = {}
    mlp, conv_bn = _mlp(), _conv_bn()
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)

    seen["cpu available"] = "CPUExecutionProvider" in rt.get_available_providers()
    seen["device"] = rt.get_device()

    so = rt.SessionOptions()
    seen["defaults"] = (so.intra_op_num_threads, so.inter_op_num_threads,
                        int(so.graph_optimization_level), int(so.execution_mode),
                        so.log_severity_level, so.profile_file_prefix, so.enable_mem_pattern,
                        so.enable_cpu_mem_arena, so.enable_profiling, so.optimized_model_filepath)
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.execution_mode = rt.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    so.log_verbosity_level = 0
    so.enable_mem_pattern = True
    so.enable_cpu_mem_arena = True
    so.enable_profiling = True
    so.profile_file_prefix = str(workdir / "mlp_profile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # segflow says it records onnxruntime's keys only
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    seen["config entry"] = so.get_session_config_entry("session.intra_op.allow_spinning")
    with pytest.raises(Exception, match="nope"):
        so.get_session_config_entry("nope")
    seen["set"] = (so.intra_op_num_threads, int(so.graph_optimization_level),
                   int(so.execution_mode))

    sess = rt.InferenceSession(mlp.SerializeToString(), so, providers=["CPUExecutionProvider"])
    seen["providers"] = sess.get_providers()
    seen["provider options"] = sess.get_provider_options()
    seen["inputs"] = _args(sess.get_inputs())
    seen["outputs"] = _args(sess.get_outputs())
    seen["overridable"] = _args(sess.get_overridable_initializers())
    meta = sess.get_modelmeta()
    seen["meta"] = (meta.producer_name, meta.graph_name, meta.domain, meta.description,
                    meta.graph_description, meta.version, dict(meta.custom_metadata_map))
    options = sess.get_session_options()
    seen["session options"] = (int(options.graph_optimization_level),
                               options.intra_op_num_threads)

    seen["run None"] = sess.run(None, {"x": x})
    seen["run []"] = sess.run([], {"x": x})
    seen["run y"] = sess.run(["y"], {"x": x})
    seen["run h, y"] = sess.run(["h", "y"], {"x": x})

    run_options = rt.RunOptions()
    run_options.log_severity_level = 3
    run_options.log_verbosity_level = 0
    run_options.logid = "compat"
    seen["run options"] = sess.run(None, {"x": x}, run_options)
    seen["logid"] = run_options.logid
    run_options.terminate = True
    with pytest.raises(Exception, match="terminate"):
        sess.run(None, {"x": x}, run_options)

    # IOBinding: numpy inputs, outputs left to the runtime, then preallocated ones.
    binding = sess.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_output("y")
    binding.bind_output("h", "cpu")
    sess.run_with_iobinding(binding)
    seen["binding copy"] = binding.copy_outputs_to_cpu()
    values = binding.get_outputs()
    seen["binding values"] = [(v.shape(), v.data_type(), v.device_name()) for v in values]
    seen["binding numpy"] = [v.numpy() for v in values]

    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    x_value = rt.OrtValue.ortvalue_from_numpy(x, "cpu", 0)
    seen["ortvalue"] = (x_value.shape(), x_value.data_type(), x_value.device_name(),
                        x_value.element_type(), x_value.is_tensor())
    y_value = rt.OrtValue.ortvalue_from_shape_and_type([3, 4], np.float32, "cpu", 0)
    binding.bind_ortvalue_input("x", x_value)
    binding.bind_ortvalue_output("y", y_value)
    sess.run_with_iobinding(binding, run_options=None)
    seen["preallocated"] = y_value.numpy()

    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    x2 = np.ascontiguousarray(x * 2)
    h_out = np.zeros((3, 16), np.float32)
    binding.bind_input("x", "cpu", 0, np.float32, list(x2.shape), x2.ctypes.data)
    binding.bind_output("h", "cpu", 0, np.float32, list(h_out.shape), h_out.ctypes.data)
    sess.run_with_iobinding(binding)
    seen["buffer output"] = h_out.copy()

    profile = sess.end_profiling()
    seen["profile name"] = bool(re.fullmatch(
        re.escape(str(workdir / "mlp_profile")) + r"_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d(_\d+)?\.json",
        profile))
    with open(profile, encoding="utf-8") as f:
        events = json.load(f)
    seen["profile cats"] = sorted({e["cat"] for e in events})
    seen["profile keys"] = sorted({k for e in events for k in e})
    seen["profile phases"] = sorted({e["ph"] for e in events})
    nodes = [e for e in events if e["cat"] == "Node"]
    seen["node events"] = (all(e["name"].endswith("_kernel_time") for e in nodes),
                           all({"op_name", "provider"} <= set(e["args"]) for e in nodes),
                           {e["args"]["provider"] for e in nodes})
    seen["session events"] = sorted({e["name"] for e in events if e["cat"] == "Session"}
                                    & {"model_loading_array", "session_initialization",
                                       "model_run"})
    seen["profiling off"] = sess.end_profiling()

    # Providers: a tuple with options, CUDA where none is (both fall back, warning).
    tuple_sess = rt.InferenceSession(mlp.SerializeToString(),
                                     providers=[("CPUExecutionProvider", {})])
    seen["tuple providers"] = tuple_sess.get_providers()
    if "CUDAExecutionProvider" not in rt.get_available_providers():
        with pytest.warns(UserWarning, match="CUDAExecutionProvider"):
            fallback = rt.InferenceSession(
                mlp.SerializeToString(),
                providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        seen["cuda fallback"] = (fallback.get_providers(), fallback.run(["y"], {"x": x}))
    tuple_sess.set_providers(["CPUExecutionProvider"])
    seen["set providers"] = (tuple_sess.get_providers(), tuple_sess.run(["y"], {"x": x}))

    # optimized_model_filepath at the basic level: onnxruntime loads the file and gives
    # the session's results; the BatchNormalization is folded into the Conv.
    img = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    opt = rt.SessionOptions()
    opt.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opt.optimized_model_filepath = str(workdir / "conv_bn.opt.onnx")
    conv_sess = rt.InferenceSession(conv_bn.SerializeToString(), opt,
                                    providers=["CPUExecutionProvider"])
    seen["conv_bn"] = conv_sess.run(None, {"img": img})
    seen["conv_bn outputs"] = _args(conv_sess.get_outputs())
    written = onnxruntime.InferenceSession(opt.optimized_model_filepath,
                                           providers=["CPUExecutionProvider"])
    seen["optimized file"] = written.run(None, {"img": img})
    seen["optimized ops"] = _ops(opt.optimized_model_filepath)

    opt_mlp = rt.SessionOptions()
    opt_mlp.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opt_mlp.optimized_model_filepath = str(workdir / "mlp.opt.onnx")
    rt.InferenceSession(mlp.SerializeToString(), opt_mlp, providers=["CPUExecutionProvider"])
    seen["optimized mlp"] = onnxruntime.InferenceSession(
        opt_mlp.optimized_model_filepath, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})

    unnamed = rt.InferenceSession(_broadcast().SerializeToString(),
                                  providers=["CPUExecutionProvider"])
    seen["unnamed dims"] = (_args(unnamed.get_inputs()), _args(unnamed.get_outputs()))

    # A built-in transformer, its declared symbolic dims and unnamed output dims.
    bert = models.build("bert_tiny", seed=0)
    feeds = models.example_inputs("bert_tiny", batch_size=2, seq_len=16)
    bert_sess = rt.InferenceSession(bert.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    seen["bert inputs"] = _args(bert_sess.get_inputs())
    seen["bert outputs"] = _args(bert_sess.get_outputs())
    seen["bert run"] = bert_sess.run(None, feeds)
    return seen


def _compare(key: str, expected: Any, got: Any) -> None:
    if isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray), key
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=key)
    elif isinstance(expected, list | tuple) and any(
            isinstance(e, np.ndarray | list | tuple) for e in expected):
        assert len(got) == len(expected), key
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            _compare(f"{key}[{i}]", e, g)
    else:
        assert got == expected, f"{key}: segflow {got!r} != onnxruntime {expected!r}"


def test_one_script_both_runtimes(tmp_path: Path) -> None:
    (tmp_path / "ort").mkdir()
    (tmp_path / "segflow").mkdir()
    with warnings.catch_warnings():
        # onnxruntime's note on an initializer listed as an input goes to its log only.
        warnings.simplefilter("ignore", DeprecationWarning)
        expected = script(onnxruntime, tmp_path / "ort")
        got = script(segflow, tmp_path / "segflow")
    assert set(got) == set(expected)
    for key, value in expected.items():
        _compare(key, value, got[key])
    # What the script saw, in the cases where a wrong answer could pass as equal.
    assert expected["outputs"] == [("y", ["batch", 4], "tensor(float)"),
                                   ("h", ["batch", 16], "tensor(float)")]
    assert expected["unnamed dims"][1] == [("out", [None, 4], "tensor(float)")]
    assert expected["overridable"] == [("scale", [1], "tensor(float)")]
    assert "BatchNormalization" not in expected["optimized ops"]
    assert expected["node events"][0] and expected["profile name"]
