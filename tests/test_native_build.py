"""Tests for running without the native library (kernels/native/build.py): a process with
no working C compiler runs every model, tells the user once why and what it costs, and
its results match the native run's."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import segflow
from segflow import models
from segflow.errors import NativeKernelsUnavailable
from segflow.kernels.native import build
from segflow.kernels.native.build import FALLBACKS, NativeLibrary

ATOL, RTOL = 1e-4, 1e-3
# The models whose kernels use the native library: dense chains; attention and add +
# LayerNorm; the stem, Winograd and replays of a convolutional network.
MODELS = ("mlp_chain", "bert_tiny", "resnet18")

# Opens two sessions per model from different lines: the notice must still come once.
_SCRIPT = """
import sys
import numpy as np
import segflow
from segflow import models
outputs = {}
for name in sys.argv[2:]:
    feeds = models.example_inputs(name)
    first = segflow.InferenceSession(models.build(name))
    second = segflow.InferenceSession(models.build(name))
    for i, out in enumerate(second.run(None, feeds)):
        outputs[f"{name}/{i}"] = out
    print(f"{name}: native={second.target.native is not None}")
    print(second.explain())
np.savez(sys.argv[1], **outputs)
"""


def _run_without_native(tmp_path: Path, env_change: dict[str, str | None]
                        ) -> tuple[subprocess.CompletedProcess[str], dict[str, np.ndarray]]:
    env = {**os.environ, "SEGFLOW_CACHE_DIR": str(tmp_path / "cache"),
           # every warning at every place: the once-ness asserted is segflow's own
           "PYTHONWARNINGS": "always"}
    for name, value in env_change.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    out = tmp_path / "outputs.npz"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(out), *MODELS], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with np.load(out) as saved:
        return done, dict(saved)


def _here_outputs() -> dict[str, np.ndarray]:
    """The same models in this process (native kernels where they load here)."""
    outputs = {}
    for name in MODELS:
        sess = segflow.InferenceSession(models.build(name))
        for i, out in enumerate(sess.run(None, models.example_inputs(name))):
            outputs[f"{name}/{i}"] = out
    return outputs


@pytest.mark.parametrize("case", ["cc-false", "no-compiler-on-path"])
def test_without_a_compiler_models_run_and_say_why_once(tmp_path: Path, case: str):
    if case == "cc-false":
        change: dict[str, str | None] = {"CC": "false"}
        why = "could not be built: "
    else:
        empty = tmp_path / "bin"
        empty.mkdir()
        change = {"CC": None, "PATH": str(empty)}
        why = "need a C compiler and found none ('cc' is not on PATH; set CC)"
    done, outputs = _run_without_native(tmp_path, change)
    expected = _here_outputs()
    assert sorted(outputs) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(outputs[key], value, atol=ATOL, rtol=RTOL, err_msg=key)

    notices = [line for line in done.stderr.splitlines() if "NativeKernelsUnavailable" in line]
    assert len(notices) == 1, done.stderr
    assert f"segflow's native kernels {why}" in notices[0]
    assert "ResNet-50" in notices[0] and "SEGFLOW_NATIVE=0" in notices[0]
    # It names the caller's line (the script's first session), not segflow's.
    assert notices[0].startswith("<string>:9: ")
    for name in MODELS:
        assert f"{name}: native=False" in done.stdout
    explained = [line for line in done.stdout.splitlines()
                 if line.startswith("native kernels ")]
    assert len(explained) == len(MODELS)
    assert all(why in line and "dense chains" in line for line in explained)


def test_the_notice_names_why_what_falls_back_and_the_caller(monkeypatch):
    why = "could not be built: cc exited with 1 and said nothing"
    monkeypatch.setattr(NativeLibrary, "find", staticmethod(lambda env=None: (None, why)))
    with pytest.warns(NativeKernelsUnavailable) as record:
        assert build.NativeLibrary.probe.__wrapped__() == (None, why)
    (notice,) = record
    text = str(notice.message)
    assert text.startswith(f"segflow's native kernels {why}. Dense chains, ")
    assert all(kernel.lower() in text.lower() for kernel in FALLBACKS)
    assert notice.filename == __file__
    assert issubclass(NativeKernelsUnavailable, segflow.SegflowWarning)


def test_switched_off_on_purpose_there_is_no_notice(monkeypatch):
    monkeypatch.setenv("SEGFLOW_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", NativeKernelsUnavailable)
        assert build.NativeLibrary.probe.__wrapped__() == (None, "are off (SEGFLOW_NATIVE=0)")
        assert NativeLibrary.for_session() == (None, "are off (SEGFLOW_NATIVE=0)")
