"""kernels/replay.py: runs of native kernels recorded once and replayed in one C call.

A 2-layer encoder of BERT-base's widths (768 wide, so its linears are packed for the
native kernel) runs its whole encoder as one replayed run: every result is checked
against onnxruntime, across new feeds, new sequence lengths, thread counts and
concurrent runs, and the run's results must be new tensors at every call.
"""

from __future__ import annotations

import math
import re

import numpy as np
import onnxruntime as ort
import pytest
import torch

import segflow
from concurrency import run_in_threads
from segflow import models
from segflow.kernels.layer_norm import AddLayerNorm
from segflow.kernels.linear import NativeLinear, pack
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.replay import NativeReplay, NativeStep

LIB, WHY = NativeLibrary.probe()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"native kernels {WHY}")
ENCODER = {"layers": 2, "hidden": 768, "heads": 12, "ffn": 3072, "vocab": 100,
           "max_positions": 64, "seq_len": 16}
ATOL = 1e-4


@pytest.fixture(scope="module")
def encoder():
    model = models.build("bert_tiny", **ENCODER)
    oracle = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return model, oracle


def _feeds(seq: int, seed: int, batch: int = 1) -> dict[str, np.ndarray]:
    return models.example_inputs("bert_tiny", batch_size=batch, seed=seed,
                                 **{**ENCODER, "seq_len": seq})


