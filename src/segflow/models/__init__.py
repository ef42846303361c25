"""Deterministic builders of standard architectures as ONNX, with PyTorch twins.

Weights are seeded random (no downloads); `torch_module` returns an eager module holding
exactly the weights of `build` for the same name, seed and options.

>>> from segflow import models
>>> model = models.build("bert_tiny", seed=0)
>>> feeds = models.example_inputs("bert_tiny", batch_size=2, seq_len=16)
"""

from segflow.models.registry import (
    ModelInfo,
    available,
    build,
    example_inputs,
    info,
    torch_module,
)

__all__ = ["ModelInfo", "available", "build", "example_inputs", "info", "torch_module"]
