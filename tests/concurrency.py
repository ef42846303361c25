"""Helpers for the concurrency tests: run one function on several threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def on_one_and_more_threads(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn()`` with one intra-op thread, then with at least two (the OpenMP pool that
    torch, libdnnl and the native kernels share); the thread count is restored."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(max(2, threads))
        return one, fn()
    finally:
        torch.set_num_threads(threads)


def run_in_threads(work: Callable[[int], object], count: int) -> None:
    """Run ``work(0) ... work(count - 1)`` on that many threads at once and wait for all;
    the first exception a thread raised (a failed assertion, a kernel error) is raised
    here, so it fails the test instead of being lost with its thread."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def runs_match_in_threads(sess: Any, ref: Any, width: int, *, atol: float, rtol: float,
                          threads: int = 3) -> None:
    """Run ``sess`` on ``threads`` threads at once, each over batches 1, 2, 3 (three
    times) of ``x`` ``[batch, 16, width]``, and compare every result with ``ref``'s
    (an onnxruntime session)."""
    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for batch in (1, 2, 3) * 3:
            x = rng.standard_normal((batch, 16, width)).astype(np.float32)
            np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                                       ref.run(None, {"x": x})[0], atol=atol, rtol=rtol)
    run_in_threads(worker, threads)
