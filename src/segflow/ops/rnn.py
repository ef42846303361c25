"""Recurrent layers: RNN, GRU and LSTM (ONNX semantics, every attribute).

One kernel shape serves all three: the input projection ``X @ W^T + Wb`` is
computed for every time step at once, then a Python loop runs the recurrence
per direction. Supported: forward/reverse/bidirectional, ``sequence_lens``
(steps past a sequence's end leave its state alone and output zeros),
initial states, LSTM peepholes and ``input_forget``, GRU
``linear_before_reset``, ``clip``, ``layout`` and custom activations with
their alpha/beta.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from segflow.errors import UnsupportedOp
from segflow.ir.graph import Node
from segflow.ops import gradients
from segflow.ops._common import has_input
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
Activation = Callable[[Tensor], Tensor]


class Cell(enum.Enum):
    RNN = "RNN"
    GRU = "GRU"
    LSTM = "LSTM"

    @property
    def gates(self) -> int:
        return {Cell.RNN: 1, Cell.GRU: 3, Cell.LSTM: 4}[self]

    @property
    def default_activations(self) -> tuple[str, ...]:
        return {Cell.RNN: ("Tanh",), Cell.GRU: ("Sigmoid", "Tanh"),
                Cell.LSTM: ("Sigmoid", "Tanh", "Tanh")}[self]


# name -> (factory(alpha, beta), default alpha, default beta); None: the function takes no
# such parameter (so it consumes nothing from activation_alpha / activation_beta).
_ACTIVATIONS: dict[str, tuple[Callable[[float, float], Activation], float | None, float | None]] = {
    "relu": (lambda a, b: torch.relu, None, None),
    "tanh": (lambda a, b: torch.tanh, None, None),
    "sigmoid": (lambda a, b: torch.sigmoid, None, None),
    "softsign": (lambda a, b: F.softsign, None, None),
    "softplus": (lambda a, b: F.softplus, None, None),
    "affine": (lambda a, b: (lambda x: a * x + b), 1.0, 0.0),
    "leakyrelu": (lambda a, b: (lambda x: torch.where(x >= 0, x, a * x)), 0.01, None),
    "thresholdedrelu": (lambda a, b: (lambda x: torch.where(x > a, x, torch.zeros_like(x))),
                        1.0, None),
    "scaledtanh": (lambda a, b: (lambda x: a * torch.tanh(b * x)), 1.0, 1.0),
    "hardsigmoid": (lambda a, b: (lambda x: torch.clamp(a * x + b, 0.0, 1.0)), 0.2, 0.5),
    "elu": (lambda a, b: (lambda x: torch.where(x > 0, x, a * torch.expm1(x))), 1.0, None),
}


def parse_activations(names: Sequence[str], alphas: Sequence[float],
                      betas: Sequence[float]) -> list[Activation]:
    """Activation functions; alphas/betas are consumed in order by the functions that take them."""
    alpha_iter, beta_iter = iter(alphas), iter(betas)
    out = []
    for name in names:
        entry = _ACTIVATIONS.get(name.lower())
        if entry is None:
            raise UnsupportedOp(f"unsupported recurrent activation function {name!r}")
        factory, alpha_default, beta_default = entry
        alpha = next(alpha_iter, alpha_default) if alpha_default is not None else 0.0
        beta = next(beta_iter, beta_default) if beta_default is not None else 0.0
        out.append(factory(float(alpha), float(beta)))  # type: ignore[arg-type]
    return out


@dataclass(frozen=True, slots=True)
class RecurrentAttrs:
    """A recurrent node's attributes, parsed once at bind time."""

    cell: Cell
    hidden: int
    reverse: tuple[bool, ...]          # one entry per direction
    activations: tuple[tuple[Activation, ...], ...]  # per direction
    clip: float | None
    batch_first: bool                  # layout == 1
    linear_before_reset: bool
    input_forget: bool

    @classmethod
    def parse(cls, node: Node, cell: Cell) -> RecurrentAttrs:
        attrs = node.attrs
        direction = attrs.get("direction", "forward")
        reverse = {"forward": (False,), "reverse": (True,),
                   "bidirectional": (False, True)}.get(direction)
        if reverse is None:
            raise UnsupportedOp(f"{node.label}: unknown direction {direction!r}")
        per_dir = len(cell.default_activations)
        names = list(attrs.get("activations", cell.default_activations * len(reverse)))
        if len(names) == per_dir and len(reverse) == 2:
            names = names * 2
        funcs = parse_activations(names, list(attrs.get("activation_alpha", [])),
                                  list(attrs.get("activation_beta", [])))
        acts = tuple(tuple(funcs[d * per_dir:(d + 1) * per_dir]) for d in range(len(reverse)))
        clip = attrs.get("clip")
        return cls(cell, int(attrs.get("hidden_size", 0)), reverse, acts,
                   float(clip) if clip is not None else None, int(attrs.get("layout", 0)) == 1,
                   bool(attrs.get("linear_before_reset", 0)), bool(attrs.get("input_forget", 0)))


