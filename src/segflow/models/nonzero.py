"""nonzero_mid: compute -> NonZero -> compute, a data-dependent op in mid-graph.

x [batch, 16] -> Gemm -> Relu = h; NonZero(h > 0) lists the active units; their column
indices gather rows of an embedding table whose mean (sum / (count + 1)) is added back
to h before a final Gemm. The output shape [batch, 8] is static even though the
NonZero result is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from segflow.models._onnx_builder import FLOAT, GraphBuilder


@dataclass(frozen=True, slots=True)
class NonZeroConfig:
    """Layer sizes (fixed)."""

    in_features: int = 16
    hidden: int = 32
    out_features: int = 8


def emit(cfg: NonZeroConfig, b: GraphBuilder) -> None:
    """Emit x [batch, 16] -> y [batch, 8] with a NonZero between the two Gemms."""
    h_dim = cfg.hidden
    x = b.add_input("x", FLOAT, ["batch", cfg.in_features])
    h = b.gemm(x, "fc1", cfg.in_features, h_dim)
    h = b.node("Relu", [h], "relu1")
    active = b.node("Greater", [h, b.const("float.0", 0.0)], "active")
    nz = b.node("NonZero", [active], "nonzero")  # [2, K], K known only at run time
    cols = b.node("Gather", [nz, b.const("int.1", 1)], "active_columns", axis=0)
    table = b.param("table.weight", b.normal((h_dim, h_dim), std=float(1 / np.sqrt(h_dim))))
    rows = b.node("Gather", [table, cols], "table_lookup", axis=0)
    total = b.node("ReduceSum", [rows, b.const("int.[0]", [0])], "table_sum", keepdims=1)
    count = b.node("Shape", [nz], "count", start=1, end=2)
    count = b.node("Cast", [count], "count_float", to=FLOAT)
    count = b.node("Add", [count, b.const("float.1", 1.0)], "count_plus_one")
    mean = b.node("Div", [total, count], "table_mean")
    z = b.node("Add", [h, mean], "mix")
    b.gemm(z, "fc2", h_dim, cfg.out_features, output="y")
    b.add_output("y", FLOAT, ["batch", cfg.out_features])


def example_inputs(
    cfg: NonZeroConfig, batch_size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Standard-normal rows."""
    return {"x": rng.standard_normal((batch_size, cfg.in_features), dtype=np.float32)}


class NonZeroMid(nn.Module):
    """PyTorch twin of nonzero_mid (torch.nonzero returns [K, 2], ONNX NonZero [2, K])."""

    def __init__(self, cfg: NonZeroConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.in_features, cfg.hidden)
        self.table = nn.Embedding(cfg.hidden, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        active = torch.nonzero(h > 0)
        total = self.table(active[:, 1]).sum(dim=0, keepdim=True)
        return self.fc2(h + total / (active.shape[0] + 1.0))
