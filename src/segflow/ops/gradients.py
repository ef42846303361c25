"""Gradient rules, referenced from the forward ops' rows as ``OpDef(..., grad=rule)``.

A rule maps a forward node and the gradients of its outputs to gradients of
its inputs, emitting backward nodes (kernels in :mod:`segflow.ops.backward`)
through a :class:`segflow.passes.autodiff.GradContext`::

    def relu_grad(ctx, node, douts):
        return [ctx.emit1("UnaryGrad", [douts[0], None, node.outputs[0]], op="Relu")]

Rules skip work for inputs that want no gradient (``ctx.need(i)``) and return
None for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from segflow.errors import UnsupportedOp
from segflow.ir.graph import Node, Value

if TYPE_CHECKING:
    from segflow.passes.autodiff import GradContext

Grads = list[Value | None]


def _mask(ctx: GradContext, count: int) -> list[int]:
    return [int(ctx.need(i)) for i in range(count)]


def _input(node: Node, index: int) -> Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


# -- elementwise --------------------------------------------------------------------------
def unary(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Activations and unary math: one UnaryGrad node reading x, or y where the op's row
    says its gradient reads the output (``OpDef.grad_reads_output``)."""
    reads_output = ctx.opdef(node).grad_reads_output
    x = None if reads_output else node.inputs[0]
    y = node.outputs[0] if reads_output else None
    extra = list(node.inputs[1:]) if node.op_type == "Clip" else []
    attrs: dict[str, Any] = {k: v for k, v in node.attrs.items()
                             if isinstance(v, int | float | str)}
    return [ctx.emit1("UnaryGrad", [douts[0], x, y, *extra], like=node.inputs[0],
                      op=node.op_type, **attrs)]


