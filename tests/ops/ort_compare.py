"""Shared helper for op tests: build a one-node model, run it on onnxruntime and segflow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

import segflow


def make_model(nodes: Sequence[onnx.NodeProto], inputs: dict[str, np.ndarray],
               outputs: Sequence[str], opset: int,
               initializers: dict[str, np.ndarray] | None = None,
               domains: dict[str, int] | None = None) -> onnx.ModelProto:
    """A model whose inputs are typed from ``inputs`` and whose outputs are untyped;
    ``domains`` adds opset imports (``{"com.microsoft": 1}``)."""
    graph = helper.make_graph(
        list(nodes), "t",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for name, a in inputs.items()],
        [helper.make_empty_tensor_value_info(name) for name in outputs],
        initializer=[onnx.numpy_helper.from_array(a, name)
                     for name, a in (initializers or {}).items()])
    imports = [helper.make_opsetid("", opset)]
    imports += [helper.make_opsetid(d, v) for d, v in (domains or {}).items()]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = min(model.ir_version, 10)  # what this onnxruntime accepts
    return model


def run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list[Any], list[Any]]:
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    return expected, got


def assert_matches_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                       rtol: float = 1e-5, atol: float = 1e-6) -> list[Any]:
    """Run on both and compare every output (dtype, shape, values)."""
    expected, got = run_both(model, feeds)
    assert len(got) == len(expected)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g.dtype == e.dtype, f"output {i}: dtype {g.dtype} != {e.dtype}"
        assert g.shape == e.shape, f"output {i}: shape {g.shape} != {e.shape}"
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"output {i}")
    return got
