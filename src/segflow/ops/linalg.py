"""Linear algebra beyond MatMul/Gemm: Einsum and Det."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.ir.graph import Node
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor

_EINSUM_NATIVE = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                  torch.int32, torch.int64, torch.complex64, torch.complex128)


def _einsum(node: Node, ctx: BindContext) -> Kernel:
    # torch.einsum accepts ONNX's grammar (implicit output, "..." broadcasting) once the
    # whitespace ONNX allows is gone.
    equation = "".join(str(node.attrs["equation"]).split())

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        operands = [t for t in inputs if t is not None]
        dtype = operands[0].dtype
        if dtype in _EINSUM_NATIVE:
            return [torch.einsum(equation, *operands)]
        # Narrow integer types: accumulate in int64 and wrap back, as a C loop would.
        wide = [t.to(torch.int64) for t in operands]
        return [torch.einsum(equation, *wide).to(dtype)]
    return kernel


def _det(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if x.dtype in (torch.float16, torch.bfloat16):
            return [torch.linalg.det(x.to(torch.float32)).to(x.dtype)]
        return [torch.linalg.det(x)]
    return kernel


OPS: list[OpDef] = [
    OpDef("Einsum", _einsum, since=12),
    OpDef("Det", _det, since=11),
]