def neg(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    return [ctx.emit1("Neg", [douts[0]], domain="", like=node.inputs[0])]


def identity(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    return [douts[0]]


def cast(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    x = node.inputs[0]
    assert x is not None
    if x.spec.dtype is not None:
        return [ctx.emit1("Cast", [douts[0]], domain="", like=x, to=x.spec.dtype.value)]
    return [ctx.emit1("CastLike", [douts[0], x], domain="", like=x)]


def binary(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Add/Sub/Mul/Div/Pow with numpy broadcasting (gradients summed back to each shape)."""
    dy = douts[0]
    a, b = node.inputs[0], node.inputs[1]
    assert dy is not None and a is not None and b is not None
    y = node.outputs[0]
    if node.op_type in ("Add", "Sub") and ctx.same_shape(a, y) and ctx.same_shape(b, y):
        db: Value | None = dy
        if node.op_type == "Sub" and ctx.need(1):
            db = ctx.emit1("Neg", [dy], domain="", like=b)
        return [dy, db]
    da, db = ctx.emit("BinaryGrad", [dy, a, b], 2, like=[a, b], op=node.op_type,
                      need=_mask(ctx, 2))
    return [da, db]


def variadic_sum(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Sum and Mean over any number of broadcasting inputs."""
    dy = douts[0]
    assert dy is not None
    y = node.outputs[0]
    if node.op_type == "Mean" and len(node.inputs) > 1:
        dy = ctx.emit1("UnaryGrad", [dy, None, None], like=y, op="Scale",
                       alpha=1.0 / len(node.inputs))
    out: Grads = []
    for i, x in enumerate(node.inputs):
        out.append(ctx.sum_to(dy, x, reference=y) if x is not None and ctx.need(i) else None)
    return out


# -- dense layers -------------------------------------------------------------------------
def conv(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    x, w, b = node.inputs[0], node.inputs[1], _input(node, 2)
    dx, dw, db = ctx.emit("ConvGrad", [douts[0], x, w], 3, like=[x, w, b],
                          need=_mask(ctx, 3), **_window_attrs(node))
    return [dx if ctx.need(0) else None, dw if ctx.need(1) else None,
            db if ctx.need(2) else None]


def conv_transpose(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """ConvTranspose is the adjoint of Conv with the same weight and window: dx is that
    Conv of dy, and dw is Conv's weight gradient with x and dy trading places. The
    forms whose pads depend on an output size (``output_shape``, SAME) recompute."""
    x, w, b = node.inputs[0], node.inputs[1], _input(node, 2)
    assert x is not None and w is not None
    rank = x.spec.rank
    if rank is None or "output_shape" in node.attrs or \
            node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return recompute(ctx, node, douts)
    dy = douts[0]
    window = {k: v for k, v in _window_attrs(node).items() if k != "auto_pad"}
    dx = dw = db = None
    if ctx.need(0):
        dx = ctx.emit1("Conv", [dy, w], domain="", like=x, **window)
    if ctx.need(1):
        dw = ctx.emit("ConvGrad", [x, dy, w], 3, like=[None, w, None], need=[0, 1, 0],
                      **window)[1]
    if b is not None and ctx.need(2):
        axes = [0, *range(2, rank)]
        if ctx.graph.opsets.get("", 17) >= 13:
            db = ctx.emit1("ReduceSum", [dy, ctx.const(torch.tensor(axes), "axes")],
                           domain="", like=b, keepdims=0)
        else:
            db = ctx.emit1("ReduceSum", [dy], domain="", like=b, axes=axes, keepdims=0)
    return [dx, dw, db]


def _window_attrs(node: Node) -> dict[str, Any]:
    keys = ("kernel_shape", "strides", "dilations", "pads", "auto_pad", "group", "ceil_mode")
    return {k: node.attrs[k] for k in keys if k in node.attrs}


def gemm(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    a, b, c = node.inputs[0], node.inputs[1], _input(node, 2)
    attrs: dict[str, Any] = {k: node.attrs[k] for k in ("alpha", "beta", "transA", "transB")
                             if k in node.attrs}
    grads = ctx.emit("GemmGrad", [douts[0], a, b, c], 3, like=[a, b, c], need=_mask(ctx, 3),
                     **attrs)
    return [g if ctx.need(i) else None for i, g in enumerate(grads)]


def matmul(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    a, b = node.inputs[0], node.inputs[1]
    da, db = ctx.emit("MatMulGrad", [douts[0], a, b], 2, like=[a, b], need=_mask(ctx, 2))
    return [da if ctx.need(0) else None, db if ctx.need(1) else None]


# -- normalization ------------------------------------------------------------------------
def batch_norm(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Training mode: the forward node becomes ``segflow.BatchNormTraining``, which also
    returns the saved batch mean and inverse std the backward kernel reads."""
    x, scale, bias, mean, var = node.inputs[:5]
    eps = float(node.attrs.get("epsilon", 1e-5))
    mask = _mask(ctx, 3)
    if int(node.attrs.get("training_mode", 0)):
        ctx.forward_output(node, 2)  # running statistics come before the residuals
        saved_mean, saved_invstd = ctx.rewrite(node, "BatchNormTraining", 2)
        stats: list[Value | None] = [saved_mean, saved_invstd]
        training = 1
    else:
        stats, training = [mean, var], 0
    dx, dscale, dbias = ctx.emit("BatchNormGrad", [douts[0], x, scale, *stats], 3,
                                 like=[x, scale, bias], need=mask, epsilon=eps,
                                 training=training)
    return [dx if mask[0] else None, dscale if mask[1] else None, dbias if mask[2] else None]


def layer_norm(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """The saved Mean and InvStdDev outputs feed the backward kernel; where the loss also
    reads them, their gradients flow through a recomputed forward instead."""
    if any(g is not None for g in douts[1:]):
        return recompute(ctx, node, douts)
    x, scale, bias = node.inputs[0], node.inputs[1], _input(node, 2)
    mean = ctx.forward_output(node, 1)
    invstd = ctx.forward_output(node, 2)
    grads = ctx.emit("LayerNormGrad", [douts[0], x, scale, bias, mean, invstd], 3,
                     like=[x, scale, bias], need=_mask(ctx, 3),
                     axis=int(node.attrs.get("axis", -1)))
    return [g if ctx.need(i) else None for i, g in enumerate(grads)]


def group_norm(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """InstanceNormalization and GroupNormalization: the forward node becomes
    ``segflow.GroupNormTraining``, which also returns the per-group mean and inverse std
    the backward kernel reads (an instance norm is a group norm with one channel a group)."""
    x, scale, bias = node.inputs[0], node.inputs[1], node.inputs[2]
    attrs: dict[str, Any] = {"epsilon": float(node.attrs.get("epsilon", 1e-5))}
    if node.op_type == "InstanceNormalization":
        attrs["num_groups"] = 0  # one group per channel, known when the kernel runs
    else:
        attrs["num_groups"] = int(node.attrs["num_groups"])
        attrs["per_group"] = int(node.opset < 21)  # opset 18 scales and shifts per group
    mean, invstd = ctx.rewrite(node, "GroupNormTraining", 2, **attrs)
    grads = ctx.emit("GroupNormGrad", [douts[0], x, scale, mean, invstd], 3,
                     like=[x, scale, bias], need=_mask(ctx, 3), **attrs)
    return [g if ctx.need(i) else None for i, g in enumerate(grads)]


def dropout(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    mask = ctx.forward_output(node, 1)
    return [ctx.emit1("DropoutGrad", [douts[0], mask, _input(node, 1), _input(node, 2)],
                      like=node.inputs[0])]


# -- pooling ------------------------------------------------------------------------------
def max_pool(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Single-output MaxPool becomes ``segflow.MaxPoolTrain`` (also returns argmax
    indices); with ONNX's own Indices output the backward kernel recomputes them."""
    x = node.inputs[0]
    indices: list[Value | None] = [None]
    if len(node.outputs) == 1:
        indices = list(ctx.rewrite(node, "MaxPoolTrain", 1))
    return [ctx.emit1("MaxPoolGrad", [douts[0], x, *indices], like=x, **_window_attrs(node))]


def global_average_pool(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    x = node.inputs[0]
    assert x is not None
    return [ctx.emit1("GlobalAveragePoolGrad", [douts[0], ctx.shape_of(x)], like=x)]


def recompute(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Backward by re-running the forward kernel under torch autograd (exact, costs a
    second forward): for ops with many variants (AveragePool) and for the ops whose
    forward kernel is a composition of differentiable torch calls and which no training
    graph runs often enough to earn a closed form (Acosh, CumProd, RoiAlign ...).

    The recomputed forward gets outputs of its own: the real outputs may have planned
    storage, which a second forward must not overwrite (and autograd cannot record a
    kernel writing into given storage)."""
    outputs = [Value(f"{v.name}/recomputed", v.spec) for v in node.outputs]
    forward = Node(node.op_type, node.inputs, outputs, dict(node.attrs), name=node.name,
                   domain=node.domain, opset=node.opset)
    grads = ctx.emit("Vjp", [*douts, *node.inputs], len(node.inputs), like=list(node.inputs),
                     forward=forward, bind=ctx.opdef(node).bind, need=_mask(ctx, len(node.inputs)))
    return [g if ctx.need(i) else None for i, g in enumerate(grads)]


def global_max_pool(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    x = node.inputs[0]
    return [ctx.emit1("GlobalMaxPoolGrad", [douts[0], x, node.outputs[0]], like=x)]


# -- selection: kernels in segflow.ops.backward_select ------------------------------------
def gather(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Gather and GatherElements: the gradient added back at the indices."""
    x, idx = node.inputs[0], node.inputs[1]
    assert x is not None
    return [ctx.emit1(f"{node.op_type}Grad", [douts[0], ctx.shape_of(x), idx], like=x,
                      axis=int(node.attrs.get("axis", 0))), None]


def scatter(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """ScatterND and ScatterElements (Scatter before opset 11) without reduction or with
    ``add`` (the others have no rule)."""
    reduction = str(node.attrs.get("reduction", "none"))
    if reduction not in ("none", "add"):
        raise UnsupportedOp(f"no gradient rule for op {node.op_type} with reduction "
                            f"{reduction!r} (node {node.name!r}, {node.label})")
    data, idx, updates = node.inputs[0], node.inputs[1], node.inputs[2]
    assert updates is not None
    grad = "ScatterNDGrad" if node.op_type == "ScatterND" else "ScatterElementsGrad"
    attrs: dict[str, Any] = {"reduction": reduction}
    if grad == "ScatterElementsGrad":
        attrs["axis"] = int(node.attrs.get("axis", 0))
    ddata, dupdates = ctx.emit(grad, [douts[0], idx, ctx.shape_of(updates)], 2,
                               like=[data, updates], need=[int(ctx.need(0)), int(ctx.need(2))],
                               **attrs)
    return [ddata if ctx.need(0) else None, None, dupdates if ctx.need(2) else None]


def split(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    shapes = [ctx.shape_of(v) for v in node.outputs]
    return [ctx.emit1("SplitGrad", [*douts, *shapes], like=node.inputs[0],
                      axis=int(node.attrs.get("axis", 0)))]


def where(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Each branch gets the gradient where it was chosen; the condition gets none."""
    cond, a, b = node.inputs[0], node.inputs[1], node.inputs[2]
    assert a is not None and b is not None
    da, db = ctx.emit("WhereGrad", [douts[0], cond, ctx.shape_of(a), ctx.shape_of(b)], 2,
                      like=[a, b], need=[int(ctx.need(1)), int(ctx.need(2))])
    return [None, da if ctx.need(1) else None, db if ctx.need(2) else None]


def extremum(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Max and Min over any number of broadcasting inputs; ties share the gradient."""
    xs = list(node.inputs)
    if len(xs) == 1:
        return [douts[0]]
    grads = ctx.emit("ExtremumGrad", [douts[0], node.outputs[0], *xs], len(xs), like=xs,
                     need=_mask(ctx, len(xs)))
    return [g if ctx.need(i) else None for i, g in enumerate(grads)]


def pad(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Pad in every mode; the constant value (opset >= 11) gets what fell on the padding."""
    x = node.inputs[0]
    assert x is not None
    mode = str(node.attrs.get("mode", "constant"))
    attrs: dict[str, Any] = {"mode": mode}
    if node.opset < 11:
        attrs["old_pads"] = list(node.attrs.get("pads", node.attrs.get("paddings", [])))
        rest: list[Value | None] = []
    else:
        rest = list(node.inputs[1:])
    value = _input(node, 2) if node.opset >= 11 else None
    need_value = value is not None and mode == "constant" and ctx.need(2)
    dx, dvalue = ctx.emit("PadGrad", [douts[0], ctx.shape_of(x), *rest], 2, like=[x, value],
                          need=[int(ctx.need(0)), int(need_value)], **attrs)
    return [dx if ctx.need(0) else None, None, dvalue if need_value else None, None]


# -- shape ops ----------------------------------------------------------------------------
def reshape(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """Reshape, Flatten, Squeeze, Unsqueeze: reshape the gradient back."""
    x = node.inputs[0]
    assert x is not None
    return [ctx.emit1("ReshapeTo", [douts[0], ctx.shape_of(x)], like=x)]


def expand(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    x = node.inputs[0]
    assert x is not None and douts[0] is not None
    return [ctx.sum_to(douts[0], x, reference=node.outputs[0])]


def transpose(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    perm = node.attrs.get("perm")
    attrs: dict[str, Any] = {}
    if perm is not None:
        inverse = [0] * len(perm)
        for i, p in enumerate(perm):
            inverse[p] = i
        attrs["perm"] = inverse
    return [ctx.emit1("Transpose", [douts[0]], domain="", like=node.inputs[0], **attrs)]


def concat(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    parts = [v for v in node.inputs if v is not None]
    shapes = [ctx.shape_of(v) for v in parts]
    grads = ctx.emit("ConcatGrad", [douts[0], *shapes], len(parts), like=parts,
                     axis=int(node.attrs.get("axis", 1)))
    out: Grads = []
    it = iter(grads)
    for i, v in enumerate(node.inputs):
        out.append(next(it) if v is not None else None)
        if not ctx.need(i):
            out[-1] = None
    return out


def slice_(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    x = node.inputs[0]
    assert x is not None
    if node.opset < 10:
        attrs: dict[str, Any] = {"old_starts": node.attrs["starts"], "old_ends": node.attrs["ends"],
                 "old_axes": node.attrs.get("axes")}
        return [ctx.emit1("SliceGrad", [douts[0], ctx.shape_of(x)], like=x, **attrs)]
    return [ctx.emit1("SliceGrad", [douts[0], ctx.shape_of(x), *node.inputs[1:]], like=x)]


# -- softmax and losses -------------------------------------------------------------------
def softmax(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    old = node.opset < 13
    axis = int(node.attrs.get("axis", 1 if old else -1))
    return [ctx.emit1("SoftmaxGrad", [douts[0], node.outputs[0]], like=node.inputs[0],
                      axis=axis, old=int(old), log=int(node.op_type == "LogSoftmax"))]


def softmax_cross_entropy(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    log_prob = ctx.forward_output(node, 1)
    attrs: dict[str, Any] = {k: node.attrs[k] for k in ("reduction", "ignore_index")
                             if k in node.attrs}
    dscores = ctx.emit1("SoftmaxCrossEntropyGrad",
                        [douts[0], log_prob, node.inputs[1], _input(node, 2)],
                        like=node.inputs[0], **attrs)
    return [dscores, None, None]


# -- reductions ---------------------------------------------------------------------------
def reduce(ctx: GradContext, node: Node, douts: Sequence[Value | None]) -> Grads:
    """ReduceSum / ReduceMean: broadcast the gradient back (divided by the count for mean)."""
    x = node.inputs[0]
    assert x is not None
    attrs: dict[str, Any] = {k: node.attrs[k] for k in ("keepdims", "noop_with_empty_axes", "axes")
                             if k in node.attrs}
    return [ctx.emit1("ReduceGrad", [douts[0], ctx.shape_of(x), _input(node, 1)], like=x,
                      mean=int(node.op_type == "ReduceMean"), **attrs)]
