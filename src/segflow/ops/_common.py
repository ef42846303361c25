"""Small helpers shared by the op family modules (kernel factories and attribute access)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from segflow.ir.graph import Node
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor


def unary(fn: Callable[[Tensor], Tensor]) -> Callable[[Node, BindContext], Kernel]:
    """Factory for an attribute-free one-input, one-output op."""

    def bind(node: Node, ctx: BindContext) -> Kernel:
        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            return [fn(inputs[0])]  # type: ignore[arg-type]
        return kernel

    return bind


def binary(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Node, BindContext], Kernel]:
    """Factory for a broadcasting two-input op."""

    def bind(node: Node, ctx: BindContext) -> Kernel:
        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            return [fn(inputs[0], inputs[1])]  # type: ignore[arg-type]
        return kernel

    return bind


def with_attrs(fn: Callable[..., Tensor], **defaults: Any) -> Callable[[Node, BindContext], Kernel]:
    """Factory for a one-output op whose kernel takes the inputs then attributes by keyword.

    ``with_attrs(lambda x, alpha: ..., alpha=0.01)`` reads ``alpha`` from the node once.
    """

    def bind(node: Node, ctx: BindContext) -> Kernel:
        kwargs = {key: node.attrs.get(key, default) for key, default in defaults.items()}

        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            return [fn(*inputs, **kwargs)]
        return kernel

    return bind


def ints(t: Tensor | None) -> list[int]:
    """A small integer tensor (shape, axes, pads ...) as a Python list."""
    if t is None:
        return []
    return [int(v) for v in t.reshape(-1).tolist()]


def const_input(node: Node, index: int) -> Tensor | None:
    """The constant data behind input ``index``, if it is an initializer/folded constant."""
    if index >= len(node.inputs):
        return None
    value = node.inputs[index]
    return None if value is None else value.const


def has_input(node: Node, index: int) -> bool:
    return index < len(node.inputs) and node.inputs[index] is not None


def normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def pads_over_axes(pads: Sequence[int], axes: Sequence[int], rank: int) -> list[int]:
    """A Pad's amounts for ``axes`` (begins, then ends) over all ``rank`` dims."""
    full = [0] * (2 * rank)
    for i, a in enumerate(axes):
        a = normalize_axis(a, rank)
        full[a], full[rank + a] = pads[i], pads[len(axes) + i]
    return full


def float_dtype_like(t: Tensor) -> torch.dtype:
    return t.dtype if t.is_floating_point() else torch.float32


def same_pads(in_sizes: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
              dilations: Sequence[int], upper: bool) -> list[int]:
    """ONNX SAME_UPPER/SAME_LOWER pads as [begin..., end...]."""
    begins, ends = [], []
    for size, k, s, d in zip(in_sizes, kernel, strides, dilations):
        out = -(-size // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, big = total // 2, total - total // 2
        begins.append(small if upper else big)
        ends.append(big if upper else small)
    return begins + ends


def resolve_pads(auto_pad: str, pads: Sequence[int] | None, in_sizes: Sequence[int],
                 kernel: Sequence[int], strides: Sequence[int],
                 dilations: Sequence[int]) -> list[int]:
    """The pads a Conv/Pool window really uses, as ONNX [begin..., end...]."""
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return same_pads(in_sizes, kernel, strides, dilations, auto_pad == "SAME_UPPER")
    if auto_pad == "VALID" or not pads:
        return [0] * (2 * len(kernel))
    return list(pads)


def torch_pad(pads: Sequence[int]) -> list[int]:
    """ONNX [b1, b2, .., e1, e2, ..] -> torch F.pad order (last dim first)."""
    n = len(pads) // 2
    out: list[int] = []
    for i in reversed(range(n)):
        out += [pads[i], pads[i + n]]
    return out


def gelu_erf(x: Tensor, inplace: bool = False) -> Tensor:
    """The erf form of GELU, ``x * (1 + erf(x / sqrt(2))) / 2``, as onnxruntime evaluates it
    at the edges: torch's kernel returns NaN for +inf where the formula (and onnxruntime)
    gives +inf; NaN and -inf give NaN in both."""
    edge = torch.isposinf(x) if x.is_floating_point() else None
    y = torch.ops.aten.gelu_(x) if inplace else torch.nn.functional.gelu(x)
    return y.masked_fill_(edge, math.inf) if edge is not None else y


def always(node: Node) -> bool:
    """An ``OpDef.creates_nonfinite`` for ops that may create NaN or Inf from any input."""
    return True


def computed_or_unsafe(index: int, safe: Callable[[Tensor], bool]) -> Callable[[Node], bool]:
    """An ``OpDef.creates_nonfinite``: True unless input ``index`` is a constant whose
    values ``safe`` accepts (a divisor with no zero, a whole non-negative exponent)."""
    def creates(node: Node) -> bool:
        value = node.inputs[index] if len(node.inputs) > index else None
        const = value.const if value is not None else None
        return const is None or const.is_mkldnn or not safe(const)
    return creates


def nonzero_finite(t: Tensor) -> bool:
    """Whether every element of ``t`` is finite and not zero (a safe divisor)."""
    return bool((torch.isfinite(t) & (t != 0)).all()) if t.is_floating_point() \
        else bool((t != 0).all())


def whole_nonnegative(t: Tensor) -> bool:
    """Whether every element of ``t`` is a whole number >= 0 (a safe exponent)."""
    return bool(((t >= 0) & (t == torch.round(t))).all()) if t.is_floating_point() \
        else bool((t >= 0).all())