def _check(sess, oracle, feeds):
    for got, want in zip(sess.run(None, feeds), oracle.run(None, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def _replays(sess) -> list[NativeReplay]:
    return sess.compile_report.native_replays


def _session(model, **optimize):
    """One plan for every shape: the tests below follow one recording across sequence
    lengths and thread counts (the builder's encoder reads its sequence length off a
    Shape, so by default each input shape gets a plan of its own; see test_specialize)."""
    return segflow.InferenceSession(model, optimize={"specialize": False, **optimize})


def test_the_encoder_is_one_replayed_run_that_matches_onnxruntime(encoder):
    model, oracle = encoder
    # Query, key and value as one linear and a Split (views replayed as recorded).
    sess = segflow.InferenceSession(model, optimize={"fuse.siblings": True})
    for seed in range(5):        # new ids and masks every call, one shape
        _check(sess, oracle, _feeds(16, seed, batch=2))
    # The runs took the plan specialized for their shape, which records its own replay.
    (specialized,) = sess.specializations.values()
    (replay,) = _replays(specialized)
    # 2 layers: query/key/value, attention, output, add + norm, FFN in, FFN out, add + norm.
    assert replay.kernels == 14 and not replay.why_not
    # The first call runs as before, the second records, the rest replay.
    assert replay.replays == 3
    text = specialized.explain()
    assert "3 calls replayed" in sess.explain()   # the session's explain shows what ran
    assert "replayed runs (native kernels): 1 run, 14 kernels; 3 calls replayed" in text
    # Its block holds what dies inside the run: far less than every result of the run.
    assert 0 < replay.block_bytes == specialized.arena_bytes < 2 * 32 * 3072 * 4
    # Replayed calls still count as native calls, node by node (8 linears in the run,
    # and the pooler's after it).
    assert re.search(r"native linears: 9 nodes .*; 45 calls native, 0 through torch", text)
    assert "attention: 2 nodes (2 reading heads in place); 10 calls native" in text


def test_the_encoder_with_separate_projections_is_one_replayed_run(encoder):
    model, oracle = encoder
    sess = _session(model, **{"fuse.siblings": False})
    (replay,) = _replays(sess)
    assert replay.kernels == 18 and not replay.why_not     # 3 projections a layer
    for seed in range(4):
        _check(sess, oracle, _feeds(16, seed, batch=2))
    assert replay.replays == 2


def test_results_are_new_tensors_at_every_call(encoder):
    model, oracle = encoder
    sess = _session(model)
    kept = []
    for seed in range(4):
        feeds = _feeds(16, seed)
        outs = sess.run_tensors({k: torch.from_numpy(v) for k, v in feeds.items()})
        kept.append((feeds, [t.clone() for t in outs], outs))
    assert _replays(sess)[0].replays == 2
    for feeds, copies, outs in kept:     # no later call wrote over an earlier one's results
        for copy, out, want in zip(copies, outs, oracle.run(None, feeds), strict=True):
            assert torch.equal(copy, out)
            np.testing.assert_allclose(out.numpy(), want, atol=ATOL, rtol=0)


def test_runs_and_tensor_runs_share_one_recording(encoder):
    # run() records under inference_mode; run_tensors() replays outside it, and its
    # results are ordinary tensors.
    model, oracle = encoder
    sess = _session(model)
    for seed in range(2):
        _check(sess, oracle, _feeds(16, seed))
    feeds = _feeds(16, 5)
    outs = sess.run_tensors({k: torch.from_numpy(v) for k, v in feeds.items()})
    assert _replays(sess)[0].replays == 1
    for out, want in zip(outs, oracle.run(None, feeds), strict=True):
        assert not out.is_inference()
        np.testing.assert_allclose(out.numpy(), want, atol=ATOL, rtol=0)
    _check(sess, oracle, _feeds(16, 6))
    assert _replays(sess)[0].replays == 2


def test_a_new_sequence_length_runs_as_before_until_it_is_recorded(encoder):
    model, oracle = encoder
    sess = _session(model)
    (replay,) = _replays(sess)
    counts = []
    for seed, seq in enumerate([16, 16, 16, 24, 24, 24, 24, 16]):
        _check(sess, oracle, _feeds(seq, seed))
        counts.append(replay.replays)
    # 16: noted, recorded, replayed. 24: two misses, noted again, recorded, replayed.
    # 16 again: a miss, which runs as before.
    assert counts == [0, 0, 1, 1, 1, 1, 2, 2]


def test_a_change_of_thread_count_is_not_replayed(encoder):
    model, oracle = encoder
    sess = _session(model)
    (replay,) = _replays(sess)
    threads = torch.get_num_threads()
    try:
        for seed in range(3):
            _check(sess, oracle, _feeds(16, seed))
        assert replay.replays == 1
        torch.set_num_threads(1)      # the recorded scratch has room for the old count
        _check(sess, oracle, _feeds(16, 7))
        assert replay.replays == 1
    finally:
        torch.set_num_threads(threads)


def test_concurrent_runs_of_one_session_match_onnxruntime(encoder):
    model, oracle = encoder
    sess = segflow.InferenceSession(model)
    cases = [_feeds(16, seed) for seed in range(4)]
    wants = [oracle.run(None, feeds) for feeds in cases]

    def work(i: int) -> None:
        for _ in range(4):
            for got, want in zip(sess.run(None, cases[i]), wants[i], strict=True):
                np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    run_in_threads(work, 4)


def test_the_replay_switch_turns_it_off(encoder, monkeypatch):
    model, oracle = encoder
    monkeypatch.setenv("SEGFLOW_ONEDNN_REPLAY", "0")
    sess = segflow.InferenceSession(model)
    assert _replays(sess) == [] and "native kernels)" not in sess.explain()
    _check(sess, oracle, _feeds(16, 0))


def _linear(n: int, k: int, after=None):
    w = torch.randn(n, k) / math.sqrt(k)
    b = torch.randn(n)
    op = NativeLinear(LIB, k, n, None, after, lambda y: y)
    return op, pack(LIB, w), b, w


def test_a_step_it_cannot_record_leaves_the_run_as_before():
    first, p1, b1, w1 = _linear(64, 32)
    second, p2, b2, w2 = _linear(16, 64, after=torch.sigmoid_)   # runs after the kernel
    steps = [NativeStep(first, (0, 1, 2), (5,), "first"),
             NativeStep(second, (5, 3, 4), (6,), "second")]
    replay = NativeReplay(steps, 5, [1, 2, 3, 4], [6], LIB)
    for _ in range(4):
        x = torch.randn(8, 32)
        (y,) = replay(x, p1, b1, p2, b2)
        want = torch.sigmoid(torch.nn.functional.linear(
            torch.nn.functional.linear(x, w1, b1), w2, b2))
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert replay.replays == 0
    assert replay.why_not == "second applies its activation after the kernel"


def test_two_linears_replay_with_the_feed_and_results_written_anew():
    first, p1, b1, w1 = _linear(64, 32)
    second, p2, b2, w2 = _linear(16, 64)
    steps = [NativeStep(first, (0, 1, 2), (5,), "first"),
             NativeStep(second, (5, 3, 4), (6,), "second")]
    replay = NativeReplay(steps, 5, [1, 2, 3, 4], [6], LIB)
    results = []
    for _ in range(4):
        x = torch.randn(8, 32)
        (y,) = replay(x, p1, b1, p2, b2)
        results.append((x, y))
    assert replay.replays == 2 and not replay.why_not
    for x, y in results:
        want = torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    # A row-strided feed is a new signature: run as before, not replayed over stale strides.
    wide = torch.randn(8, 40)
    (y,) = replay(wide[:, :32], p1, b1, p2, b2)
    want = torch.nn.functional.linear(torch.nn.functional.linear(wide[:, :32], w1, b1), w2, b2)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert replay.replays == 2


@pytest.mark.parametrize("sum_read_after", [False, True])
def test_a_kernel_with_two_outputs_replays_both(sum_read_after):
    # A pre-LN block's add + norm writes the normalized rows and the sum; the sum dies
    # inside the run (the block holds it) or is returned with the run's result.
    first = AddLayerNorm(1e-5, LIB, WHY, with_sum=True)
    linear, packed, bias, w = _linear(32, 32)
    second = AddLayerNorm(1e-5, LIB, WHY)
    gamma, beta = torch.randn(32), torch.randn(32)
    steps = [NativeStep(first, (0, 1, 2, 3), (6, 7), "first"),
             NativeStep(linear, (6, 4, 5), (8,), "linear"),
             NativeStep(second, (8, 7, 2, 3), (9,), "second")]
    returns = [9, 7] if sum_read_after else [9]
    replay = NativeReplay(steps, 6, [2, 3, 4, 5], returns, LIB)
    results = []
    for _ in range(4):
        x, r = torch.randn(8, 32), torch.randn(8, 32)
        x[1, 3] = float("nan")
        r[5, 0] = float("inf")
        results.append((x, r, replay(x, r, gamma, beta, packed, bias)))
    assert replay.replays == 2 and not replay.why_not
    assert replay.block_bytes > 0
    for x, r, got in results:
        s = x + r
        y = torch.nn.functional.layer_norm(s, (32,), gamma, beta, 1e-5)
        want = torch.nn.functional.layer_norm(torch.nn.functional.linear(y, w, bias) + s,
                                              (32,), gamma, beta, 1e-5)
        torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4, equal_nan=True)
        assert torch.isnan(got[0][1]).all() and torch.isnan(got[0][5]).all()
        assert not torch.isnan(got[0][[0, 2, 3, 4, 6, 7]]).any()
        if sum_read_after:
            torch.testing.assert_close(got[1], s, atol=0, rtol=0, equal_nan=True)
    if sum_read_after:     # each call's sum is a tensor of its own
        assert results[-1][2][1].data_ptr() != results[-2][2][1].data_ptr()
