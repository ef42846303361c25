"""Backward kernels (domain ``segflow.train``) of the ops that select or route elements.

Gathers, scatters, Split, Where, Max/Min, GlobalMaxPool and Pad move input elements to
output positions without arithmetic, so each backward routes the output gradient back to
the positions it came from (summing where one input element reached several outputs).
Their rules live in :mod:`segflow.ops.gradients`; the convention is
:mod:`segflow.ops.backward`'s (a ``need`` attribute, None for gradients nobody reads).

Ties in Max, Min and GlobalMaxPool split the gradient evenly among the tied elements:
torch's convention for ``maximum``/``minimum`` of two tensors (half each) and for
``amax``/``amin`` over a stacked or pooled tensor (an even share each). A NaN element,
which Max/Min and the pool propagate, counts as equal to the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.ir.graph import Node
from segflow.ops._common import ints, normalize_axis, pads_over_axes
from segflow.ops.backward import DOMAIN, _need, _partial, sum_to
from segflow.ops.image import PadMode, _enum, _pad_index
from segflow.ops.indexing import Reduction, _wrap, gather_nd, scatter_nd
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor


def _gather_grad(node: Node, ctx: BindContext) -> Kernel:
    """Gather: the gradient rows added back at their indices (repeats accumulate)."""
    axis = int(node.attrs.get("axis", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, shape, idx = inputs[0], ints(inputs[1]), inputs[2]
        assert dy is not None and idx is not None
        a = normalize_axis(axis, len(shape))
        flat = _wrap(idx, shape[a]).reshape(-1)
        rows = dy.reshape(*shape[:a], flat.numel(), *shape[a + 1:])
        return [dy.new_zeros(shape).index_add_(a, flat, rows)]
    return kernel


def _gather_elements_grad(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, shape, idx = inputs[0], ints(inputs[1]), inputs[2]
        assert dy is not None and idx is not None
        a = normalize_axis(axis, len(shape))
        return [dy.new_zeros(shape).scatter_add_(a, _wrap(idx, shape[a]), dy)]
    return kernel


def _scatter_nd_grad(node: Node, ctx: BindContext) -> Kernel:
    """ScatterND without reduction: the data's gradient is zero where updates overwrote
    it; with ``add`` it passes whole. The updates' gradient is gathered from there.
    Inputs: dy, the indices, the updates' shape."""
    overwrite = node.attrs.get("reduction", "none") == "none"
    need_data, need_updates = _need(node, 2)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, idx = inputs[0], inputs[1]
        assert dy is not None and idx is not None
        ddata = dupdates = None
        if need_data:
            ddata = scatter_nd(dy, idx, dy.new_zeros(ints(inputs[2])), Reduction.NONE) \
                if overwrite else dy
        if need_updates:
            dupdates = gather_nd(dy, idx, 0)
        return [ddata, dupdates]
    return _partial(kernel)


def _scatter_elements_grad(node: Node, ctx: BindContext) -> Kernel:
    """ScatterElements, as ScatterND's: the data's gradient zero where updates overwrote
    it (whole with ``add``), the updates' gathered along the axis. Inputs: dy, the
    indices, the updates' shape."""
    overwrite = node.attrs.get("reduction", "none") == "none"
    axis = int(node.attrs.get("axis", 0))
    need_data, need_updates = _need(node, 2)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, idx = inputs[0], inputs[1]
        assert dy is not None and idx is not None
        a = normalize_axis(axis, dy.dim())
        index = _wrap(idx, dy.shape[a])
        ddata = dupdates = None
        if need_data:
            ddata = dy.clone().scatter_(a, index, 0.0) if overwrite else dy
        if need_updates:
            dupdates = dy.gather(a, index)
        return [ddata, dupdates]
    return _partial(kernel)


