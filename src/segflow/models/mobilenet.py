"""MobileNetV2 (torchvision layout, width 1.0) as ONNX and as a PyTorch module."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from segflow.models._onnx_builder import FLOAT, GraphBuilder

# (expand ratio t, output channels c, repeats n, first stride s), as in the paper.
INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
STEM_CHANNELS = 32
LAST_CHANNELS = 1280
GAMMA = (0.5, 1.5)


@dataclass(frozen=True, slots=True)
class MobileNetConfig:
    """User options of MobileNetV2."""

    num_classes: int = 1000
    image_size: int = 224


def _block_plan() -> list[tuple[int, int, int, int]]:
    """(in_channels, out_channels, stride, expand_ratio) for features.1 .. features.17."""
    plan = []
    cin = STEM_CHANNELS
    for t, c, n, s in INVERTED_RESIDUAL_SETTING:
        for i in range(n):
            plan.append((cin, c, s if i == 0 else 1, t))
            cin = c
    return plan


ConvSpec = tuple[int, int, int, int, int]


def _conv_bn_layers(cin: int, cout: int, stride: int, t: int) -> list[ConvSpec]:
    """(cin, cout, kernel, stride, group) of the convs in one inverted-residual block."""
    hidden = cin * t
    layers: list[ConvSpec] = [] if t == 1 else [(cin, hidden, 1, 1, 1)]
    layers += [(hidden, hidden, 3, stride, hidden), (hidden, cout, 1, 1, 1)]
    return layers


def _relu6(b: GraphBuilder, x: str, name: str) -> str:
    low = b.const("relu6.min", 0.0)
    high = b.const("relu6.max", 6.0)
    return b.node("Clip", [x, low, high], name)


def emit(cfg: MobileNetConfig, b: GraphBuilder) -> None:
    """Emit MobileNetV2: input [batch, 3, H, W] -> logits [batch, num_classes]."""
    size = cfg.image_size
    x = b.add_input("input", FLOAT, ["batch", 3, size, size])
    x = b.conv(x, "features.0.0", 3, STEM_CHANNELS, 3, stride=2)
    x = _relu6(b, b.batch_norm(x, "features.0.1", STEM_CHANNELS, GAMMA), "features.0.2")
    plan = _block_plan()
    for index, (cin, cout, stride, t) in enumerate(plan, start=1):
        y = x
        layers = _conv_bn_layers(cin, cout, stride, t)
        for j, (c_in, c_out, kernel, s, group) in enumerate(layers[:-1]):
            prefix = f"features.{index}.conv.{j}"
            y = b.conv(y, f"{prefix}.0", c_in, c_out, kernel, stride=s, group=group)
            y = _relu6(b, b.batch_norm(y, f"{prefix}.1", c_out, GAMMA), f"{prefix}.2")
        j = len(layers) - 1
        c_in, c_out, _, _, _ = layers[-1]
        y = b.conv(y, f"features.{index}.conv.{j}", c_in, c_out, 1)
        y = b.batch_norm(y, f"features.{index}.conv.{j + 1}", c_out, GAMMA)
        x = b.node("Add", [x, y], f"features.{index}.add") if stride == 1 and cin == cout else y
    last = len(plan) + 1
    x = b.conv(x, f"features.{last}.0", 320, LAST_CHANNELS, 1)
    x = b.batch_norm(x, f"features.{last}.1", LAST_CHANNELS, GAMMA)
    x = _relu6(b, x, f"features.{last}.2")
    x = b.node("GlobalAveragePool", [x], "avgpool")
    x = b.node("Flatten", [x], "flatten", axis=1)
    b.gemm(x, "classifier.1", LAST_CHANNELS, cfg.num_classes, output="logits")
    b.add_output("logits", FLOAT, ["batch", cfg.num_classes])


def example_inputs(
    cfg: MobileNetConfig, batch_size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """A standard-normal image batch."""
    shape = (batch_size, 3, cfg.image_size, cfg.image_size)
    return {"input": rng.standard_normal(shape, dtype=np.float32)}


def _conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int, group: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=group, bias=False),
        nn.BatchNorm2d(cout, eps=1e-5),
        nn.ReLU6(),
    )


class InvertedResidual(nn.Module):
    """Expand (1x1) -> depthwise (3x3) -> linear projection (1x1), residual when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, t: int) -> None:
        super().__init__()
        layers = _conv_bn_layers(cin, cout, stride, t)
        modules: list[nn.Module] = [_conv_bn_relu6(*spec) for spec in layers[:-1]]
        modules += [nn.Conv2d(layers[-1][0], cout, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-5)]
        self.conv = nn.Sequential(*modules)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return x + y if self.use_residual else y


class MobileNetV2(nn.Module):
    """PyTorch MobileNetV2 with parameter names equal to the ONNX initializer names."""

    def __init__(self, cfg: MobileNetConfig) -> None:
        super().__init__()
        features: list[nn.Module] = [_conv_bn_relu6(3, STEM_CHANNELS, 3, 2, 1)]
        features += [InvertedResidual(*spec) for spec in _block_plan()]
        features.append(_conv_bn_relu6(320, LAST_CHANNELS, 1, 1, 1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(LAST_CHANNELS, cfg.num_classes))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.features(input).mean(dim=(2, 3), keepdim=True)
        return self.classifier(torch.flatten(x, 1))
