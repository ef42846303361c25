"""The command line's :class:`segflow.progress.Listener`: long steps drawn with rich on stderr.

Each running step is one transient line (a spinner, its text, a bar once its fraction
is known, the time so far), drawn only while some step runs and erased when it ends, so
what a command prints on stdout is left as it would be without it. Where stderr is not
a terminal (a pipe, a log file, CI) nothing is drawn: a spinner's redraws would only
fill the log. Notices are different: each topic's last text is written once, as a
``note:`` line on stderr when the display closes, terminal or not, since they say
what ran.

The console is bound to the stream stderr was when the display was made: inductor's
compile swaps ``sys.stderr`` for a buffer while it runs, and the spinner must keep
drawing on the terminal meanwhile.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

from segflow import progress
from segflow.progress import Step, Topic


class TerminalDisplay:
    """Shows steps on a terminal and notices anywhere; :meth:`close` writes the notices.

    ``hints``: notice topic -> what the command line adds to that notice (the flags
    that change it, which library code does not know). ``terminal``: draw steps
    (None: when ``stream`` is a terminal); ``steps=False`` never draws them.
    """

    def __init__(self, stream: TextIO | None = None, *, steps: bool = True,
                 terminal: bool | None = None, hints: Mapping[Topic, str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if terminal is None:
            isatty = getattr(self.stream, "isatty", None)
            terminal = bool(isatty and isatty())
        self.draws_steps = steps and terminal
        self.hints = dict(hints or {})
        self._lock = threading.Lock()
        self._bar: Any = None                 # a rich Progress while a step runs
        self._tasks: dict[int, Any] = {}      # id(step) -> its rich task
        self._notices: dict[Topic, str] = {}  # topic -> its last text, in arrival order
        self._closed = False

    # -- Listener ----------------------------------------------------------------------
    def started(self, step: Step) -> None:
        if not self.draws_steps:
            return
        with self._lock:
            if self._bar is None:
                self._bar = self._new_bar()
                self._bar.start()
            self._tasks[id(step)] = self._bar.add_task(
                step.text, total=None if step.fraction is None else 1.0,
                completed=step.fraction or 0.0)

    def updated(self, step: Step) -> None:
        with self._lock:
            task = self._tasks.get(id(step))
            if task is None or self._bar is None:
                return
            if step.fraction is not None:
                self._bar.update(task, description=step.text, total=1.0,
                                 completed=step.fraction)
            else:
                self._bar.update(task, description=step.text)

    def finished(self, step: Step) -> None:
        with self._lock:
            task = self._tasks.pop(id(step), None)
            if task is None or self._bar is None:
                return
            self._bar.remove_task(task)
            if not self._tasks:   # nothing runs: erase the display until the next step
                self._bar.stop()
                self._bar = None

    def noticed(self, topic: Topic, text: str) -> None:
        with self._lock:
            self._notices[topic] = text

    # -- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Erase any step still drawn and write each notice once (a second call writes
        nothing)."""
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
                self._tasks.clear()
            if self._closed:
                return
            self._closed = True
            notices = list(self._notices.items())
        for topic, text in notices:
            hint = self.hints.get(topic)
            self.stream.write(f"note: {text}" + (f"; {hint}" if hint else "") + "\n")
        with contextlib.suppress(Exception):
            self.stream.flush()

    def _new_bar(self) -> Any:
        # rich is imported only once a step is drawn: a command that runs none
        # (segflow cache, a warm run) does not pay for it.
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            Task,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.table import Column
        from rich.text import Text

        class FractionBar(BarColumn):
            """A bar only for a step that says how far it got: a compile's would only pulse."""

            def render(self, task: Task) -> Any:
                return Text("") if task.total is None else super().render(task)

        console = Console(file=self.stream, force_terminal=True)
        # Time first: a long description is cut at the terminal's edge, the time is not.
        return Progress(SpinnerColumn(), TimeElapsedColumn(table_column=Column(min_width=7)),
                        FractionBar(bar_width=24), TaskProgressColumn(),
                        TextColumn("{task.description}", table_column=Column(
                            ratio=1, no_wrap=True, overflow="ellipsis")),
                        console=console, transient=True, expand=True)


@contextlib.contextmanager
def shown(steps: bool = True, hints: Mapping[Topic, str] | None = None,
          stream: TextIO | None = None) -> Iterator[progress.Listener]:
    """Install a :class:`TerminalDisplay` for the duration and close it at the end;
    where a listener is already installed (``segflow train-demo`` under the command
    line's), use that one instead.

    >>> with shown(steps=not args.no_progress):              # doctest: +SKIP
    ...     run_the_command()
    """
    existing = progress.current()
    if existing is not None:
        yield existing
        return
    display = TerminalDisplay(stream, steps=steps, hints=hints)
    try:
        with progress.listening(display):
            yield display
    finally:
        display.close()
