"""Tests for the regression gate (segflow.bench.baseline) and the CI counter-gate command."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import segflow.bench
from segflow import cli
from segflow.bench.baseline import compare, load_record, parse_tolerance
from segflow.errors import SegflowError

COMMITTED = Path(segflow.bench.__file__).parent / "baseline_counters.json"
TINY = "mlp_chain:layers=3"


@pytest.fixture
def _layers_stay_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count per-node work (tasks, pushes) over a small MLP: the dense_chain pass would
    make all its layers one node (tests/test_dense_chain.py)."""
    monkeypatch.setenv("SEGFLOW_NO_DENSE_CHAIN", "1")


def _record(counters: dict[str, int] | None = None, ratios: dict[str, float] | None = None,
            batch_size: int = 1, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    counters = counters or {"segments": 1, "pushes": 1, "syncs": 1, "kernels": 6, "copies": 0}
    return {"kind": "segflow-bench", "schema": 1, "models": [{
        "model": "m", "batch_size": batch_size, "device": "cpu:0", "shapes": {"x": [1, 4]},
        "ratios": ratios or {},
        "variants": [
            {"name": "bulk", "kind": "segflow", "status": "ok", "counters": counters,
             "settings": settings or {"inference": True}},
            {"name": "onnxruntime", "kind": "peer", "status": "ok", "counters": None},
        ]}]}


def test_identical_records_pass() -> None:
    report = compare(_record(), _record())
    assert not report.failed
    assert report.counters_compared == 5
    assert report.format().splitlines()[-1].startswith("PASSED")


def test_counter_increase_fails_naming_counter_model_and_values() -> None:
    new = _record({"segments": 6, "pushes": 6, "syncs": 1, "kernels": 6, "copies": 0},
                  settings={"inference": False})
    report = compare(_record(), new, baseline_name="base.json")
    assert report.failed
    messages = [f.format() for f in report.failures]
    assert messages == [
        "FAIL  counters  m [bulk]: segments 1 -> 6 (+5) "
        "(settings changed: inference True -> False)",
        "FAIL  counters  m [bulk]: pushes 1 -> 6 (+5) (settings changed: inference True -> False)",
    ]
    assert "FAILED: 2 regression(s) in m" in report.format()


def test_counter_decrease_is_a_note() -> None:
    old = _record({"segments": 2, "pushes": 2, "syncs": 1, "kernels": 6, "copies": 0})
    report = compare(old, _record())
    assert not report.failed
    assert any("improved" in f.message for f in report.findings)


def test_a_mode_that_stopped_working_fails() -> None:
    new = _record()
    new["models"][0]["variants"][0].update(status="error", counters=None, detail="boom")
    report = compare(_record(), new)
    assert report.failed and "now: error boom" in report.failures[0].message


def test_timing_ratios_beyond_tolerance_fail() -> None:
    old = _record(ratios={"bulk/onnxruntime": 1.00, "bulk/nobulk": 0.50})
    within = _record(ratios={"bulk/onnxruntime": 1.08, "bulk/nobulk": 0.40})
    assert not compare(old, within, max_slowdown=0.10).failed
    beyond = _record(ratios={"bulk/onnxruntime": 1.25, "bulk/nobulk": 0.50})
    report = compare(old, beyond, max_slowdown=0.10)
    (failure,) = report.failures
    assert failure.check == "timing"
    assert "ratio bulk/onnxruntime 1.000 -> 1.250 (+25.0%, tolerance 10%)" in failure.message
    assert report.ratios_compared == 2
    assert not compare(old, beyond, timing=False).failed


def test_timings_at_other_settings_are_not_compared() -> None:
    old = _record(ratios={"bulk/onnxruntime": 1.0})
    new = _record(ratios={"bulk/onnxruntime": 3.0}, batch_size=8)
    report = compare(old, new)
    assert not report.failed
    assert any("batch_size differs" in f.message for f in report.findings)


def test_nothing_in_common_fails() -> None:
    other = copy.deepcopy(_record())
    other["models"][0]["model"] = "other"
    report = compare(_record(), other)
    assert report.failed
    assert "nothing in common" in report.format()


def test_tolerance_parsing() -> None:
    assert parse_tolerance("10%") == pytest.approx(0.10)
    assert parse_tolerance("0.25") == pytest.approx(0.25)
    with pytest.raises(SegflowError):
        parse_tolerance("fast")


def test_bad_baseline_files(tmp_path: Path) -> None:
    with pytest.raises(SegflowError, match="not found"):
        load_record(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SegflowError, match="not valid JSON"):
        load_record(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SegflowError, match="not a segflow bench record"):
        load_record(tmp_path / "other.json")


# -- end to end through the CLI -----------------------------------------------------------
@pytest.mark.usefixtures("_layers_stay_nodes")
def test_disabling_bulking_by_environment_fails_the_counter_gate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base.json"
    args = ["bench", TINY, "nonzero_mid", "--counters-only", "--no-progress"]
    assert cli.main([*args, "--save-baseline", str(base)]) == 0
    assert cli.main([*args, "--baseline", str(base)]) == 0
    capsys.readouterr()
    monkeypatch.setenv("SEGFLOW_BULK_INFERENCE", "0")  # the founding incident
    assert cli.main([*args, "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    # 3 fused Gemm+Relu layers; nonzero_mid has 12 nodes after fusion.
    assert f"FAIL  counters  {TINY} [bulk]: segments 1 -> 3 (+2) " \
           "(settings changed: inference True -> False)" in out
    assert f"FAIL  counters  {TINY} [bulk]: pushes 1 -> 3 (+2)" in out
    assert "FAIL  counters  nonzero_mid [bulk]: segments 3 -> 12 (+9)" in out
    assert f"FAILED: 4 regression(s) in {TINY}, nonzero_mid" in out
    assert "[nobulk]" not in out.split("Regression gate")[1]  # nobulk is unaffected


def test_timing_gate_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base.json"
    args = ["bench", TINY, "--runs", "3", "--peers", "onnxruntime", "--no-progress"]
    assert cli.main([*args, "--save-baseline", str(base)]) == 0
    record = json.loads(base.read_text())
    record["models"][0]["ratios"] = {k: v / 100 for k, v in record["models"][0]["ratios"].items()}
    base.write_text(json.dumps(record))  # pretend segflow used to be 100x faster
    assert cli.main([*args, "--baseline", str(base), "--max-slowdown", "15%"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  timing" in out and "ratio bulk/onnxruntime" in out and "tolerance 15%" in out


def test_committed_baseline_subset_passes(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", "--counters-only", "mlp_chain", "mobilenet_v2", "--no-progress",
                   "--baseline", str(COMMITTED)])
    assert rc == 0, capsys.readouterr().out


def test_committed_baseline_covers_the_builtin_set() -> None:
    from segflow.bench.runner import DEFAULT_MODELS, DEFAULT_MODES

    record = load_record(COMMITTED)
    assert [m["model"] for m in record["models"]] == list(DEFAULT_MODELS)
    for model in record["models"]:
        assert [v["name"] for v in model["variants"]] == list(DEFAULT_MODES)
        assert all(v["counters"] for v in model["variants"])


@pytest.mark.slow
def test_ci_counter_gate_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The exact command CI runs on every push (builds ResNet-50 and BERT-base: ~30 s)."""
    rc = cli.main(["bench", "--counters-only", "--no-progress", "--baseline", str(COMMITTED)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASSED (40 counters, 0 timing ratios compared)" in out
