"""The disk cache's trust rules (cache_store.py), through the native library and the
inductor packages that use them: planted, mis-hashed, truncated and linked files are
refused before any of their code runs, clearing never follows a link, and processes
starting together build once.

The real native library is built once for the module; the tests that need a rebuild
get a copy of it from a stand-in for the compiler step that also counts its calls.
The process runs as root, so files chowned to uid 65534 stand for another user's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import segflow
from segflow import cli, models
from segflow.cache_store import MISSING, STALE_BUILD_S, ArtifactStore
from segflow.kernels.native import build as native_library
from segflow.kernels.native.build import NativeLibrary
from segflow.runtime import aot_inductor

OTHER_UID = 65534   # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chowns files to another uid")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("SEGFLOW_TEST_MARKER");
    FILE *f = marker ? fopen(marker, "w") : NULL;
    if (f) { fputs("planted code ran", f); fclose(f); }
}
int segflow_native_abi(void) { return %d; }
"""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(path: Path, digest: str) -> None:
    """Write the digest file segflow would keep beside ``path``."""
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")


def _env(cache: Path) -> dict[str, str]:
    env = {"SEGFLOW_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    if os.environ.get("CC"):
        env["CC"] = os.environ["CC"]
    return env


@pytest.fixture(scope="module")
def good_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real native library, built once for the module (its name is the cache name
    every test here looks for)."""
    cache = tmp_path_factory.mktemp("built")
    library, why = NativeLibrary.find(_env(cache))
    if library is None:
        pytest.skip(f"native kernels {why}")
    return library.path


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory: pytest.TempPathFactory, good_library: Path) -> Path:
    """A library that speaks segflow's ABI and, when loaded, writes the file named by
    $SEGFLOW_TEST_MARKER from its constructor."""
    work = tmp_path_factory.mktemp("planted")
    source = work / "planted.c"
    source.write_text(PLANTED_C % native_library.ABI)
    out = work / "planted.so"
    subprocess.run([os.environ.get("CC") or "cc", "-shared", "-fPIC", "-o", str(out),
                    str(source)], check=True, capture_output=True)
    return out


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "marker"
    monkeypatch.setenv("SEGFLOW_TEST_MARKER", str(path))
    return path


@pytest.fixture
def builds(good_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Stand in for the compiler: each build copies the module's library; the list
    holds where each build wrote."""
    made: list[Path] = []

    def build(exe: str, out: Path) -> str:
        made.append(out)
        shutil.copyfile(good_library, out)
        return ""
    monkeypatch.setattr(native_library, "_build", build)
    return made


def _cache_with(tmp_path: Path, name: str, planted: Path) -> Path:
    """A cache whose native store holds ``planted`` at ``name``; returns the file."""
    native = tmp_path / "cache" / "native"
    native.mkdir(parents=True, mode=0o700)
    target = native / name
    shutil.copyfile(planted, target)
    return target


# -- the planted-library check is real ----------------------------------------------------
def test_the_planted_library_runs_its_constructor_when_loaded(planted_library, marker,
                                                              tmp_path):
    import ctypes

    copy = tmp_path / "loaded-on-purpose.so"
    shutil.copyfile(planted_library, copy)
    ctypes.CDLL(str(copy))
    assert marker.read_text() == "planted code ran"


# -- refused before dlopen ----------------------------------------------------------------
@needs_root
def test_a_library_owned_by_another_user_is_refused_and_never_runs(
        good_library, planted_library, marker, builds, tmp_path):
    planted = _cache_with(tmp_path, good_library.name, planted_library)
    _record(planted, _sha256(planted))   # even its digest is right: the owner is not
    os.chown(planted, OTHER_UID, OTHER_UID)
    library, why = NativeLibrary.find(_env(tmp_path / "cache"))
    assert not marker.exists()
    assert library is not None and library.path == planted and len(builds) == 1
    assert library.describe().endswith(
        "(the file there before was not loaded: owned by uid 65534)")
    assert planted.stat().st_uid == os.geteuid()   # a fresh file replaced it
    assert _sha256(planted) == _sha256(good_library)


def test_a_library_whose_hash_is_not_the_recorded_one_is_refused(
        good_library, planted_library, marker, builds, tmp_path):
    planted = _cache_with(tmp_path, good_library.name, planted_library)
    _record(planted, _sha256(good_library))  # what segflow built, then replaced
    library, _ = NativeLibrary.find(_env(tmp_path / "cache"))
    assert not marker.exists() and len(builds) == 1
    assert library is not None and "not loaded: hash mismatch" in library.describe()
    assert _sha256(planted) == _sha256(good_library)
    again, _ = NativeLibrary.find(_env(tmp_path / "cache"))  # now it is trusted: loaded
    assert again is not None and again.describe() == f"loaded from {planted}"
    assert len(builds) == 1


def test_a_library_without_a_recorded_digest_is_rebuilt(good_library, planted_library,
                                                        marker, builds, tmp_path):
    _cache_with(tmp_path, good_library.name, planted_library)
    library, _ = NativeLibrary.find(_env(tmp_path / "cache"))
    assert not marker.exists() and len(builds) == 1
    assert library is not None and "not loaded: no recorded digest" in library.describe()


def test_a_link_at_the_cache_name_is_refused_not_followed(good_library, planted_library,
                                                          marker, builds, tmp_path):
    native = tmp_path / "cache" / "native"
    native.mkdir(parents=True, mode=0o700)
    link = native / good_library.name
    link.symlink_to(planted_library)
    _record(link, _sha256(planted_library))
    library, _ = NativeLibrary.find(_env(tmp_path / "cache"))
    assert not marker.exists() and len(builds) == 1
    assert library is not None and "not loaded: a symbolic link" in library.describe()
    assert not link.is_symlink() and planted_library.exists()   # replaced, target intact


@pytest.mark.parametrize("mode, phrase", [(0o770, "group-writable"),
                                          (0o777, "world-writable")])
def test_a_library_in_a_writable_directory_is_refused_and_built_privately(
        good_library, planted_library, marker, builds, tmp_path, mode, phrase):
    planted = _cache_with(tmp_path, good_library.name, planted_library)
    _record(planted, _sha256(planted))   # a file and digest that would pass on their own
    native = planted.parent
    native.chmod(mode)
    library, _ = NativeLibrary.find(_env(tmp_path / "cache"))
    assert not marker.exists() and len(builds) == 1
    assert library is not None and library.path.parent != native
    assert library.describe().endswith(
        f"(for this process only; not loaded from the cache: directory {native} is {phrase})")
    # Left as they were: segflow neither trusts nor "fixes" a directory.
    assert (native.stat().st_mode & 0o777) == mode and _sha256(planted) == \
        _sha256(planted_library)


@needs_root
def test_a_cache_root_owned_by_someone_else_is_not_trusted_nor_changed(
        good_library, builds, tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER_UID, OTHER_UID)
    library, _ = NativeLibrary.find(_env(root))
    assert library is not None and len(builds) == 1
    assert f"not loaded from the cache: directory {root} is owned by uid 65534" in \
        library.describe()
    assert list(root.iterdir()) == [] and root.stat().st_uid == OTHER_UID
    assert (root.stat().st_mode & 0o777) == 0o755


def test_a_truncated_library_is_rebuilt_not_left_off(good_library, builds, tmp_path):
    # What segflow built and recorded, then cut short (a full disk, a killed copy). A new
    # file, not truncated in place: this process has mapped the library at that inode.
    library = _cache_with(tmp_path, good_library.name, good_library)
    _record(library, _sha256(good_library))
    half = library.with_name("half")
    half.write_bytes(good_library.read_bytes()[: good_library.stat().st_size // 2])
    os.replace(half, library)
    rebuilt, _ = NativeLibrary.find(_env(tmp_path / "cache"))
    assert rebuilt is not None and rebuilt.path == library and len(builds) == 1
    assert "not loaded: hash mismatch" in rebuilt.describe()
    assert _sha256(library) == _sha256(good_library)


def test_the_cache_directories_are_created_private(good_library, builds, tmp_path):
    cache = tmp_path / "new" / "cache"
    library, _ = NativeLibrary.find(_env(cache))
    assert library is not None and library.cache_note == ""
    assert (cache.stat().st_mode & 0o777) == 0o700
    assert ((cache / "native").stat().st_mode & 0o777) == 0o700
    assert (library.path.stat().st_mode & 0o022) == 0


def test_explain_says_why_the_cached_library_was_not_loaded(
        good_library, planted_library, builds, tmp_path, monkeypatch):
    planted = _cache_with(tmp_path, good_library.name, planted_library)
    _record(planted, "0" * 64)
    found = NativeLibrary.find(_env(tmp_path / "cache"))
    assert found[0] is not None
    monkeypatch.setattr(NativeLibrary, "probe", staticmethod(_cached_probe(found)))
    assert native_library.describe_cache() == [
        f"native kernels: built in {found[0].build_s:.2f} s into {planted} "
        "(the file there before was not loaded: hash mismatch)"]


def _cached_probe(result: tuple[NativeLibrary | None, str]) -> Callable[[], object]:
    """A stand-in for ``NativeLibrary.probe`` that has been called once."""
    import functools

    @functools.cache
    def probe() -> tuple[NativeLibrary | None, str]:
        return result
    probe()
    return probe


# -- processes starting together ----------------------------------------------------------
_WORKER = r"""
import json, os, shutil, sys, time
from segflow.kernels.native import build as nl

good, counter, go = sys.argv[1:4]

def build(exe, out):
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)          # long enough that every process asks while it runs
    shutil.copyfile(good, out)
    return ""

nl._build = build
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.002)
library, why = nl.NativeLibrary.find()
print(json.dumps({"path": str(library.path) if library else None, "why": why,
                  "built": bool(library and library.build_s)}), flush=True)
"""


def test_four_processes_starting_together_build_once(good_library, tmp_path):
    cache, counter, go = tmp_path / "cache", tmp_path / "builds", tmp_path / "go"
    env = {**os.environ, **_env(cache),
           "PYTHONPATH": os.pathsep.join([str(Path(segflow.__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(good_library), str(counter),
                               str(go)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    try:
        for proc in procs:   # each imported segflow and waits for the others
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        go.touch()
        results = [json.loads(proc.communicate(timeout=120)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert len(counter.read_text().split()) == 1   # one build ...
    assert sorted(r["built"] for r in results) == [False, False, False, True]
    assert {r["path"] for r in results} == {str(cache / "native" / good_library.name)}


# -- the store itself ---------------------------------------------------------------------
def _write(out: Path, data: bytes = b"artifact") -> str:
    out.write_bytes(data)
    return ""


def test_the_store_records_a_digest_and_refuses_everything_else(tmp_path):
    env = {"SEGFLOW_CACHE_DIR": str(tmp_path / "c")}
    store = ArtifactStore.open("things", env)
    assert store.check("a.bin") == MISSING
    got = store.obtain("a.bin", _write, wait_s=1)
    assert got.built and got.path == tmp_path / "c" / "things" / "a.bin" and got.refused == ""
    digest = (tmp_path / "c" / "things" / "a.bin.sha256").read_text()
    assert digest == f"{hashlib.sha256(b'artifact').hexdigest()}  a.bin\n"
    assert store.check("a.bin") == ""
    assert store.obtain("a.bin", _write, wait_s=1) == type(got)(got.path, built=False)
    got.path.write_bytes(b"artifacT")
    assert store.check("a.bin") == "hash mismatch"
    (tmp_path / "c" / "things" / "a.bin.sha256").write_text("not hex\n")
    assert store.check("a.bin") == "its recorded digest is malformed"
    got.path.unlink()
    os.mkfifo(got.path)   # opened without blocking, refused
    assert store.check("a.bin") == "not a regular file"


def test_a_failed_build_leaves_nothing_and_says_why(tmp_path):
    store = ArtifactStore.open("things", {"SEGFLOW_CACHE_DIR": str(tmp_path)})
    got = store.obtain("a.bin", lambda out: "the compiler said no", wait_s=1)
    assert got.path is None and got.failure == "the compiler said no"
    assert sorted(p.name for p in (tmp_path / "things").iterdir()) == ["a.bin.lock"]


def test_a_process_that_waits_too_long_for_the_lock_builds_privately(tmp_path):
    env = {"SEGFLOW_CACHE_DIR": str(tmp_path)}
    holder = ArtifactStore.open("things", env)
    started, release = threading.Event(), threading.Event()

    def slow_build(out: Path) -> str:
        started.set()
        release.wait(10)
        return _write(out)
    thread = threading.Thread(target=holder.obtain, args=("a.bin", slow_build, 10))
    thread.start()
    try:
        assert started.wait(10)
        waiter = ArtifactStore.open("things", env)
        got = waiter.obtain("a.bin", _write, wait_s=0.2)
    finally:
        release.set()
        thread.join()
    assert got.built and got.path is not None and got.path.parent != tmp_path / "things"
    assert waiter.distrust == "another process held a.bin's lock over 0 s"
    assert holder.check("a.bin") == ""


def test_a_read_only_cache_builds_for_this_process_only(tmp_path, monkeypatch):
    env = {"SEGFLOW_CACHE_DIR": str(tmp_path)}
    store = ArtifactStore.open("things", env)

    def read_only(self, name):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(ArtifactStore, "_open_lock", read_only)
    got = store.obtain("a.bin", _write, wait_s=1)
    assert got.built and got.path is not None and got.path.parent != tmp_path / "things"
    assert store.distrust == (f"directory {tmp_path / 'things'} is not writable "
                              "(Read-only file system)")


# -- clearing and eviction ----------------------------------------------------------------
def test_clear_never_follows_a_link_and_removes_stale_builds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path / "cache"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("precious.pt2", "precious.so", "precious.pt2.sha256"):
        (elsewhere / name).write_bytes(b"keep me")
    (elsewhere / ".build-keep").mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "native").symlink_to(elsewhere, target_is_directory=True)
    aoti = cache / "aoti"
    aoti.mkdir()
    (aoti / "ours.pt2").write_bytes(b"x" * 1024)
    _record(aoti / "ours.pt2", "0" * 64)
    (aoti / "linked.pt2").symlink_to(elsewhere / "precious.pt2")
    (aoti / ".build-linked").symlink_to(elsewhere / ".build-keep", target_is_directory=True)
    (aoti / ".build-killed").mkdir()
    (aoti / ".build-killed" / "half.pt2").write_bytes(b"half")
    old = time.time() - 2 * STALE_BUILD_S
    os.utime(aoti / ".build-killed", (old, old))
    (aoti / ".build-live").mkdir()   # another process's build in progress
    assert cli.main(["cache", "--clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 packages (0.0 MiB)" in out
    assert "and 1 partial builds left by killed processes" in out
    assert f"left alone: {cache / 'native'} (a symbolic link, not followed)" in out
    assert f"left alone: {aoti / 'linked.pt2'} (a symbolic link, not followed)" in out
    assert sorted(p.name for p in aoti.iterdir()) == [".build-linked", ".build-live",
                                                       "linked.pt2"]
    assert (cache / "native").is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == [
        ".build-keep", "precious.pt2", "precious.pt2.sha256", "precious.so"]
    assert all((elsewhere / n).read_bytes() == b"keep me"
               for n in ("precious.pt2", "precious.so", "precious.pt2.sha256"))


def test_clear_leaves_a_linked_cache_root_alone(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "aoti").mkdir(parents=True)
    (elsewhere / "aoti" / "p.pt2").write_bytes(b"keep me")
    (tmp_path / "cache").symlink_to(elsewhere, target_is_directory=True)
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path / "cache"))
    cleared = aot_inductor.clear_packages()
    assert cleared.files == 0 and cleared.skipped == (
        f"{tmp_path / 'cache'} (a symbolic link, not followed)",)
    assert (elsewhere / "aoti" / "p.pt2").read_bytes() == b"keep me"


def test_eviction_skips_links_and_removes_digests(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path / "cache"))
    outside = tmp_path / "outside.pt2"
    outside.write_bytes(b"x" * (1 << 20))
    store = ArtifactStore.open("aoti")
    got = store.obtain("a.pt2", lambda out: _write(out, b"x" * (1 << 20)), wait_s=1)
    (store.shared / "old.pt2").symlink_to(outside)
    os.utime(store.shared / "old.pt2", (1e9, 1e9), follow_symlinks=False)
    cleared = aot_inductor.evict_packages(0)
    assert (cleared.files, cleared.bytes) == (1, 1 << 20)
    assert got.path is not None and not got.path.exists()
    assert sorted(p.name for p in store.shared.iterdir()) == ["old.pt2"]  # digest, lock gone
    assert outside.stat().st_size == 1 << 20


def test_cache_command_says_when_the_cache_is_not_trusted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path))
    (tmp_path / "native").mkdir()
    tmp_path.chmod(0o777)
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert (f"not trusted: directory {tmp_path} is world-writable; each process builds its "
            "own native artifacts until it is fixed") in out
    tmp_path.chmod(0o700)


# -- inductor packages --------------------------------------------------------------------
def _mlp_session(monkeypatch: pytest.MonkeyPatch, compile: str) -> segflow.InferenceSession:
    """A 2-layer MLP under ``compile`` whose segment's package is named ``k.pt2``, run
    once and checked against onnxruntime."""
    monkeypatch.setattr(aot_inductor, "package_key", lambda *args, **kwargs: "k")
    model = models.build("mlp_chain", layers=2, width=16)
    feeds = models.example_inputs("mlp_chain", layers=2, width=16)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = segflow.InferenceSession(model, engine="inline", compile=compile)
    np.testing.assert_allclose(sess.run(None, feeds)[0], want[0], atol=1e-4, rtol=1e-3)
    return sess


def _plant_package(cache: Path, how: str) -> Path:
    aoti = cache / "aoti"
    aoti.mkdir(parents=True, exist_ok=True)
    package = aoti / "k.pt2"
    package.write_bytes(b"PK planted package")
    if how == "owned by uid 65534":
        _record(package, _sha256(package))
        os.chown(package, OTHER_UID, OTHER_UID)
    elif how == "hash mismatch":
        _record(package, "0" * 64)
    elif how == "a symbolic link":
        package.rename(cache / "elsewhere.pt2")
        package.symlink_to(cache / "elsewhere.pt2")
        _record(package, _sha256(cache / "elsewhere.pt2"))
    return package


@pytest.mark.parametrize("how", [
    pytest.param("owned by uid 65534", marks=needs_root),
    "hash mismatch", "no recorded digest", "a symbolic link"])
def test_a_planted_package_is_refused_before_the_loader_sees_it(tmp_path, monkeypatch, how):
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path))
    _plant_package(tmp_path, how)
    loads: list[Path] = []
    monkeypatch.setattr(aot_inductor, "_load", lambda path: loads.append(path))
    sess = _mlp_session(monkeypatch, "auto")   # a cached package is looked for, never compiled
    report = sess.compile_report
    assert loads == [] and report.cache_hits == 0 and report.fallbacks == []
    assert report.cache_notes == [f"k.pt2: not loaded: {how}"]
    assert f"(disk cache: k.pt2: not loaded: {how})" in report.describe()
    assert f"disk cache: k.pt2: not loaded: {how}" in sess.explain()


def test_a_package_that_fails_to_load_is_recorded_not_swallowed(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path))
    store = ArtifactStore.open("aoti")
    store.obtain("k.pt2", lambda out: _write(out, b"not a zip archive"), wait_s=1)

    def load(path: Path) -> None:
        raise RuntimeError(f"PytorchStreamReader failed reading zip archive {path.name}\n...")
    monkeypatch.setattr(aot_inductor, "_load", load)
    report = _mlp_session(monkeypatch, "auto").compile_report
    assert report.cache_notes == ["k.pt2: not loaded: RuntimeError: PytorchStreamReader "
                                  "failed reading zip archive k.pt2"]


def test_a_refused_package_is_compiled_into_a_fresh_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path))
    package = _plant_package(tmp_path, "hash mismatch")
    compiled: list[Path] = []

    def compile_package(self, inputs, options, out: Path) -> str:
        compiled.append(out)
        return _write(out, b"compiled")
    loaded: list[bytes] = []

    def load(path: Path) -> None:
        loaded.append(path.read_bytes())
        raise RuntimeError("a stand-in loader")
    monkeypatch.setattr(aot_inductor.AotInductorSegment, "_compile_package", compile_package)
    monkeypatch.setattr(aot_inductor, "_load", load)
    report = _mlp_session(monkeypatch, "inductor").compile_report
    assert len(compiled) == 1 and compiled[0].parent.name.startswith(".build-")
    assert loaded == [b"compiled"]   # never the planted bytes
    assert report.cache_notes == ["k.pt2: not loaded: hash mismatch"]
    assert report.fallbacks == ["RuntimeError: a stand-in loader"]
    assert ArtifactStore.open("aoti").check("k.pt2") == ""
    assert package.read_bytes() == b"compiled"
