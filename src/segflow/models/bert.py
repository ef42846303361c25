"""BERT encoder (Hugging Face BertModel layout) as ONNX and as a PyTorch module.

The ONNX graph follows what torch.onnx emits at opset 17: Gather embeddings, position
embeddings sliced to the runtime sequence length, LayerNormalization, MatMul + Add
projections, Reshape/Transpose heads, the (1 - mask) * -10000 attention bias and GELU as
the Erf pattern. Batch and sequence dimensions are symbolic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from segflow.models._onnx_builder import FLOAT, INT64, GraphBuilder

INIT_STD = 0.02
LAYER_NORM_EPS = 1e-12
MASK_BIAS = -10000.0
TYPE_VOCAB = 2
_QKV = ("query", "key", "value")


@dataclass(frozen=True, slots=True)
class BertConfig:
    """BERT hyper-parameters; `seq_len` only sizes `example_inputs`."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int
    seq_len: int = 128

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if not 1 <= self.seq_len <= self.max_positions:
            raise ValueError(f"seq_len must be in [1, {self.max_positions}], got {self.seq_len}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _layer_norm(b: GraphBuilder, x: str, prefix: str, width: int, output: str | None = None) -> str:
    gamma = b.param(f"{prefix}.weight", b.normal((width,), std=INIT_STD, mean=1.0))
    beta = b.param(f"{prefix}.bias", b.normal((width,), std=INIT_STD))
    return b.node(
        "LayerNormalization",
        [x, gamma, beta],
        prefix,
        output=output,
        axis=-1,
        epsilon=LAYER_NORM_EPS,
    )


def _embeddings(b: GraphBuilder, cfg: BertConfig, ids: str) -> str:
    p = "embeddings"
    word = b.param(f"{p}.word_embeddings.weight", b.normal((cfg.vocab, cfg.hidden), INIT_STD))
    pos_table = b.normal((cfg.max_positions, cfg.hidden), INIT_STD)
    pos = b.param(f"{p}.position_embeddings.weight", pos_table)
    tok = b.param(f"{p}.token_type_embeddings.weight", b.normal((TYPE_VOCAB, cfg.hidden), INIT_STD))
    x = b.node("Gather", [word, ids], f"{p}.word_embeddings", axis=0)
    # position ids are Range(0, seq): any seq <= max_positions works
    shape = b.node("Shape", [ids], f"{p}.ids_shape")
    seq = b.node("Gather", [shape, b.const("int.1", 1)], f"{p}.seq_len", axis=0)
    position_ids = b.node(
        "Range", [b.const("int.0", 0), seq, b.const("int.1", 1)], f"{p}.position_ids"
    )
    positions = b.node("Gather", [pos, position_ids], f"{p}.position_embeddings", axis=0)
    # no token_type_ids input: every token has type 0
    token_type = b.node("Gather", [tok, b.const("int.0", 0)], f"{p}.token_type_embeddings")
    x = b.node("Add", [x, positions], f"{p}.add_positions")
    x = b.node("Add", [x, token_type], f"{p}.add_token_type")
    return _layer_norm(b, x, f"{p}.LayerNorm", cfg.hidden)


def _attention_bias(b: GraphBuilder, mask: str) -> str:
    """[batch, seq] int64 mask -> [batch, 1, 1, seq] float additive bias."""
    x = b.node("Unsqueeze", [mask, b.const("int.[1,2]", [1, 2])], "mask.unsqueeze")
    x = b.node("Cast", [x], "mask.cast", to=FLOAT)
    x = b.node("Sub", [b.const("float.1", 1.0), x], "mask.invert")
    return b.node("Mul", [x, b.const("float.mask_bias", MASK_BIAS)], "mask.bias")


def _split_heads(b: GraphBuilder, cfg: BertConfig, x: str, name: str, perm: list[int]) -> str:
    shape = b.const("shape.split_heads", [0, 0, cfg.heads, cfg.head_dim])
    x = b.node("Reshape", [x, shape], f"{name}.reshape")
    return b.node("Transpose", [x], f"{name}.transpose", perm=perm)


def _layer(b: GraphBuilder, cfg: BertConfig, x: str, bias: str, p: str, output: str | None) -> str:
    h = cfg.hidden
    att = f"{p}.attention.self"
    q, k, v = (b.matmul_add(x, f"{att}.{n}", h, h, std=INIT_STD) for n in _QKV)
    q = _split_heads(b, cfg, q, f"{att}.query", [0, 2, 1, 3])
    k_t = _split_heads(b, cfg, k, f"{att}.key", [0, 2, 3, 1])  # K already transposed
    v = _split_heads(b, cfg, v, f"{att}.value", [0, 2, 1, 3])
    scores = b.node("MatMul", [q, k_t], f"{att}.scores")
    scale = b.const("float.sqrt_head_dim", math.sqrt(cfg.head_dim))
    scores = b.node("Div", [scores, scale], f"{att}.scale")
    scores = b.node("Add", [scores, bias], f"{att}.mask")
    probs = b.node("Softmax", [scores], f"{att}.softmax", axis=-1)
    ctx = b.node("MatMul", [probs, v], f"{att}.context")
    ctx = b.node("Transpose", [ctx], f"{att}.merge.transpose", perm=[0, 2, 1, 3])
    merge = b.const("shape.merge_heads", [0, 0, h])
    ctx = b.node("Reshape", [ctx, merge], f"{att}.merge.reshape")
    a = b.matmul_add(ctx, f"{p}.attention.output.dense", h, h, std=INIT_STD)
    a = b.node("Add", [a, x], f"{p}.attention.output.residual")
    a = _layer_norm(b, a, f"{p}.attention.output.LayerNorm", h)
    y = b.matmul_add(a, f"{p}.intermediate.dense", h, cfg.ffn, std=INIT_STD)
    y = _gelu(b, y, f"{p}.intermediate.gelu")
    y = b.matmul_add(y, f"{p}.output.dense", cfg.ffn, h, std=INIT_STD)
    y = b.node("Add", [y, a], f"{p}.output.residual")
    return _layer_norm(b, y, f"{p}.output.LayerNorm", h, output)


def _gelu(b: GraphBuilder, x: str, name: str) -> str:
    """x * 0.5 * (1 + erf(x / sqrt(2))), node for node as the exporter writes it."""
    y = b.node("Div", [x, b.const("float.sqrt2", math.sqrt(2.0))], f"{name}.div")
    y = b.node("Erf", [y], f"{name}.erf")
    y = b.node("Add", [y, b.const("float.1", 1.0)], f"{name}.add")
    y = b.node("Mul", [x, y], f"{name}.mul")
    return b.node("Mul", [y, b.const("float.0.5", 0.5)], f"{name}.half")


def emit(cfg: BertConfig, b: GraphBuilder) -> None:
    """Emit BERT: input_ids, attention_mask [batch, seq] -> last_hidden_state, pooler_output."""
    ids = b.add_input("input_ids", INT64, ["batch", "seq"])
    mask = b.add_input("attention_mask", INT64, ["batch", "seq"])
    x = _embeddings(b, cfg, ids)
    bias = _attention_bias(b, mask)
    for i in range(cfg.layers):
        last = i == cfg.layers - 1
        x = _layer(b, cfg, x, bias, f"encoder.layer.{i}", "last_hidden_state" if last else None)
    first = b.node("Gather", [x, b.const("int.0", 0)], "pooler.first_token", axis=1)
    pooled = b.gemm(first, "pooler.dense", cfg.hidden, cfg.hidden, std=INIT_STD)
    b.node("Tanh", [pooled], "pooler.tanh", output="pooler_output")
    b.add_output("last_hidden_state", FLOAT, ["batch", "seq", cfg.hidden])
    b.add_output("pooler_output", FLOAT, ["batch", cfg.hidden])


def example_inputs(
    cfg: BertConfig, batch_size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Random token ids; row 0 is unpadded, other rows are right-padded to random lengths."""
    seq = cfg.seq_len
    ids = rng.integers(0, cfg.vocab, size=(batch_size, seq), dtype=np.int64)
    lengths = rng.integers((seq + 1) // 2, seq + 1, size=batch_size)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product attention with an additive mask bias."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        return x.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
        ctx = torch.softmax(scores, dim=-1) @ v
        return ctx.transpose(1, 2).flatten(2)


class DenseResidualNorm(nn.Module):
    """LayerNorm(dense(x) + residual): BERT's attention.output and output blocks."""

    def __init__(self, fin: int, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(fin, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseResidualNorm(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, bias), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseResidualNorm(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        a = self.attention(x, bias)
        return self.output(self.intermediate(a), a)


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(TYPE_VOCAB, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=LAYER_NORM_EPS)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[:seq]
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class Encoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, bias)
        return x


class Pooler(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class Bert(nn.Module):
    """PyTorch BERT encoder with parameter names equal to the builder's state dict."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.pooler = Pooler(cfg)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bias = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * MASK_BIAS
        x = self.encoder(self.embeddings(input_ids), bias)
        return x, self.pooler(x)
