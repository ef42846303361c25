"""Data-parallel training (segflow.distributed): buckets, the communication lane, and
2 gloo processes on localhost against a single-process run on the concatenated batch.

The multi-process tests spawn their ranks through ``segflow.distributed.launch.spawn``
with a bounded time; the ranks run ``tests/distributed_workers.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from segflow.distributed import DataParallelOptions, GradientGroup, plan_buckets
from segflow.distributed.launch import free_port, results_or_raise, spawn
from segflow.errors import CommunicationError, InvalidInput, InvalidSetting
from segflow.profiler.chrome_trace import check_trace, to_chrome_trace
from segflow.profiler.events import Category, Event

sys.path.insert(0, str(Path(__file__).parent))
import distributed_workers as workers  # noqa: E402

STEPS = 3
SPAWN_TIMEOUT_S = 50.0
F32 = torch.float32


# -- buckets ------------------------------------------------------------------------------
def _group(task: int | None, *shapes: tuple[int, ...], dtype: torch.dtype = F32
           ) -> GradientGroup:
    names = tuple(f"p{task}.{i}" for i in range(len(shapes)))
    return GradientGroup(task, names, tuple(range(len(shapes))), shapes, dtype)


def test_buckets_pack_groups_in_backward_order_up_to_the_cap():
    groups = [_group(7, (10,)), _group(3, (4, 4)), _group(5, (8,)), _group(9, (30,))]
    buckets = plan_buckets(groups, cap_bytes=100)
    assert [[g.task for g in b.groups] for b in buckets] == [[3, 5], [7], [9]]
    assert [b.offsets for b in buckets] == [(0, 16), (0,), (0,)]
    assert [b.nbytes for b in buckets] == [96, 40, 120]   # the 120-byte group alone
    assert buckets[0].tasks == (3, 5)
    assert [b.index for b in buckets] == [0, 1, 2]


def test_buckets_split_dtypes_and_put_taskless_gradients_first():
    groups = [_group(2, (4,)), _group(None, (2,)), _group(4, (4,), dtype=torch.float64)]
    buckets = plan_buckets(groups, cap_bytes=1 << 20)
    assert [[g.task for g in b.groups] for b in buckets] == [[None, 2], [4]]
    assert buckets[0].tasks == (2,)
    assert [b.dtype for b in buckets] == [F32, torch.float64]


def test_bucket_cap_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([_group(1, (1,))], 0)
    with pytest.raises(InvalidSetting, match="bucket_bytes"):
        DataParallelOptions(bucket_bytes=0)
    with pytest.raises(InvalidSetting, match="timeout_s"):
        DataParallelOptions(timeout_s=0)


# -- the Chrome trace ---------------------------------------------------------------------
def test_all_reduces_get_communication_lanes_that_never_overlap():
    def span(category: Category, name: str, start: int, end: int, thread: str, tid: int,
             **args: object) -> Event:
        return Event(category, name, start, end, thread, tid, "cpu:0", args)

    events = [span(Category.SEGMENT, "segment 4", 0, 100, "segflow-cpu:0", 1, segment=4),
              span(Category.COMM, "all-reduce bucket 0", 40, 300, "gloo", 2, bucket=0),
              span(Category.COMM, "all-reduce bucket 1", 120, 350, "gloo", 2, bucket=1),
              span(Category.COMM, "all-reduce bucket 2", 320, 400, "gloo", 2, bucket=2)]
    trace = to_chrome_trace(events)
    assert check_trace(trace) == []
    lanes = {ev["args"]["name"]: ev["tid"] for ev in trace["traceEvents"]
             if ev.get("name") == "thread_name"}
    assert set(lanes) == {"segflow-cpu:0", "communication", "communication 2"}
    tid_of = {ev["name"]: ev["tid"] for ev in trace["traceEvents"] if ev.get("ph") == "X"}
    assert tid_of["all-reduce bucket 0"] == tid_of["all-reduce bucket 2"] \
        == lanes["communication"]
    assert tid_of["all-reduce bucket 1"] == lanes["communication 2"]


# -- one rank, in this process ------------------------------------------------------------
@pytest.fixture
def single_rank() -> Iterator[None]:
    """A gloo process group of this process alone."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _steps(sess, steps: int = STEPS, world_size: int = 1) -> dict[str, np.ndarray]:
    for step in range(steps):
        images, labels = workers.global_batch(step, world_size)
        sess.step({"image": images, "label": labels})
    params = {n: t.detach().numpy().copy() for n, t in sess.parameters().items()}
    sess.close()
    return params


