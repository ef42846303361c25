"""Optimizers: in-place parameter updates that run as engine tasks.

An optimizer is a frozen configuration; the per-parameter state (momentum
buffers, Adam moments) lives in :class:`ParamState` objects owned by the
:class:`segflow.TrainingSession`. Updates follow ``torch.optim`` exactly
(same formulas and operation order), so a segflow step and a torch step from
the same weights and gradients agree to rounding.

>>> opt = SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)
>>> sess = segflow.TrainingSession(model, loss=..., optimizer=opt)   # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

Tensor = torch.Tensor


class ParamState:
    """Mutable per-parameter optimizer state (touched only by that parameter's update task)."""

    __slots__ = ("step", "momentum", "exp_avg", "exp_avg_sq")

    def __init__(self) -> None:
        self.step = 0
        self.momentum: Tensor | None = None
        self.exp_avg: Tensor | None = None
        self.exp_avg_sq: Tensor | None = None


class Optimizer(Protocol):
    """What the session needs of an optimizer."""

    @property
    def name(self) -> str:
        ...

    @property
    def lr(self) -> float:
        ...

    def update(self, params: Sequence[Tensor], grads: Sequence[Tensor],
               states: Sequence[ParamState]) -> None:
        """Update ``params`` in place from ``grads`` (never modified)."""
        ...


@dataclass(frozen=True, slots=True)
class SGD:
    """Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay."""

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    name: str = "SGD"

    def __post_init__(self) -> None:
        if self.lr < 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError(f"SGD needs lr, momentum, weight_decay >= 0, got {self}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening 0")

    def update(self, params: Sequence[Tensor], grads: Sequence[Tensor],
               states: Sequence[ParamState]) -> None:
        for param, grad, state in zip(params, grads, states):
            d_p = grad if self.weight_decay == 0 else grad.add(param, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = state.momentum
                if buf is None:
                    buf = state.momentum = d_p.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(d_p, alpha=1 - self.dampening)
                d_p = d_p.add(buf, alpha=self.momentum) if self.nesterov else buf
            param.add_(d_p, alpha=-self.lr)
            state.step += 1


@dataclass(frozen=True, slots=True)
class Adam:
    """Adam (L2 weight decay added to the gradient, as ``torch.optim.Adam``)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    name: str = "Adam"

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if self.lr < 0 or self.eps < 0 or not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"Adam needs lr, eps >= 0 and betas in [0, 1), got {self}")

    def update(self, params: Sequence[Tensor], grads: Sequence[Tensor],
               states: Sequence[ParamState]) -> None:
        beta1, beta2 = self.betas
        for param, grad, state in zip(params, grads, states):
            if state.exp_avg is None or state.exp_avg_sq is None:
                state.exp_avg = torch.zeros_like(param)
                state.exp_avg_sq = torch.zeros_like(param)
            state.step += 1
            g = grad if self.weight_decay == 0 else grad.add(param, alpha=self.weight_decay)
            state.exp_avg.lerp_(g, 1 - beta1)
            state.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias1 = 1 - beta1 ** state.step
            bias2_sqrt = math.sqrt(1 - beta2 ** state.step)
            denom = (state.exp_avg_sq.sqrt() / bias2_sqrt).add_(self.eps)
            param.addcdiv_(state.exp_avg, denom, value=-self.lr / bias1)


__all__ = ["SGD", "Adam", "Optimizer", "ParamState"]