def _split_grad(node: Node, ctx: BindContext) -> Kernel:
    """Split: the parts' gradients concatenated (zeros for parts the loss does not read).
    Inputs: the n output gradients, then the n output shapes."""
    axis = int(node.attrs.get("axis", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        n = len(inputs) // 2
        grads, shapes = inputs[:n], inputs[n:]
        model = next(g for g in grads if g is not None)
        parts = [g if g is not None else model.new_zeros(ints(s))
                 for g, s in zip(grads, shapes)]
        return [torch.cat(parts, dim=axis)]
    return kernel


def _where_grad(node: Node, ctx: BindContext) -> Kernel:
    need_a, need_b = _need(node, 2)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, cond = inputs[0], inputs[1]
        assert dy is not None and cond is not None
        zero = dy.new_zeros(())
        da = sum_to(torch.where(cond, dy, zero), ints(inputs[2])) if need_a else None
        db = sum_to(torch.where(cond, zero, dy), ints(inputs[3])) if need_b else None
        return [da, db]
    return _partial(kernel)


def _extremum_grad(node: Node, ctx: BindContext) -> Kernel:
    """Max/Min over n broadcasting inputs: each input equal to the result takes an even
    share of the gradient. Inputs: dy, the result y, then the n operands."""
    need = _need(node, len(node.inputs) - 2)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, y, xs = inputs[0], inputs[1], inputs[2:]
        assert dy is not None and y is not None
        # A NaN operand is the result where it is (Max/Min propagate NaN).
        hits = [(x == y) | torch.isnan(x) for x in xs]  # type: ignore[arg-type, operator]
        count = hits[0].to(dy.dtype)
        for hit in hits[1:]:
            count = count + hit
        share = dy / count
        return [sum_to(torch.where(hit, share, 0.0), x.shape) if want and x is not None
                else None for hit, x, want in zip(hits, xs, need)]
    return _partial(kernel)


def _global_max_pool_grad(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, x, y = inputs[0], inputs[1], inputs[2]
        assert dy is not None and x is not None and y is not None
        hit = (x == y) | torch.isnan(x)
        count = hit.sum(dim=tuple(range(2, x.dim())), keepdim=True)
        return [torch.where(hit, dy / count, 0.0)]
    return kernel


def _pad_grad(node: Node, ctx: BindContext) -> Kernel:
    """Pad: the gradient of the kept region (constant), or summed over every output
    position that copies an input element (edge, reflect, wrap); cropped (negative-pad)
    input elements get zero. A constant value that is differentiated gets what fell on
    the padding. Inputs: dy, x's shape, then the forward's pads, value, axes."""
    mode: PadMode = _enum(node, PadMode, "mode", "constant")  # type: ignore[assignment]
    attr_pads = node.attrs.get("old_pads")
    need_x, need_value = _need(node, 2)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, shape = inputs[0], ints(inputs[1])
        assert dy is not None
        rank = len(shape)
        pads = list(attr_pads) if attr_pads is not None else ints(inputs[2])
        axes = inputs[4] if len(inputs) > 4 else None
        if axes is not None and axes.numel():  # an empty tensor is an omitted input
            pads = pads_over_axes(pads, ints(axes), rank)
        begins, ends = pads[:rank], pads[rank:]
        kept = [s - max(0, -b) - max(0, -e) for s, b, e in zip(shape, begins, ends)]
        g = dy
        if mode is PadMode.CONSTANT:
            for a in range(rank):
                g = g.narrow(a, max(0, begins[a]), kept[a])
        else:
            for a in reversed(range(rank)):
                b, e = max(0, begins[a]), max(0, ends[a])
                if b or e:
                    index = _pad_index(mode, kept[a], b, e, dy.device)
                    target = list(g.shape)
                    target[a] = kept[a]
                    g = g.new_zeros(target).index_add_(a, index, g)
        dx = g
        if any(b < 0 or e < 0 for b, e in zip(begins, ends)):
            dx = dy.new_zeros(shape)
            region = tuple(slice(max(0, -b), max(0, -b) + k)
                           for b, k in zip(begins, kept))
            dx[region] = g
        dvalue = None
        if need_value:
            dvalue = (dy.sum() - g.sum()).reshape(inputs[3].shape)  # type: ignore[union-attr]
        return [dx if need_x else None, dvalue]
    return _partial(kernel)


OPS: list[OpDef] = [
    OpDef("GatherGrad", _gather_grad, domain=DOMAIN),
    OpDef("GatherElementsGrad", _gather_elements_grad, domain=DOMAIN),
    OpDef("ScatterNDGrad", _scatter_nd_grad, domain=DOMAIN),
    OpDef("ScatterElementsGrad", _scatter_elements_grad, domain=DOMAIN),
    OpDef("SplitGrad", _split_grad, domain=DOMAIN),
    OpDef("WhereGrad", _where_grad, domain=DOMAIN),
    OpDef("ExtremumGrad", _extremum_grad, domain=DOMAIN, doc="Max/Min backward"),
    OpDef("GlobalMaxPoolGrad", _global_max_pool_grad, domain=DOMAIN),
    OpDef("PadGrad", _pad_grad, domain=DOMAIN),
]