@pytest.mark.parametrize("engine", ["inline", "threaded"])
def test_one_rank_trains_exactly_as_a_plain_session(single_rank, engine):
    reference = _steps(workers.session(workers.build_model(0), engine=engine))
    got = _steps(workers.session(workers.build_model(0), DataParallelOptions(bucket_bytes=1),
                                 engine))
    for name, value in reference.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_distributed_step_counts_its_all_reduces(single_rank):
    images, labels = workers.global_batch(0, 1)
    feeds = {"image": images, "label": labels}
    plain = workers.session(workers.build_model(0), engine="threaded")
    plain_stats = plain.step(feeds).stats
    plain.close()
    sess = workers.session(workers.build_model(0), DataParallelOptions(bucket_bytes=1))
    stats = sess.step(feeds).stats
    # One bucket per backward segment that ends at a gradient: fc2, fc1, conv (backward order).
    assert stats.allreduces == 3
    assert stats.allreduce_bytes == 4 * sum(p.numel() for p in sess.parameters().values())
    assert stats.engine == "threaded"                # auto: communication to overlap
    assert stats.pushes == plain_stats.pushes + 3    # an all-reduce task per bucket
    assert stats.syncs == plain_stats.syncs + 1      # the wait for the step's all-reduces
    sess.close()
    assert sess.explain().splitlines()[-1] == (
        "data-parallel: rank 0 of 1, 3 gradient buckets (680 B, 16448 B, 160 B; cap 1 B), "
        "each an all-reduce task after the backward segments it reads, averaged")
    one = workers.session(workers.build_model(0), True)   # 25 MiB: one bucket
    assert one.step(feeds).stats.allreduces == 1
    one.close()


def test_no_sync_steps_must_not_update(single_rank):
    sess = workers.session(workers.build_model(0), True)
    images, labels = workers.global_batch(0, 1)
    with sess.no_sync(), pytest.raises(InvalidInput, match="update=False"):
        sess.step({"image": images, "label": labels})
    sess.close()


def test_distributed_needs_a_process_group_and_no_sync_a_distributed_session():
    assert not dist.is_initialized()
    with pytest.raises(InvalidSetting, match="init_process_group"):
        workers.session(workers.build_model(0), True)
    sess = workers.session(workers.build_model(0))
    with pytest.raises(InvalidInput, match="distributed=True"), sess.no_sync():
        pass
    sess.close()


