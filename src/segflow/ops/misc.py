"""Signal processing, text features, random generators and sequence-reordering ops: DFT,
STFT, window functions, MelWeightMatrix, TfIdfVectorizer (integer tokens), RandomNormal/
RandomUniform(Like), Bernoulli, Multinomial and ReverseSequence.

A ``seed`` attribute seeds a generator owned by the bound kernel: runs of one session
continue its sequence (as onnxruntime does), and two sessions with the same seed agree.

Complex tensors follow ONNX's convention: a trailing axis of size 2 holds
(real, imaginary); a trailing axis of size 1 is a real signal. Ops whose
output shape comes from an input's *value* (a window size, a DFT length) run
LOCAL unless that input is a constant, so a device never syncs mid-segment.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from segflow.engine.base import ExecType
from segflow.errors import InvalidModel, UnsupportedOp
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.ops import gradients
from segflow.ops._common import const_input, normalize_axis
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
Inputs = Sequence[Tensor | None]


def _local_unless_const(*indices: int) -> Callable[[Node], ExecType]:
    """SYNC when every listed (present) input is a constant, else LOCAL."""

    def classify(node: Node) -> ExecType:
        for i in indices:
            if i < len(node.inputs) and node.inputs[i] is not None and const_input(node, i) is None:
                return ExecType.LOCAL
        return ExecType.SYNC
    return classify


def _scalar(t: Tensor | None, default: float | None = None) -> float:
    if t is None or t.numel() == 0:
        if default is None:
            raise ValueError("a required scalar input is missing")
        return default
    return t.reshape(-1)[0].item()


def _output_dtype(node: Node) -> torch.dtype:
    code = int(node.attrs.get("output_datatype", 1))
    try:
        return DType.from_onnx(code).torch
    except ValueError as exc:
        raise InvalidModel(f"{node.label}: {exc}") from None


# -- Fourier transforms ------------------------------------------------------------------

def _as_complex(x: Tensor) -> Tensor:
    """[..., 1] real or [..., 2] (re, im) -> a complex (or real) tensor without the last axis."""
    work = x if x.dtype == torch.float64 else x.to(torch.float32)
    if x.shape[-1] == 1:
        return work[..., 0]
    return torch.complex(work[..., 0], work[..., 1])


def _as_pairs(z: Tensor, dtype: torch.dtype) -> Tensor:
    if not z.is_complex():
        return z.unsqueeze(-1).to(dtype)
    return torch.view_as_real(z).to(dtype)


def dft(x: Tensor, length: int | None, axis: int, inverse: bool, onesided: bool) -> Tensor:
    """ONNX DFT along ``axis`` (an axis of ``x``, not the trailing complex axis)."""
    a = axis % x.dim()
    signal = _as_complex(x)
    size = x.shape[a]
    if length is None:
        length = 2 * (size - 1) if inverse and onesided else size
    if inverse:
        if onesided:
            return torch.fft.irfft(signal, n=length, dim=a).unsqueeze(-1).to(x.dtype)
        return _as_pairs(torch.fft.ifft(signal, n=length, dim=a), x.dtype)
    out = torch.fft.fft(signal, n=length, dim=a)
    if onesided:
        out = out.narrow(a, 0, length // 2 + 1)
    return _as_pairs(out, x.dtype)


def _dft(node: Node, ctx: BindContext) -> Kernel:
    old = node.opset < 20
    attr_axis = int(node.attrs.get("axis", 1)) if old else None
    inverse = bool(int(node.attrs.get("inverse", 0)))
    onesided = bool(int(node.attrs.get("onesided", 0)))

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        length_t = inputs[1] if len(inputs) > 1 else None
        length = None if length_t is None or length_t.numel() == 0 else int(_scalar(length_t))
        axis = attr_axis if attr_axis is not None else int(
            _scalar(inputs[2] if len(inputs) > 2 else None, -2))
        return [dft(x, length, axis, inverse, onesided)]
    return kernel


def _stft(node: Node, ctx: BindContext) -> Kernel:
    onesided = bool(int(node.attrs.get("onesided", 1)))

    def kernel(inputs: Inputs) -> list[Tensor]:
        x, step_t = inputs[0], inputs[1]
        assert x is not None and step_t is not None
        window = inputs[2] if len(inputs) > 2 else None
        length_t = inputs[3] if len(inputs) > 3 else None
        step = int(_scalar(step_t))
        if length_t is not None:
            frame = int(_scalar(length_t))
        else:
            frame = window.shape[0] if window is not None else x.shape[-2]
        signal = _as_complex(x)  # [batch, length]
        frames = signal.unfold(-1, frame, step)  # [batch, n_frames, frame]
        if window is not None:
            frames = frames * window.to(torch.float64 if x.dtype == torch.float64
                                        else torch.float32)
        out = torch.fft.fft(frames, n=frame, dim=-1)
        if onesided:
            out = out[..., : frame // 2 + 1]
        return [_as_pairs(out, x.dtype)]
    return kernel


# -- windows -----------------------------------------------------------------------------

def _window(kind: str) -> Callable[[Node, BindContext], Kernel]:
    def bind(node: Node, ctx: BindContext) -> Kernel:
        dtype = _output_dtype(node)
        periodic = bool(int(node.attrs.get("periodic", 1)))

        def kernel(inputs: Inputs) -> list[Tensor]:
            size = int(_scalar(inputs[0]))
            n = torch.arange(size, dtype=torch.float64)
            denom = size if periodic else size - 1
            if kind == "hann":
                w = torch.sin(n * math.pi / denom) ** 2
            elif kind == "hamming":
                alpha = 25.0 / 46.0
                w = alpha - torch.cos(n * 2 * math.pi / denom) * (1 - alpha)
            else:
                w = (0.42 - 0.5 * torch.cos(n * 2 * math.pi / denom)
                     + 0.08 * torch.cos(n * 4 * math.pi / denom))
            return [w.to(ctx.device, dtype)]
        return kernel
    return bind


def mel_weight_matrix(bins: int, dft_length: int, sample_rate: int, lower: float,
                      upper: float) -> np.ndarray:
    """Triangular mel filter bank, as the ONNX reference builds it."""
    spectrogram_bins = dft_length // 2 + 1
    low_mel = 2595 * np.log1p(lower / 700) / np.log(10)
    high_mel = 2595 * np.log1p(upper / 700) / np.log(10)
    points = np.arange(0, bins + 2)
    step = (high_mel - low_mel) / points.shape[0]
    hz = 700 * np.expm1((points * step + low_mel) / 2595 * np.log(10))
    edges = (((dft_length + 1) * hz) // sample_rate).astype(int)
    out = np.zeros((spectrogram_bins, bins))
    for i in range(bins):
        left, center, right = edges[i], edges[i + 1], edges[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            for j in range(left, center + 1):
                out[j, i] = (j - left) / (center - left)
        if right > center:
            for j in range(center, right):
                out[j, i] = (right - j) / (right - center)
    return out


def _mel_weight_matrix(node: Node, ctx: BindContext) -> Kernel:
    dtype = _output_dtype(node)

    def kernel(inputs: Inputs) -> list[Tensor]:
        bins, length, rate = (int(_scalar(t)) for t in inputs[:3])
        lower, upper = _scalar(inputs[3]), _scalar(inputs[4])
        table = mel_weight_matrix(bins, length, rate, lower, upper)
        return [torch.from_numpy(table).to(ctx.device, dtype)]
    return kernel


# -- ReverseSequence ---------------------------------------------------------------------

def _reverse_sequence(node: Node, ctx: BindContext) -> Kernel:
    batch_axis = int(node.attrs.get("batch_axis", 1))
    time_axis = int(node.attrs.get("time_axis", 0))
    if {batch_axis, time_axis} != {0, 1}:
        raise InvalidModel(f"{node.label}: batch_axis and time_axis must be 0 and 1 "
                           f"(got {batch_axis}, {time_axis})")

    def kernel(inputs: Inputs) -> list[Tensor]:
        x, lens = inputs[0], inputs[1]
        assert x is not None and lens is not None
        b, t = normalize_axis(batch_axis, x.dim()), normalize_axis(time_axis, x.dim())
        steps = torch.arange(x.shape[t], device=x.device).reshape(1, -1)
        lengths = lens.to(torch.int64).reshape(-1, 1)
        src = torch.where(steps < lengths, lengths - 1 - steps, steps)  # [batch, time]
        if b > t:
            src = src.t()
        index = src.reshape(*src.shape, *([1] * (x.dim() - 2))).expand(x.shape)
        return [torch.gather(x, t, index)]
    return kernel


# -- TfIdfVectorizer ---------------------------------------------------------------------

class TfIdfMode(enum.Enum):
    TF = "TF"
    IDF = "IDF"
    TFIDF = "TFIDF"


@dataclass(frozen=True, slots=True)
class NgramTable:
    """The pool's n-grams (integer tokens) -> output column, for sizes in [min, max]."""

    columns: dict[tuple[int, ...], int]
    min_n: int
    max_n: int
    max_skip: int
    width: int


