"""The threaded engine: a worker thread per device, a copy worker, dependency tracking.

Each push becomes a task record. Under one lock the engine finds the earlier,
unfinished tasks it conflicts with through its Vars (the last writer of
every Var it reads or writes, and the readers since that write for every Var
it writes); when the count of those reaches zero the task goes to its worker's
queue. SYNC and ASYNC tasks run on the worker of their device, COPY tasks on
the copy worker, and LOCAL tasks on the pushing thread once their
dependencies are done. A failed task poisons the tasks that depend on it;
``wait`` re-raises the error and the engine stays usable.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence

from segflow.engine.base import AsyncTask, ExecType, Task, Var
from segflow.engine.counters import RunCounters
from segflow.ir.types import Device


class _Task:
    __slots__ = ("fn", "exec_type", "worker", "name", "pending", "dependents", "done",
                 "error", "event")

    def __init__(self, fn: Task | AsyncTask, exec_type: ExecType, worker: str, name: str) -> None:
        self.fn = fn
        self.exec_type = exec_type
        self.worker = worker
        self.name = name
        self.pending = 0
        self.dependents: list[_Task] = []
        self.done = False
        self.error: BaseException | None = None
        self.event: threading.Event | None = None


class _VarState:
    __slots__ = ("last_writer", "readers")

    def __init__(self) -> None:
        self.last_writer: _Task | None = None
        self.readers: list[_Task] = []


class ThreadedEngine:
    """Concurrent engine. Workers start lazily, one per device plus one for copies."""

    name = "threaded"
    COPY_WORKER = "copy"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[_Task | None]] = {}
        self._threads: list[threading.Thread] = []
        self._unfinished = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False
        # Workers must be stopped before the interpreter shuts down: a daemon thread still
        # inside a torch kernel during finalization aborts the process. The finalizer holds
        # only the queues and threads, not the engine, so the engine can still be collected.
        self._finalizer = weakref.finalize(self, _stop_workers, self._queues, self._threads)

    # -- pushing -----------------------------------------------------------------------
    def push(self, fn: Task | AsyncTask, reads: Sequence[Var], writes: Sequence[Var],
             exec_type: ExecType = ExecType.SYNC, device: Device | None = None,
             name: str = "", counts: RunCounters | None = None) -> None:
        if exec_type is ExecType.COPY:
            worker = self.COPY_WORKER
        else:
            worker = str(device) if device is not None else "cpu:0"
        task = _Task(fn, exec_type, worker, name)
        if exec_type is ExecType.LOCAL:
            task.event = threading.Event()
        written = False  # a read Var has a writer: a LOCAL task waits for it (counted)
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._unfinished += 1
            for var in reads:
                state = self._state(var)
                writer = state.last_writer
                if writer is not None:
                    written = True
                    if not writer.done:
                        self._depend(task, writer)
                state.readers.append(task)
            for var in writes:
                state = self._state(var)
                writer = state.last_writer
                if writer is not None and not writer.done:
                    self._depend(task, writer)
                for reader in state.readers:
                    if reader is not task and not reader.done:
                        self._depend(task, reader)
                state.readers = []
                state.last_writer = task
            ready = task.pending == 0
        if counts is not None:
            counts.count_push()
            # Counted whether or not the writer has finished yet: the count must not
            # depend on timing.
            if written and exec_type is ExecType.LOCAL:
                counts.count_wait()
        if exec_type is ExecType.LOCAL:
            if not ready:
                assert task.event is not None
                task.event.wait()
            self._execute(task)
        elif ready:
            self._dispatch(task)

    @staticmethod
    def _depend(task: _Task, on: _Task) -> None:
        if task in on.dependents:
            return
        on.dependents.append(task)
        task.pending += 1

    @staticmethod
    def _state(var: Var) -> _VarState:
        state = var._state
        if state is None:
            state = var._state = _VarState()
        assert isinstance(state, _VarState)
        return state

    def _dispatch(self, task: _Task) -> None:
        if task.exec_type is ExecType.LOCAL:
            # The pushing thread is parked on this event; it runs the task itself.
            assert task.event is not None
            task.event.set()
            return
        q = self._queues.get(task.worker)
        if q is None:
            q = self._start_worker(task.worker)
        q.put(task)

    def _start_worker(self, worker: str) -> queue.SimpleQueue[_Task | None]:
        with self._lock:
            q = self._queues.get(worker)
            if q is not None:
                return q
            q = queue.SimpleQueue()
            thread = threading.Thread(target=self._work, args=(q,), name=f"segflow-{worker}",
                                      daemon=True)
            self._queues[worker] = q
            self._threads.append(thread)
            thread.start()
            return q

    # -- running -----------------------------------------------------------------------
    def _work(self, q: queue.SimpleQueue[_Task | None]) -> None:
        while True:
            task = q.get()
            if task is None:
                return
            self._execute(task)

    def _execute(self, task: _Task) -> None:
        if task.error is not None:  # poisoned by a failed dependency
            self._finish(task, task.error)
            return
        if task.exec_type is ExecType.ASYNC:
            try:
                task.fn(self._callback(task))  # type: ignore[call-arg]
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                self._finish(task, exc)
            return
        try:
            task.fn()  # type: ignore[call-arg]
        except BaseException as exc:  # noqa: BLE001
            self._finish(task, exc)
            return
        self._finish(task, None)

    def _callback(self, task: _Task) -> Callable[[BaseException | None], None]:
        def on_complete(error: BaseException | None = None) -> None:
            self._finish(task, error)
        return on_complete

    def _finish(self, task: _Task, error: BaseException | None) -> None:
        ready: list[_Task] = []
        with self._lock:
            task.error = error
            task.done = True
            for dep in task.dependents:
                if error is not None and dep.error is None:
                    dep.error = error
                dep.pending -= 1
                if dep.pending == 0:
                    ready.append(dep)
            task.dependents = []
            event = task.event
            self._unfinished -= 1
            if self._unfinished == 0:
                self._idle.notify_all()
        if event is not None:
            event.set()
        # An ASYNC task only launches work that completes elsewhere (a collective): queued
        # before the SYNC tasks that became ready with it, that work overlaps theirs.
        for dep in sorted(ready, key=lambda t: t.exec_type is not ExecType.ASYNC):
            self._dispatch(dep)

    # -- waiting -----------------------------------------------------------------------
    def wait(self, *vars: Var, counts: RunCounters | None = None) -> None:
        if counts is not None and vars:
            counts.count_wait()
        for var in vars:
            self._wait_one(var)

    def _wait_one(self, var: Var) -> None:
        with self._lock:
            state = var._state
            writer = state.last_writer if isinstance(state, _VarState) else None
            if writer is None:
                return
            if not writer.done and writer.event is None:
                writer.event = threading.Event()
            event = writer.event
        if not writer.done and event is not None:
            event.wait()
        if writer.error is not None:
            raise writer.error

    def wait_all(self) -> None:
        with self._idle:
            while self._unfinished:
                self._idle.wait()

    def close(self) -> None:
        """Finish the tasks already queued, then stop the workers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()


def _stop_workers(queues: dict[str, queue.SimpleQueue[_Task | None]],
                  threads: list[threading.Thread]) -> None:
    for q in list(queues.values()):
        q.put(None)
    for thread in list(threads):
        if thread is not threading.current_thread():
            thread.join(timeout=30)
