"""The regression gate: compare a benchmark record against a saved baseline.

Two kinds of checks:

- counters (segments, pushes, syncs, kernels, copies per run) of every segflow
  mode are compared exactly; any increase fails. Pushes, syncs and kernels are
  counted as the run makes them (``RunStats``), so a change that adds a host
  wait or a kernel call the plan does not show fails here. They are
  deterministic, so this gate is cheap and runs on every push
  (``segflow bench --counters-only``).
- timings are compared only as ratios measured within one run (e.g.
  ``bulk/onnxruntime``, ``bulk/nobulk``), never as absolute times: a ratio that
  grew by more than ``max_slowdown`` fails. Absolute times on shared machines
  drift far more than the regressions worth catching.

Records are the JSON written by :func:`segflow.bench.runner.to_record`.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from segflow.errors import SegflowError


class Verdict(enum.Enum):
    FAIL = "FAIL"
    NOTE = "note"


@dataclass(frozen=True, slots=True)
class Finding:
    """One difference between baseline and current run."""

    verdict: Verdict
    check: str      # "counters", "timing", "coverage"
    model: str
    variant: str
    message: str

    def format(self) -> str:
        where = f"{self.model} [{self.variant}]" if self.variant else self.model
        return f"{self.verdict.value:4s}  {self.check:8s}  {where}: {self.message}"


@dataclass(frozen=True, slots=True)
class GateReport:
    """Everything the gate found; ``failed`` decides the exit code."""

    baseline: str
    max_slowdown: float
    findings: tuple[Finding, ...]
    counters_compared: int
    ratios_compared: int

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict is Verdict.FAIL]

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    def format(self) -> str:
        lines = [f"Regression gate vs {self.baseline} (counters: any increase fails; "
                 f"timing ratios: max slowdown {self.max_slowdown:.0%})"]
        lines += [f.format() for f in sorted(self.findings, key=lambda f: f.verdict.value)]
        compared = (f"{self.counters_compared} counters, {self.ratios_compared} timing ratios "
                    f"compared")
        if self.failed:
            models = sorted({f.model for f in self.failures})
            lines.append(f"FAILED: {len(self.failures)} regression(s) in "
                         f"{', '.join(models)} ({compared})")
        else:
            lines.append(f"PASSED ({compared})")
        return "\n".join(lines)


# -- records -----------------------------------------------------------------------------
def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def save_record(record: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(record), f, indent=1, sort_keys=False)
        f.write("\n")


def load_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        raise SegflowError(f"baseline {os.fspath(path)!r} not found "
                           "(create one with segflow bench --save-baseline PATH)") from None
    except json.JSONDecodeError as exc:
        raise SegflowError(f"baseline {os.fspath(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("kind") != "segflow-bench":
        raise SegflowError(f"{os.fspath(path)!r} is not a segflow bench record")
    return record


def parse_tolerance(text: str) -> float:
    """``"10%"`` or ``"0.1"`` -> 0.1."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise SegflowError(f"--max-slowdown {text!r}: expected e.g. 10% or 0.1") from None
    if value < 0:
        raise SegflowError(f"--max-slowdown {text!r} must not be negative")
    return value


# -- comparing ---------------------------------------------------------------------------
def _models(record: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {m["model"]: m for m in record.get("models", [])}


def _variants(model: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {v["name"]: v for v in model.get("variants", [])}


def _settings_change(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str:
    if not old or not new:
        return ""
    changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k)]
    return f" (settings changed: {', '.join(changed)})" if changed else ""


def compare_counters(model: str, old_m: Mapping[str, Any], new_m: Mapping[str, Any]
                     ) -> tuple[list[Finding], int]:
    findings: list[Finding] = []
    compared = 0
    new_variants = _variants(new_m)
    for name, old in _variants(old_m).items():
        if old.get("kind") != "segflow" or not old.get("counters"):
            continue
        new = new_variants.get(name)
        if new is None:
            findings.append(Finding(Verdict.NOTE, "coverage", model, name,
                                    "mode in the baseline was not run"))
            continue
        if new.get("status") != "ok" or not new.get("counters"):
            findings.append(Finding(Verdict.FAIL, "counters", model, name,
                                    f"ran in the baseline but now: {new.get('status')} "
                                    f"{new.get('detail', '')}".rstrip()))
            continue
        why = _settings_change(old.get("settings"), new.get("settings"))
        for counter, before in old["counters"].items():
            after = new["counters"].get(counter)
            if after is None:
                continue
            compared += 1
            if after > before:
                findings.append(Finding(Verdict.FAIL, "counters", model, name,
                                        f"{counter} {before} -> {after} (+{after - before})"
                                        f"{why}"))
            elif after < before:
                findings.append(Finding(Verdict.NOTE, "counters", model, name,
                                        f"{counter} {before} -> {after} (improved; refresh the "
                                        f"baseline with --save-baseline){why}"))
    return findings, compared


def compare_timing(model: str, old_m: Mapping[str, Any], new_m: Mapping[str, Any],
                   max_slowdown: float) -> tuple[list[Finding], int]:
    old_ratios: Mapping[str, float] = old_m.get("ratios") or {}
    new_ratios: Mapping[str, float] = new_m.get("ratios") or {}
    if not old_ratios or not new_ratios:
        return [], 0
    for key in ("batch_size", "device", "shapes"):
        if old_m.get(key) != new_m.get(key):
            return [Finding(Verdict.NOTE, "timing", model, "",
                            f"{key} differs ({old_m.get(key)} vs {new_m.get(key)}): "
                            f"timings not compared")], 0
    findings = []
    compared = 0
    for key, before in old_ratios.items():
        after = new_ratios.get(key)
        if after is None or before is None or before <= 0:
            continue
        compared += 1
        change = after / before - 1
        text = (f"ratio {key} {before:.3f} -> {after:.3f} ({change:+.1%}, "
                f"tolerance {max_slowdown:.0%})")
        if change > max_slowdown:
            findings.append(Finding(Verdict.FAIL, "timing", model, key.split("/")[0], text))
        elif change < -max_slowdown:
            findings.append(Finding(Verdict.NOTE, "timing", model, key.split("/")[0],
                                    text + " improved"))
    return findings, compared


def compare(baseline: Mapping[str, Any], current: Mapping[str, Any], *,
            max_slowdown: float = 0.10, timing: bool = True,
            baseline_name: str = "baseline") -> GateReport:
    """Compare ``current`` against ``baseline``: counters exactly, timings as ratios."""
    findings: list[Finding] = []
    counters = ratios = 0
    new_models = _models(current)
    for model, old_m in _models(baseline).items():
        new_m = new_models.get(model)
        if new_m is None:
            continue  # not benchmarked this time (a subset was asked for)
        f, n = compare_counters(model, old_m, new_m)
        findings += f
        counters += n
        if timing:
            f, n = compare_timing(model, old_m, new_m, max_slowdown)
            findings += f
            ratios += n
    for model in new_models.keys() - _models(baseline).keys():
        findings.append(Finding(Verdict.NOTE, "coverage", model, "",
                                "not in the baseline (not compared)"))
    if counters == 0 and ratios == 0:
        findings.append(Finding(Verdict.FAIL, "coverage", "(all)", "",
                                "nothing in common with the baseline was compared"))
    return GateReport(baseline_name, max_slowdown, tuple(findings), counters, ratios)


def format_failures(findings: Sequence[Finding]) -> str:
    return "\n".join(f.format() for f in findings)
