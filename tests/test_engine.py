"""Engine contract: per-Var ordering, concurrency, errors, exec types."""

from __future__ import annotations

import threading
import time

import pytest

from segflow.engine import ExecType, InlineEngine, ThreadedEngine, Var, make_engine
from segflow.ir.types import Device


@pytest.fixture(params=["inline", "threaded"])
def engine(request):
    eng = make_engine(request.param)
    yield eng
    eng.close()


def test_read_after_write_order(engine):
    log: list[str] = []
    v = Var("v")

    def writer():
        time.sleep(0.02)
        log.append("write")

    engine.push(writer, [], [v])
    engine.push(lambda: log.append("read"), [v], [])
    engine.wait_all()
    assert log == ["write", "read"]


def test_write_after_read_order(engine):
    log: list[str] = []
    v = Var("v")

    def reader():
        time.sleep(0.02)
        log.append("read")

    engine.push(reader, [v], [], device=Device.parse("cpu:0"))
    engine.push(lambda: log.append("write"), [], [v], device=Device.parse("cpu:1"))
    engine.wait_all()
    assert log == ["read", "write"]


def test_write_after_write_order(engine):
    log: list[int] = []
    v = Var("v")
    for i in range(20):
        dev = Device.parse(f"cpu:{i % 3}")
        engine.push(lambda i=i: log.append(i), [], [v], device=dev)
    engine.wait(v)
    assert log == list(range(20))


def test_independent_tasks_run_concurrently_on_threaded_engine():
    engine = ThreadedEngine()
    barrier = threading.Barrier(2, timeout=5)
    a, b = Var("a"), Var("b")
    # Each task waits for the other: only possible if they run at the same time.
    engine.push(barrier.wait, [], [a], device=Device.parse("cpu:0"))
    engine.push(barrier.wait, [], [b], device=Device.parse("cpu:1"))
    engine.wait(a)
    engine.wait(b)
    engine.close()


def test_error_propagates_to_waiter_and_engine_stays_usable(engine):
    v, w = Var("v"), Var("w")

    def boom():
        raise RuntimeError("kernel exploded")

    if isinstance(engine, InlineEngine):
        with pytest.raises(RuntimeError, match="kernel exploded"):
            engine.push(boom, [], [v])
    else:
        engine.push(boom, [], [v])
        engine.push(lambda: None, [v], [w])  # depends on the failed task: poisoned
        with pytest.raises(RuntimeError, match="kernel exploded"):
            engine.wait(v)
        with pytest.raises(RuntimeError, match="kernel exploded"):
            engine.wait(w)
    ok = Var("ok")
    done: list[bool] = []
    engine.push(lambda: done.append(True), [], [ok])
    engine.wait(ok)
    assert done == [True]


def test_local_task_runs_on_pushing_thread_after_dependencies(engine):
    v = Var("v")
    seen: dict[str, object] = {}

    def producer():
        time.sleep(0.02)
        seen["produced"] = True

    def local():
        seen["thread"] = threading.current_thread()
        seen["after"] = seen.get("produced", False)

    engine.push(producer, [], [v])
    engine.push(local, [v], [Var("out")], exec_type=ExecType.LOCAL)
    assert seen["thread"] is threading.current_thread()
    assert seen["after"] is True


def test_copy_tasks_run_on_copy_worker():
    engine = ThreadedEngine()
    names: list[str] = []
    v = Var("v")
    engine.push(lambda: names.append(threading.current_thread().name), [], [v],
                exec_type=ExecType.COPY, device=Device.parse("cpu:1"))
    engine.wait(v)
    engine.close()
    assert names == ["segflow-copy"]


def test_async_task_completes_through_callback(engine):
    v = Var("v")
    log: list[str] = []

    def task(on_complete):
        log.append("started")
        on_complete(None)

    engine.push(task, [], [v], exec_type=ExecType.ASYNC)
    engine.push(lambda: log.append("after"), [v], [])
    engine.wait_all()
    assert log == ["started", "after"]


def test_an_async_task_made_ready_with_sync_ones_is_queued_first():
    engine = ThreadedEngine()
    v, out_sync, out_async = Var("v"), Var("sync"), Var("async")
    release = threading.Event()
    log: list[str] = []

    def launch(on_complete):
        log.append("async")
        on_complete(None)

    engine.push(release.wait, [], [v])            # holds both readers until they are pushed
    engine.push(lambda: log.append("sync"), [v], [out_sync])
    engine.push(launch, [v], [out_async], exec_type=ExecType.ASYNC)
    release.set()
    engine.wait(out_sync, out_async)
    engine.close()
    assert log == ["async", "sync"]


def test_unknown_engine_name():
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("turbo")
