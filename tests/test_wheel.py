"""The wheel (pyproject.toml's packaging): built from a copy of this checkout, installed
into a fresh virtual environment, it carries every file segflow reads at run time and its
native kernels build and load there as they do here.

The new environment gets this one's dependencies without this one's segflow: a ``.pth``
file lists this environment's site-packages. Paths a ``.pth`` lists are appended to
``sys.path`` after the new environment's own site-packages (which holds the wheel's
segflow), and ``.pth`` files inside a listed directory are not processed, so an editable
install of segflow there stays inert (checked below).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import wheel_probe

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["mlp_chain", "bert_tiny", "resnet18"]   # dense chains; attention; stem, replays

pytestmark = pytest.mark.slow


def _source_files() -> list[str]:
    """The checkout's files as git sees them (tracked, and untracked but not ignored)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"],
                          capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if (ROOT / line).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a copy of the checkout's packaging files (never a stale ``build/``)."""
    pytest.importorskip("setuptools", minversion="77")
    copy = tmp_path_factory.mktemp("checkout")
    package = [f for f in _source_files() if f.startswith("src/")
               or f in ("pyproject.toml", "README.md")]
    for name in package:
        (copy / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / "tree" / name)
    out = copy / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(copy / "tree")],
                   check=True, capture_output=True, text=True, timeout=300)
    (built,) = out.glob("segflow-*.whl")
    return built


def test_the_wheel_holds_every_file_of_the_package(wheel: Path):
    shipped = {name for name in zipfile.ZipFile(wheel).namelist()
               if name.startswith("segflow/")}
    sources = {name.removeprefix("src/") for name in _source_files()
               if name.startswith("src/segflow/")}
    assert sources - shipped == set(), "in the checkout, not in the wheel"
    assert shipped - sources == set(), "in the wheel, not in the checkout"
    # What is read at run time rather than imported, named so that a narrowed
    # package-data pattern cannot pass unseen.
    for needed in ("segflow/py.typed", "segflow/bench/baseline_counters.json",
                   "segflow/kernels/native/dense_chain.c", "segflow/kernels/native/panel.h"):
        assert needed in shipped


def test_the_installed_wheel_builds_and_loads_the_same_kernels(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    # Before the .pth below, and without PYTHONPATH: pip would otherwise see this
    # environment's segflow of the same version as installed already, and install nothing.
    env = {**os.environ, "SEGFLOW_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)],
                   env=env, check=True, capture_output=True, text=True, timeout=300)
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "_parent_environment.pth").write_text("".join(f"{p}\n" for p in parents))
    # libdnnl's wheel puts the library in the environment's lib/, where segflow looks.
    for lib in Path(sys.prefix, "lib").glob("libdnnl.so*"):
        (venv / "lib" / lib.name).symlink_to(lib)

    done = subprocess.run([str(python), str(ROOT / "tests" / "wheel_probe.py"), *MODELS],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    there = json.loads(done.stdout)
    assert Path(there["segflow"]).is_relative_to(venv)
    # No editable path of this environment's leaked in through its .pth files.
    editable = {line.strip() for parent in parents for pth in Path(parent).glob("*.pth")
                for line in pth.read_text().splitlines()
                if line.strip() and not line.startswith(("#", "import"))}
    assert editable.isdisjoint(there["path"])
    assert there["facts"] == wheel_probe.kernel_facts(MODELS)

    version = subprocess.run([str(venv / "bin" / "segflow"), "--version"], env=env,
                             capture_output=True, text=True, check=True).stdout
    assert version.strip() == "segflow 0.1.0"