def ngram_table(node: Node) -> NgramTable:
    attrs = node.attrs
    if attrs.get("pool_strings"):
        raise UnsupportedOp(f"{node.label}: TfIdfVectorizer over strings is not supported "
                            "(segflow's kernels are tensor-only); use pool_int64s")
    pool = [int(v) for v in attrs.get("pool_int64s", [])]
    counts = [int(v) for v in attrs["ngram_counts"]]
    indexes = [int(v) for v in attrs["ngram_indexes"]]
    min_n, max_n = int(attrs["min_gram_length"]), int(attrs["max_gram_length"])
    columns: dict[tuple[int, ...], int] = {}
    ngram_id = 0
    for i, start in enumerate(counts):
        n = i + 1
        end = counts[i + 1] if i + 1 < len(counts) else len(pool)
        for j in range(start, end - n + 1, n):
            if min_n <= n <= max_n:
                columns.setdefault(tuple(pool[j:j + n]), indexes[ngram_id])
            ngram_id += 1
    return NgramTable(columns, min_n, max_n, int(attrs.get("max_skip_count", 0)),
                      max(indexes) + 1)


def tfidf_counts(rows: list[list[int]], table: NgramTable) -> np.ndarray:
    """Occurrences of each pool n-gram per row; skips widen the gap between tokens."""
    out = np.zeros((len(rows), table.width), dtype=np.float32)
    for r, row in enumerate(rows):
        for skip in range(1, table.max_skip + 2):
            # Unigrams do not depend on the gap: count them once, at skip 1.
            first_n = table.min_n if skip == 1 else max(table.min_n, 2)
            for n in range(first_n, table.max_n + 1):
                for start in range(len(row) - skip * (n - 1)):
                    col = table.columns.get(tuple(row[start:start + skip * (n - 1) + 1:skip]))
                    if col is not None:
                        out[r, col] += 1
    return out


