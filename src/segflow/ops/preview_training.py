"""The optimizer steps of ONNX's ``ai.onnx.preview.training`` domain: Adagrad, Adam and
Momentum (standard and Nesterov).

Each node updates n tensors at once: inputs ``R`` (learning rate, scalar), ``T``
(iteration count, int64 scalar), then n parameters, n gradients and n optimizer states
per state kind; outputs the n new parameters, then the n new states of each kind. The
arithmetic runs in float64 and rounds once to each tensor's type; ``T`` is read with
tensor ops, never on the host, so the nodes stay SYNC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from segflow.errors import InvalidModel
from segflow.ir.graph import Node
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
DOMAIN = "ai.onnx.preview.training"
# One tensor's update: (r, t, x, g, *states) in float64 -> (x_new, *new states).
Step = Callable[..., tuple[Tensor, ...]]


def _float(node: Node, name: str, default: float | None = None) -> float:
    if name in node.attrs:
        return float(node.attrs[name])
    if default is None:
        raise InvalidModel(f"{node.label}: {node.op_type} needs the attribute {name!r}")
    return default


def _grouped(node: Node, states: int, step: Step) -> Kernel:
    """A kernel applying ``step`` to each of the node's n (x, g, states...) groups."""
    per_group = 2 + states
    count, rest = divmod(len(node.inputs) - 2, per_group)
    if count < 1 or rest or len(node.outputs) != (1 + states) * count:
        raise InvalidModel(f"{node.label}: {node.op_type} takes R, T and {per_group} groups "
                           f"of n inputs with {1 + states} groups of n outputs; got "
                           f"{len(node.inputs)} inputs and {len(node.outputs)} outputs")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        if any(t is None for t in inputs):
            raise ValueError(f"{node.op_type}: every input is required")
        r, t = inputs[0], inputs[1]
        assert r is not None and t is not None
        r64, t64 = r.reshape(()).to(torch.float64), t.reshape(()).to(torch.float64)
        columns: list[list[Tensor]] = [[] for _ in range(1 + states)]
        for i in range(count):
            group = [inputs[2 + i + k * count] for k in range(per_group)]
            wide = [g.to(torch.float64) for g in group if g is not None]
            for column, new, old in zip(columns, step(r64, t64, *wide),
                                        [group[0], *group[2:]]):
                assert old is not None
                column.append(new.to(old.dtype))
        return [out for column in columns for out in column]
    return kernel


def _adagrad(node: Node, ctx: BindContext) -> Kernel:
    decay = _float(node, "decay_factor", 0.0)
    epsilon = _float(node, "epsilon", 1e-6)
    norm = _float(node, "norm_coefficient", 0.0)

    def step(r: Tensor, t: Tensor, x: Tensor, g: Tensor, h: Tensor) -> tuple[Tensor, ...]:
        rate = r / (1 + t * decay)
        g_reg = norm * x + g
        h_new = h + g_reg * g_reg
        return x - rate * g_reg / (torch.sqrt(h_new) + epsilon), h_new
    return _grouped(node, 1, step)


def _adam(node: Node, ctx: BindContext) -> Kernel:
    alpha = _float(node, "alpha", 0.9)
    beta = _float(node, "beta", 0.999)
    epsilon = _float(node, "epsilon", 1e-6)
    norm = _float(node, "norm_coefficient", 0.0)
    norm_post = _float(node, "norm_coefficient_post", 0.0)

    def step(r: Tensor, t: Tensor, x: Tensor, g: Tensor, v: Tensor,
             h: Tensor) -> tuple[Tensor, ...]:
        g_reg = norm * x + g
        v_new = alpha * v + (1 - alpha) * g_reg
        h_new = beta * h + (1 - beta) * (g_reg * g_reg)
        # Bias correction from the first step on (T > 0); T = 0 takes R as it is. The
        # corrected rate is computed at T = 1 where T = 0 so no 0 / 0 is formed.
        t_pos = torch.clamp(t, min=1.0)
        corrected = r * torch.sqrt(1 - beta ** t_pos) / (1 - alpha ** t_pos)
        rate = torch.where(t > 0, corrected, r)
        x_new = x - rate * (v_new / (torch.sqrt(h_new) + epsilon))
        return (1 - norm_post) * x_new, v_new, h_new
    return _grouped(node, 2, step)


def _momentum(node: Node, ctx: BindContext) -> Kernel:
    alpha = _float(node, "alpha")
    beta = _float(node, "beta")
    norm = _float(node, "norm_coefficient")
    mode = node.attrs.get("mode")
    if mode not in ("standard", "nesterov"):
        raise InvalidModel(f"{node.label}: Momentum mode must be 'standard' or 'nesterov', "
                           f"got {mode!r}")
    nesterov = mode == "nesterov"

    def step(r: Tensor, t: Tensor, x: Tensor, g: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        g_reg = norm * x + g
        # The gradient's coefficient is 1 on the first step (T = 0).
        beta_t = torch.where(t > 0, torch.full_like(t, beta), torch.ones_like(t))
        v_new = alpha * v + beta_t * g_reg
        direction = g_reg + alpha * v_new if nesterov else v_new
        return x - r * direction, v_new
    return _grouped(node, 1, step)


OPS: list[OpDef] = [
    OpDef("Adagrad", _adagrad, domain=DOMAIN, doc="Adagrad step over n tensors"),
    OpDef("Adam", _adam, domain=DOMAIN, doc="Adam step over n tensors"),
    OpDef("Momentum", _momentum, domain=DOMAIN, doc="SGD with (Nesterov) momentum"),
]
