"""The fuzz (tests/fuzz_cases.py) at a fixed seed: every case must end ``equal``,
``refused``, ``unsupported`` or ``strict``, never wrong values, a different NaN/Inf
pattern, a raw exception, a crash or a hang.

Under the defaults it runs the first CASES cases of seed 0 (valid graphs, broken
models, bad feeds); under each switch that changes which kernel runs, the first
VARIANT_CASES valid graphs (the broken ones fail at load, before any kernel is
chosen). A failure message is the outcome table and one line a failing case;
``python benchmarks/fuzz.py --case ID --verbose`` reproduces one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")

import fuzz_cases  # noqa: E402 - after the importorskip

SEED = 0
CASES = 1000
VARIANT_CASES = 80
# The SEGFLOW_* switches that change which kernel runs (benchmarks/fuzz.py --optimize).
VARIANTS = {
    "layout=off": {"SEGFLOW_NO_LAYOUT": "1"},
    "native=off": {"SEGFLOW_NATIVE": "0"},
    "direct=off": {"SEGFLOW_ONEDNN_DIRECT": "0"},
    "winograd=on": {"SEGFLOW_WINOGRAD": "1"},
    "native_stem=on": {"SEGFLOW_NATIVE_STEM": "1"},
}


def _report(results: list[fuzz_cases.Result]) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fuzz

    failures = [r for r in results if r.outcome in fuzz_cases.FAILING]
    return "\n".join([fuzz.table(results),
                      *(f"{r.outcome} {r.case_id} {r.kind}: {r.detail}" for r in failures)])


def test_the_fuzz_cases_cover_every_generator_kind():
    """The generator keeps reaching what it is for: valid graphs with non-finite feeds,
    each mutation and each bad feed, at the test's seed and count."""
    kinds = {fuzz_cases.make_case(SEED, i).kind for i in range(CASES)}
    assert "valid" in kinds
    assert {f"model:{m}" for m in fuzz_cases.MUTATIONS} <= kinds
    assert {f"feed:{m}" for m in fuzz_cases.FEED_MUTATIONS} <= kinds


def test_fuzz_cases_end_equal_or_refused_by_name():
    results = fuzz_cases.run_guarded(fuzz_cases.case_ids(SEED, CASES))
    assert len(results) == CASES
    assert all(r.outcome in fuzz_cases.PASSING for r in results), _report(results)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_valid_fuzz_graphs_match_under_each_kernel_switch(variant):
    ids = [case_id for case_id in fuzz_cases.case_ids(SEED, 4 * VARIANT_CASES)
           if fuzz_cases.make_case(*fuzz_cases.parse_case_id(case_id)).kind == "valid"]
    results = fuzz_cases.run_guarded(ids[:VARIANT_CASES], env=VARIANTS[variant])
    assert all(r.outcome in fuzz_cases.PASSING for r in results), _report(results)
