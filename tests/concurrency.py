"""A helper for the concurrency tests: run one function on several threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable


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
