"""Neural-network ops: convolution, pooling, normalization, dense layers, softmax.

Why one module past ~500 lines: it is one family's ``OPS`` table with the kernels that
are a few lines each; the larger ones already live in ``_losses``, ``_transformer``,
``_deform`` and ``_pooling``, and the direct libdnnl pooling binder leaves for ``kernels/``
with the other kernel binders.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from segflow.ir.graph import Node
from segflow.ops import _deform, _losses, _transformer, gradients
from segflow.ops._common import has_input, resolve_pads, torch_pad
from segflow.ops.registry import BindContext, Kernel, OpDef, ViewOfInput

Tensor = torch.Tensor

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


class Window:
    """Parsed window attributes shared by Conv and the pools."""

    def __init__(self, node: Node, spatial: int, kernel: Sequence[int]) -> None:
        attrs = node.attrs
        self.kernel = list(kernel)
        self.strides = list(attrs.get("strides", [1] * spatial))
        self.dilations = list(attrs.get("dilations", [1] * spatial))
        self.auto_pad = attrs.get("auto_pad", "NOTSET")
        self.pads = list(attrs.get("pads", [0] * (2 * spatial)))
        if self.auto_pad == "VALID":
            self.pads = [0] * (2 * spatial)
        self.spatial = spatial

    def resolve(self, x: Tensor) -> list[int]:
        return resolve_pads(self.auto_pad, self.pads, x.shape[2:], self.kernel, self.strides,
                            self.dilations)

    @property
    def symmetric(self) -> bool:
        n = self.spatial
        return self.auto_pad in ("NOTSET", "VALID") and self.pads[:n] == self.pads[n:]


def _conv(node: Node, ctx: BindContext) -> Kernel:
    weight = node.inputs[1]
    kshape = node.attrs.get("kernel_shape")
    if kshape is None:
        if weight is None or weight.spec.shape is None:
            # Learn the kernel shape from the weight at run time.
            kshape = None
        else:
            kshape = list(weight.spec.shape[2:])
    group = int(node.attrs.get("group", 1))
    has_bias = has_input(node, 2)

    state: dict[str, object] = {}

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        b = inputs[2] if has_bias else None
        spatial = w.dim() - 2
        win = state.get("win")
        if win is None:
            win = Window(node, spatial, kshape or list(w.shape[2:]))
            state["win"] = win
        assert isinstance(win, Window)
        if win.symmetric:
            return [_CONV[spatial](x, w, b, win.strides, win.pads[:spatial], win.dilations, group)]
        x = F.pad(x, torch_pad(win.resolve(x)))
        return [_CONV[spatial](x, w, b, win.strides, 0, win.dilations, group)]
    return kernel


def _conv_transpose(node: Node, ctx: BindContext) -> Kernel:
    attrs = node.attrs
    group = int(attrs.get("group", 1))
    has_bias = has_input(node, 2)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    same = auto_pad in ("SAME_UPPER", "SAME_LOWER")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        b = inputs[2] if has_bias else None
        n = w.dim() - 2
        kshape = list(attrs.get("kernel_shape", w.shape[2:]))
        strides = list(attrs.get("strides", [1] * n))
        dil = list(attrs.get("dilations", [1] * n))
        out_pad = list(attrs.get("output_padding", [0] * n))
        in_sizes = list(x.shape[2:])
        full = [s * (i - 1) + op + (k - 1) * d + 1 for s, i, op, k, d in
                zip(strides, in_sizes, out_pad, kshape, dil)]
        target = list(attrs["output_shape"])[-n:] if "output_shape" in attrs else None
        if same or target is not None:
            # Pads split the surplus over the target (SAME's default: input * stride), the
            # larger half at the end for SAME_UPPER and at the start otherwise (explicit
            # pads do not count once there is an output_shape); a target past the full
            # output gets zeros at the end, as onnxruntime writes them.
            want = target or [i * s for i, s in zip(in_sizes, strides)]
            total = [f - t for f, t in zip(full, want)]
            upper = auto_pad == "SAME_UPPER"
            begin = [0 if t < 0 else t // 2 if upper else t - t // 2 for t in total]
            end = [t - b for t, b in zip(total, begin)]
            target = None
        else:
            pads = list(attrs.get("pads", [0] * 2 * n))
            begin, end = pads[:n], pads[n:]
        simple = (begin == end and all(p >= 0 for p in begin) and target is None
                  and all(op < max(s, d) for op, s, d in zip(out_pad, strides, dil)))
        if simple:
            return [_CONV_T[n](x, w, b, strides, begin, out_pad, group, dil)]
        # General case: the full transposed conv, then crop (or zero-extend) each side.
        y = _CONV_T[n](x, w, None, strides, 0, 0, group, dil)
        y = F.pad(y, torch_pad([0] * n + [f - s for f, s in zip(full, y.shape[2:])]))
        y = F.pad(y, torch_pad([-p for p in begin] + [-p for p in end]))
        if target is not None:
            y = F.pad(y, torch_pad([0] * n + [t - s for t, s in zip(target, y.shape[2:])]))
        if b is not None:
            y = y + b.reshape(1, -1, *([1] * n))
        return [y]
    return kernel


def pool_out_pad(x: Tensor, win: Window) -> tuple[list[int], list[int]]:
    pads = win.resolve(x)
    n = win.spatial
    return pads[:n], pads[n:]


# 8-bit integers viewed as torch's quantized dtypes, whose max pooling is vectorized over
# channels-last input (the plain integer kernel is a scalar loop, two orders slower).
_QUANTIZED_VIEW = {torch.uint8: torch.quint8, torch.int8: torch.qint8}


def _integer_max_pool(x: Tensor, kernel: list[int], strides: list[int], pads: list[int],
                      dilations: list[int], ceil_mode: bool) -> Tensor | None:
    """Max pooling of an 8-bit integer tensor through torch's quantized kernel (max
    commutes with any scale, so the view's scale 1 and zero point 0 change nothing);
    None where this torch no longer has it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the quantized dtypes are deprecated
            view = torch._make_per_tensor_quantized_tensor(x, 1.0, 0)   # quint8 / qint8
            pooled = F.max_pool2d(view, kernel, strides, pads, dilations, ceil_mode)
            return pooled.int_repr()
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _maxpool(node: Node, ctx: BindContext) -> Kernel:
    kshape = list(node.attrs["kernel_shape"])
    n = len(kshape)
    win = Window(node, n, kshape)
    ceil_mode = bool(node.attrs.get("ceil_mode", 0))
    storage_order = int(node.attrs.get("storage_order", 0))
    want_indices = len(node.outputs) > 1

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        begin, end = pool_out_pad(x, win)
        if x.dtype in _QUANTIZED_VIEW and n == 2 and begin == end and not want_indices \
                and all(p <= k // 2 for p, k in zip(begin, kshape)):
            pooled = _integer_max_pool(x, kshape, win.strides, begin, win.dilations, ceil_mode)
            if pooled is not None:
                return [pooled]
        if not x.is_floating_point() and not x.is_contiguous():
            x = x.contiguous()   # torch's integer max pooling refuses channels-last input
        if begin == end and all(p <= k // 2 for p, k in zip(begin, kshape)) and not want_indices:
            return [_MAXPOOL[n](x, kshape, win.strides, begin, win.dilations, ceil_mode)]
        low = -math.inf if x.is_floating_point() else torch.iinfo(x.dtype).min
        xp = F.pad(x, torch_pad(begin + end), value=low) if any(begin + end) else x
        if want_indices:
            y, idx = _MAXPOOL[n](xp, kshape, win.strides, 0, win.dilations, ceil_mode,
                                 return_indices=True)
            idx = _unpad_indices(idx, x.shape, begin, end, storage_order)
            return [y, idx]
        return [_MAXPOOL[n](xp, kshape, win.strides, 0, win.dilations, ceil_mode)]

    return kernel


def _unpad_indices(idx: Tensor, shape: Sequence[int], begin: list[int], end: list[int],
                   storage_order: int) -> Tensor:
    """Map torch's per-plane flat indices (over the padded input) to ONNX's global ones."""
    spatial = list(shape[2:])
    padded = [s + b + e for s, b, e in zip(spatial, begin, end)]
    coords = []
    rem = idx
    for size in reversed(padded):
        coords.append(rem % size)
        rem = rem // size
    coords = [c - b for c, b in zip(reversed(coords), begin)]
    if storage_order == 1:
        flat = torch.zeros_like(idx)
        stride = 1
        for c, size in zip(coords, spatial):
            flat = flat + c * stride
            stride *= size
    else:
        flat = torch.zeros_like(idx)
        for c, size in zip(coords, spatial):
            flat = flat * size + c
    plane = math.prod(spatial)
    n, ch = shape[0], shape[1]
    base = torch.arange(n * ch, dtype=idx.dtype, device=idx.device).reshape(
        [n, ch] + [1] * len(spatial)) * plane
    return flat + base


def _avgpool(node: Node, ctx: BindContext) -> Kernel:
    kshape = list(node.attrs["kernel_shape"])
    n = len(kshape)
    win = Window(node, n, kshape)
    ceil_mode = bool(node.attrs.get("ceil_mode", 0))
    count_pad = bool(node.attrs.get("count_include_pad", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        begin, end = pool_out_pad(x, win)
        if (begin == end and all(p <= k // 2 for p, k in zip(begin, kshape))
                and win.dilations == [1] * n):
            return [_AVGPOOL[n](x, kshape, win.strides, begin, ceil_mode, count_pad)]
        return [_avgpool_general(x, kshape, win, begin, end, ceil_mode, count_pad)]
    return kernel


def _avgpool_general(x: Tensor, kshape: list[int], win: Window, begin: list[int],
                     end: list[int], ceil_mode: bool, count_pad: bool) -> Tensor:
    """Average pooling with asymmetric pads/dilations: a sum-conv divided by counts."""
    n = len(kshape)
    ch = x.shape[1]
    xp = F.pad(x, torch_pad(begin + end))
    ones_in = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    ones = F.pad(ones_in, torch_pad(begin + end), value=1.0 if count_pad else 0.0)
    if ceil_mode:
        extra = []
        for i in range(n):
            size = xp.shape[2 + i]
            eff = (kshape[i] - 1) * win.dilations[i] + 1
            out = -(-(size - eff) // win.strides[i]) + 1
            if (out - 1) * win.strides[i] >= size - 0 - begin[i] and out > 1:
                out -= 1
            extra.append(max(0, (out - 1) * win.strides[i] + eff - size))
        pad_extra = [0] * n + extra
        xp = F.pad(xp, torch_pad(pad_extra))
        ones = F.pad(ones, torch_pad(pad_extra))
    weight = torch.ones((ch, 1, *kshape), dtype=x.dtype, device=x.device)
    total = _CONV[n](xp, weight, None, win.strides, 0, win.dilations, ch)
    counts = _CONV[n](ones, weight[:1], None, win.strides, 0, win.dilations, 1)
    return total / counts


def _global_pool(reduce: str):  # type: ignore[no-untyped-def]
    def bind(node: Node, ctx: BindContext) -> Kernel:
        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x = inputs[0]
            assert x is not None
            dims = tuple(range(2, x.dim()))
            if reduce == "mean":
                return [x.mean(dim=dims, keepdim=True)]
            return [x.amax(dim=dims, keepdim=True)]
        return kernel
    return bind


def _batchnorm(node: Node, ctx: BindContext) -> Kernel:
    eps = float(node.attrs.get("epsilon", 1e-5))
    training = bool(node.attrs.get("training_mode", 0))
    momentum = float(node.attrs.get("momentum", 0.9))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale, bias, mean, var = inputs[:5]
        assert x is not None and scale is not None and bias is not None
        assert mean is not None and var is not None
        if not training:
            return [F.batch_norm(x, mean, var, scale, bias, False, 0.0, eps)]
        dims = [0] + list(range(2, x.dim()))
        batch_mean = x.mean(dim=dims)
        batch_var = x.var(dim=dims, unbiased=False)
        shape = [1, -1] + [1] * (x.dim() - 2)
        y = (x - batch_mean.reshape(shape)) / torch.sqrt(batch_var.reshape(shape) + eps)
        y = y * scale.reshape(shape) + bias.reshape(shape)
        running_mean = mean * momentum + batch_mean * (1 - momentum)
        running_var = var * momentum + batch_var * (1 - momentum)
        return [y, running_mean, running_var][: len(node.outputs)]
    return kernel


def _instancenorm(node: Node, ctx: BindContext) -> Kernel:
    eps = float(node.attrs.get("epsilon", 1e-5))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale, bias = inputs
        assert x is not None
        return [F.instance_norm(x, weight=scale, bias=bias, eps=eps)]
    return kernel


def _layernorm(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", -1))
    eps = float(node.attrs.get("epsilon", 1e-5))
    n_out = len(node.outputs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        assert x is not None and scale is not None
        a = axis + x.dim() if axis < 0 else axis
        norm_shape = x.shape[a:]
        if n_out == 1 and x.dtype in (torch.float32, torch.float64):
            return [F.layer_norm(x, norm_shape, scale.expand(norm_shape),
                                 None if bias is None else bias.expand(norm_shape), eps)]
        dims = tuple(range(a, x.dim()))
        xf = x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x
        mean = xf.mean(dim=dims, keepdim=True)
        var = ((xf - mean) ** 2).mean(dim=dims, keepdim=True)
        inv = torch.rsqrt(var + eps)
        y = ((xf - mean) * inv).to(x.dtype) * scale
        if bias is not None:
            y = y + bias
        return [y, mean, inv][:n_out]
    return kernel


def _groupnorm(node: Node, ctx: BindContext) -> Kernel:
    eps = float(node.attrs.get("epsilon", 1e-5))
    groups = int(node.attrs["num_groups"])

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, scale, bias = inputs
        assert x is not None and scale is not None and bias is not None
        if node.opset < 21:
            # Opset 18 declares per-group scale/bias.
            c = x.shape[1]
            scale = scale.repeat_interleave(c // groups)
            bias = bias.repeat_interleave(c // groups)
        return [F.group_norm(x, groups, scale, bias, eps)]
    return kernel


def _lrn(node: Node, ctx: BindContext) -> Kernel:
    size = int(node.attrs["size"])
    alpha = float(node.attrs.get("alpha", 1e-4))
    beta = float(node.attrs.get("beta", 0.75))
    bias = float(node.attrs.get("bias", 1.0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        if size % 2:
            return [F.local_response_norm(x, size, alpha, beta, bias)]
        # ONNX windows an even size as floor((size-1)/2) channels before and ceil(...)
        # after; torch puts the extra channel before. Sum the window explicitly.
        before, after = (size - 1) // 2, size // 2
        squares = F.pad((x * x).movedim(1, -1), (before + 1, after)).movedim(-1, 1)
        totals = squares.cumsum(dim=1)
        window = totals[:, size:] - totals[:, :-size]
        return [x / (bias + (alpha / size) * window) ** beta]
    return kernel


def _gemm(node: Node, ctx: BindContext) -> Kernel:
    alpha = float(node.attrs.get("alpha", 1.0))
    beta = float(node.attrs.get("beta", 1.0))
    ta = int(node.attrs.get("transA", 0))
    tb = int(node.attrs.get("transB", 0))
    has_c = has_input(node, 2)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        if ta:
            a = a.t()
        if tb:
            b = b.t()
        c = inputs[2] if has_c else None
        if c is not None and a.dtype.is_floating_point:
            return [torch.addmm(c, a, b, beta=beta, alpha=alpha)
                    if c.dim() <= 2 else alpha * (a @ b) + beta * c]
        y = a @ b
        if alpha != 1.0:
            y = y * alpha
        if c is not None:
            y = y + (c * beta if beta != 1.0 else c)
        return [y]
    return kernel


def _matmul(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        return [torch.matmul(a, b)]
    return kernel


def _softmax_family(fn):  # type: ignore[no-untyped-def]
    def bind(node: Node, ctx: BindContext) -> Kernel:
        old = node.opset < 13
        axis = int(node.attrs.get("axis", 1 if old else -1))

        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            x = inputs[0]
            assert x is not None
            if old:
                a = axis + x.dim() if axis < 0 else axis
                flat = x.reshape(math.prod(x.shape[:a]), -1)
                return [fn(flat, dim=1).reshape(x.shape)]
            return [fn(x, dim=axis)]
        return kernel
    return bind


def _hardmax(node: Node, ctx: BindContext) -> Kernel:
    old = node.opset < 13
    axis = int(node.attrs.get("axis", 1 if old else -1))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        shape = x.shape
        a = axis + x.dim() if axis < 0 else axis
        if old:
            x = x.reshape(math.prod(shape[:a]), -1)
            a = 1
        idx = x.argmax(dim=a, keepdim=True)
        y = torch.zeros_like(x).scatter_(a, idx, 1.0)
        return [y.reshape(shape)]
    return kernel


def _dropout(node: Node, ctx: BindContext) -> Kernel:
    n_out = len(node.outputs)
    # With a seed, the mask comes from numpy's Mersenne Twister seeded once per bound
    # kernel, which is how ONNX's reference draws it: a session's first run reproduces
    # the reference's mask, and later runs continue the sequence (as with every seeded
    # random op, ops/misc.py). Without a seed, torch's own generator is faster.
    seeded = np.random.RandomState(int(node.attrs["seed"])) if "seed" in node.attrs else None

    def draw_keep(x: Tensor, ratio: float) -> Tensor:
        if seeded is None:
            return torch.rand_like(x, dtype=torch.float32) >= ratio
        uniform = seeded.uniform(0.0, 1.0, tuple(x.shape))
        return torch.from_numpy(uniform >= ratio).to(x.device)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        training = len(inputs) > 2 and inputs[2] is not None and bool(inputs[2])
        ratio = float(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else 0.5
        if training and ratio > 0:
            mask = draw_keep(x, ratio)
            y = x * mask / (1 - ratio)
        else:
            mask = torch.ones_like(x, dtype=torch.bool)
            y = x
        return [y, mask][:n_out]
    return kernel


def _flatten(node: Node, ctx: BindContext) -> Kernel:
    axis = int(node.attrs.get("axis", 1))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        a = axis + x.dim() if axis < 0 else axis
        return [x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))]
    return kernel


def _softmax_cross_entropy(node: Node, ctx: BindContext) -> Kernel:
    """SoftmaxCrossEntropyLoss: scores [N, C, d...], integer labels [N, d...], optional
    class weights [C]; reduction mean (weighted by the labels' weights), sum or none."""
    reduction = str(node.attrs.get("reduction", "mean"))
    ignore = node.attrs.get("ignore_index")
    # nll_loss always ignores some index; -100 never names a class when ONNX sets none.
    ignore_index = int(ignore) if ignore is not None else -100
    n_out = len(node.outputs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        scores, labels = inputs[0], inputs[1]
        weights = inputs[2] if len(inputs) > 2 else None
        assert scores is not None and labels is not None
        log_prob = torch.log_softmax(scores, dim=1)
        loss = F.nll_loss(log_prob, labels.long(), weight=weights, ignore_index=ignore_index,
                          reduction=reduction)
        return [loss, log_prob][:n_out]
    return kernel


OPS: list[OpDef] = [
    OpDef("Conv", _conv, grad=gradients.conv),
    OpDef("ConvTranspose", _conv_transpose, grad=gradients.conv_transpose),
    OpDef("MaxPool", _maxpool, grad=gradients.max_pool),
    OpDef("AveragePool", _avgpool, grad=gradients.recompute),
    OpDef("GlobalAveragePool", _global_pool("mean"), grad=gradients.global_average_pool),
    OpDef("GlobalMaxPool", _global_pool("max"), grad=gradients.global_max_pool),
    OpDef("BatchNormalization", _batchnorm, grad=gradients.batch_norm),
    OpDef("InstanceNormalization", _instancenorm, grad=gradients.group_norm),
    OpDef("LayerNormalization", _layernorm, grad=gradients.layer_norm),
    OpDef("GroupNormalization", _groupnorm, grad=gradients.group_norm),
    OpDef("LRN", _lrn, grad=gradients.recompute),
    OpDef("Gemm", _gemm, grad=gradients.gemm),
    OpDef("MatMul", _matmul, grad=gradients.matmul),
    OpDef("Softmax", _softmax_family(torch.softmax), grad=gradients.softmax),
    OpDef("LogSoftmax", _softmax_family(torch.log_softmax), grad=gradients.softmax),
    OpDef("Hardmax", _hardmax),
    OpDef("Dropout", _dropout, grad=gradients.dropout, view_of_input=ViewOfInput.MAY_ALIAS),
    OpDef("Flatten", _flatten, grad=gradients.reshape, view_of_input=ViewOfInput.RESHAPE),
    OpDef("SoftmaxCrossEntropyLoss", _softmax_cross_entropy, since=12,
          grad=gradients.softmax_cross_entropy),
    OpDef("NegativeLogLikelihoodLoss", _losses.bind_nll, since=12, grad=gradients.recompute),
    OpDef("RMSNormalization", _transformer.bind_rms_norm, since=23, grad=gradients.recompute),
    OpDef("Attention", _transformer.bind_attention, since=23, grad=gradients.recompute),
    OpDef("RotaryEmbedding", _transformer.bind_rotary, since=23, grad=gradients.recompute),
    OpDef("CausalConvWithState", _transformer.bind_causal_conv_with_state, since=27,
          grad=gradients.recompute),
    OpDef("DeformConv", _deform.bind_deform_conv, since=19, grad=gradients.recompute),
]
