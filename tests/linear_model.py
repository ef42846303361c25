"""Helpers for the linear-kernel tests: a one-linear ONNX model, and a session of it with
one layout choice switched off."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper


def linear_model(rng: np.random.Generator, k: int, n: int, act: str | None,
                 batch: str | int = "batch") -> tuple[ModelProto, np.ndarray]:
    """``act(x @ w + b)`` for ``x`` ``[batch, 16, k]`` (MatMul, Add, then the activation
    op if any) with a random ``[k, n]`` weight; returns the model and the weight."""
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["y" if act else "out"])]
    if act:
        nodes.append(helper.make_node(act, ["y"], ["out"]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16, k])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, w


def session_switched_off(model: ModelProto, how: str, monkeypatch: Any, variable: str,
                         key: str) -> Any:
    """A session of ``model`` with one layout choice off: through the environment
    (``how == "env"``: ``variable=0``) or the API (``optimize={key: False}``)."""
    import segflow

    if how == "env":
        monkeypatch.setenv(variable, "0")
        return segflow.InferenceSession(model)
    return segflow.InferenceSession(model, optimize={key: False})
