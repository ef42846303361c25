"""The corpus's models: each a torch module built from a config (random weights,
seeded), the ONNX inputs it takes and how to make them at a batch and sequence length.

Every Hugging Face model is wrapped in a module that calls it with keyword arguments
and returns plain tensors, as a user exporting it for inference would. Full-size
configs are the named architectures' (BERT-base is 12 layers of 768); ``small=True``
gives a few-layer, narrow variant of the same code for tests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SEED = 0


class ModelKind(enum.Enum):
    """What a model's inputs are: an image batch, token ids, or audio features."""

    IMAGE = "image"
    TEXT = "text"
    AUDIO = "audio"


@dataclass(frozen=True)
class InputSpec:
    """One ONNX input: its name, how to make it, and which of its axes are dynamic."""

    name: str
    # (batch, seq, rng) -> array; seq is None for models without a sequence axis.
    make: Callable[[int, int | None, np.random.Generator], np.ndarray]
    dynamic: Mapping[int, str]


@dataclass(frozen=True)
class Built:
    """A model ready to export: the module, its inputs and outputs, and what it was
    built from (the config, part of the cache key)."""

    module: torch.nn.Module
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    output_dynamic: Mapping[str, Mapping[int, str]]
    config: Mapping[str, Any]


@dataclass(frozen=True)
class CorpusModel:
    """One model of the corpus.

    ``seq_lens``: the sequence lengths correctness is checked at (empty: no sequence
    axis); ``export_seq``: the example length the exporters trace with.
    """

    name: str
    kind: ModelKind
    build: Callable[[bool], Built]
    description: str
    seq_lens: tuple[int, ...] = ()
    export_seq: int | None = None
    bench_seq: int | None = None
    # Tolerances of the check against onnxruntime; a model that needs looser ones than
    # float32's defaults says why in ``loose`` (none does so far).
    atol: float = 1e-4
    rtol: float = 1e-3
    loose: str = ""

    def __post_init__(self) -> None:
        if (self.atol, self.rtol) != (1e-4, 1e-3) and not self.loose:
            raise ValueError(f"{self.name}: looser tolerances need a stated reason")

    def feeds(self, built: Built, batch: int, seq: int | None,
              seed: int = SEED) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {spec.name: spec.make(batch, seq, rng) for spec in built.inputs}