def _tfidf(node: Node, ctx: BindContext) -> Kernel:
    table = ngram_table(node)
    mode = TfIdfMode(str(node.attrs.get("mode", "TF")))
    weights = node.attrs.get("weights")
    w = np.asarray(weights, dtype=np.float32) if weights else None

    def kernel(inputs: Inputs) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        rows = x.reshape(1, -1).tolist() if x.dim() == 1 else x.tolist()
        counts = tfidf_counts(rows, table)
        if mode is TfIdfMode.IDF:
            counts = (counts > 0) * (w if w is not None else np.float32(1))
        elif mode is TfIdfMode.TFIDF and w is not None:
            counts = counts * w
        out = torch.from_numpy(np.ascontiguousarray(counts, dtype=np.float32))
        return [(out[0] if x.dim() == 1 else out).to(x.device)]
    return kernel


# -- random generators -------------------------------------------------------------------

def _generator(node: Node, ctx: BindContext) -> torch.Generator | None:
    """A generator seeded from the node's ``seed`` (advancing run to run), else torch's global."""
    if "seed" not in node.attrs:
        return None
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(int(float(node.attrs["seed"])))
    return gen


def _random_dtype(node: Node, like: Tensor | None) -> torch.dtype:
    code = node.attrs.get("dtype")
    if code is not None:
        return DType.from_onnx(int(code)).torch
    return like.dtype if like is not None else torch.float32


