"""Static shapes through computed shape inputs: a node whose data inputs have fixed
shapes and whose other inputs are constants gets the output shapes its kernel gives.

ONNX's shape inference stops at a ``Reshape`` (``Expand``, ``Tile`` ...) whose shape
input is computed, even where that computation is all constants once the input shapes
are fixed: exporters assemble the target shape from ``Shape`` outputs
(``Shape -> Gather -> Unsqueeze -> Concat``). Constant folding evaluates that
arithmetic; this rule then runs the node's own kernel over *meta* tensors (shapes and
dtypes, no data) of its data inputs and the real constants of the others, and records
the shapes it returns (where a kernel will not mix devices, the constants go on meta
too), so the ``Shape`` nodes after it fold too and the fuse rules see
the shapes they match on (constants too large to be shape values go on meta at once).
Folding calls it on each node it does not fold, in order, so
one walk settles a chain of them.

A kernel that cannot run on meta tensors (one that reads its input's values, or
converts to numpy) leaves the node's spec as it was; a spec already fixed is never
changed, and a computed one that contradicts a fixed dim is not used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.ir.graph import Node
from segflow.ir.types import DType, TensorSpec
from segflow.ops.registry import BindContext, OpRegistry, touches_strings

# The domains whose rows' kernels run here: ONNX's, and onnxruntime's contrib ops, whose
# outputs ONNX's shape inference leaves unknown (it has no schemas for them).
_DOMAINS = frozenset({"", "com.microsoft"})
# Ops never run here: a subgraph's, or ones whose result has no fixed shape anyway.
_DATA_DEPENDENT = frozenset({"NonZero", "Unique", "NonMaxSuppression", "TopK", "Compress",
                             "RandomNormal", "RandomUniform", "RandomNormalLike",
                             "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"})


# Constants with at most this many elements go to the kernel as they are: the values a
# kernel computes a shape from (a shape, axes, scales, pads) are that small. Larger ones
# go on meta at once: a kernel that mixes a meta input with a host weight fails, and a
# failed call costs far more than the meta one (torch formats the error and its trace).
SHAPE_VALUES_MAX = 16


def refine_static_shapes(node: Node, registry: OpRegistry, ctx: BindContext) -> bool:
    """Give ``node``'s outputs the fixed shapes its kernel computes over meta tensors of
    its non-constant inputs (all of fixed shape); True where a spec changed."""
    if node.subgraphs or node.domain not in _DOMAINS or node.op_type in _DATA_DEPENDENT \
            or node.touches_containers \
            or touches_strings(node) \
            or all(v.spec.is_static and v.spec.dtype is not None for v in node.outputs):
        return False
    inputs: list[torch.Tensor | None] = []
    moved = False    # a constant too large to be shape values went on meta
    for value in node.inputs:
        if value is None:
            inputs.append(None)
        elif value.const is not None:
            if value.const.is_mkldnn:
                return False
            small = value.const.numel() <= SHAPE_VALUES_MAX
            moved = moved or not small
            inputs.append(value.const if small else value.const.to("meta"))
        elif value.spec.is_static and value.spec.dtype is not None \
                and value.spec.dtype.torch is not None:
            shape = tuple(int(d) for d in value.spec.shape)  # type: ignore[union-attr,arg-type]
            inputs.append(torch.empty(shape, dtype=value.spec.dtype.torch, device="meta"))
        else:
            return False
    if all(v is None or v.const is not None for v in node.inputs):
        return False   # all constants: folding's job
    outs = _run_meta(node, registry, ctx, inputs)
    if outs is None:   # mixing devices fails in some kernels: constants on meta too
        outs = _run_meta(node, registry, ctx, [
            None if t is None else t if t.device.type == "meta" else t.to("meta")
            for t in inputs])
    if outs is None and moved:   # a kernel that reads a large constant's values
        outs = _run_meta(node, registry, ctx, [
            None if v is None else v.const if v.const is not None else t
            for v, t in zip(node.inputs, inputs)])
    if outs is None or len(outs) < len(node.outputs):
        return False
    changed = False
    for value, out in zip(node.outputs, outs):
        spec = _agreeing(value.spec, out)
        if spec is not None and spec != value.spec:
            value.spec = spec
            changed = True
    return changed


def _run_meta(node: Node, registry: OpRegistry, ctx: BindContext,
              inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
    try:
        opdef = registry.resolve(node)
        kernel = opdef.bind(node, ctx)
        with torch.inference_mode(False), torch.no_grad():
            outs = list(kernel(inputs))
    except Exception:
        return None    # the kernel reads values, or meta tensors do not suit it
    return outs if all(isinstance(t, torch.Tensor) for t in outs) else None


def _agreeing(spec: TensorSpec, out: torch.Tensor) -> TensorSpec | None:
    """The spec ``out`` shows, where it agrees with what ``spec`` already fixes."""
    try:
        dtype = DType.from_torch(out.dtype)
    except ValueError:
        return None
    if spec.dtype is not None and spec.dtype is not dtype:
        return None
    shape = tuple(int(d) for d in out.shape)
    if spec.shape is not None and (len(spec.shape) != len(shape) or any(
            isinstance(d, int) and d != s for d, s in zip(spec.shape, shape))):
        return None
    return TensorSpec(dtype, shape)
