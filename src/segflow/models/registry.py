"""The table of named models and the public functions over it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any

import numpy as np
import onnx
from torch import nn

from segflow.models import bert, mlp, mobilenet, nonzero, resnet
from segflow.models._onnx_builder import GraphBuilder
from segflow.models._torch_util import load_state


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What `segflow models` lists: name, one-line summary, graph I/O and default options."""

    name: str
    summary: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    default_options: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class _Family:
    """The three functions every architecture module provides, over its config type."""

    emit: Callable[[Any, GraphBuilder], None]
    torch_module: Callable[[Any], nn.Module]
    example_inputs: Callable[[Any, int, np.random.Generator], dict[str, np.ndarray]]


@dataclass(frozen=True, slots=True)
class _Entry:
    info: ModelInfo
    family: _Family
    make_config: Callable[..., Any]


_RESNET = _Family(resnet.emit, resnet.ResNet, resnet.example_inputs)
_MOBILENET = _Family(mobilenet.emit, mobilenet.MobileNetV2, mobilenet.example_inputs)
_BERT = _Family(bert.emit, bert.Bert, bert.example_inputs)
_MLP = _Family(mlp.emit, mlp.MlpChain, mlp.example_inputs)
_NONZERO = _Family(nonzero.emit, nonzero.NonZeroMid, nonzero.example_inputs)

_IMAGE = {"num_classes": 1000, "image_size": 224}
_BERT_BASE = {
    "seq_len": 128,
    "layers": 12,
    "hidden": 768,
    "heads": 12,
    "ffn": 3072,
    "vocab": 30522,
    "max_positions": 512,
}
_BERT_TINY = {
    "seq_len": 128,
    "layers": 2,
    "hidden": 128,
    "heads": 2,
    "ffn": 512,
    "vocab": 1000,
    "max_positions": 128,
}
_IMAGE_IO = (("input",), ("logits",))
_BERT_IO = (("input_ids", "attention_mask"), ("last_hidden_state", "pooler_output"))


def _entry(
    name: str,
    summary: str,
    io: tuple[tuple[str, ...], tuple[str, ...]],
    defaults: Mapping[str, int],
    family: _Family,
    make_config: Callable[..., Any],
) -> tuple[str, _Entry]:
    info = ModelInfo(name, summary, io[0], io[1], MappingProxyType(dict(defaults)))
    return name, _Entry(info, family, make_config)


_MODELS: Mapping[str, _Entry] = MappingProxyType(
    dict(
        [
            _entry(
                "resnet50",
                "ResNet-50 v1.5 image classifier (bottleneck blocks 3-4-6-3), ~25.6M params",
                _IMAGE_IO,
                _IMAGE,
                _RESNET,
                partial(resnet.ResNetConfig, bottleneck=True, blocks=(3, 4, 6, 3)),
            ),
            _entry(
                "resnet18",
                "ResNet-18 image classifier (basic blocks 2-2-2-2), ~11.7M params",
                _IMAGE_IO,
                _IMAGE,
                _RESNET,
                partial(resnet.ResNetConfig, bottleneck=False, blocks=(2, 2, 2, 2)),
            ),
            _entry(
                "mobilenet_v2",
                "MobileNetV2 image classifier (depthwise convs, Clip as ReLU6), ~3.5M params",
                _IMAGE_IO,
                _IMAGE,
                _MOBILENET,
                mobilenet.MobileNetConfig,
            ),
            _entry(
                "bert_base",
                "BERT-base encoder (12 layers, hidden 768), ~110M params, symbolic seq dim",
                _BERT_IO,
                _BERT_BASE,
                _BERT,
                bert.BertConfig,
            ),
            _entry(
                "bert_tiny",
                "BERT-tiny encoder (2 layers, hidden 128), ~0.6M params, symbolic seq dim",
                _BERT_IO,
                _BERT_TINY,
                _BERT,
                bert.BertConfig,
            ),
            _entry(
                "mlp_chain",
                "chain of tiny Gemm + Relu layers (default 200 x 64 wide): overhead-bound",
                (("x",), ("y",)),
                {"layers": 200, "width": 64},
                _MLP,
                mlp.MlpConfig,
            ),
            _entry(
                "nonzero_mid",
                "small MLP with a data-dependent NonZero between compute nodes",
                (("x",), ("y",)),
                {},
                _NONZERO,
                nonzero.NonZeroConfig,
            ),
        ]
    )
)


def available() -> list[str]:
    """Names accepted by `build`, e.g. ["resnet50", "resnet18", ...]."""
    return list(_MODELS)


def info(name: str) -> ModelInfo:
    """Description of model `name`: summary, input/output names and default options."""
    return _lookup(name).info


def build(name: str, *, seed: int = 0, **options: int) -> onnx.ModelProto:
    """Build model `name` as ONNX with weights drawn from `seed`.

    >>> model = build("resnet18", num_classes=10, image_size=64)
    """
    entry, config = _configure(name, options)
    builder = GraphBuilder(name, seed)
    entry.family.emit(config, builder)
    return builder.to_model()


def torch_module(name: str, *, seed: int = 0, **options: int) -> nn.Module:
    """The PyTorch eval-mode twin of `build(name, seed=seed, **options)`, same weights.

    Call it with the ONNX inputs as keyword arguments (`module(**tensors)`); it returns
    the ONNX outputs in graph order (a tuple when the graph has several).
    """
    entry, config = _configure(name, options)
    builder = GraphBuilder(name, seed)
    entry.family.emit(config, builder)
    return load_state(partial(entry.family.torch_module, config), builder.state_dict)


def example_inputs(
    name: str, *, batch_size: int = 1, seed: int = 0, **options: int
) -> dict[str, np.ndarray]:
    """Random valid feeds for model `name`, keyed by its input names."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    entry, config = _configure(name, options)
    return entry.family.example_inputs(config, batch_size, np.random.default_rng(seed))


def _lookup(name: str) -> _Entry:
    entry = _MODELS.get(name)
    if entry is None:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(_MODELS)}")
    return entry


def _configure(name: str, options: Mapping[str, int]) -> tuple[_Entry, Any]:
    entry = _lookup(name)
    defaults = entry.info.default_options
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        accepted = ", ".join(defaults) or "none"
        raise ValueError(f"model {name!r} has no option {', '.join(unknown)}; accepts: {accepted}")
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"option {key} of {name!r} must be a positive int, got {value!r}")
    return entry, entry.make_config(**{**defaults, **options})
