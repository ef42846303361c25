"""benchmarks/corpus.py: real exports (both torch exporters) built, cached and checked
against onnxruntime -- the CI subset of the corpus, and its cache's rules."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _corpus_build as build  # noqa: E402
import _corpus_check as check  # noqa: E402
from _corpus_build import Corpus, EntryId, Exporter  # noqa: E402

TS, DYNAMO = Exporter.TORCHSCRIPT, Exporter.DYNAMO


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Corpus]:
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path / "cache"))
    yield Corpus.open()


def _checked(corpus: Corpus, entry_id: EntryId) -> list[check.CheckRow]:
    entry = corpus.obtain(entry_id)
    assert entry.path is not None, entry.failure
    return check.check_entry(entry, corpus.built(entry_id.model, entry_id.small))


def _assert_all_pass(rows: list[check.CheckRow], shapes: set[tuple[int, int | None]],
                     traced_seq: int | None = None) -> None:
    """Every row passes. ``traced_seq``: the file holds that sequence length as a constant
    (the TorchScript tracer's nn.MultiheadAttention reshapes), so at other lengths the
    oracle itself may fail; those rows are not segflow's to pass."""
    assert {(r.batch, r.seq) for r in rows} == shapes
    rows = [r for r in rows if not (traced_seq is not None and r.seq != traced_seq
                                    and r.verdict is check.Verdict.ORACLE)]
    bad = [f"{r.label} {r.shape}: {r.verdict.value} {r.reason}" for r in rows
           if r.verdict is not check.Verdict.PASS]
    assert not bad, "\n".join(bad)
    assert rows and all(0 <= r.metric <= 1 for r in rows)


TEXT_SHAPES = {(1, 16), (1, 128), (4, 16), (4, 128)}


@pytest.mark.parametrize("exporter,opset", [(TS, 17), (DYNAMO, 18)])
def test_torch_transformer_encoder_matches_onnxruntime(corpus: Corpus, exporter: Exporter,
                                                       opset: int) -> None:
    # The full-size encoder (4 layers, d=256, 4 heads): small enough for CI.
    rows = _checked(corpus, EntryId("torch_transformer", exporter, opset))
    _assert_all_pass(rows, TEXT_SHAPES, traced_seq=16 if exporter is TS else None)


@pytest.mark.parametrize("exporter,opset", [(TS, 17), (DYNAMO, 18)])
def test_small_bert_matches_onnxruntime(corpus: Corpus, exporter: Exporter,
                                        opset: int) -> None:
    rows = _checked(corpus, EntryId("bert_base", exporter, opset, small=True))
    _assert_all_pass(rows, TEXT_SHAPES)


@pytest.mark.parametrize("exporter,opset", [(TS, 17), (DYNAMO, 18)])
def test_small_resnet_matches_onnxruntime(corpus: Corpus, exporter: Exporter,
                                          opset: int) -> None:
    rows = _checked(corpus, EntryId("resnet50", exporter, opset, small=True))
    _assert_all_pass(rows, {(1, None), (4, None)})


@pytest.mark.parametrize("model,exporter,norm_op", [("gpt2", DYNAMO, "LayerNormalization"),
                                                    ("t5_small_encoder", TS, "ReduceMean")])
def test_every_normalization_of_a_pre_ln_transformer_is_one_fused_node(
        corpus: Corpus, model: str, exporter: Exporter, norm_op: str) -> None:
    # Pre-LN blocks read each residual sum again after its norm (GPT-2's LayerNorms, T5's
    # RMS norms written out as Pow, ReduceMean, Add, Sqrt, Div, Mul, Mul): each norm, with
    # the Add before it, is one AddLayerNorm in the plan that runs, and the results match.
    import onnx
    from _corpus_models import MODELS

    import segflow

    entry_id = EntryId(model, exporter, 18, small=True)
    rows = _checked(corpus, entry_id)
    _assert_all_pass(rows, TEXT_SHAPES)
    entry = corpus.obtain(entry_id)
    assert entry.path is not None
    norms = sum(n.op_type == norm_op
                for n in onnx.load(entry.path, load_external_data=False).graph.node)
    built = corpus.built(model, True)
    sess = segflow.InferenceSession(entry.path)
    sess.run(None, MODELS[model].feeds(built, 1, 16))
    (plan,) = sess.specializations.values()
    ops = list(plan.graph.nodes)
    fused = [n for n in ops if n.op_type == "AddLayerNorm"]
    assert norms > 2 and len(fused) == norms
    assert not any(n.op_type in ("LayerNormalization", "RMSNormalization", "ReduceMean")
                   for n in ops)
    # All but the last residual sum are read again (the embeddings' one too).
    assert sum(len(n.outputs) == 2 for n in fused) >= norms - 2


def test_an_export_is_cached_listed_and_checked_before_use(corpus: Corpus) -> None:
    entry_id = EntryId("resnet50", TS, 17, small=True)
    first = corpus.obtain(entry_id)
    assert first.path is not None and not first.cached and first.nodes > 0
    again = Corpus.open().obtain(entry_id)   # a new process: found, verified
    assert again.cached and again.path == first.path
    manifest = json.loads((Path(first.path).parent / "manifest.json").read_text())
    assert manifest["entries"][entry_id.label]["key"] == first.key
    # A file that does not match its recorded digest is built again, not loaded.
    with open(first.path, "ab") as f:
        f.write(b"\0")
    rebuilt = Corpus.open().obtain(entry_id)
    assert rebuilt.path is not None and not rebuilt.cached
    # The key covers the exporter and opset: another opset is another file.
    other = corpus.obtain(EntryId("resnet50", TS, 18, small=True))
    assert other.key != first.key and other.path != first.path


def test_a_cached_file_failing_the_checker_is_rebuilt(corpus: Corpus,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    entry_id = EntryId("resnet50", TS, 17, small=True)
    assert corpus.obtain(entry_id).path is not None
    problems = iter(["onnx.checker: ValidationError: planted"])
    monkeypatch.setattr(build, "_check", lambda path: next(problems, ""))
    entry = Corpus.open().obtain(entry_id)
    assert entry.path is not None and not entry.cached   # rebuilt after the refusal


def test_a_failed_export_is_a_manifest_row_not_retried(corpus: Corpus,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[EntryId] = []

    def failing(entry_id: EntryId, built: object, out: Path) -> str:
        calls.append(entry_id)
        return "UnsupportedOperatorError: planted"

    monkeypatch.setattr(build, "export", failing)
    entry_id = EntryId("torch_transformer", DYNAMO, 17, small=True)
    entry = corpus.obtain(entry_id)
    assert entry.path is None and entry.failure == "UnsupportedOperatorError: planted"
    again = Corpus.open().obtain(entry_id)
    assert again.failure == entry.failure and again.cached and len(calls) == 1
    rows = check.check_entry(again, corpus.built(entry_id.model, entry_id.small))
    assert [r.verdict for r in rows] == [check.Verdict.EXPORT]
    Corpus.open().obtain(entry_id, rebuild=True)
    assert len(calls) == 2


def test_a_group_writable_cache_is_refused(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o770)
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(root))
    corpus = Corpus.open()
    assert "group-writable" in corpus.distrust
    assert not str(corpus.store.directory).startswith(str(root))


def test_compare_states_metric_and_reason() -> None:
    b = np.array([1.0, -2.0, np.inf], np.float32)
    step = np.array([1e-4, 0, 0], np.float32)
    metric, max_abs, problem = check.compare([b + step], [b], ["y"], 1e-4, 1e-3)
    assert problem == "" and max_abs == pytest.approx(1e-4, rel=1e-2)
    assert metric == pytest.approx(1e-4 / 1.1e-3, rel=1e-2)
    assert check.compare([b + 100 * step], [b], ["y"], 1e-4, 1e-3)[2] == "y: out of tolerance"
    assert "non-finite" in check.compare([np.array([1, -2, 0], np.float32)], [b], ["y"],
                                         1e-4, 1e-3)[2]
    assert "shape" in check.compare([b[:2]], [b], ["y"], 1e-4, 1e-3)[2]


def test_list_names_every_model(capsys: pytest.CaptureFixture[str], corpus: Corpus) -> None:
    corpus_script = _script()
    assert corpus_script.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("resnet50", "bert_base", "gpt2_past", "whisper_tiny_encoder"):
        assert name in out


def _script() -> ModuleType:
    import importlib

    return importlib.import_module("corpus")
