"""CUDA-graph segments on a real GPU (skipped without CUDA).

Capture after one warm-up run, replay with one graph launch, re-capture on a
new input shape, fall back (and say why) when an op synchronizes inside the
capture; outputs always match the uncaptured run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from cuda_trace import count_api_calls, requires_cuda
from onnx import TensorProto, helper

import segflow
from segflow import models
from segflow.ops import default_registry
from segflow.ops.registry import OpDef

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not requires_cuda, reason="needs a CUDA device")]

DEVICE = "cuda:0"
IMAGE = {"image_size": 64, "num_classes": 10}


@pytest.fixture(scope="module")
def resnet18():
    return models.build("resnet18", **IMAGE)


def _feeds(batch: int) -> dict[str, np.ndarray]:
    return models.example_inputs("resnet18", batch_size=batch, **IMAGE)


def _close(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> None:
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("engine", ["inline", "threaded"])
def test_capture_once_then_replay(resnet18, engine):
    plain = segflow.InferenceSession(resnet18, device=DEVICE, engine="inline")
    sess = segflow.InferenceSession(resnet18, device=DEVICE, engine=engine, cuda_graphs=True)
    graph = sess._executor.completion.graphs[0]
    syncs = []
    for _ in range(4):
        _close(sess.run(None, _feeds(1)), plain.run(None, _feeds(1)))
        syncs.append(sess.last_run_stats.syncs)
    assert graph.captures == 1 and graph.replays == 3 and graph.failure is None
    assert syncs == [1, 2, 1, 1]  # the capture run synchronizes the device once more
    assert "segment 0: captured 1x" in sess.explain()


def test_replay_is_one_graph_launch_and_one_host_sync(resnet18):
    sess = segflow.InferenceSession(resnet18, device=DEVICE, engine="inline", cuda_graphs=True)
    plain = segflow.InferenceSession(resnet18, device=DEVICE, engine="inline")
    for _ in range(3):
        sess.run(None, _feeds(1))
        plain.run(None, _feeds(1))
    runs = 5
    graphed = count_api_calls(lambda: sess.run(None, _feeds(1)), runs)
    eager = count_api_calls(lambda: plain.run(None, _feeds(1)), runs)
    assert graphed.syncs == runs == eager.syncs
    assert graphed.graph_launches == runs
    # Kernel launches left outside the graph: the static-input copy and the output clone.
    assert graphed.launches - graphed.graph_launches <= 4 * runs
    assert eager.launches >= 10 * graphed.launches


def test_shape_change_recaptures(resnet18):
    sess = segflow.InferenceSession(resnet18, device=DEVICE, engine="inline", cuda_graphs=True)
    plain = segflow.InferenceSession(resnet18, device=DEVICE, engine="inline")
    graph = sess._executor.completion.graphs[0]
    graph.cache.capacity = 2
    for batch in (1, 1, 2, 2, 1, 3, 3, 3):
        _close(sess.run(None, _feeds(batch)), plain.run(None, _feeds(batch)))
    assert graph.captures == 3 and graph.cache.evictions == 1


def test_outputs_do_not_alias_static_buffers(resnet18):
    sess = segflow.InferenceSession(resnet18, device=DEVICE, engine="inline", cuda_graphs=True)
    x = _feeds(1)
    outs = [sess.run(None, x)[0] for _ in range(3)]
    kept = outs[-1].copy()
    sess.run(None, {"input": x["input"] * 0.5})
    np.testing.assert_array_equal(outs[-1], kept)
    (y,) = sess.run_tensors({"input": torch.from_numpy(x["input"])})
    y_kept = y.clone()
    sess.run_tensors({"input": torch.from_numpy(x["input"] * 2)})
    torch.testing.assert_close(y, y_kept)


def test_bert_and_mobilenet_graphs_match_uncaptured():
    for name, options in (("bert_tiny", {"seq_len": 16}), ("mobilenet_v2", IMAGE)):
        model = models.build(name, **options)
        feeds = models.example_inputs(name, batch_size=2, **options)
        want = segflow.InferenceSession(model, engine="inline").run(None, feeds)
        sess = segflow.InferenceSession(model, device=DEVICE, engine="inline", cuda_graphs=True)
        for _ in range(3):
            got = sess.run(None, feeds)
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
        print(name, sess.explain().splitlines()[-3:])


def _host_reading_registry():
    """A test op that reads its input on the host (.item()): capture must fail."""

    def bind(node, ctx):
        def kernel(inputs):
            x = inputs[0]
            return [x * float(x.sum().item() > -1e30)]
        return kernel

    return default_registry().extend([OpDef("HostRead", bind, domain="test")])


def test_failed_capture_falls_back_with_reason():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("HostRead", ["r"], ["h"], name="host", domain="test"),
             helper.make_node("Neg", ["h"], ["y"], name="neg")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid("test", 1)])
    sess = segflow.InferenceSession(model, device=DEVICE, engine="inline", cuda_graphs=True,
                                    registry=_host_reading_registry())
    data = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    for _ in range(4):
        (out,) = sess.run(None, {"x": data})
        np.testing.assert_allclose(out, -np.maximum(data, 0))
    assert "not captured: capture failed" in sess.explain()
    # The device still works after the failed capture.
    assert torch.ones(3, device=DEVICE).sum().item() == 3


def test_run_async_two_in_flight_match_run_and_wait_once_each(resnet18):
    sess = segflow.InferenceSession(resnet18, device=DEVICE, engine="inline", cuda_graphs=True)
    plain = segflow.InferenceSession(resnet18, device=DEVICE, engine="inline")
    feeds = [_feeds(1), {"input": _feeds(1)["input"] * -0.5}]
    want = [plain.run(None, f)[0] for f in feeds]
    for _ in range(3):
        sess.run(None, feeds[0])  # warm-up, capture, replay

    def two_in_flight() -> list[np.ndarray]:
        first, second = sess.run_async(None, feeds[0]), sess.run_async(None, feeds[1])
        return [second.result()[0], first.result()[0]]

    got = two_in_flight()
    np.testing.assert_allclose(got[0], want[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], want[0], rtol=1e-4, atol=1e-5)
    counts = count_api_calls(two_in_flight, runs=3)
    assert counts.syncs == 6 and counts.graph_launches == 6  # one wait per run, none more
