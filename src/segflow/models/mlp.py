"""mlp_chain: many tiny Gemm + Relu layers, an overhead-bound model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from segflow.models._onnx_builder import FLOAT, GraphBuilder


@dataclass(frozen=True, slots=True)
class MlpConfig:
    """`layers` Gemm + Relu pairs of size `width` x `width`."""

    layers: int = 200
    width: int = 64

    def __post_init__(self) -> None:
        if self.layers < 1 or self.width < 1:
            raise ValueError(f"layers and width must be >= 1, got {self.layers}, {self.width}")


def emit(cfg: MlpConfig, b: GraphBuilder) -> None:
    """Emit x [batch, width] -> (Gemm -> Relu) * layers -> y [batch, width]."""
    x = b.add_input("x", FLOAT, ["batch", cfg.width])
    # He-normal weights keep the scale of a Relu chain roughly constant with depth.
    std = float(np.sqrt(2.0 / cfg.width))
    for i in range(cfg.layers):
        x = b.gemm(x, f"layers.{i}.linear", cfg.width, cfg.width, std=std)
        last = i == cfg.layers - 1
        x = b.node("Relu", [x], f"layers.{i}.relu", output="y" if last else None)
    b.add_output("y", FLOAT, ["batch", cfg.width])


def example_inputs(
    cfg: MlpConfig, batch_size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Standard-normal rows."""
    return {"x": rng.standard_normal((batch_size, cfg.width), dtype=np.float32)}


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class MlpChain(nn.Module):
    """PyTorch twin of mlp_chain."""

    def __init__(self, cfg: MlpConfig) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(Layer(cfg.width) for _ in range(cfg.layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
