"""ONNX node conformance regression gate.

Every case that ``docs/conformance.json`` lists as passing must still pass;
regenerate the file with
``python -m segflow.conformance --report docs/conformance.md --json docs/conformance.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from segflow.conformance import Outcome, load_cases, run_case

_RECORD = Path(__file__).resolve().parents[1] / "docs" / "conformance.json"
_PASSING: list[str] = json.loads(_RECORD.read_text())["passing"] if _RECORD.exists() else []


@pytest.fixture(scope="module")
def cases() -> dict[str, Any]:
    return {case.name: case for case in load_cases()}


@pytest.mark.parametrize("name", _PASSING)
def test_recorded_pass_still_passes(name: str, cases: dict[str, Any]) -> None:
    if name not in cases:
        pytest.skip(f"{name} is not among this onnx version's node cases")
    result = run_case(cases[name])
    assert result.outcome is Outcome.PASS, f"{name}: {result.outcome.value}: {result.reason}"


def test_record_exists() -> None:
    assert _RECORD.exists(), "docs/conformance.json is missing; regenerate it"
    assert len(_PASSING) > 0


def test_report_counts_random_outputs_apart_and_notes_known_deviations() -> None:
    from segflow.conformance import CaseResult, markdown_report, summary

    results = [CaseResult("test_a", "Add", Outcome.PASS),
               CaseResult("test_bernoulli", "Bernoulli", Outcome.RANDOM, "random"),
               CaseResult("test_dft_inverse", "DFT", Outcome.WRONG, "Mismatched"),
               CaseResult("test_b", "Foo", Outcome.SKIPPED, "string tensors")]
    s = summary(results)
    assert s["attempted"] == 2 and s["counts"][Outcome.RANDOM.value] == 1
    report = markdown_report(results, 1.0)
    assert "## Out of scope: random outputs (1)" in report
    assert "- test_bernoulli (Bernoulli)" in report
    assert "## Failures (1)" in report
    assert "- test_dft_inverse: the expected output is numpy's float32 FFT" in report
