"""ResNet-18/50 (torchvision layout, v1.5 strides) as ONNX and as a PyTorch module."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from segflow.models._onnx_builder import FLOAT, GraphBuilder

STAGE_WIDTHS = (64, 128, 256, 512)
# BatchNorm gamma ranges: the last BN of each residual branch is kept small so that the
# residual sum does not double the activation scale at every block.
GAMMA = (0.5, 1.5)
GAMMA_LAST = (0.1, 0.3)


@dataclass(frozen=True, slots=True)
class ResNetConfig:
    """Architecture (fixed per model name) and the user options."""

    bottleneck: bool
    blocks: tuple[int, int, int, int]
    num_classes: int = 1000
    image_size: int = 224

    @property
    def expansion(self) -> int:
        return 4 if self.bottleneck else 1


def _block_plan(cfg: ResNetConfig) -> list[tuple[str, int, int, int]]:
    """(prefix, in_channels, width, stride) for every residual block."""
    plan = []
    cin = 64
    for stage, (width, count) in enumerate(zip(STAGE_WIDTHS, cfg.blocks), start=1):
        for index in range(count):
            stride = 2 if stage > 1 and index == 0 else 1
            plan.append((f"layer{stage}.{index}", cin, width, stride))
            cin = width * cfg.expansion
    return plan


def emit(cfg: ResNetConfig, b: GraphBuilder) -> None:
    """Emit the ResNet graph: input [batch, 3, H, W] -> logits [batch, num_classes]."""
    size = cfg.image_size
    x = b.add_input("input", FLOAT, ["batch", 3, size, size])
    x = b.conv(x, "conv1", 3, 64, 7, stride=2)
    x = b.batch_norm(x, "bn1", 64, GAMMA)
    x = b.node("Relu", [x], "relu")
    x = b.node("MaxPool", [x], "maxpool", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    for prefix, cin, width, stride in _block_plan(cfg):
        x = _emit_block(b, cfg, x, prefix, cin, width, stride)
    x = b.node("GlobalAveragePool", [x], "avgpool")
    x = b.node("Flatten", [x], "flatten", axis=1)
    b.gemm(x, "fc", 512 * cfg.expansion, cfg.num_classes, output="logits")
    b.add_output("logits", FLOAT, ["batch", cfg.num_classes])


def _emit_block(
    b: GraphBuilder, cfg: ResNetConfig, x: str, prefix: str, cin: int, width: int, stride: int
) -> str:
    cout = width * cfg.expansion
    if cfg.bottleneck:
        convs = [(cin, width, 1, 1), (width, width, 3, stride), (width, cout, 1, 1)]
    else:
        convs = [(cin, width, 3, stride), (width, width, 3, 1)]
    y = x
    for i, (c_in, c_out, kernel, s) in enumerate(convs, start=1):
        last = i == len(convs)
        y = b.conv(y, f"{prefix}.conv{i}", c_in, c_out, kernel, stride=s)
        y = b.batch_norm(y, f"{prefix}.bn{i}", c_out, GAMMA_LAST if last else GAMMA)
        if not last:
            y = b.node("Relu", [y], f"{prefix}.relu{i}")
    shortcut = x
    if stride != 1 or cin != cout:
        shortcut = b.conv(x, f"{prefix}.downsample.0", cin, cout, 1, stride=stride)
        shortcut = b.batch_norm(shortcut, f"{prefix}.downsample.1", cout, GAMMA)
    y = b.node("Add", [y, shortcut], f"{prefix}.add")
    return b.node("Relu", [y], f"{prefix}.relu")


def example_inputs(
    cfg: ResNetConfig, batch_size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """A standard-normal image batch."""
    shape = (batch_size, 3, cfg.image_size, cfg.image_size)
    return {"input": rng.standard_normal(shape, dtype=np.float32)}


def _conv_bn(cin: int, cout: int, kernel: int, stride: int) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
    return conv, nn.BatchNorm2d(cout, eps=1e-5)


class Block(nn.Module):
    """Basic (two 3x3) or bottleneck (1x1, 3x3, 1x1) residual block."""

    def __init__(self, cfg: ResNetConfig, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * cfg.expansion
        if cfg.bottleneck:
            specs = [(cin, width, 1, 1), (width, width, 3, stride), (width, cout, 1, 1)]
        else:
            specs = [(cin, width, 3, stride), (width, width, 3, 1)]
        self.depth = len(specs)
        for i, spec in enumerate(specs, start=1):
            conv, bn = _conv_bn(*spec)
            self.add_module(f"conv{i}", conv)
            self.add_module(f"bn{i}", bn)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for i in range(1, self.depth + 1):
            y = getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(y))
            if i < self.depth:
                y = torch.relu(y)
        shortcut = x if self.downsample is None else self.downsample(x)
        return torch.relu(y + shortcut)


class ResNet(nn.Module):
    """PyTorch ResNet with parameter names equal to the ONNX initializer names."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, 64, 7, 2)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages: dict[str, list[nn.Module]] = {}
        for prefix, cin, width, stride in _block_plan(cfg):
            stage = prefix.split(".")[0]
            stages.setdefault(stage, []).append(Block(cfg, cin, width, stride))
        for stage, blocks in stages.items():
            self.add_module(stage, nn.Sequential(*blocks))
        self.fc = nn.Linear(512 * cfg.expansion, cfg.num_classes)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(input))))
        for stage in range(1, 5):
            x = getattr(self, f"layer{stage}")(x)
        return self.fc(torch.flatten(x.mean(dim=(2, 3), keepdim=True), 1))