def _random(normal: bool, like: bool) -> Callable[[Node, BindContext], Kernel]:
    """RandomNormal/RandomUniform and their *Like forms (shape from the input)."""

    def bind(node: Node, ctx: BindContext) -> Kernel:
        gen = _generator(node, ctx)
        attrs = node.attrs
        a, b = ((float(attrs.get("mean", 0.0)), float(attrs.get("scale", 1.0))) if normal
                else (float(attrs.get("low", 0.0)), float(attrs.get("high", 1.0))))
        shape = None if like else [int(d) for d in attrs["shape"]]
        fixed_dtype = None if like else _random_dtype(node, None)

        def kernel(inputs: Inputs) -> list[Tensor]:
            src = inputs[0] if like else None
            size = list(src.shape) if src is not None else shape
            dtype = fixed_dtype or _random_dtype(node, src)
            work = torch.empty(size or [], dtype=torch.float64 if dtype == torch.float64
                               else torch.float32, device=ctx.device)
            if normal:
                work.normal_(a, b, generator=gen)
            else:
                work.uniform_(a, b, generator=gen)
            return [work.to(dtype)]
        return kernel
    return bind


def _bernoulli(node: Node, ctx: BindContext) -> Kernel:
    gen = _generator(node, ctx)

    def kernel(inputs: Inputs) -> list[Tensor]:
        p = inputs[0]
        assert p is not None
        draw = torch.bernoulli(p.to(torch.float64 if p.dtype == torch.float64
                                    else torch.float32), generator=gen)
        return [draw.to(_random_dtype(node, p))]
    return kernel


def _multinomial(node: Node, ctx: BindContext) -> Kernel:
    gen = _generator(node, ctx)
    samples = int(node.attrs.get("sample_size", 1))
    dtype = DType.from_onnx(int(node.attrs.get("dtype", 6))).torch

    def kernel(inputs: Inputs) -> list[Tensor]:
        logits = inputs[0]
        assert logits is not None
        # Input rows are unnormalized log-probabilities; sampling is with replacement.
        probs = torch.softmax(logits.to(torch.float64), dim=-1)
        return [torch.multinomial(probs, samples, replacement=True, generator=gen).to(dtype)]
    return kernel


OPS: list[OpDef] = [
    OpDef("DFT", _dft, since=17, classify=_local_unless_const(1, 2), grad=gradients.recompute),
    OpDef("STFT", _stft, since=17, classify=_local_unless_const(1, 3), grad=gradients.recompute),
    OpDef("HannWindow", _window("hann"), since=17, classify=_local_unless_const(0)),
    OpDef("HammingWindow", _window("hamming"), since=17, classify=_local_unless_const(0)),
    OpDef("BlackmanWindow", _window("blackman"), since=17, classify=_local_unless_const(0)),
    OpDef("MelWeightMatrix", _mel_weight_matrix, since=17,
          classify=_local_unless_const(0, 1, 2, 3, 4)),
    OpDef("ReverseSequence", _reverse_sequence, since=10, grad=gradients.recompute),
    OpDef("TfIdfVectorizer", _tfidf, since=9, exec_type=ExecType.LOCAL,
          doc="host-side n-gram counting"),
    OpDef("RandomNormal", _random(normal=True, like=False)),
    OpDef("RandomUniform", _random(normal=False, like=False)),
    OpDef("RandomNormalLike", _random(normal=True, like=True)),
    OpDef("RandomUniformLike", _random(normal=False, like=True)),
    OpDef("Bernoulli", _bernoulli, since=15),
    OpDef("Multinomial", _multinomial, since=7),
]
