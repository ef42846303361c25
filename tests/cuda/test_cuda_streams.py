"""CUDA streams and completion modes on a real GPU (skipped without CUDA).

The counters are checked against what CUPTI sees: in ``sync_mode="event"`` a
bulk inference makes exactly one host synchronization, and the RunStats
counter says so.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from cuda_trace import count_api_calls, requires_cuda

import segflow
from segflow import models
from segflow.engine.streams import StreamPool, TorchCudaBackend
from segflow.ir.types import Device
from segflow.runtime.completion import StreamCompletion

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not requires_cuda, reason="needs a CUDA device")]

MLP = {"layers": 4, "width": 16}
DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def mlp():
    return models.build("mlp_chain", **MLP)


@pytest.fixture(scope="module")
def mlp_feeds():
    return models.example_inputs("mlp_chain", batch_size=2, **MLP)


@pytest.fixture(scope="module")
def mlp_reference(mlp, mlp_feeds):
    return segflow.InferenceSession(mlp, engine="inline").run(None, mlp_feeds)


def test_backend_primitives():
    backend = TorchCudaBackend()
    dev = Device.parse(DEVICE)
    pool = StreamPool(backend)
    compute, copy = pool.compute(dev), pool.copy(dev)
    assert pool.compute(dev) is compute and compute != copy
    host = torch.arange(1024, dtype=torch.float32)
    moved = backend.to_device(host, dev, copy)
    ready = backend.record_event(copy)
    with backend.use_stream(compute):
        assert torch.cuda.current_stream(dev.torch) == compute
        backend.wait_event(compute, ready)
        doubled = moved * 2
    backend.wait_event(copy, backend.record_event(compute))  # order the copy after the kernel
    back = backend.to_host(doubled, copy)
    backend.synchronize_event(backend.record_event(copy))
    assert back.is_pinned()
    torch.testing.assert_close(back, host * 2)
    assert backend.on_device(moved) and not backend.on_device(host)
    assert backend.needs_upload(host, dev) and not backend.needs_upload(moved, dev)


@pytest.mark.parametrize("engine", ["inline", "threaded"])
def test_event_mode_one_sync_and_correct(mlp, mlp_feeds, mlp_reference, engine):
    sess = segflow.InferenceSession(mlp, device=DEVICE, engine=engine, sync_mode="event")
    assert isinstance(sess._executor.completion, StreamCompletion)
    for _ in range(3):
        out = sess.run(None, mlp_feeds)
        np.testing.assert_allclose(out[0], mlp_reference[0], rtol=1e-5, atol=1e-5)
        assert sess.last_run_stats.syncs == 1
    assert sess._executor.completion.pool.created == 1  # one device: compute stream only


def test_event_mode_counter_matches_cupti(mlp, mlp_feeds):
    sess = segflow.InferenceSession(mlp, device=DEVICE, engine="inline", sync_mode="event")
    for _ in range(3):
        sess.run(None, mlp_feeds)
    counts = count_api_calls(lambda: sess.run(None, mlp_feeds), runs=5)
    assert counts.syncs == 5 * sess.last_run_stats.syncs == 5


def test_stream_mode_without_bulk_syncs_every_node(mlp, mlp_feeds, mlp_reference):
    sess = segflow.InferenceSession(mlp, device=DEVICE, engine="inline", bulk=False,
                                    sync_mode="stream")
    out = sess.run(None, mlp_feeds)
    np.testing.assert_allclose(out[0], mlp_reference[0], rtol=1e-5, atol=1e-5)
    stats = sess.last_run_stats
    assert stats.syncs == sess.plan.compute_nodes + 1 and stats.segments >= MLP["layers"]
    counts = count_api_calls(lambda: sess.run(None, mlp_feeds), runs=2)
    assert counts.syncs == 2 * stats.syncs


def test_local_op_on_cuda(mlp_feeds):
    model = models.build("nonzero_mid")
    feeds = models.example_inputs("nonzero_mid", batch_size=4)
    expected = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    for mode, syncs in (("event", 2), ("stream", 4)):
        sess = segflow.InferenceSession(model, device=DEVICE, sync_mode=mode)
        for _ in range(2):
            out = sess.run(None, feeds)
            np.testing.assert_allclose(out[0], expected[0], rtol=1e-5, atol=1e-5)
            assert sess.last_run_stats.syncs == syncs


def test_outputs_are_fresh_host_arrays(mlp, mlp_feeds):
    sess = segflow.InferenceSession(mlp, device=DEVICE, engine="inline")
    first = sess.run(None, mlp_feeds)[0]
    kept = first.copy()
    sess.run(None, {"x": mlp_feeds["x"] * 3})
    np.testing.assert_array_equal(first, kept)


def test_run_tensors_accepts_device_feeds(mlp, mlp_feeds, mlp_reference):
    sess = segflow.InferenceSession(mlp, device=DEVICE, engine="inline")
    x = torch.from_numpy(mlp_feeds["x"]).to(DEVICE)
    (y,) = sess.run_tensors({"x": x})
    assert y.is_cuda and sess.last_run_stats.syncs == 1
    np.testing.assert_allclose(y.cpu().numpy(), mlp_reference[0], rtol=1e-5, atol=1e-5)


def test_concurrent_runs(mlp, mlp_feeds, mlp_reference):
    sess = segflow.InferenceSession(mlp, device=DEVICE, engine="threaded", bulk=False)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(10):
                out = sess.run(None, mlp_feeds)
                np.testing.assert_allclose(out[0], mlp_reference[0], rtol=1e-5, atol=1e-5)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_host_only_constants_stay_on_the_host_for_bert():
    model = models.build("bert_tiny", seq_len=16)
    sess = segflow.InferenceSession(model, device=DEVICE, engine="inline")
    graph = sess.graph
    for node in graph.nodes:
        if node.op_type == "Reshape":
            slot = sess._executor.slots[node.inputs[1]]
            assert sess._executor.template[slot].device.type == "cpu"


@pytest.mark.parametrize("name", ["resnet18", "bert_tiny", "mobilenet_v2"])
def test_builtin_models_match_cpu(name):
    options = {"image_size": 64, "num_classes": 10} if name != "bert_tiny" else {"seq_len": 16}
    model = models.build(name, **options)
    feeds = models.example_inputs(name, batch_size=2, **options)
    expected = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    sess = segflow.InferenceSession(model, device=DEVICE, sync_mode="event")
    for _ in range(2):
        outs = sess.run(None, feeds)
        for got, want in zip(outs, expected):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
        assert sess.last_run_stats.syncs == 1
