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
