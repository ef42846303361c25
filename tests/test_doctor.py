"""Tests for ``segflow doctor`` (doctor.py): what it reports, that a broken piece is a
line rather than an exception, and that it works without a C compiler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import segflow
from segflow import cli, doctor

PREFIXES = ("segflow 0.1.0 at ", "python ", "torch ", "onnx ", "numpy ", "onnxruntime ",
            "openvino", "C compiler: ", "cpu: ", "kernel choices: ", "native kernels: ",
            "libdnnl: ", "cache: ", "  inductor packages: ", "  native builds: ")


def test_every_fact_has_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path / "cache"))
    lines = doctor.report()
    assert [next(p for p in PREFIXES if line.startswith(p)) for line in lines] == list(PREFIXES)
    text = "\n".join(lines)
    assert f"segflow 0.1.0 at {Path(segflow.__file__).resolve().parent} (" in text
    assert f"torch {torch.__version__} (" in text
    assert f"{torch.get_num_threads()} threads" in text
    assert f"cache: {tmp_path / 'cache'} (from $SEGFLOW_CACHE_DIR)" in text
    assert "  inductor packages: 0, 0.0 MiB; trusted" in lines
    assert all(len(line) < 240 for line in lines)


def test_an_untrusted_cache_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(cache))
    (line,) = [x for x in doctor.report() if x.startswith("  inductor packages: ")]
    assert "NOT TRUSTED: " in line


def test_a_broken_piece_is_a_line_not_an_error(monkeypatch: pytest.MonkeyPatch):
    def broken() -> list[str]:
        raise OSError("no such thing\nsecond line")

    monkeypatch.setattr(doctor, "SECTIONS", (("torch", broken), *doctor.SECTIONS[3:4]))
    monkeypatch.setattr(doctor, "OPTIONAL_MODULES", (("no_such_peer_module", "a test"),))
    assert doctor.report() == ["torch: could not be read (OSError: no such thing)",
                               f"onnx {doctor._version('onnx')}",
                               f"numpy {doctor._version('numpy')}",
                               "no_such_peer_module: not installed (optional: a test)"]


def test_the_command_prints_the_report(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("segflow 0.1.0 at ") and "\nnative kernels: " in out


def test_without_a_compiler_it_says_why_and_nothing_else(tmp_path: Path):
    env = {**os.environ, "CC": "false", "SEGFLOW_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "segflow", "doctor"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    lines = done.stdout.splitlines()
    assert any(line.startswith("C compiler: ") and "false" in line for line in lines)
    (native,) = [line for line in lines if line.startswith("native kernels: ")]
    assert native.startswith("native kernels: could not be built: ")
    assert "exited with 1" in native