# -- two ranks ------------------------------------------------------------------------------
def _reference(accumulate: bool) -> dict[str, np.ndarray]:
    """One process on the ranks' batches concatenated (accumulating: the ranks' first
    halves, then their second halves, with grad_req="add")."""
    from segflow.optim import SGD
    from segflow.runtime.training import CrossEntropyLoss, TrainingSession

    sess = TrainingSession(workers.build_model(0), loss=CrossEntropyLoss(labels="label"),
                           optimizer=SGD(lr=0.1, momentum=0.9, weight_decay=1e-3),
                           grad_req="add" if accumulate else "write")
    half, b = workers.BATCH // 2, workers.BATCH
    for step in range(STEPS):
        images, labels = workers.global_batch(step, 2)
        if not accumulate:
            sess.step({"image": images, "label": labels})
            continue
        sess.zero_grad()
        first = np.r_[0:half, b:b + half]
        second = np.r_[half:b, b + half:2 * b]
        sess.step({"image": images[first], "label": labels[first]}, update=False)
        sess.step({"image": images[second], "label": labels[second]})
    params = {n: t.detach().numpy().copy() for n, t in sess.parameters().items()}
    sess.close()
    return params


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync"])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(accumulate):
    outcomes = spawn(workers.train_steps, 2, args=(STEPS, 1, None, accumulate),
                     timeout_s=SPAWN_TIMEOUT_S, group_timeout_s=30)
    ranks = results_or_raise(outcomes)
    reference = _reference(accumulate)
    for name, value in reference.items():
        # The ranks apply the same reduced gradients to rank 0's broadcast weights.
        np.testing.assert_array_equal(ranks[0]["params"][name], ranks[1]["params"][name])
        np.testing.assert_allclose(ranks[0]["params"][name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    param_bytes = 4 * sum(v.size for v in reference.values())
    for rank in ranks:
        assert rank["engine"] == "threaded"
        assert rank["allreduces"] == 3
        assert rank["allreduce_bytes"] == param_bytes
        # Overlap, from the recorded spans: the first all-reduce starts before the last
        # backward segment ends.
        spans = rank["spans"]
        assert len(spans["comm"]) == 3
        assert min(s for s, _ in spans["comm"]) < max(e for _, e in spans["backward"])
        trace = rank["trace"]
        assert check_trace(trace) == []
        comm_lanes = {ev["tid"] for ev in trace["traceEvents"] if ev.get("cat") == "comm"}
        names = {ev["tid"]: ev["args"]["name"] for ev in trace["traceEvents"]
                 if ev.get("name") == "thread_name"}
        assert {names[t] for t in comm_lanes} <= {"communication", "communication 2",
                                                  "communication 3"}


def test_a_killed_rank_fails_the_other_with_a_clear_error_in_time():
    outcomes = spawn(workers.killed_rank, 2, timeout_s=SPAWN_TIMEOUT_S, group_timeout_s=20)
    survivor, killed = outcomes
    assert killed.exitcode == 3 and killed.result is None
    assert survivor.ok, survivor.error
    error = survivor.result["error"]
    assert error is not None, "the survivor trained on without its peer"
    assert error.startswith("rank 0: all-reduce of gradient bucket ")
    assert "another rank may have failed" in error and "\n" not in error
    assert survivor.result["seconds"] < 25


def test_a_rank_that_stops_answering_fails_the_other_after_the_step_timeout():
    outcomes = spawn(workers.stalled_rank, 2, timeout_s=SPAWN_TIMEOUT_S, group_timeout_s=30)
    survivor, stalled = outcomes
    assert stalled.exitcode == 4
    assert survivor.ok, survivor.error
    assert survivor.result["error"] == ("rank 0: the step's all-reduces did not finish within "
                                        "3 s; another rank may have failed or stopped")
    assert 3 <= survivor.result["seconds"] < 8


def test_mismatched_parameter_shapes_fail_every_rank_at_start():
    outcomes = spawn(workers.mismatched_shapes, 2, timeout_s=SPAWN_TIMEOUT_S,
                     group_timeout_s=20)
    messages = results_or_raise(outcomes)
    for message in messages:
        assert "'fc1.weight'" in message and "rank 1" in message and "[24, 256]" in message


def test_results_or_raise_names_the_failed_rank():
    from segflow.distributed.launch import RankOutcome

    with pytest.raises(CommunicationError, match="rank 1 failed: timed out"):
        results_or_raise([RankOutcome(0, 1), RankOutcome(1, error="timed out", exitcode=None)])


def test_train_demo_with_two_workers_reports_accuracy_and_overlap(capsys):
    from segflow.training_demo import main

    code = main(["--workers", "2", "--epochs", "1", "--quiet", "--min-accuracy", "50%"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "test accuracy" in out and "after 1 epochs" in out
    line = next(line for line in out.splitlines() if line.startswith("data-parallel:"))
    # fc2, fc1 and the convolutions with their BatchNorms: three 64 KiB buckets.
    assert line.startswith("data-parallel: 2 processes, 3 all-reduces a step, ")
    assert line.endswith("of the all-reduce time overlapped backward segments (last epoch)")


def test_overlap_is_the_share_of_all_reduce_time_under_backward_segments():
    from segflow.distributed.overlap import communication_overlap

    def span(category: Category, start: int, end: int, segment: int | None = None) -> Event:
        args = {} if segment is None else {"segment": segment}
        return Event(category, "x", start, end, "t", 1, "cpu:0", args)

    events = [span(Category.SEGMENT, 0, 100, segment=1),      # forward: not counted
              span(Category.SEGMENT, 100, 200, segment=5),
              span(Category.SEGMENT, 250, 300, segment=6),
              span(Category.COMM, 150, 260), span(Category.COMM, 180, 400)]
    # all-reduces cover 150..400 (250 ns); backward segments 150..200 and 250..300 of it.
    assert communication_overlap(events, {5, 6}) == pytest.approx(100 / 250)
    assert communication_overlap(events[:3], {5, 6}) == 0.0
