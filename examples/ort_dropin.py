"""A typical onnxruntime script; only the import chooses the runtime.

    python examples/ort_dropin.py --runtime onnxruntime
    python examples/ort_dropin.py --runtime segflow

Everything after the import is onnxruntime's documented API: SessionOptions,
providers, get_inputs/get_outputs, run, RunOptions, IOBinding and profiling.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build_model(path: str) -> None:
    """A small classifier: x [batch, 32] -> Gemm -> Relu -> Gemm -> Softmax."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((10, 64)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal(10).astype(np.float32), "b2")]
    nodes = [helper.make_node("Gemm", ["input", "w1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("Gemm", ["a", "w2", "b2"], ["logits"], name="fc2", transB=1),
             helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=1)]
    graph = helper.make_graph(
        nodes, "classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="ort_dropin", model_version=1)
    helper.set_model_props(model, {"labels": "digits"})
    onnx.save(model, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=("onnxruntime", "segflow"), default="onnxruntime")
    args = parser.parse_args()
    ort = importlib.import_module(args.runtime)   # the only runtime-specific line

    workdir = tempfile.mkdtemp()
    model_path = os.path.join(workdir, "classifier.onnx")
    build_model(model_path)

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(workdir, "profile")
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                 if p in ort.get_available_providers()]
    session = ort.InferenceSession(model_path, sess_options=so, providers=providers)

    print("providers:", session.get_providers())
    for arg in session.get_inputs():
        print(f"input:  {arg.name} {arg.shape} {arg.type}")
    for arg in session.get_outputs():
        print(f"output: {arg.name} {arg.shape} {arg.type}")
    meta = session.get_modelmeta()
    print("model:", meta.producer_name, meta.graph_name, meta.version, meta.custom_metadata_map)

    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    input_name = session.get_inputs()[0].name
    probs, logits = session.run(None, {input_name: x})
    print("argmax:", probs.argmax(axis=1).tolist(),
          "row sums:", probs.sum(axis=1).round(4).tolist())

    run_options = ort.RunOptions()
    run_options.log_severity_level = 3
    (only_probs,) = session.run(["probs"], {input_name: x}, run_options)
    print("run(['probs']) matches:", bool(np.allclose(only_probs, probs, rtol=1e-5, atol=1e-6)))

    binding = session.io_binding()
    binding.bind_cpu_input(input_name, x)
    binding.bind_output("probs")
    session.run_with_iobinding(binding)
    bound = binding.copy_outputs_to_cpu()[0]
    print("io_binding matches:", bool(np.allclose(bound, probs, rtol=1e-5, atol=1e-6)))

    start = time.perf_counter()
    for _ in range(100):
        session.run(None, {input_name: x})
    print(f"100 runs: {(time.perf_counter() - start) * 1e3:.1f} ms")

    profile_path = session.end_profiling()
    with open(profile_path, encoding="utf-8") as f:
        events = json.load(f)
    kernels = [e for e in events if e["cat"] == "Node"]
    ops = sorted({e["args"]["op_name"] for e in kernels})
    print(f"profile: {len(events)} events, {len(kernels)} kernel events, ops {ops}")
    print("logits[0, :3]:", logits[0, :3].round(4).tolist())


if __name__ == "__main__":
    main()
