"""NegativeLogLikelihoodLoss with ONNX reference semantics (the row lives in nn.py).

:func:`nll_loss` also serves SoftmaxCrossEntropyLoss: log_softmax over axis 1, then NLL.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from segflow.errors import InvalidModel
from segflow.ir.graph import Node
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor


class LossReduction(enum.Enum):
    NONE = "none"
    SUM = "sum"
    MEAN = "mean"


def _reduction(node: Node) -> LossReduction:
    text = str(node.attrs.get("reduction", "mean"))
    try:
        return LossReduction(text)
    except ValueError:
        raise InvalidModel(f"{node.label}: unknown reduction {text!r} "
                           "(expected none, sum or mean)") from None


def nll_loss(log_prob: Tensor, target: Tensor, weight: Tensor | None,
             reduction: LossReduction, ignore_index: int | None) -> Tensor:
    """ONNX NegativeLogLikelihoodLoss over [N, C, d1..] log-probabilities."""
    classes = log_prob.shape[1]
    t = target.to(torch.int64)
    if ignore_index is None:
        ignored = torch.zeros_like(t, dtype=torch.bool)
    else:
        ignored = t == ignore_index
    safe = torch.where(ignored, torch.zeros_like(t), t).clamp(0, classes - 1)
    picked = -log_prob.gather(1, safe.unsqueeze(1)).squeeze(1)
    if weight is not None:
        w = weight.to(log_prob.dtype)[safe]
    else:
        w = torch.ones_like(picked)
    w = torch.where(ignored, torch.zeros_like(w), w)
    loss = picked * w
    if reduction is LossReduction.NONE:
        return loss
    if reduction is LossReduction.SUM:
        return loss.sum()
    if weight is None and ignore_index is None:
        return loss.mean()
    return loss.sum() / w.sum()


def bind_nll(node: Node, ctx: BindContext) -> Kernel:
    reduction = _reduction(node)
    ignore = node.attrs.get("ignore_index")
    ignore_index = None if ignore is None else int(ignore)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, target = inputs[0], inputs[1]
        assert x is not None and target is not None
        weight = inputs[2] if len(inputs) > 2 else None
        return [nll_loss(x, target, weight, reduction, ignore_index).to(x.dtype)]
    return kernel
