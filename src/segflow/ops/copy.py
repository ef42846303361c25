"""Cross-device copy, inserted by the placement pass (domain ``segflow``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.engine.base import ExecType
from segflow.ir.graph import Node
from segflow.ir.types import Device, DeviceKind
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor


def _copy(node: Node, ctx: BindContext) -> Kernel:
    target = Device.parse(node.attrs["to"])
    torch_device = target.torch

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if target.kind is DeviceKind.CPU and x.device.type == "cpu":
            # Logical CPU devices share memory; copy anyway so devices never alias buffers.
            return [x.clone()]
        return [x.to(torch_device, non_blocking=True)]
    return kernel


OPS: list[OpDef] = [
    OpDef("Copy", _copy, domain="segflow", exec_type=ExecType.COPY,
          doc="device-to-device copy, runs on the engine's copy worker"),
]