# -- inputs ------------------------------------------------------------------------------
def _pixels(size: int) -> InputSpec:
    def make(batch: int, seq: int | None, rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal((batch, 3, size, size), dtype=np.float32)
    return InputSpec("pixel_values", make, {0: "batch"})


def _token_ids(vocab: int) -> InputSpec:
    def make(batch: int, seq: int | None, rng: np.random.Generator) -> np.ndarray:
        assert seq is not None
        return rng.integers(0, vocab, (batch, seq), dtype=np.int64)
    return InputSpec("input_ids", make, {0: "batch", 1: "seq"})


def _padding_mask(batch: int, seq: int | None, rng: np.random.Generator) -> np.ndarray:
    """Ones, with the tail of every row but the first padded out (row i: i*seq/8 zeros),
    so the masked path of attention is exercised; no row is all padding."""
    assert seq is not None
    mask = np.ones((batch, seq), np.int64)
    for row in range(1, batch):
        pad = min(seq - 1, row * seq // 8)
        if pad:
            mask[row, seq - pad:] = 0
    return mask


ATTENTION_MASK = InputSpec("attention_mask", _padding_mask, {0: "batch", 1: "seq"})


# -- wrappers: keyword calls, plain tensors out ------------------------------------------
class _ImageClassifier(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


class _TextEncoder(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, output: str = "last_hidden_state") -> None:
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return getattr(out, self.output)


class _AudioEncoder(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.model(input_features=input_features).last_hidden_state


class _CausalLMWithPast(torch.nn.Module):
    """GPT-2 one decoding step: the new token, its mask and the past keys and values as
    plain tensors in; the logits and the updated keys and values out."""

    def __init__(self, model: torch.nn.Module, layers: int) -> None:
        super().__init__()
        self.model = model
        self.layers = layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(self.layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         past_key_values=cache, use_cache=True)
        present = out.past_key_values
        flat = [t for layer in present.layers for t in (layer.keys, layer.values)]
        return (out.logits, *flat)


def _seeded(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return make().eval()


def _calibrate_batchnorm(module: torch.nn.Module, sample: torch.Tensor) -> None:
    """Set every BatchNorm's running statistics to those of one forward pass over a
    random batch, as training would have. Freshly initialized statistics (mean 0, var 1)
    make eval-mode BatchNorm an identity, and through tens of layers of small random
    weights the activations vanish (MobileNetV2's logits came out ~1e-24): a comparison
    of such outputs checks nothing. The affine scales are drawn in [0.5, 1.5]."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    torch.manual_seed(SEED + 1)
    for norm in norms:
        if norm.affine:   # some inits draw the scales near 0 (N(0, 0.02)), as for weights
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.normal_(0.0, 0.1)
        norm.reset_running_stats()
        norm.momentum = None   # a cumulative average: one pass sets the statistics
        norm.train()
    with torch.no_grad():
        module(sample)
    module.eval()


def _config_dict(config: Any) -> dict[str, Any]:
    d = config.to_dict()
    # Fields that say nothing about the graph (and vary between transformers releases).
    for key in ("transformers_version", "_name_or_path", "architectures"):
        d.pop(key, None)
    return d


# -- builders ----------------------------------------------------------------------------
def _image(config_cls: str, model_cls: str, full: Mapping[str, Any],
           small: Mapping[str, Any], size: int = 224,
           small_size: int = 64) -> Callable[[bool], Built]:
    def build(is_small: bool) -> Built:
        import transformers

        config = getattr(transformers, config_cls)(**(small if is_small else full))
        model = _seeded(lambda: getattr(transformers, model_cls)(config))
        pixels = _pixels(small_size if is_small else size)
        wrapper = _ImageClassifier(model).eval()
        sample = pixels.make(4, None, np.random.default_rng(SEED + 1))
        _calibrate_batchnorm(wrapper, torch.from_numpy(sample))
        return Built(wrapper, (pixels,), ("logits",), {"logits": {0: "batch"}},
                     _config_dict(config))
    return build


def _text(config_cls: str, model_cls: str, full: Mapping[str, Any],
          small: Mapping[str, Any], output: str = "last_hidden_state"
          ) -> Callable[[bool], Built]:
    def build(is_small: bool) -> Built:
        import transformers

        config = getattr(transformers, config_cls)(**(small if is_small else full))
        model = _seeded(lambda: getattr(transformers, model_cls)(config))
        vocab = config.vocab_size
        return Built(_TextEncoder(model, output).eval(), (_token_ids(vocab), ATTENTION_MASK),
                     (output,), {output: {0: "batch", 1: "seq"}}, _config_dict(config))
    return build


def _whisper(is_small: bool) -> Built:
    import transformers

    full = dict(d_model=384, encoder_layers=4, encoder_attention_heads=6,
                encoder_ffn_dim=1536, decoder_layers=4, decoder_attention_heads=6,
                decoder_ffn_dim=1536, num_mel_bins=80, max_source_positions=1500)
    small = dict(full, d_model=64, encoder_layers=2, encoder_attention_heads=2,
                 encoder_ffn_dim=128, decoder_layers=1, max_source_positions=100)
    config = transformers.WhisperConfig(**(small if is_small else full))
    encoder = _seeded(lambda: transformers.WhisperModel(config).get_encoder())
    frames = 2 * config.max_source_positions   # the encoder takes exactly this many

    def make(batch: int, seq: int | None, rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal((batch, config.num_mel_bins, frames), dtype=np.float32)

    return Built(_AudioEncoder(encoder).eval(),
                 (InputSpec("input_features", make, {0: "batch"}),), ("last_hidden_state",),
                 {"last_hidden_state": {0: "batch"}}, _config_dict(config))


GPT2_FULL: dict[str, Any] = {}   # GPT2Config's defaults are GPT-2 small (124M)
GPT2_SMALL = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=256,
                  bos_token_id=0, eos_token_id=0)


def _gpt2_past(is_small: bool) -> Built:
    import transformers

    config = transformers.GPT2Config(**(GPT2_SMALL if is_small else GPT2_FULL))
    model = _seeded(lambda: transformers.GPT2LMHeadModel(config))
    heads, width = config.n_head, config.n_embd // config.n_head
    layers = config.n_layer

    def ids(batch: int, seq: int | None, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(0, config.vocab_size, (batch, 1), dtype=np.int64)

    def mask(batch: int, seq: int | None, rng: np.random.Generator) -> np.ndarray:
        assert seq is not None
        return np.ones((batch, seq + 1), np.int64)

    def past(batch: int, seq: int | None, rng: np.random.Generator) -> np.ndarray:
        assert seq is not None
        return rng.standard_normal((batch, heads, seq, width), dtype=np.float32)

    inputs = [InputSpec("input_ids", ids, {0: "batch"}),
              InputSpec("attention_mask", mask, {0: "batch", 1: "total_seq"})]
    outputs = ["logits"]
    dynamic: dict[str, Mapping[int, str]] = {"logits": {0: "batch"}}
    for i in range(layers):
        for part in ("key", "value"):
            inputs.append(InputSpec(f"past_{part}_{i}", past, {0: "batch", 2: "past_seq"}))
            outputs.append(f"present_{part}_{i}")
            dynamic[f"present_{part}_{i}"] = {0: "batch", 2: "total_seq"}
    return Built(_CausalLMWithPast(model, layers).eval(), tuple(inputs), tuple(outputs),
                 dynamic, _config_dict(config))


class _TorchEncoder(torch.nn.Module):
    def __init__(self, layers: int, width: int, heads: int) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(width, heads, batch_first=True)
        # enable_nested_tensor: off, the encoder's fast path would take a padding mask
        # only; without one it is a plain stack of layers either way.
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        return self.encoder(src)


def _torch_encoder(is_small: bool) -> Built:
    layers, width, heads = (2, 64, 4) if is_small else (4, 256, 4)
    module = _seeded(lambda: _TorchEncoder(layers, width, heads))

    def make(batch: int, seq: int | None, rng: np.random.Generator) -> np.ndarray:
        assert seq is not None
        return rng.standard_normal((batch, seq, width), dtype=np.float32)

    config = {"layers": layers, "d_model": width, "nhead": heads, "dim_feedforward": 2048,
              "batch_first": True}
    return Built(module, (InputSpec("src", make, {0: "batch", 1: "seq"}),), ("out",),
                 {"out": {0: "batch", 1: "seq"}}, config)


_BERT_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128, vocab_size=1000, max_position_embeddings=256)
MODELS: dict[str, CorpusModel] = {m.name: m for m in (
    CorpusModel("resnet50", ModelKind.IMAGE, _image(
        "ResNetConfig", "ResNetForImageClassification", {},
        dict(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)),
        "ResNet-50 (transformers ResNetForImageClassification)"),
    CorpusModel("mobilenet_v2", ModelKind.IMAGE, _image(
        "MobileNetV2Config", "MobileNetV2ForImageClassification", {},
        dict(depth_multiplier=0.35, num_labels=10), small_size=64),
        "MobileNetV2 1.0 224 (transformers; V3 is not in transformers)"),
    CorpusModel("efficientnet_b0", ModelKind.IMAGE, _image(
        "EfficientNetConfig", "EfficientNetForImageClassification", {},
        dict(width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320, num_labels=10)),
        "EfficientNet-B0 (transformers)"),
    CorpusModel("convnext_tiny", ModelKind.IMAGE, _image(
        "ConvNextConfig", "ConvNextForImageClassification", {},
        dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10)),
        "ConvNeXt-tiny (transformers)"),
    CorpusModel("vit_b16", ModelKind.IMAGE, _image(
        "ViTConfig", "ViTForImageClassification", dict(num_labels=1000),
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, image_size=64, patch_size=16, num_labels=10)),
        "ViT-B/16 224 (transformers)"),
    CorpusModel("swin_tiny", ModelKind.IMAGE, _image(
        "SwinConfig", "SwinForImageClassification", dict(num_labels=1000),
        dict(embed_dim=16, depths=[1, 1], num_heads=[2, 4], image_size=64, window_size=4,
             num_labels=10)),
        "Swin-tiny patch4 window7 224 (transformers)"),
    CorpusModel("bert_base", ModelKind.TEXT, _text("BertConfig", "BertModel", {}, _BERT_SMALL),
                "BERT-base uncased shape (transformers BertModel)", (16, 128), 16, 128),
    CorpusModel("distilbert", ModelKind.TEXT, _text(
        "DistilBertConfig", "DistilBertModel", {},
        dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=1000,
             max_position_embeddings=256)),
        "DistilBERT-base (transformers DistilBertModel)", (16, 128), 16, 128),
    CorpusModel("gpt2", ModelKind.TEXT, _text(
        "GPT2Config", "GPT2LMHeadModel", GPT2_FULL, GPT2_SMALL, output="logits"),
        "GPT-2 small with its LM head, no KV cache (transformers GPT2LMHeadModel)",
        (16, 128), 16, 128),
    CorpusModel("gpt2_past", ModelKind.TEXT, _gpt2_past,
                "GPT-2 small, one decoding step with past keys and values as inputs",
                (16, 128), 16, 128),
    CorpusModel("t5_small_encoder", ModelKind.TEXT, _text(
        "T5Config", "T5EncoderModel", {},
        dict(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=1000)),
        "T5-small encoder (transformers T5EncoderModel)", (16, 128), 16, 128),
    CorpusModel("whisper_tiny_encoder", ModelKind.AUDIO, _whisper,
                "Whisper-tiny encoder, 30 s of 80 mel bins (transformers WhisperEncoder)"),
    CorpusModel("torch_transformer", ModelKind.TEXT, _torch_encoder,
                "torch.nn.TransformerEncoder: 4 layers, d=256, 4 heads, batch_first",
                (16, 128), 16, 128),
)}
