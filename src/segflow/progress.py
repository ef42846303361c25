"""Announcing the steps that take a while, and the facts a user should hear once.

Library code wraps work that can take more than a couple of seconds (an inductor
compile, the native kernels' C build, a benchmark) in a step, and tells of a choice
made on the user's behalf (a cached package run instead of generated code) as a
notice:

>>> from segflow import progress
>>> with progress.step("compiling segment 3 with inductor"):
...     pass
>>> with progress.step("timing 4 variants", fraction=0.0) as step:
...     step.update(0.5)
>>> progress.notice(progress.Topic.CACHED_PACKAGES, "using 1 cached inductor package ...")

A :class:`Listener` hears them where one is installed with :func:`listening`: the
command line installs a terminal display (:mod:`segflow.progress_display`); tests
install a recorder. With none installed (a library user's default) a step costs one
context-variable lookup and nothing is shown.

The listener is held in a :class:`contextvars.ContextVar`, not a module global:
each thread and task sees the listener its own context installed, so a session
used from several threads reports only where someone listens. A new thread starts
with an empty context, so steps announced on the threaded engine's worker threads
are not heard (the inline engine, the default for single-device plans, runs them on
the caller's thread).
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol


class Topic(enum.Enum):
    """What a notice is about: a listener shows one notice per topic."""

    CACHED_PACKAGES = "cached-packages"   # compile=auto runs inductor packages it found cached


class Step:
    """One announced step: what it does, how far it got (None: unknown), when it began."""

    __slots__ = ("text", "fraction", "started_at", "_listener")

    def __init__(self, text: str, fraction: float | None, listener: Listener | None) -> None:
        self.text = text
        self.fraction = fraction
        self.started_at = time.monotonic()
        self._listener = listener

    def update(self, fraction: float | None = None, text: str | None = None) -> None:
        """Say how far the step got (0..1) and, optionally, what it does now."""
        if self._listener is None:
            return
        if fraction is not None:
            self.fraction = min(1.0, max(0.0, fraction))
        if text is not None:
            self.text = text
        self._listener.updated(self)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at


class Listener(Protocol):
    """Whoever shows the steps and notices (:mod:`segflow.progress_display`, a test's)."""

    def started(self, step: Step) -> None: ...

    def updated(self, step: Step) -> None: ...

    def finished(self, step: Step) -> None: ...

    def noticed(self, topic: Topic, text: str) -> None:
        """``text`` is the whole notice on ``topic`` so far: a later one on the same
        topic replaces it (a listener that shows notices once shows the last)."""


_listener: ContextVar[Listener | None] = ContextVar("segflow_progress_listener", default=None)


def current() -> Listener | None:
    """The listener installed in this context, if any."""
    return _listener.get()


@contextlib.contextmanager
def listening(listener: Listener | None) -> Iterator[Listener | None]:
    """Install ``listener`` for the duration (and in contexts copied from this one);
    None silences the block (a ``--quiet`` inside a command that shows progress)."""
    token = _listener.set(listener)
    try:
        yield listener
    finally:
        _listener.reset(token)


@contextlib.contextmanager
def step(text: str, fraction: float | None = None) -> Iterator[Step]:
    """Announce a step for the duration of the ``with`` block (see the module docstring)."""
    listener = _listener.get()
    announced = Step(text, fraction, listener)
    if listener is None:
        yield announced
        return
    listener.started(announced)
    try:
        yield announced
    finally:
        listener.finished(announced)


def notice(topic: Topic, text: str) -> None:
    """Tell the listener, if any, a fact the user should hear once (see :class:`Listener`)."""
    listener = _listener.get()
    if listener is not None:
        listener.noticed(topic, text)