class _Step:
    """One direction's recurrence: weights split by gate, activations bound."""

    def __init__(self, attrs: RecurrentAttrs, direction: int, w: Tensor, r: Tensor,
                 b: Tensor | None, p: Tensor | None) -> None:
        self.attrs = attrs
        self.acts = attrs.activations[direction]
        hidden = r.shape[-1]
        gates = attrs.cell.gates
        self.w_t = w.t()
        self.r_t = r.t()
        if b is None:
            b = w.new_zeros(2 * gates * hidden)
        self.wb, self.rb = b[:gates * hidden], b[gates * hidden:]
        self.p = p
        self.hidden = hidden

    def _clip(self, x: Tensor) -> Tensor:
        c = self.attrs.clip
        return x if c is None else torch.clamp(x, -c, c)

    def rnn(self, xw: Tensor, h: Tensor) -> Tensor:
        (f,) = self.acts
        return f(self._clip(xw + h @ self.r_t + self.rb))

    def gru(self, xw: Tensor, h: Tensor) -> Tensor:
        f, g = self.acts
        n = self.hidden
        r_t, rb = self.r_t, self.rb
        zr = self._clip(xw[:, :2 * n] + h @ r_t[:, :2 * n] + rb[:2 * n])
        z, r = f(zr[:, :n]), f(zr[:, n:])
        if self.attrs.linear_before_reset:
            pre = xw[:, 2 * n:] + r * (h @ r_t[:, 2 * n:] + rb[2 * n:])
        else:
            pre = xw[:, 2 * n:] + (r * h) @ r_t[:, 2 * n:] + rb[2 * n:]
        candidate = g(self._clip(pre))
        return (1 - z) * candidate + z * h

    def lstm(self, xw: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        f, g, hact = self.acts
        n = self.hidden
        gates = xw + h @ self.r_t + self.rb
        i, o, fg, cand = gates[:, :n], gates[:, n:2 * n], gates[:, 2 * n:3 * n], gates[:, 3 * n:]
        if self.p is not None:
            i = i + self.p[:n] * c
            fg = fg + self.p[2 * n:] * c
        i = f(self._clip(i))
        fg = 1 - i if self.attrs.input_forget else f(self._clip(fg))
        c_new = fg * c + i * g(self._clip(cand))
        if self.p is not None:
            o = o + self.p[n:2 * n] * c_new
        o = f(self._clip(o))
        return o * hact(c_new), c_new


def _run_direction(step: _Step, x: Tensor, h: Tensor, c: Tensor | None, reverse: bool,
                   lengths: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Run one direction over ``x`` [seq, batch, input]; returns Y [seq, batch, hidden], h, c."""
    seq = x.shape[0]
    xw = x @ step.w_t + step.wb  # input projection for every step at once
    cell = step.attrs.cell
    ys: list[Tensor] = [h.new_zeros(0)] * seq
    order = range(seq - 1, -1, -1) if reverse else range(seq)
    for t in order:
        if cell is Cell.LSTM:
            assert c is not None
            h_new, c_new = step.lstm(xw[t], h, c)
        elif cell is Cell.GRU:
            h_new, c_new = step.gru(xw[t], h), None
        else:
            h_new, c_new = step.rnn(xw[t], h), None
        if lengths is not None:
            # Past a sequence's end: keep its state and emit zeros.
            live = (lengths > t).unsqueeze(1)
            h_new = torch.where(live, h_new, h)
            if c_new is not None:
                c_new = torch.where(live, c_new, c)  # type: ignore[arg-type]
            ys[t] = torch.where(live, h_new, torch.zeros_like(h_new))
        else:
            ys[t] = h_new
        h, c = h_new, c_new
    y = torch.stack(ys) if seq else x.new_zeros([0, x.shape[1], step.hidden])
    return y, h, c


def _bind(cell: Cell) -> Callable[[Node, BindContext], Kernel]:
    def bind(node: Node, ctx: BindContext) -> Kernel:
        attrs = RecurrentAttrs.parse(node, cell)
        is_lstm = cell is Cell.LSTM
        idx_h = 5
        idx_c = 6 if is_lstm else None
        idx_p = 7 if is_lstm else None
        has_b, has_lens, has_h = has_input(node, 3), has_input(node, 4), has_input(node, idx_h)
        has_c = idx_c is not None and has_input(node, idx_c)
        has_p = idx_p is not None and has_input(node, idx_p)
        batch_first = attrs.batch_first

        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x, w, r = inputs[0], inputs[1], inputs[2]
            assert x is not None and w is not None and r is not None
            if batch_first:
                x = x.transpose(0, 1)
            b = inputs[3] if has_b else None
            lengths = inputs[4].to(torch.int64) if has_lens else None  # type: ignore[union-attr]
            h0 = inputs[idx_h] if has_h else None
            c0 = inputs[idx_c] if has_c else None  # type: ignore[index]
            p = inputs[idx_p] if has_p else None  # type: ignore[index]
            if batch_first:
                h0 = h0.transpose(0, 1) if h0 is not None else None
                c0 = c0.transpose(0, 1) if c0 is not None else None
            hidden = r.shape[-1]
            batch = x.shape[1]
            ys, hs, cs = [], [], []
            for d, reverse in enumerate(attrs.reverse):
                step = _Step(attrs, d, w[d], r[d], b[d] if b is not None else None,
                             p[d] if p is not None else None)
                h = h0[d] if h0 is not None else x.new_zeros([batch, hidden])
                c = (c0[d] if c0 is not None else x.new_zeros([batch, hidden])) \
                    if is_lstm else None
                y, h, c = _run_direction(step, x, h, c, reverse, lengths)
                ys.append(y)
                hs.append(h)
                if c is not None:
                    cs.append(c)
            y_all = torch.stack(ys, dim=1)      # [seq, dirs, batch, hidden]
            y_h = torch.stack(hs)               # [dirs, batch, hidden]
            outs = [y_all, y_h]
            if is_lstm:
                outs.append(torch.stack(cs))
            if batch_first:
                outs = [outs[0].permute(2, 0, 1, 3)] + [t.transpose(0, 1) for t in outs[1:]]
            return [t.to(x.dtype) for t in outs]
        return kernel
    return bind


OPS: list[OpDef] = [
    OpDef("RNN", _bind(Cell.RNN), since=1, grad=gradients.recompute),
    OpDef("GRU", _bind(Cell.GRU), since=1, grad=gradients.recompute),
    OpDef("LSTM", _bind(Cell.LSTM), since=1, grad=gradients.recompute),
]
