"""Correctness of segflow on the corpus, onnxruntime as the oracle.

For each exported model: batch 1 and 4, and for text models each of the model's
sequence lengths. An output passes when its shape equals the oracle's, its
non-finite values sit where the oracle's do, and

    metric = max |a - b| / (atol + rtol * |b|) <= 1

(``a`` segflow's, ``b`` the oracle's; float32 default atol 1e-4, rtol 1e-3; a model
that states why may use looser ones). Every failure of segflow -- an error at load,
an unsupported op, an error at run, a wrong answer -- is a row with its reason.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from _corpus_build import Entry, one_line
from _corpus_models import MODELS, Built

BATCHES = (1, 4)


class Verdict(enum.Enum):
    PASS = "pass"
    WRONG = "wrong"            # ran, but an output is out of tolerance
    LOAD = "load error"        # segflow refused or failed to load the model
    RUN = "run error"          # segflow failed while running it
    ORACLE = "oracle error"    # onnxruntime itself failed: not segflow's verdict
    EXPORT = "export failed"   # no file to check


@dataclass(frozen=True)
class CheckRow:
    label: str
    batch: int | None
    seq: int | None
    verdict: Verdict
    metric: float = float("nan")
    max_abs: float = float("nan")
    reason: str = ""
    tolerance: str = ""

    @property
    def shape(self) -> str:
        if self.batch is None:
            return "-"
        return f"b{self.batch}" + (f" s{self.seq}" if self.seq is not None else "")


def compare(ours: Sequence[np.ndarray], oracle: Sequence[np.ndarray], names: Sequence[str],
            atol: float, rtol: float) -> tuple[float, float, str]:
    """(metric, max |a-b|, '' or what is wrong) over all outputs."""
    if len(ours) != len(oracle):
        return float("inf"), float("inf"), f"{len(ours)} outputs, the oracle has {len(oracle)}"
    metric = max_abs = 0.0
    worst = ""
    for name, a, b in zip(names, ours, oracle):
        if a.shape != b.shape:
            return float("inf"), float("inf"), f"{name}: shape {a.shape}, oracle {b.shape}"
        if a.dtype != b.dtype:
            return float("inf"), float("inf"), f"{name}: dtype {a.dtype}, oracle {b.dtype}"
        if a.dtype.kind not in "fc":
            if not np.array_equal(a, b):
                return float("inf"), float("inf"), f"{name}: integer values differ"
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        finite = np.isfinite(b64)
        if not np.array_equal(finite, np.isfinite(a64)) or \
                not np.array_equal(a64[~finite], b64[~finite], equal_nan=True):
            return float("inf"), float("inf"), f"{name}: non-finite values differ"
        if not finite.any():
            continue
        if float(np.abs(b64[finite]).max()) < 1e-6:
            return float("inf"), float("inf"), f"{name}: the oracle's output is ~0 " \
                "(vanished activations): the comparison would check nothing"
        diff = np.abs(a64[finite] - b64[finite])
        ratio = float((diff / (atol + rtol * np.abs(b64[finite]))).max())
        if ratio > metric:
            metric, worst = ratio, name
        max_abs = max(max_abs, float(diff.max()))
    return metric, max_abs, (f"{worst}: out of tolerance" if metric > 1 else "")


def _shapes(name: str) -> Iterator[tuple[int, int | None]]:
    model = MODELS[name]
    for batch in BATCHES:
        for seq in model.seq_lens or (None,):
            yield batch, seq


def check_entry(entry: Entry, built: Built) -> list[CheckRow]:
    """The rows for one exported model."""
    import onnxruntime as ort

    import segflow

    label = entry.id.label
    if entry.path is None:
        return [CheckRow(label, None, None, Verdict.EXPORT, reason=entry.failure)]
    model = MODELS[entry.id.model]
    try:
        oracle = ort.InferenceSession(entry.path, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        return [CheckRow(label, None, None, Verdict.ORACLE, reason=one_line(exc))]
    names = [o.name for o in oracle.get_outputs()]
    try:
        sess = segflow.InferenceSession(entry.path)
    except Exception as exc:  # noqa: BLE001 - segflow's failure is a row
        return [CheckRow(label, None, None, Verdict.LOAD, reason=one_line(exc))]
    rows = []
    for batch, seq in _shapes(entry.id.model):
        feeds = model.feeds(built, batch, seq)
        try:
            expected = oracle.run(None, feeds)
        except Exception as exc:  # noqa: BLE001
            rows.append(CheckRow(label, batch, seq, Verdict.ORACLE, reason=one_line(exc)))
            continue
        try:
            got = sess.run(None, feeds)
        except Exception as exc:  # noqa: BLE001
            rows.append(CheckRow(label, batch, seq, Verdict.RUN, reason=one_line(exc)))
            continue
        metric, max_abs, problem = compare(got, expected, names, model.atol, model.rtol)
        rows.append(CheckRow(label, batch, seq, Verdict.WRONG if problem else Verdict.PASS,
                             metric, max_abs, problem or entry.note,
                             f"{model.atol:g}+{model.rtol:g}"))
    sess.close()
    return rows


def format_rows(rows: Sequence[CheckRow]) -> str:
    header = f"{'model/exporter/opset':<40} {'shape':<9} {'atol+rtol':<11} {'metric':>9} " \
             f"{'max|a-b|':>9}  {'verdict':<13} reason"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.label:<40} {r.shape:<9} {r.tolerance or '-':<11} {r.metric:>9.3g} "
                     f"{r.max_abs:>9.2g}  {r.verdict.value:<13} {r.reason}")
    return "\n".join(lines)
