"""segflow.progress and its terminal display: steps reach the listener a context installed,
nothing is shown without one, and the command line draws steps only on a terminal."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from segflow import cli, progress
from segflow.kernels.native import build as native_build
from segflow.kernels.native.build import NativeLibrary
from segflow.progress import Step, Topic
from segflow.progress_display import TerminalDisplay, shown


class Recorder:
    """A listener that keeps what it heard, as ``(event, text)`` rows."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.fractions: list[float | None] = []
        self.notices: list[tuple[Topic, str]] = []

    def started(self, step: Step) -> None:
        self.events.append(("started", step.text))

    def updated(self, step: Step) -> None:
        self.events.append(("updated", step.text))
        self.fractions.append(step.fraction)

    def finished(self, step: Step) -> None:
        self.events.append(("finished", step.text))

    def noticed(self, topic: Topic, text: str) -> None:
        self.notices.append((topic, text))


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_listener_a_step_shows_nothing_and_updates_are_no_ops():
    assert progress.current() is None
    with progress.step("compiling", fraction=0.0) as step:
        step.update(0.5, "still compiling")
    assert (step.text, step.fraction) == ("compiling", 0.0)   # nobody listened
    progress.notice(Topic.CACHED_PACKAGES, "unheard")


def test_a_listener_hears_nested_steps_in_order_and_is_uninstalled_after():
    recorder = Recorder()
    with progress.listening(recorder):
        with progress.step("bench", 0.0) as outer:
            with progress.step("compiling segment 0 with inductor"):
                pass
            outer.update(2.0, "bench: timing")   # clamped to 1
        progress.notice(Topic.CACHED_PACKAGES, "using 1 cached inductor package")
    assert recorder.events == [("started", "bench"),
                               ("started", "compiling segment 0 with inductor"),
                               ("finished", "compiling segment 0 with inductor"),
                               ("updated", "bench: timing"), ("finished", "bench: timing")]
    assert recorder.fractions == [1.0]
    assert recorder.notices == [(Topic.CACHED_PACKAGES, "using 1 cached inductor package")]
    assert progress.current() is None
    with progress.listening(recorder), progress.listening(None), progress.step("quiet"):
        pass   # listening(None) silences a block
    assert ("started", "quiet") not in recorder.events


def test_a_step_that_raises_still_finishes():
    recorder = Recorder()
    with progress.listening(recorder), pytest.raises(RuntimeError), progress.step("fails"):
        raise RuntimeError("compile failed")
    assert recorder.events == [("started", "fails"), ("finished", "fails")]


def test_another_thread_does_not_hear_this_contexts_listener():
    recorder = Recorder()

    def elsewhere() -> None:
        with progress.step("on another thread"):
            pass
    with progress.listening(recorder):
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert recorder.events == []


def test_a_fresh_cache_announces_the_native_build(tmp_path, monkeypatch):
    """The inductor-less path: the native kernels' C build, with the compiler stood in for
    (it writes a file that is not a library, so the build is announced, then not loaded)."""
    def compile_and_link(exe: str, flags: tuple[str, ...], work: Path, out: Path) -> str:
        out.write_bytes(b"not a library")
        return ""
    monkeypatch.setattr(native_build, "_compile_and_link", compile_and_link)
    recorder = Recorder()
    with progress.listening(recorder):
        library, why = NativeLibrary.find({"SEGFLOW_CACHE_DIR": str(tmp_path),
                                           "PATH": "/usr/bin:/bin"})
    if "C compiler" in why:
        pytest.skip(f"native kernels {why}")
    assert library is None and "could not be loaded" in why
    texts = [text for event, text in recorder.events]
    assert len(texts) == 2 and texts[0].startswith("building native kernels (")
    assert recorder.events[-1][0] == "finished"


def test_the_display_draws_nothing_off_a_terminal_and_writes_notices_once():
    stream = io.StringIO()
    display = TerminalDisplay(stream, hints={Topic.CACHED_PACKAGES: "a flag changes it"})
    with progress.listening(display):
        with progress.step("compiling", 0.0) as step:
            step.update(0.5)
        progress.notice(Topic.CACHED_PACKAGES, "using 1 package")
        progress.notice(Topic.CACHED_PACKAGES, "using 2 packages")   # the last one counts
    assert stream.getvalue() == ""
    display.close()
    display.close()
    assert stream.getvalue() == "note: using 2 packages; a flag changes it\n"


def test_the_display_draws_a_step_on_a_terminal_and_erases_it():
    stream = FakeTerminal()
    with shown(stream=stream) as display:
        assert isinstance(display, TerminalDisplay) and display.draws_steps
        with progress.step("compiling segment 0 with inductor"):
            pass
        assert display._bar is None   # nothing runs: nothing drawn
    assert "compiling segment 0 with inductor" in stream.getvalue()
    with shown(stream=stream, steps=False) as quiet:   # --no-progress
        assert isinstance(quiet, TerminalDisplay) and not quiet.draws_steps


def test_shown_reuses_the_listener_already_installed():
    recorder = Recorder()
    with progress.listening(recorder), shown(stream=FakeTerminal()) as listener:
        assert listener is recorder


def _announce_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the commands run a long step first (a stand-in for a build)."""
    def announced(command):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            with progress.step("building native kernels"):
                return command(*args)
        return run
    monkeypatch.setattr(cli, "_cmd_cache", announced(cli._cmd_cache))
    monkeypatch.setattr(cli, "open_model", announced(cli.open_model))


def test_the_command_line_shows_nothing_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    _announce_a_step(monkeypatch)
    assert cli.main(["cache"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "native kernels:" in captured.out


def test_the_command_line_draws_steps_on_a_terminal_unless_told_not_to(monkeypatch, capsys):
    _announce_a_step(monkeypatch)
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert cli.main(["cache"]) == 0
    assert "building native kernels" in terminal.getvalue()
    terminal.seek(0)
    terminal.truncate()
    monkeypatch.setenv("SEGFLOW_NATIVE", "0")   # no real build: the stand-in step is enough
    assert cli.main(["run", "builtin:mlp_chain", "--compile", "codegen", "--no-progress"]) == 0
    assert terminal.getvalue() == ""
    assert "output y: float32[1, 64]" in capsys.readouterr().out
