"""Backward kernels (domain ``segflow.train``): the nodes gradient rules emit.

Why one module past ~500 lines: it is one table, the ``segflow.train`` domain's rows and
their kernels, which share one convention (a ``need`` attribute, None for gradients nobody
reads) and its attribute helpers; each kernel is found from its rule in
:mod:`segflow.ops.gradients` by its op name here.

The rules themselves live in :mod:`segflow.ops.gradients` and are referenced
from each forward op's row. Kernels here use torch's own backward functions
(``convolution_backward``, ``native_batch_norm_backward`` ...) so a training
step runs the same arithmetic as PyTorch eager. Multi-output kernels take a
``need`` attribute and return None for gradients nobody reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from segflow.errors import UnsupportedOp
from segflow.ir.graph import Node
from segflow.ops._common import ints, resolve_pads, torch_pad
from segflow.ops.registry import BindContext, Kernel, OpDef, ViewOfInput

Tensor = torch.Tensor
aten = torch.ops.aten

DOMAIN = "segflow.train"


def _partial(fn: Callable[[Sequence[Tensor | None]], Sequence[Tensor | None]]) -> Kernel:
    """A kernel that returns None for outputs nobody reads (the executor stores None)."""
    return cast(Kernel, fn)


def _need(node: Node, count: int) -> list[bool]:
    need = node.attrs.get("need")
    return [bool(n) for n in need] if need is not None else [True] * count


def _unpad(t: Tensor, begin: Sequence[int], end: Sequence[int]) -> Tensor:
    for axis, (b, e) in enumerate(zip(begin, end), start=2):
        t = t.narrow(axis, b, t.shape[axis] - b - e)
    return t


class _Window:
    """Window attributes of a Conv/Pool node, with pads resolved per input shape."""

    def __init__(self, node: Node, kernel: Sequence[int] | None) -> None:
        attrs = node.attrs
        self.kernel = list(kernel) if kernel is not None else None
        self.strides = attrs.get("strides")
        self.dilations = attrs.get("dilations")
        self.auto_pad = attrs.get("auto_pad", "NOTSET")
        self.pads = attrs.get("pads")

    def resolve(self, x: Tensor, kernel: Sequence[int]) -> tuple[list[int], list[int], list[int],
                                                                  list[int]]:
        """(strides, dilations, pad begins, pad ends) for input ``x``."""
        n = len(kernel)
        strides = list(self.strides or [1] * n)
        dilations = list(self.dilations or [1] * n)
        pads = resolve_pads(self.auto_pad, self.pads, list(x.shape[2:]), kernel, strides,
                            dilations)  # the forward op's own rule
        return strides, dilations, pads[:n], pads[n:]


# -- shape plumbing ---------------------------------------------------------------------
def _sum_to_shape(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        g, shape = inputs[0], ints(inputs[1])
        assert g is not None
        return [sum_to(g, shape)]
    return kernel


def sum_to(g: Tensor, shape: Sequence[int]) -> Tensor:
    """Sum a broadcast gradient down to ``shape`` (numpy broadcasting rules)."""
    shape = list(shape)
    if list(g.shape) == shape:
        return g
    lead = g.dim() - len(shape)
    if lead > 0:
        g = g.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, (have, want) in enumerate(zip(g.shape, shape)) if want == 1 and have != 1)
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    return g.reshape(shape)


def _reshape_to(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        g = inputs[0]
        assert g is not None
        return [g.reshape(ints(inputs[1]))]
    return kernel


def _ones_like(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        return [torch.ones_like(x)]
    return kernel


# -- elementwise --------------------------------------------------------------------------
UnaryFn = Callable[[Tensor, Tensor, Tensor, dict[str, Any], Sequence[Tensor | None]], Tensor]


def _clip_mask(x: Tensor, attrs: dict[str, Any], extra: Sequence[Tensor | None]) -> Tensor:
    lo = extra[0] if len(extra) > 0 and extra[0] is not None else attrs.get("min")
    hi = extra[1] if len(extra) > 1 and extra[1] is not None else attrs.get("max")
    mask = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        mask &= x >= lo
    if hi is not None:
        mask &= x <= hi
    return mask


# dy, x, y, attrs, extra inputs -> dx. Entries read x or y; the rule passes only what is read.
UNARY_GRADS: dict[str, UnaryFn] = {
    "Relu": lambda dy, x, y, a, e: aten.threshold_backward(dy, y, 0),
    "Sigmoid": lambda dy, x, y, a, e: aten.sigmoid_backward(dy, y),
    "Tanh": lambda dy, x, y, a, e: aten.tanh_backward(dy, y),
    "Gelu": lambda dy, x, y, a, e: aten.gelu_backward(
        dy, x, approximate="tanh" if a.get("approximate") == "tanh" else "none"),
    "LeakyRelu": lambda dy, x, y, a, e: aten.leaky_relu_backward(
        dy, x, float(a.get("alpha", 0.01)), False),
    "Sqrt": lambda dy, x, y, a, e: dy * 0.5 / y,
    "Exp": lambda dy, x, y, a, e: dy * y,
    "Log": lambda dy, x, y, a, e: dy / x,
    "Reciprocal": lambda dy, x, y, a, e: -dy * y * y,
    "Abs": lambda dy, x, y, a, e: dy * torch.sign(x),
    "Softplus": lambda dy, x, y, a, e: dy * torch.sigmoid(x),
    "Erf": lambda dy, x, y, a, e: dy * (2.0 / math.sqrt(math.pi)) * torch.exp(-x * x),
    "Sin": lambda dy, x, y, a, e: dy * torch.cos(x),
    "Cos": lambda dy, x, y, a, e: -dy * torch.sin(x),
    "Clip": lambda dy, x, y, a, e: dy * _clip_mask(x, a, e),
    "Scale": lambda dy, x, y, a, e: dy * float(a["alpha"]),
}


def _unary_grad(node: Node, ctx: BindContext) -> Kernel:
    fn = UNARY_GRADS[node.attrs["op"]]
    attrs = dict(node.attrs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, x, y = inputs[0], inputs[1], inputs[2]
        return [fn(dy, x, y, attrs, inputs[3:])]  # type: ignore[arg-type]
    return kernel


def _binary_parts(op: str, dy: Tensor, a: Tensor, b: Tensor, need_a: bool,
                  need_b: bool) -> tuple[Tensor | None, Tensor | None]:
    if op == "Add":
        return dy if need_a else None, dy if need_b else None
    if op == "Sub":
        return dy if need_a else None, -dy if need_b else None
    if op == "Mul":
        return dy * b if need_a else None, dy * a if need_b else None
    if op == "Div":
        return dy / b if need_a else None, -dy * a / (b * b) if need_b else None
    if op == "Pow":
        bb = b.to(a.dtype)
        da = dy * bb * a.pow(bb - 1) if need_a else None
        db = None
        if need_b:
            db = torch.where((a == 0) & (bb >= 0), torch.zeros_like(dy),
                             dy * a.pow(bb) * torch.log(a))
        return da, db
    raise KeyError(op)


def _binary_grad(node: Node, ctx: BindContext) -> Kernel:
    op = node.attrs["op"]
    need_a, need_b = _need(node, 2)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, a, b = inputs[0], inputs[1], inputs[2]
        assert dy is not None and a is not None and b is not None
        da, db = _binary_parts(op, dy, a, b, need_a, need_b)
        return [None if da is None else sum_to(da, a.shape).to(a.dtype),
                None if db is None else sum_to(db, b.shape).to(b.dtype)]
    return _partial(kernel)


# -- dense layers -------------------------------------------------------------------------
def _conv_grad(node: Node, ctx: BindContext) -> Kernel:
    win = _Window(node, node.attrs.get("kernel_shape"))
    group = int(node.attrs.get("group", 1))
    mask = _need(node, 3)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, x, w = inputs[0], inputs[1], inputs[2]
        assert dy is not None and x is not None and w is not None
        n = w.dim() - 2
        strides, dil, begin, end = win.resolve(x, win.kernel or list(w.shape[2:]))
        bias = [w.shape[0]] if mask[2] else None
        if begin == end:
            return list(aten.convolution_backward(dy, x, w, bias, strides, begin, dil, False,
                                                  [0] * n, group, mask))
        xp = F.pad(x, torch_pad(begin + end))
        dx, dw, db = aten.convolution_backward(dy, xp, w, bias, strides, [0] * n, dil, False,
                                               [0] * n, group, mask)
        return [None if dx is None else _unpad(dx, begin, end), dw, db]
    return _partial(kernel)


def _gemm_grad(node: Node, ctx: BindContext) -> Kernel:
    alpha = float(node.attrs.get("alpha", 1.0))
    beta = float(node.attrs.get("beta", 1.0))
    ta = int(node.attrs.get("transA", 0))
    tb = int(node.attrs.get("transB", 0))
    need_a, need_b, need_c = _need(node, 3)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, a, b, c = inputs[0], inputs[1], inputs[2], inputs[3] if len(inputs) > 3 else None
        assert dy is not None and a is not None and b is not None
        if alpha != 1.0:
            dy_a = dy * alpha
        else:
            dy_a = dy
        a2 = a.t() if ta else a
        b2 = b.t() if tb else b
        da = db = dc = None
        if need_a:
            da = b2.mm(dy_a.t()) if ta else dy_a.mm(b2.t())       # dA' = dY B'^T
        if need_b:
            db = dy_a.t().mm(a2) if tb else a2.t().mm(dy_a)       # dB' = A'^T dY
        if need_c and c is not None:
            dc = sum_to(dy * beta if beta != 1.0 else dy, c.shape)
        return [da, db, dc]
    return _partial(kernel)


def _matmul_grad(node: Node, ctx: BindContext) -> Kernel:
    need_a, need_b = _need(node, 2)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, a, b = inputs[0], inputs[1], inputs[2]
        assert dy is not None and a is not None and b is not None
        a2 = a.unsqueeze(0) if a.dim() == 1 else a
        b2 = b.unsqueeze(-1) if b.dim() == 1 else b
        g = dy
        if a.dim() == 1:
            g = g.unsqueeze(-2)
        if b.dim() == 1:
            g = g.unsqueeze(-1)
        da = sum_to(g.matmul(b2.transpose(-1, -2)), a2.shape).reshape(a.shape) if need_a else None
        db = sum_to(a2.transpose(-1, -2).matmul(g), b2.shape).reshape(b.shape) if need_b else None
        return [da, db]
    return _partial(kernel)


# -- normalization ------------------------------------------------------------------------
def _batchnorm_training(node: Node, ctx: BindContext) -> Kernel:
    """BatchNormalization in training mode, also returning saved mean and inverse std."""
    eps = float(node.attrs.get("epsilon", 1e-5))
    momentum = float(node.attrs.get("momentum", 0.9))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale, bias, mean, var = inputs[:5]
        assert x is not None and mean is not None and var is not None
        y, save_mean, save_invstd = torch.native_batch_norm(x, scale, bias, None, None, True,
                                                            0.0, eps)
        batch_var = save_invstd.pow(-2) - eps
        # ONNX semantics: running = running * momentum + batch * (1 - momentum), biased var.
        running_mean = mean * momentum + save_mean.to(mean.dtype) * (1 - momentum)
        running_var = var * momentum + batch_var.to(var.dtype) * (1 - momentum)
        return [y, running_mean, running_var, save_mean, save_invstd]
    return kernel


def _batchnorm_grad(node: Node, ctx: BindContext) -> Kernel:
    eps = float(node.attrs.get("epsilon", 1e-5))
    training = bool(node.attrs.get("training", 1))
    mask = _need(node, 3)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, x, scale, stat_a, stat_b = inputs[:5]
        assert dy is not None and x is not None
        if training:
            return list(aten.native_batch_norm_backward(dy, x, scale, None, None, stat_a, stat_b,
                                                        True, eps, mask))
        return list(aten.native_batch_norm_backward(dy, x, scale, stat_a, stat_b, None, None,
                                                    False, eps, mask))
    return _partial(kernel)


def _layernorm_grad(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", -1))
    need_x, need_scale, need_bias = _need(node, 3)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, x, scale, bias, mean, invstd = inputs[:6]
        assert dy is not None and x is not None and scale is not None
        a = axis + x.dim() if axis < 0 else axis
        shape = list(x.shape[a:])
        w = scale.expand(shape).contiguous()
        dx, dw, _ = aten.native_layer_norm_backward(dy, x, shape, mean, invstd, w, None,
                                                    [need_x, need_scale, False])
        dscale = sum_to(dw, scale.shape) if need_scale else None
        dbias = sum_to(dy, bias.shape) if need_bias and bias is not None else None
        return [dx, dscale, dbias]
    return _partial(kernel)


class _Groups:
    """How a GroupNormTraining/GroupNormGrad node groups channels: ``num_groups`` 0 is
    one group per channel (InstanceNormalization); ``per_group`` scales are per group."""

    def __init__(self, node: Node) -> None:
        self.eps = float(node.attrs.get("epsilon", 1e-5))
        self.groups = int(node.attrs["num_groups"])
        self.per_group = bool(node.attrs.get("per_group", 0))

    def sizes(self, x: Tensor) -> tuple[int, int, int, int]:
        """(N, C, spatial size, groups) as aten's group norm takes them."""
        n, c = x.shape[0], x.shape[1]
        return n, c, math.prod(x.shape[2:]), self.groups or c

    def per_channel(self, t: Tensor | None, c: int, groups: int) -> Tensor | None:
        return t.repeat_interleave(c // groups) if t is not None and self.per_group else t


def _groupnorm_training(node: Node, ctx: BindContext) -> Kernel:
    """Instance/GroupNormalization that also returns the saved mean and inverse std."""
    spec = _Groups(node)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale, bias = inputs[0], inputs[1], inputs[2]
        assert x is not None
        n, c, hw, groups = spec.sizes(x)
        return list(aten.native_group_norm(x.contiguous(), spec.per_channel(scale, c, groups),
                                           spec.per_channel(bias, c, groups), n, c, hw,
                                           groups, spec.eps))
    return kernel


def _groupnorm_grad(node: Node, ctx: BindContext) -> Kernel:
    spec = _Groups(node)
    mask = _need(node, 3)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        dy, x, scale, mean, invstd = inputs[:5]
        assert dy is not None and x is not None and scale is not None
        n, c, hw, groups = spec.sizes(x)
        dx, dscale, dbias = aten.native_group_norm_backward(
            dy.contiguous(), x.contiguous(), mean, invstd, spec.per_channel(scale, c, groups),
            n, c, hw, groups, mask)
        if spec.per_group:
            dscale = None if dscale is None else dscale.reshape(groups, -1).sum(1)
            dbias = None if dbias is None else dbias.reshape(groups, -1).sum(1)
        return [dx, dscale, dbias]
    return _partial(kernel)


# -- pooling ------------------------------------------------------------------------------
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _maxpool_indices(x: Tensor, win: _Window, kernel: list[int], ceil_mode: bool
                     ) -> tuple[Tensor, Tensor]:
    """Max pooling with torch's per-plane indices (over the padded input when padded)."""
    strides, dil, begin, end = win.resolve(x, kernel)
    pool = _MAXPOOL[len(kernel)]
    if begin == end and all(p <= k // 2 for p, k in zip(begin, kernel)):
        return pool(x, kernel, strides, begin, dil, ceil_mode, return_indices=True)
    xp = F.pad(x, torch_pad(begin + end), value=-math.inf)
    return pool(xp, kernel, strides, 0, dil, ceil_mode, return_indices=True)


def _maxpool_train(node: Node, ctx: BindContext) -> Kernel:
    """MaxPool that also returns torch-style indices for its backward kernel."""
    kernel_shape = list(node.attrs["kernel_shape"])
    win = _Window(node, kernel_shape)
    ceil_mode = bool(node.attrs.get("ceil_mode", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        y, idx = _maxpool_indices(x, win, kernel_shape, ceil_mode)
        return [y, idx]
    return kernel


def _maxpool_grad(node: Node, ctx: BindContext) -> Kernel:
    kernel_shape = list(node.attrs["kernel_shape"])
    win = _Window(node, kernel_shape)
    ceil_mode = bool(node.attrs.get("ceil_mode", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, x = inputs[0], inputs[1]
        idx = inputs[2] if len(inputs) > 2 else None
        assert dy is not None and x is not None
        if idx is None:
            _, idx = _maxpool_indices(x, win, kernel_shape, ceil_mode)
        strides, dil, begin, end = win.resolve(x, kernel_shape)
        padded = not (begin == end and all(p <= k // 2 for p, k in zip(begin, kernel_shape)))
        if not padded and len(kernel_shape) == 2:
            return [aten.max_pool2d_with_indices_backward(dy, x, kernel_shape, strides, begin,
                                                          dil, ceil_mode, idx)]
        spatial = [s + (b + e if padded else 0) for s, b, e in zip(x.shape[2:], begin, end)]
        n, c = x.shape[0], x.shape[1]
        dx = dy.new_zeros((n, c, math.prod(spatial)))
        dx.scatter_add_(2, idx.reshape(n, c, -1), dy.reshape(n, c, -1))
        dx = dx.reshape(n, c, *spatial)
        return [_unpad(dx, begin, end) if padded else dx]
    return kernel


def _global_avgpool_grad(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, shape = inputs[0], ints(inputs[1])
        assert dy is not None
        count = math.prod(shape[2:])
        return [(dy / count).expand(shape)]
    return kernel


def _vjp(node: Node, ctx: BindContext) -> Kernel:
    """Backward by recomputation: rerun the forward kernel under torch autograd.

    Used by rules of ops whose many variants (pads, ceil_mode, dilations) make a
    closed form long, e.g. AveragePool. The forward node travels in ``attrs``.
    """
    forward: Node = node.attrs["forward"]
    fwd_kernel = node.attrs["bind"](forward, ctx)
    n_out = len(forward.outputs)
    want = [bool(w) for w in node.attrs["need"]]

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
        douts, xs = list(inputs[:n_out]), list(inputs[n_out:])
        # A step run under inference_mode could not record the forward: leave it here.
        with torch.inference_mode(False), torch.enable_grad():
            leaves = [_leaf(x) if w and x is not None else x for x, w in zip(xs, want)]
            ys = fwd_kernel(leaves)
            pairs = [(y, g) for y, g in zip(ys, douts) if g is not None]
            if any(not y.requires_grad for y, _ in pairs):
                # A kernel that left torch (numpy, a native call) records nothing: its
                # gradient would read as zero, which is a wrong answer, not a gradient.
                raise UnsupportedOp(f"no gradient for op {forward.op_type} (node "
                                    f"{forward.name!r}): its kernel is not differentiable "
                                    "by recomputation for these inputs")
            targets = [x for x, w in zip(leaves, want) if w and x is not None]
            grads = torch.autograd.grad([y for y, _ in pairs], targets, [g for _, g in pairs],
                                        allow_unused=True)
        out: list[Tensor | None] = []
        it = iter(grads)
        for x, w in zip(leaves, want):
            if w and x is not None:
                g = next(it)
                out.append(torch.zeros_like(x) if g is None else g)
            else:
                out.append(None)
        return out
    return _partial(kernel)


def _leaf(x: Tensor) -> Tensor:
    """``x`` as an autograd leaf; a tensor made under ``inference_mode`` cannot be one, so
    it is copied (outside inference mode) first."""
    if x.is_inference():
        x = x.clone()
    return x.detach().requires_grad_(True)


# -- shape ops ----------------------------------------------------------------------------
def _concat_grad(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs["axis"])

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy = inputs[0]
        assert dy is not None
        a = axis + dy.dim() if axis < 0 else axis
        sizes = [ints(s)[a] for s in inputs[1:]]
        return list(torch.split(dy, sizes, dim=a))
    return kernel


def _slice_grad(node: Node, ctx: BindContext) -> Kernel:
    old = node.attrs.get("old_starts") is not None
    attrs = node.attrs

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        from segflow.ops.tensor import slice_tensor  # the forward op's own semantics
        dy, shape = inputs[0], ints(inputs[1])
        assert dy is not None
        if old:
            starts, ends = list(attrs["old_starts"]), list(attrs["old_ends"])
            axes = list(attrs.get("old_axes") or range(len(starts)))
            steps = [1] * len(starts)
        else:
            starts, ends = ints(inputs[2]), ints(inputs[3])
            axes = ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else list(
                range(len(starts)))
            steps = ints(inputs[5]) if len(inputs) > 5 and inputs[5] is not None else [1] * len(
                starts)
        dx = dy.new_zeros(shape)
        if all(s > 0 for s in steps):
            slice_tensor(dx, starts, ends, axes, steps).copy_(dy)
            return [dx]
        index = torch.arange(dx.numel(), device=dy.device).reshape(shape)
        picked = slice_tensor(index, starts, ends, axes, steps)
        dx.view(-1).index_add_(0, picked.reshape(-1), dy.reshape(-1))
        return [dx]
    return kernel


def _softmax_grad(node: Node, ctx: BindContext) -> Kernel:
    old = bool(node.attrs.get("old", 0))
    axis = int(node.attrs["axis"])
    log = bool(node.attrs.get("log", 0))
    backward = torch._log_softmax_backward_data if log else torch._softmax_backward_data

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, y = inputs[0], inputs[1]
        assert dy is not None and y is not None
        if old:
            a = axis + y.dim() if axis < 0 else axis
            rows = math.prod(y.shape[:a])
            dx = backward(dy.reshape(rows, -1), y.reshape(rows, -1), 1, y.dtype)
            return [dx.reshape(y.shape)]
        return [backward(dy, y, axis, y.dtype)]
    return kernel


def _softmax_cross_entropy_grad(node: Node, ctx: BindContext) -> Kernel:
    reduction = node.attrs.get("reduction", "mean")
    ignore = node.attrs.get("ignore_index")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dloss, log_prob, labels = inputs[0], inputs[1], inputs[2]
        weights = inputs[3] if len(inputs) > 3 else None
        assert dloss is not None and log_prob is not None and labels is not None
        labels = labels.long()
        valid = labels != ignore if ignore is not None else None
        safe = torch.where(valid, labels, 0) if valid is not None else labels
        if weights is not None:
            w = weights[safe].to(log_prob.dtype)
        else:
            w = torch.ones(labels.shape, dtype=log_prob.dtype, device=log_prob.device)
        if valid is not None:
            w = w * valid
        coeff = w * dloss / w.sum() if reduction == "mean" else w * dloss
        coeff = coeff.unsqueeze(1)
        grad = log_prob.exp() * coeff
        grad.scatter_add_(1, safe.unsqueeze(1), -coeff)
        return [grad]
    return kernel


def _dropout_grad(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, mask = inputs[0], inputs[1]
        assert dy is not None and mask is not None
        ratio_t = inputs[2] if len(inputs) > 2 else None
        training_t = inputs[3] if len(inputs) > 3 else None
        training = training_t is not None and bool(training_t)
        ratio = float(ratio_t) if ratio_t is not None else 0.5
        if training and ratio > 0:
            return [dy * mask / (1 - ratio)]
        return [dy]
    return kernel


def _reduce_grad(node: Node, ctx: BindContext) -> Kernel:
    keepdims = int(node.attrs.get("keepdims", 1))
    noop = int(node.attrs.get("noop_with_empty_axes", 0))
    mean = bool(node.attrs.get("mean", 0))
    attr_axes = node.attrs.get("axes")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        dy, shape = inputs[0], ints(inputs[1])
        assert dy is not None
        axes = list(attr_axes) if attr_axes is not None else (
            ints(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else [])
        rank = len(shape)
        if not axes:
            if noop:
                return [dy.reshape(shape)]
            axes = list(range(rank))
        axes = sorted(a + rank if a < 0 else a for a in axes)
        if not keepdims:
            kept = list(dy.shape)
            for a in axes:
                kept.insert(a, 1)
            dy = dy.reshape(kept)
        if mean:
            dy = dy / math.prod(shape[a] for a in axes)
        return [dy.expand(shape)]
    return kernel


OPS: list[OpDef] = [
    OpDef("SumToShape", _sum_to_shape, domain=DOMAIN, doc="sum a broadcast gradient to a shape",
          view_of_input=ViewOfInput.MAY_ALIAS),
    OpDef("ReshapeTo", _reshape_to, domain=DOMAIN, doc="reshape a gradient to a shape tensor",
          view_of_input=ViewOfInput.RESHAPE),
    OpDef("OnesLike", _ones_like, domain=DOMAIN, doc="the loss seed when its shape is unknown"),
    OpDef("UnaryGrad", _unary_grad, domain=DOMAIN, doc="elementwise activation backward"),
    OpDef("BinaryGrad", _binary_grad, domain=DOMAIN, doc="broadcasting arithmetic backward"),
    OpDef("ConvGrad", _conv_grad, domain=DOMAIN),
    OpDef("GemmGrad", _gemm_grad, domain=DOMAIN),
    OpDef("MatMulGrad", _matmul_grad, domain=DOMAIN),
    OpDef("BatchNormTraining", _batchnorm_training, domain=DOMAIN,
          doc="training-mode BatchNormalization that also returns saved statistics"),
    OpDef("BatchNormGrad", _batchnorm_grad, domain=DOMAIN),
    OpDef("LayerNormGrad", _layernorm_grad, domain=DOMAIN),
    OpDef("GroupNormTraining", _groupnorm_training, domain=DOMAIN,
          doc="Instance/GroupNormalization that also returns saved statistics"),
    OpDef("GroupNormGrad", _groupnorm_grad, domain=DOMAIN),
    OpDef("MaxPoolTrain", _maxpool_train, domain=DOMAIN,
          doc="MaxPool that also returns torch-style argmax indices"),
    OpDef("MaxPoolGrad", _maxpool_grad, domain=DOMAIN),
    OpDef("GlobalAveragePoolGrad", _global_avgpool_grad, domain=DOMAIN),
    OpDef("Vjp", _vjp, domain=DOMAIN, doc="backward by recomputing the forward under autograd"),
    OpDef("ConcatGrad", _concat_grad, domain=DOMAIN),
    OpDef("SliceGrad", _slice_grad, domain=DOMAIN),
    OpDef("SoftmaxGrad", _softmax_grad, domain=DOMAIN),
    OpDef("SoftmaxCrossEntropyGrad", _softmax_cross_entropy_grad, domain=DOMAIN),
    OpDef("DropoutGrad", _dropout_grad, domain=DOMAIN),
    OpDef("ReduceGrad", _reduce_grad, domain=DOMAIN),
]
