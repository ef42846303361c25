"""The one-line forms generated code writes for a node instead of a kernel call.

A node whose form is known here runs as a torch call (or a view) written straight into
a generated segment (``runtime/compile.py``): its chosen kernel's own form
(``kernels/conv.py``, ``kernels/gemm.py``), a fused op's (``ops/fused.py``,
``ops/dense_chain.py``), a core op's from its row (``OpDef.inline``), a Flatten view or
a Split of constant sizes. Anything else is called as its bound kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.kernels.choice import CONV_KINDS, NATIVE_FUSED_KINDS, KernelChoice, KernelKind
from segflow.kernels.conv import inline_conv
from segflow.kernels.gemm import inline_linear
from segflow.kernels.registry import inline_native_fused
from segflow.kernels.target import CpuTarget
from segflow.ops import default_registry
from segflow.ops.dense_chain import traceable_chain
from segflow.ops.fused import FUSED_DOMAIN, Inline, inline_fused, traceable_fused
from segflow.ops.registry import InlineOp, Kernel
from segflow.runtime.binding import Step

Tensor = torch.Tensor

_FLOAT = (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16)


def _core_forms() -> Mapping[str, InlineOp]:
    """The core ops' direct calls, from their rows (``OpDef.inline``, ops/elementwise.py)."""
    return {name: row.inline for (domain, name), rows in default_registry().rows.items()
            if domain == "" for row in rows if row.inline is not None}


_CORE: Mapping[str, InlineOp] = _core_forms()


def inline_form(node: Node, inplace_input: int | None, device: torch.device,
            consts: Sequence[Tensor | None], traceable: bool, kernel: Kernel | None,
            choice: KernelChoice, target: CpuTarget) -> Inline | None:
    if choice.kind in NATIVE_FUSED_KINDS and not traceable:
        return inline_native_fused(node, kernel)
    if choice.kind is not KernelKind.REFERENCE and choice.kind not in NATIVE_FUSED_KINDS:
        # The chosen kernel's own form; a tracer gets none (its weight is packed).
        if traceable:
            return None
        if choice.kind in CONV_KINDS:
            return inline_conv(node, choice, inplace_input, kernel, target.dnnl)
        if node.op_type == "FusedGemm":
            return inline_linear(node, choice, kernel, target.fuses_transcendental_post_ops())
        return None
    # The reference kernel's forms (a fused op's native kernel traces as its reference).
    if node.domain == FUSED_DOMAIN and node.op_type == "DenseChain":
        return traceable_chain(node) if traceable else None
    if node.domain == FUSED_DOMAIN:
        if traceable:
            return traceable_fused(node)
        return inline_fused(node, device, inplace_input, consts, kernel,
                            fuses_transcendental=target.fuses_transcendental_post_ops(),
                            onednn=target.onednn_ops)
    if node.domain == "" and node.op_type == "Flatten":
        return inline_flatten(node)
    if node.domain == "" and node.op_type == "Reshape":
        return inline_reshape(node, consts)
    if node.domain == "" and node.op_type == "Transpose":
        return inline_transpose(node)
    op = _CORE.get(node.op_type)
    if node.domain != "" or op is None or len(node.outputs) != 1:
        return None
    if len(node.inputs) != op.expr.count("{in") or any(v is None for v in node.inputs):
        return None
    if op.float_only and node.outputs[0].spec.dtype not in _FLOAT:
        return None
    expr = op.inplace.get(inplace_input, op.expr) if inplace_input is not None else op.expr
    return Inline(expr, op.bound)


def inline_split(node: Node, consts: Sequence[Tensor | None]
                  ) -> tuple[list[int], int] | None:
    """``(sizes, axis)`` where a Split's sizes are constant (its ``split`` attribute before
    opset 13, a constant input after) and one per output: generated code then splits in
    one line (``v1, v2, v3, = x.split(sizes, axis)``, views as the kernel's). As a kernel
    the Split after the sibling rule's merged linear reads its sizes tensor each call,
    tens of microseconds, once a transformer layer. Sizes that do not add up to the
    input's extent fail in ``split`` at run time, naming the node, as the kernel does."""
    if node.domain != "" or node.op_type != "Split" or node.inputs[0] is None:
        return None
    if node.opset < 13:
        raw = node.attrs.get("split")
        sizes = [int(v) for v in raw] if raw is not None else None
    else:
        const = consts[1] if len(consts) > 1 else None
        sizes = [int(v) for v in const.reshape(-1).tolist()] if const is not None else None
    if not sizes or len(sizes) != len(node.outputs) or min(sizes) < 0:
        return None
    return sizes, int(node.attrs.get("axis", 0))


def inline_flatten(node: Node) -> Inline | None:
    """Flatten at axis 1 of an input of known rank 2 or more: ``x.flatten(1)``, the same
    ``[d0, d1 * d2 ...]`` view or copy the kernel's reshape makes, without a kernel
    call's Python frame between a pooling and the linear after it."""
    x = node.inputs[0]
    shape = x.spec.shape if x is not None else None
    axis = int(node.attrs.get("axis", 1))
    if shape is None or len(node.outputs) != 1 or len(shape) < 2:
        return None
    if axis != 1 and axis != 1 - len(shape):
        return None
    return Inline("{in0}.flatten(1)")


def inline_reshape(node: Node, consts: Sequence[Tensor | None]) -> Inline | None:
    """A Reshape to a constant shape: ``x.reshape((a, b, c))``, the view or copy its
    kernel makes, without reading the shape tensor on every call (an exported
    transformer reshapes a few times a layer). A 0
    (copy the input's dim, without ``allowzero``) reads the input's dim; a shape that does
    not fit fails in ``reshape`` at run time, as the kernel does."""
    if len(node.outputs) != 1 or not node.inputs or node.inputs[0] is None:
        return None
    if node.opset < 5:
        raw = node.attrs.get("shape")
        dims = [int(d) for d in raw] if raw is not None else None
    else:
        const = consts[1] if len(consts) > 1 else None
        dims = [int(d) for d in const.reshape(-1).tolist()] if const is not None \
            and not const.is_floating_point() and not const.is_mkldnn else None
    if dims is None:
        return None
    copy_dims = not int(node.attrs.get("allowzero", 0))
    parts = [f"{{in0}}.shape[{i}]" if d == 0 and copy_dims else str(d) for i, d in enumerate(dims)]
    return Inline(f"{{in0}}.reshape(({', '.join(parts)}{',' if len(parts) == 1 else ''}))")


def inline_transpose(node: Node) -> Inline | None:
    """A Transpose: ``x.permute(perm)``, the view its kernel returns (no perm: the dims
    reversed, where the input's rank is known)."""
    x = node.inputs[0] if node.inputs else None
    if x is None or len(node.outputs) != 1:
        return None
    perm = node.attrs.get("perm")
    if perm is None:
        if x.spec.rank is None:
            return None
        perm = list(reversed(range(x.spec.rank)))
    return Inline(f"{{in0}}.permute({tuple(int(p) for p in perm)})")


def constants_of(step: Step, template: Sequence[Tensor | None], produced: set[int]
               ) -> list[Tensor | None]:
    """The constant behind each of a step's inputs (None: computed, or none)."""
    return [template[s] if 0 < s < len(template) and s not in produced else None
            for s in step.inputs]
