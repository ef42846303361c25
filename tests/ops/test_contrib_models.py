"""Whole models in com.microsoft ops, as onnxruntime's own tools write them, against
onnxruntime: a ResNet quantized to QOperator form, a BERT through the transformer optimizer.
The small configurations of the corpus (benchmarks/), exported into a private cache."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import segflow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _corpus_build import Corpus, EntryId, Exporter  # noqa: E402
from _corpus_models import MODELS  # noqa: E402


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Corpus]:
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path / "cache"))
    yield Corpus.open()


def _ms_ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node if n.domain == "com.microsoft")


@pytest.mark.slow
def test_qoperator_resnet_matches_onnxruntime(corpus: Corpus, tmp_path: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    entry = corpus.obtain(EntryId("resnet50", Exporter.TORCHSCRIPT, 18, small=True))
    assert entry.path is not None, entry.failure
    name = onnx.load(str(entry.path), load_external_data=False).graph.input[0].name
    rng = np.random.default_rng(0)
    images = [rng.standard_normal((1, 3, 64, 64)).astype(np.float32) for _ in range(6)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter({name: x} for x in images[:2])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    path = tmp_path / "q.onnx"
    quantize_static(str(entry.path), str(path), Reader(), quant_format=QuantFormat.QOperator,
                    per_channel=True)
    model = onnx.load(str(path))
    assert {"QLinearAdd", "QLinearGlobalAveragePool"} <= set(_ms_ops(model))
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    last = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    step = float(scales[last.input[1]])
    oracle = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    session = segflow.InferenceSession(str(path))
    for x in images[2:]:
        expected = oracle.run(None, {name: x})[0]
        got = session.run(None, {name: x})[0]
        assert got.argmax() == expected.argmax()
        # The com.microsoft nodes agree exactly given the same inputs; QLinearConv
        # (ops/quant.py) scales its accumulator in float64 where onnxruntime rounds
        # float32(acc) * scale, so a few values differ by one step and the differences
        # grow through the layers.
        assert np.abs(got - expected).max() <= 32 * step


@pytest.mark.slow
def test_optimized_bert_matches_onnxruntime(corpus: Corpus, tmp_path: Path) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    entry = corpus.obtain(EntryId("bert_base", Exporter.TORCHSCRIPT, 17, small=True))
    assert entry.path is not None, entry.failure
    optimized = optimize_model(str(entry.path), model_type="bert", num_heads=0, hidden_size=0)
    path = tmp_path / "opt.onnx"
    optimized.save_model_to_file(str(path))
    fused = _ms_ops(onnx.load(str(path)))
    assert {"SkipLayerNormalization"} <= set(fused), fused
    built = corpus.built("bert_base", True)
    spec = MODELS["bert_base"]
    oracle = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in oracle.get_inputs()}
    feeds = {k: np.asarray(v) for k, v in spec.feeds(built, 2, 16).items() if k in names}
    expected = oracle.run(None, feeds)
    got = segflow.InferenceSession(str(path)).run(None, feeds)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-4)


def test_optimized_eager_bert_fuses_attention_and_matches_onnxruntime(tmp_path: Path) -> None:
    """A BERT whose attention is the explicit matmul-softmax-matmul the optimizer matches
    (an SDPA export keeps its attention unfused): Attention, EmbedLayerNormalization,
    SkipLayerNormalization and BiasGelu, a padded row in the mask."""
    import torch
    from onnxruntime.transformers.optimizer import optimize_model
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, attn_implementation="eager")
    bert = BertModel(config).eval()

    class Outputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, mask: torch.Tensor,
                    types: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(self.bert(input_ids=ids, attention_mask=mask, token_type_ids=types,
                                   return_dict=False))

    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 10:] = 0
    types = (torch.arange(16) >= 8).to(torch.int64).expand(2, 16)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    exported = tmp_path / "bert.onnx"
    torch.onnx.export(Outputs(), (ids, mask, types), str(exported), input_names=names,
                      output_names=["hidden", "pooled"], opset_version=14, dynamo=False,
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in names})
    optimized = optimize_model(str(exported), model_type="bert", num_heads=4, hidden_size=32)
    path = tmp_path / "opt.onnx"
    optimized.save_model_to_file(str(path))
    fused = _ms_ops(onnx.load(str(path)))
    assert fused == Counter({"SkipLayerNormalization": 4, "Attention": 2, "BiasGelu": 2,
                             "EmbedLayerNormalization": 1}), fused
    oracle = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name for i in oracle.get_inputs()}
    feeds = {n: t.numpy() for n, t in zip(names, (ids, mask, types)) if n in inputs}
    expected = oracle.run(None, feeds)
    got = segflow.InferenceSession(str(path)).run(None, feeds)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-5)
