"""benchmarks/cpu_targets: ratios, their quartiles and the verdict, on synthetic samples."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def targets() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cpu_targets",
                                                  ROOT / "benchmarks" / "cpu_targets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cpu_targets"] = module
    spec.loader.exec_module(module)
    return module


def _samples(per_round_ratios: list[float]) -> dict[str, list[list[float]]]:
    """segflow/peer rounds whose within-round median ratio is exactly each given value."""
    peer = [[1.0, 1.0, 1.0] for _ in per_round_ratios]
    ours = [[r * 0.9, r, r * 1.1] for r in per_round_ratios]
    return {"segflow": ours, "onnxruntime": peer}


def _row(targets: ModuleType, ratios: list[float]) -> dict[str, object]:
    samples = _samples(ratios)
    row: dict[str, object] = {"vs_ort": targets.ratio(samples, "segflow", "onnxruntime"),
                              "vs_ort_iqr": targets.spread(samples, "segflow", "onnxruntime")}
    case = targets.Case("resnet50", 1, target_ort=1.0)
    row["pass"] = targets._passes(case, row)
    row["verdict"] = targets._verdict(case, row)
    return row


def test_ratio_is_the_median_of_round_ratios(targets: ModuleType) -> None:
    samples = _samples([0.9, 1.2, 1.0, 1.1, 0.95])
    assert targets.round_ratios(samples, "segflow", "onnxruntime") == pytest.approx(
        [0.9, 1.2, 1.0, 1.1, 0.95])
    assert targets.ratio(samples, "segflow", "onnxruntime") == pytest.approx(1.0)
    q1, q3 = targets.spread(samples, "segflow", "onnxruntime")
    assert (q1, q3) == pytest.approx((0.95, 1.1))


def test_verdict_flags_a_spread_across_the_target(targets: ModuleType) -> None:
    assert _row(targets, [0.90, 0.92, 0.94, 0.95])["verdict"] == "PASS"
    assert _row(targets, [1.05, 1.08, 1.10, 1.12])["verdict"] == "MISS"
    noisy = _row(targets, [0.95, 0.98, 1.04, 1.08, 1.10])
    assert noisy["verdict"] == "MISS (noise)"
    assert _row(targets, [0.90, 0.96, 0.99, 1.02, 1.10])["verdict"] == "PASS (noise)"


def test_single_round_has_no_spread(targets: ModuleType) -> None:
    samples = _samples([1.07])
    assert targets.spread(samples, "segflow", "onnxruntime") == pytest.approx((1.07, 1.07))


def test_measure_pauses_only_around_onnxruntime(targets: ModuleType,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime's pool spins after a run: the runtime after it waits ``settle``
    (untimed), and so does onnxruntime after another runtime; no pause elsewhere.
    Whenever the runtime changes, the next one runs once untimed before its timed
    calls (after a pause or not): no runtime's timed call is the first after
    another's."""
    events: list[str] = []
    monkeypatch.setattr(targets.time, "sleep", lambda s: events.append(f"sleep {s}"))
    runners = {name: (lambda n=name: events.append(n))
               for name in ("segflow", "onnxruntime", "torch")}
    samples = targets.measure(runners, rounds=3, per_round=2, warmup=0, settle=0.25)
    assert {name: len(rounds) for name, rounds in samples.items()} == {
        "segflow": 3, "onnxruntime": 3, "torch": 3}
    # Round orders: [sf, ort, torch], [ort, torch, sf], [torch, sf, ort], after torch.
    sf, ort, torch = ["segflow"] * 3, ["onnxruntime"] * 3, ["torch"] * 3
    pause = ["sleep 0.25"]
    assert events == [*sf, *pause, *ort, *pause, *torch,
                      *pause, *ort, *pause, *torch, *sf,
                      *torch, *sf, *pause, *ort]
    assert all(len(times) == 2 for rounds in samples.values() for times in rounds)
    events.clear()
    targets.measure(runners, rounds=1, per_round=1, warmup=0, settle=0.0)
    assert events == ["segflow"] * 2 + ["onnxruntime"] * 2 + ["torch"] * 2


def test_measure_pauses_around_openvino_too(targets: ModuleType,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenVINO has its own thread pool like onnxruntime: a pause on each side of its
    calls; none between segflow and eager, which share one OpenMP pool."""
    events: list[str] = []
    monkeypatch.setattr(targets.time, "sleep", lambda s: events.append("pause"))
    runners = {name: (lambda n=name: events.append(n)) for name in ("segflow", "torch",
                                                                    "openvino")}
    targets.measure(runners, rounds=1, per_round=1, warmup=0, settle=0.1)
    # After the (empty) warm-up the previous runtime is openvino, the last one.
    assert events == ["pause", "segflow", "segflow", "torch", "torch",
                      "pause", "openvino", "openvino"]


def test_the_openvino_column_is_optional(targets: ModuleType) -> None:
    row = {"case": "resnet50@1", "runtime": "segflow", "ms": 10.0, "ort_ms": 11.0,
           "eager_ms": 20.0, "vs_ort": 0.91, "vs_ort_iqr": (0.9, 0.92), "vs_eager": 0.5,
           "vs_eager_iqr": (0.49, 0.51), "target": "<= 1.00x ort", "verdict": "PASS"}
    plain = targets._format_row(row)
    assert plain.endswith("<= 1.00x ort PASS")
    assert targets._format_row(row, openvino=True).split()[-2:] == ["-", "-"]
    row.update(ov_ms=9.0, vs_ov=1.11, vs_ov_iqr=(1.05, 1.2))
    assert targets._format_row(row, openvino=True) == (
        plain + f"   {'9.00':>9} {'1.11 [1.05-1.20]':>20}")


def _memory(held: float, held_anon: float, warm: float = 0.0) -> dict[str, float]:
    return {"held_mib": held, "held_anon_mib": held_anon, "warm_run_peak_mib": warm}


def test_memory_verdict_reads_rss_and_private_pages_apart(
        targets: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """Code pages a run first touches count in RSS but not in private pages: the
    target can miss in one reading and pass in the other, and both are printed."""
    targets._memory_verdict({"segflow": _memory(15.4, 10.5),
                             "onnxruntime": _memory(13.6, 13.1)})
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "  run total, RSS: segflow 15.4 against onnxruntime 13.6 MiB (+1.8) MISS",
        "  run total, private pages: segflow 10.5 against onnxruntime 13.1 MiB (-2.6) PASS"]
    targets._memory_verdict({"segflow": _memory(10.0, 9.0, warm=2.0),
                             "onnxruntime": _memory(13.0, 12.0)})
    assert capsys.readouterr().out.count("PASS") == 2
    targets._memory_verdict({"torch": _memory(1.0, 1.0), "onnxruntime": _memory(2.0, 2.0)})
    assert capsys.readouterr().out == ""


def test_an_unknown_case_is_a_one_line_error(targets: ModuleType,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        targets.main(["--cases", "resnet50_b1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case 'resnet50_b1'" in err and "resnet50@8" in err
    assert "Traceback" not in err


def test_variants_name_passes_fuse_rules_and_switches(targets: ModuleType) -> None:
    kwargs, env = targets._segflow_kwargs(
        "default,fuse.batchnorm=off,layout=on,winograd=off,native_stem=off")
    assert kwargs == {"optimize": {"fuse.batchnorm": False, "layout": True}}
    assert env == {"SEGFLOW_WINOGRAD": "0", "SEGFLOW_NATIVE_STEM": "0"}
    with pytest.raises(SystemExit, match="unknown variant key 'bogus'"):
        targets._segflow_kwargs("bogus=on")
