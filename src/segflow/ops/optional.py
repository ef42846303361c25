"""Optional ops: Optional, OptionalHasElement, OptionalGetElement.

An optional value (``ir.types.OptionalSpec``) is, at run time, the tensor or sequence
(list) it holds, or None when empty: the same None an omitted input is, so an
``OptionalHasElement`` whose input is left out answers False, as ONNX says. The rows are
LOCAL: whether a value is present is a host fact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from segflow.engine.base import ExecType
from segflow.ir.graph import Node
from segflow.ops.registry import BindContext, Kernel, OpDef

Inputs = Sequence[Any]


def _optional(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        return [inputs[0] if inputs else None]
    return kernel


def _has_element(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        present = len(inputs) > 0 and inputs[0] is not None
        return [torch.tensor(present, device=ctx.device)]
    return kernel


def _get_element(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        held = inputs[0] if inputs else None
        if held is None:
            raise ValueError("OptionalGetElement: the optional input holds no value")
        return [held]
    return kernel


OPS: list[OpDef] = [
    OpDef("Optional", _optional, since=15, exec_type=ExecType.LOCAL,
          doc="an optional holding its input, or empty"),
    OpDef("OptionalHasElement", _has_element, since=15, exec_type=ExecType.LOCAL,
          doc="whether an optional (opset 18: or a tensor, a sequence) holds a value"),
    OpDef("OptionalGetElement", _get_element, since=15, exec_type=ExecType.LOCAL,
          doc="the value an optional holds; an error where it is empty"),
]
