"""Tests for runtime/arena.py: direct kernels writing into one planned block per run.

Numerics against onnxruntime (float32, atol 1e-4 / rtol 1e-3 as for the other
direct-call tests). The property test builds random convolution graphs
(residual adds, max pools, intermediate values as graph outputs), checks that
no two views of the block alive at the same time share bytes, and that a
run's outputs stay intact after later runs reuse the block.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import segflow
from concurrency import run_in_threads
from segflow import models
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import Library
from segflow.runtime.arena import ArenaLayout, ArenaPool

pytestmark = pytest.mark.skipif(Library.load() is None,
                                reason=f"libdnnl {Library.probe()[1]}")
ATOL, RTOL = 1e-4, 1e-3
CHANNELS, SIZE = 8, 8


def _pool(sess: segflow.InferenceSession) -> ArenaPool:
    pool = sess._executor.arena
    assert pool is not None
    return pool


def _oracle(model: Any) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _assert_no_live_overlap(layout: ArenaLayout) -> None:
    entries = layout.entries
    for i, a in enumerate(entries):
        assert a.offset + a.nbytes <= layout.nbytes
        for b in entries[i + 1:]:
            share_bytes = a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes
            share_time = a.start <= b.end and b.start <= a.end
            assert not (share_bytes and share_time), f"{a.name} and {b.name} overlap"


@pytest.fixture(scope="module")
def resnet() -> tuple[Any, dict[str, np.ndarray]]:
    model = models.build("resnet18", image_size=48)
    return model, models.example_inputs("resnet18", batch_size=1, image_size=48)


@pytest.mark.parametrize("native_stem", [False, True], ids=["staged-stem", "native-stem"])
def test_convolution_and_pool_outputs_live_in_one_block(resnet, native_stem):
    model, feeds = resnet
    if native_stem and NativeLibrary.probe()[0] is None:
        pytest.skip("native kernels unavailable")
    sess = segflow.InferenceSession(model.SerializeToString(), compile="codegen",
                                    optimize={"layout.native_stem": native_stem})
    pool = _pool(sess)
    direct = [n for n in sess.graph.nodes if sess.plan.choices.calls_libdnnl(n)]
    assert sorted({n.op_type for n in direct}) == ["FusedConv", "GlobalAveragePool", "MaxPool"]
    assert len(pool.values) == len(direct)
    # The stem reads the NCHW image: staged into the block's channels-last storage for
    # libdnnl, or read in place by the native stem kernel, whose storage for that copy
    # stays planned for a call it declines (a large batch).
    assert [node.op_type for _, node in pool.staged] == ["FusedConv"]
    got = sess.run(None, feeds)[0]
    np.testing.assert_allclose(got, _oracle(model).run(None, feeds)[0], atol=ATOL, rtol=RTOL)
    layout = pool.layout({"batch": 1})
    _assert_no_live_overlap(layout)
    # Only the values that die inside the run (the graph output is a Gemm's, not here),
    # and the block is no larger than the plan's peak for every value.
    plan = sess._executor.arena.plans.for_dims({"batch": 1})  # type: ignore[union-attr]
    assert 0 < layout.nbytes <= plan.arena_bytes
    assert pool.held_bytes() == layout.nbytes       # one block, kept for the next run
    assert sess.arena_bytes == layout.nbytes
    assert "arena:" in sess.explain() and "views in" in sess.explain()


def test_runs_match_the_same_session_without_the_arena_bit_for_bit(resnet, monkeypatch):
    model, _ = resnet
    with_arena = segflow.InferenceSession(model.SerializeToString(), compile="codegen")
    monkeypatch.setenv("SEGFLOW_ARENA", "0")
    without = segflow.InferenceSession(model.SerializeToString(), compile="codegen")
    assert without._executor.arena is None and without.arena_bytes == 0
    assert without.last_run_stats is None
    for batch in (1, 3, 1, 2):
        feeds = models.example_inputs("resnet18", batch_size=batch, image_size=48, seed=batch)
        np.testing.assert_array_equal(with_arena.run(None, feeds)[0],
                                      without.run(None, feeds)[0])
    assert with_arena.last_run_stats.settings["arena"] is True  # type: ignore[union-attr]
    # Blocks are kept for the two most recent sizes only.
    assert {layout for layout in _pool(with_arena)._idle} == {(("batch", 1),), (("batch", 2),)}


@pytest.mark.parametrize("compile", ["none", "codegen"])
def test_interpreter_and_codegen_both_write_into_the_block(resnet, compile):
    model, feeds = resnet
    sess = segflow.InferenceSession(model.SerializeToString(), compile=compile)
    pool = _pool(sess)
    seen: list[int] = []
    original = pool.acquire

    def acquire(dims: Any) -> Any:
        arena = original(dims)
        seen.append(id(arena))
        return arena
    pool.acquire = acquire  # type: ignore[method-assign]
    first = sess.run(None, feeds)[0]
    second = sess.run(None, feeds)[0]
    assert len(seen) == 2 and seen[0] == seen[1]          # the same block, reused
    assert pool.held_bytes() > 0
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, _oracle(model).run(None, feeds)[0], atol=ATOL, rtol=RTOL)


def test_a_profiled_run_uses_the_block_too(resnet):
    model, feeds = resnet
    sess = segflow.InferenceSession(model.SerializeToString())
    plain = sess.run(None, feeds)[0]
    with segflow.profile():
        profiled = sess.run(None, feeds)[0]
    np.testing.assert_array_equal(plain, profiled)
    assert _pool(sess).held_bytes() == _pool(sess).layout({"batch": 1}).nbytes


def test_threaded_engine_and_switches_turn_it_off(resnet, monkeypatch):
    model, feeds = resnet
    data = model.SerializeToString()
    assert segflow.InferenceSession(data, engine="threaded")._executor.arena is None
    assert segflow.InferenceSession(data, optimize={"plan_memory": False})._executor.arena \
        is None
    monkeypatch.setenv("SEGFLOW_ONEDNN_DIRECT", "0")
    assert segflow.InferenceSession(data)._executor.arena is None   # no direct kernels


def test_a_block_is_allocated_only_when_a_kernel_asks(resnet):
    model, _ = resnet
    pool = _pool(segflow.InferenceSession(model.SerializeToString()))
    arena = pool.acquire({"batch": 1})
    pool.release(arena)
    assert not arena.allocated and pool.held_bytes() == 0


def test_concurrent_runs_each_take_their_own_block(resnet):
    model, _ = resnet
    sess = segflow.InferenceSession(model.SerializeToString())
    oracle = _oracle(model)
    errors: list[str] = []
    start = threading.Barrier(3)

    def work(seed: int) -> None:
        feeds = models.example_inputs("resnet18", batch_size=1, image_size=48, seed=seed)
        ref = oracle.run(None, feeds)[0]
        start.wait()
        for _ in range(6):
            out = sess.run(None, feeds)[0]
            if not np.allclose(out, ref, atol=ATOL, rtol=RTOL):
                errors.append(f"seed {seed}: max error {np.abs(out - ref).max()}")

    run_in_threads(work, 3)
    assert errors == []
    layout = _pool(sess).layout({"batch": 1})
    assert layout.nbytes <= _pool(sess).held_bytes() <= 3 * layout.nbytes


# -- random convolution graphs ---------------------------------------------------------
F32 = TensorProto.FLOAT
_OPS = ("conv3", "conv1", "conv_relu", "add_relu", "relu", "maxpool")


@st.composite
def conv_graphs(draw: Any) -> tuple[Any, list[str]]:
    """A random graph of same-shape convolutions, residual adds, relus and max pools;
    some intermediate values are graph outputs too."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = ["x"]
    nodes: list[Any] = []
    inits: dict[str, np.ndarray] = {}
    steps = draw(st.lists(st.sampled_from(_OPS), min_size=2, max_size=16))
    for i, op in enumerate(steps):
        src = values[draw(st.integers(0, len(values) - 1))]
        out = f"v{i}"
        if op.startswith("conv"):
            k = 1 if op == "conv1" else 3
            inits[f"w{i}"] = (rng.standard_normal((CHANNELS, CHANNELS, k, k)) * 0.2).astype(
                np.float32)
            inits[f"b{i}"] = rng.standard_normal(CHANNELS).astype(np.float32) * 0.1
            conv_out = f"c{i}" if op == "conv_relu" else out
            nodes.append(helper.make_node("Conv", [src, f"w{i}", f"b{i}"], [conv_out],
                                          pads=[k // 2] * 4))
            if op == "conv_relu":
                nodes.append(helper.make_node("Relu", [conv_out], [out]))
        elif op == "add_relu":
            other = values[draw(st.integers(0, len(values) - 1))]
            nodes.append(helper.make_node("Add", [src, other], [f"a{i}"]))
            nodes.append(helper.make_node("Relu", [f"a{i}"], [out]))
        elif op == "relu":
            nodes.append(helper.make_node("Relu", [src], [out]))
        else:
            nodes.append(helper.make_node("MaxPool", [src], [out], kernel_shape=[3, 3],
                                          pads=[1, 1, 1, 1]))
        values.append(out)
    extra = draw(st.lists(st.sampled_from(values[1:-1] or values[-1:]), max_size=2,
                          unique=True))
    outputs = [values[-1], *(v for v in extra if v != values[-1])]
    shape = ["batch", CHANNELS, SIZE, SIZE]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F32, shape)],
        [helper.make_tensor_value_info(n, F32, None) for n in outputs],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, outputs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_graphs())
def test_random_conv_graphs_match_onnxruntime_and_keep_their_outputs(case):
    model, outputs = case
    data = model.SerializeToString()
    sess = segflow.InferenceSession(data, compile="codegen")
    oracle = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    kept: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
    for batch in (1, 2, 1):
        feeds = {"x": rng.standard_normal((batch, CHANNELS, SIZE, SIZE)).astype(np.float32)}
        got = sess.run(None, feeds)
        want = oracle.run(None, feeds)
        for name, g, w in zip(outputs, got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=ATOL, rtol=RTOL, err_msg=name)
        tensors = sess.run_tensors({"x": torch.from_numpy(feeds["x"])})
        kept.append((got, [g.copy() for g in got]))
        kept.append(([t.numpy() for t in tensors], [t.numpy().copy() for t in tensors]))
    for arrays, copies in kept:   # later runs reused the block: outputs must not be in it
        for a, c in zip(arrays, copies, strict=True):
            np.testing.assert_array_equal(a, c)
    pool = sess._executor.arena
    if pool is not None:
        for dims in ({"batch": 1}, {"batch": 2}):
            _assert_no_live_overlap(pool.layout(dims))

