"""What a cached artifact's description says (cache_descriptions.py), how ``segflow cache
--list`` shows it, and how ``auto``'s use of a cached package is recorded and announced.

Packages here are written by the store with stand-in bytes (an inductor compile takes tens
of seconds); the one test that runs a "cached package" stands a loader in for inductor's,
running the model through onnxruntime.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import onnxruntime as ort
import pytest
import torch

import segflow
from segflow import cli, models, progress
from segflow.cache_descriptions import (
    InputSignature,
    ModelLabel,
    NativeBuildDescription,
    PackageDescription,
    age,
    date,
)
from segflow.cache_store import DESCRIPTION_MAX_BYTES, ArtifactStore
from segflow.progress import Topic
from segflow.runtime import aot_inductor
from segflow.runtime.program import CachedPackage, CompileReport

OTHER_UID = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chowns files to another uid")

DESCRIBED = PackageDescription(ModelLabel("mlp_chain", "", "4bbecf50e599"), 3, "fc0", "fc9", 10,
                               (InputSignature("float32", (1, 64)),), "cpu", "2.13.0", "0.1.0")


def _write(out: Path, data: bytes = b"package bytes") -> str:
    out.write_bytes(data)
    return ""


def _package(name: str, description: PackageDescription | None = DESCRIBED,
             data: bytes = b"package bytes") -> Path:
    store = ArtifactStore.open("aoti")
    got = store.obtain(name, lambda out: _write(out, data), wait_s=1,
                       description=None if description is None else description.to_json())
    assert got.built and got.path is not None
    return got.path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path))
    return tmp_path


# -- the descriptions -------------------------------------------------------------------
def test_a_description_round_trips_with_the_time_the_store_installed_it(cache):
    before = time.time()
    path = _package("a.pt2")
    data = ArtifactStore.inspect("aoti").description(path.name)
    parsed = PackageDescription.parse(data)
    assert parsed is not None and before <= parsed.created <= time.time()
    assert parsed == PackageDescription(**{**{f: getattr(DESCRIBED, f)
                                              for f in DESCRIBED.__slots__},
                                           "created": parsed.created})
    assert parsed.describe() == ("mlp_chain (onnx 4bbecf50e599)  segment 3: fc0 .. fc9 "
                                 "(10 nodes)  inputs float32[1, 64]  cpu, torch 2.13.0")
    assert oct(path.with_name("a.pt2.json").stat().st_mode & 0o777) == "0o644"


@pytest.mark.parametrize("damage", [
    lambda d: d.update(format=2),                         # another format
    lambda d: d.update(kind="native"),
    lambda d: d["segment"].update(index=True),            # a bool is not an index
    lambda d: d["segment"].update(index=-1),
    lambda d: d["segment"].pop("first"),
    lambda d: d.update(inputs=[{"dtype": "float32", "shape": [1, "n"]}]),
    lambda d: d.update(inputs=[{"dtype": "float32", "shape": [1] * 17}]),
    lambda d: d.update(inputs="x"),
    lambda d: d["model"].update(name=7),
    lambda d: d.update(created="yesterday"),
    lambda d: d.update(created=float("inf")),
])
def test_a_malformed_description_is_none(damage):
    data = {**DESCRIBED.to_json(), "created": 1.0}
    damage(data)
    assert PackageDescription.parse(data) is None
    assert PackageDescription.parse([data]) is None and PackageDescription.parse(None) is None


def test_a_description_loses_control_characters_and_length():
    data = {**DESCRIBED.to_json(), "created": 1.0}
    data["model"]["name"] = "evil\x1b[2J\x07" + "x" * 500
    parsed = PackageDescription.parse(data)
    assert parsed is not None and parsed.model.name.startswith("evil?[2J?x")
    assert len(parsed.model.name) == 200 and "\x1b" not in parsed.describe()


def test_the_model_label_hashes_the_onnx_bytes(tmp_path):
    model = models.build("mlp_chain", layers=2, width=8)
    data = model.SerializeToString()
    path = tmp_path / "mlp.onnx"
    path.write_bytes(data)
    from_path, from_bytes = ModelLabel.of(str(path), "g"), ModelLabel.of(data, "g")
    from_proto = ModelLabel.of(model, "g")
    assert from_path.digest == from_bytes.digest == from_proto.digest and \
        len(from_path.digest) == 12
    assert from_path.describe() == f"g (mlp.onnx, onnx {from_path.digest})"
    assert from_proto.describe() == f"g (onnx {from_path.digest})"
    assert ModelLabel.of(tmp_path / "missing.onnx", "g").digest == ""


def test_native_descriptions_and_ages():
    built = NativeBuildDescription("cc 12.2.0", "-O3 -march=native", "AMD EPYC")
    parsed = NativeBuildDescription.parse({**built.to_json(), "created": 5.0})
    assert parsed == NativeBuildDescription("cc 12.2.0", "-O3 -march=native", "AMD EPYC", 5.0)
    assert NativeBuildDescription.parse({**built.to_json(), "cpu": None, "created": 5}) is None
    assert [age(s) for s in (5, 600, 7200, 5 * 86400)] == \
        ["just now", "10 min ago", "2 h ago", "5 days ago"]


# -- the store keeps descriptions under the cache's checks ---------------------------------
def _listed(capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert cli.main(["cache", "--list"]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]


def test_cache_list_names_packages_by_model_and_shape(cache, capsys):
    path = _package("described.pt2")
    old = _package("old.pt2", description=None)   # written before descriptions were
    os.utime(old, (time.time() - 7200,) * 2)
    lines = _listed(capsys)
    assert lines[0] == "  old.pt2  (no description)  0.0 MiB  used 2 h ago"
    assert lines[1] == (f"  {DESCRIBED.describe()}  0.0 MiB  built just now  "
                        f"[{path.name}]")


@pytest.mark.parametrize("spoil", [
    pytest.param("owned by another user", marks=needs_root),
    "group-writable", "a symbolic link", "not JSON", "too large", "not an object"])
def test_a_description_failing_the_checks_lists_as_none(cache, capsys, spoil):
    path = _package("p.pt2")
    sidecar = path.with_name("p.pt2.json")
    if spoil == "owned by another user":
        os.chown(sidecar, OTHER_UID, OTHER_UID)
    elif spoil == "group-writable":
        sidecar.chmod(0o664)
    elif spoil == "a symbolic link":
        elsewhere = cache / "elsewhere.json"
        elsewhere.write_text(sidecar.read_text())
        sidecar.unlink()
        sidecar.symlink_to(elsewhere)
    elif spoil == "not JSON":
        sidecar.write_text("{not json")
    elif spoil == "too large":
        sidecar.write_text(json.dumps({**DESCRIBED.to_json(), "created": 1.0,
                                       "pad": "x" * DESCRIPTION_MAX_BYTES}))
    else:
        sidecar.write_text("[1, 2, 3]")
    assert ArtifactStore.inspect("aoti").description("p.pt2") is None or \
        spoil == "not an object"
    assert "(no description)" in _listed(capsys)[0]


def test_a_description_in_an_untrusted_cache_is_not_read(cache, capsys):
    _package("p.pt2")
    cache.chmod(0o777)
    try:
        assert ArtifactStore.inspect("aoti").description("p.pt2") is None
    finally:
        cache.chmod(0o700)
    assert ArtifactStore.inspect("aoti").description("p.pt2") is not None


def test_clear_and_eviction_remove_descriptions_with_their_packages(cache, capsys):
    first, second = _package("first.pt2"), _package("second.pt2")
    os.utime(first, (1e9, 1e9))
    orphan = cache / "aoti" / "gone.pt2.json"   # its package removed by hand
    orphan.write_text("{}")
    assert aot_inductor.evict_packages(len(b"package bytes")).files == 1
    assert not first.with_name("first.pt2.json").exists()
    assert second.with_name("second.pt2.json").exists()
    assert cli.main(["cache", "--clear"]) == 0
    assert sorted(p.name for p in (cache / "aoti").iterdir()) == []


def test_native_builds_are_listed_with_compiler_and_cpu(cache, capsys):
    described = NativeBuildDescription("cc 12.2.0", "-O3 -march=native", "AMD EPYC")
    ArtifactStore.open("native").obtain("segflow-native-x.so", _write, wait_s=1,
                                        description=described.to_json())
    assert _listed(capsys) == ["  cc 12.2.0, -O3 -march=native  AMD EPYC  0.0 MiB  built just "
                               "now  [segflow-native-x.so]"]


# -- auto's use of a cached package ---------------------------------------------------------
def test_the_cached_packages_note_names_segments_and_dates():
    report = CompileReport("codegen")
    assert report.cached_packages_note() == "" and report.cached_package_lines() == []
    report.cached_packages += [CachedPackage(3, "b.pt2", 0.0), CachedPackage(0, "a.pt2", 1e9)]
    assert report.cached_packages_note() == (
        f"using 2 cached inductor packages for segments 0, 3 (built by compile=inductor on "
        f"{date(1e9)})")
    report.cached_packages[0] = CachedPackage(3, "b.pt2", 2e9)
    assert f"between {date(1e9)} and {date(2e9)}" in report.cached_packages_note()


def _stand_in_for_inductor(monkeypatch: pytest.MonkeyPatch, model) -> None:  # type: ignore[no-untyped-def]
    """Name every package ``k.pt2`` and load it as the model run by onnxruntime (the whole
    model is the one segment; verification against codegen still runs)."""
    reference = ort.InferenceSession(model.SerializeToString(),
                                     providers=["CPUExecutionProvider"])

    def load(path: Path):  # type: ignore[no-untyped-def]
        def run(x: torch.Tensor) -> list[torch.Tensor]:
            return [torch.from_numpy(reference.run(None, {"x": x.numpy()})[0])]
        return run
    monkeypatch.setattr(aot_inductor, "package_key", lambda *args, **kwargs: "k")
    monkeypatch.setattr(aot_inductor, "_load", load)


def test_auto_records_and_announces_the_cached_package_it_runs(cache, monkeypatch):
    monkeypatch.setenv("SEGFLOW_NATIVE", "0")   # not built for this test
    model = models.build("mlp_chain", layers=2, width=16)
    _stand_in_for_inductor(monkeypatch, model)
    _package("k.pt2")
    heard: list[tuple[Topic, str]] = []

    class Notices:
        def started(self, step: progress.Step) -> None: ...
        def updated(self, step: progress.Step) -> None: ...
        def finished(self, step: progress.Step) -> None: ...

        def noticed(self, topic: Topic, text: str) -> None:
            heard.append((topic, text))
    sess = segflow.InferenceSession(model, engine="inline", compile="auto")
    feeds = models.example_inputs("mlp_chain", layers=2, width=16)
    with progress.listening(Notices()):
        for _ in range(2):
            sess.run(None, feeds)
    report = sess.compile_report
    assert report.fallbacks == [] and report.cache_hits == 1
    [used] = report.cached_packages
    assert (used.segment, used.name) == (0, "k.pt2") and used.created > 0
    note = f"using 1 cached inductor package for segment 0 (built by compile=inductor on " \
           f"{date(used.created)})"
    assert heard == [(Topic.CACHED_PACKAGES, note)]   # once: the second run looks nothing up
    assert f"disk cache: {note}" in sess.explain()


def test_the_command_line_prints_the_note_once(cache, monkeypatch, capsys):
    monkeypatch.setenv("SEGFLOW_NATIVE", "0")
    _stand_in_for_inductor(monkeypatch, models.build("mlp_chain"))
    _package("k.pt2")
    assert cli.main(["run", "builtin:mlp_chain", "--repeat", "2"]) == 0
    captured = capsys.readouterr()
    assert "1 segments run cached inductor packages" in captured.out
    [line] = captured.err.splitlines()
    assert line.startswith("note: using 1 cached inductor package for segment 0 (built by "
                           "compile=inductor on ")
    assert line.endswith("); --compile codegen runs without them, segflow cache --clear "
                         "removes them")
    assert cli.main(["run", "builtin:mlp_chain", "--compile", "codegen"]) == 0
    assert capsys.readouterr().err == ""
