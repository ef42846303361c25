"""Shared helper for the sequence and optional op tests: models with typed sequence and
optional inputs and outputs, run on onnxruntime and segflow, compared structure and all."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import segflow

FLOAT = TensorProto.FLOAT


def tensor(name: str, elem: int = FLOAT, shape: Sequence[int | str | None] | None = None
           ) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def seq(name: str, elem: int = FLOAT, shape: Sequence[int | str | None] | None = None
        ) -> onnx.ValueInfoProto:
    return helper.make_tensor_sequence_value_info(name, elem, shape)


def optional(name: str, elem: int = FLOAT, shape: Sequence[int | str | None] | None = None,
             sequence: bool = False) -> onnx.ValueInfoProto:
    held = helper.make_tensor_type_proto(elem, shape)
    if sequence:
        held = helper.make_sequence_type_proto(held)
    return helper.make_value_info(name, helper.make_optional_type_proto(held))


def model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
          outputs: Sequence[onnx.ValueInfoProto], opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "t", list(inputs), list(outputs))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = min(proto.ir_version, 10)  # what this onnxruntime accepts
    return proto


def assert_same(got: Any, expected: Any, where: str = "output") -> None:
    """Same kind (list, None, array), length, dtype, shape and values."""
    if expected is None:
        assert got is None, f"{where}: {type(got).__name__}, expected None"
        return
    if isinstance(expected, list):
        assert isinstance(got, list), f"{where}: {type(got).__name__}, expected a list"
        assert len(got) == len(expected), f"{where}: {len(got)} tensors, expected {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{where}[{i}]")
        return
    assert isinstance(got, np.ndarray), f"{where}: {type(got).__name__}, expected an array"
    assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} != {expected.dtype}"
    assert got.shape == expected.shape, f"{where}: shape {got.shape} != {expected.shape}"
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=where)


def assert_matches_ort(proto: onnx.ModelProto, feeds: dict[str, Any], **session: Any
                       ) -> list[Any]:
    expected = ort.InferenceSession(proto.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)
    got = segflow.InferenceSession(proto, engine="inline", **session).run(None, feeds)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_same(g, e, f"output {i}")
    return got
