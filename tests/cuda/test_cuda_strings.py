"""String tensors in a CUDA session (skipped without CUDA): the string nodes run on the
host, their numeric results go to the device, and string feeds and outputs are never
uploaded or copied back."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cuda_trace import requires_cuda
from onnx import TensorProto, helper

import segflow

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not requires_cuda, reason="needs a CUDA device")]


def _model() -> onnx.ModelProto:
    nodes = [helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["f", "b"], ["g"]),
             helper.make_node("Cast", ["g"], ["s"], to=TensorProto.STRING),
             helper.make_node("StringConcat", ["s", "unit"], ["y"])]
    graph = helper.make_graph(
        nodes, "mixed", [helper.make_tensor_value_info("x", TensorProto.STRING, [2, 3])],
        [helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("y", TensorProto.STRING, [2, 3]),
         helper.make_tensor_value_info("x", TensorProto.STRING, [2, 3])],
        initializer=[onnx.numpy_helper.from_array(np.full(3, 0.5, np.float32), "b"),
                     onnx.numpy_helper.from_array(np.array([" kg"], dtype=object), "unit")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


FEED = {"x": np.array([["1.5", "-4", "2e1"], ["0", "NaN", "-INF"]], dtype=object)}


@pytest.mark.parametrize("engine", ["inline", "threaded"])
@pytest.mark.parametrize("sync_mode", ["event", "stream"])
def test_a_graph_mixing_strings_and_floats_matches_the_cpu_run(engine, sync_mode):
    expected = segflow.InferenceSession(_model(), device="cpu").run(None, FEED)
    sess = segflow.InferenceSession(_model(), device="cuda:0", engine=engine,
                                    sync_mode=sync_mode)
    for _ in range(2):
        got = sess.run(None, FEED)
        np.testing.assert_array_equal(got[0], expected[0])
        assert got[1].dtype == object and got[1].tolist() == expected[1].tolist()
        assert got[2].tolist() == FEED["x"].tolist()
