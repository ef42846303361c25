"""Fused operators (domain ``segflow``) created by the fuse pass: their declarations.

Each fused op is one kernel: it counts as one node and one kernel in RunStats.

- ``FusedConv(X, W, B?, Z?)``: ``act(conv(X, W) + B + Z)``. ``Z`` is an optional
  residual added before the activation (a convolution, then Add, then an activation).
- ``FusedGemm(X, W, B?)``: ``act(X @ W^T + B)`` with ``W`` in ``[N, K]`` (torch
  ``Linear``) layout; ``X`` may have any rank >= 2.
- ``Attention(Q, Kt, V, M?)``: ``softmax(Q @ Kt * scale + M) @ V`` (``Kt`` is K
  already transposed, as exporters emit it); with a ``heads`` attribute H it reads
  ``[B, S, H * D]`` activations and writes the heads merged back; with ``nan_to_zero``
  1 the probabilities are ``Where(IsNaN(p), 0, p)`` (torch's safe softmax).
- ``AddLayerNorm(A, B?, Scale, Bias?) -> Y, S?``: ``LayerNormalization(A + B)`` over
  the last axis (``simplified`` 1: ``RMSNormalization(A + B)``, no centring, as
  onnxruntime's SkipSimplifiedLayerNormalization); ``S``, where declared, is the sum
  ``A + B`` itself (a pre-LN residual that a later Add reads again). Without ``B`` it
  normalizes ``A``.

The OpDef rows bind the reference kernels: plain torch, on any device (a linear picks
MKL's addmm or torch's oneDNN matmul by size; :func:`attention`, :func:`add_layer_norm`).
Where ``passes/select_kernels.py`` chose a faster kernel for a node (a
:class:`~segflow.kernels.choice.KernelChoice`: libdnnl, Winograd, the native stem or
linear, a prepacked weight; on CPU the native attention and add + layer norm), the
runtime binds that one instead (``kernels/registry.py``).

Besides the OpDef rows, :func:`inline_fused` gives the codegen backend
(``runtime/compile.py``) an expression per reference node, so a compiled segment
calls the torch op directly instead of going through the kernel wrapper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from segflow.ir.graph import Node
from segflow.ops._common import gelu_erf, torch_pad
from segflow.ops._transformer import rms_norm
from segflow.ops.registry import BindContext, Kernel, OpDef
from segflow.shape_cache import RowAdmission

Tensor = torch.Tensor
FUSED_DOMAIN = "segflow"

# Below this many multiply-adds per call, MKL's addmm (a few microseconds of fixed cost)
# beats oneDNN's matmul (its primitive overhead); above it oneDNN wins where MKL takes a
# slow code path (docs/performance.md, "Kernel selection").
LINEAR_ONEDNN_MIN_MACS = 1 << 20
# A weight with at least this many elements is worth oneDNN even for a single row: the
# kernel selection packs it, dropping the dense copy.
LINEAR_PACK_MIN_WEIGHT = 1 << 19
# relu(addmm(b, x, w)) in one ATen op: same bits as addmm then relu_, one dispatch less.
_ADDMM_RELU = torch._addmm_activation


@dataclass(frozen=True, slots=True)
class Activation:
    """One activation a fused op may end with: its torch form and its oneDNN post-op."""

    name: str
    apply: Callable[[Tensor, Sequence[float]], Tensor]
    # (attr, algorithm) for oneDNN, or None when oneDNN has no exact equivalent.
    onednn: Callable[[Sequence[float]], tuple[str, list[float], str] | None]
    inplace: Callable[[Tensor, Sequence[float]], Tensor] | None = None
    # How oneDNN's post-op differs from onnxruntime on NaN or an infinity ('' where it
    # does not): its ReLU, clip and hard-sigmoid take max/min instructions, which return
    # the bound for a NaN, and its erf-GELU gives NaN for +inf. Such a post-op is fused
    # only where no NaN can reach the node (``BindContext.allow_inexact``).
    onednn_loses: str = ""


def _clip_onednn(p: Sequence[float]) -> tuple[str, list[float], str] | None:
    lo, hi = p
    if math.isinf(lo) or math.isinf(hi):
        return None
    return ("hardtanh", [lo, hi], "")


def _hardsigmoid_onednn(p: Sequence[float]) -> tuple[str, list[float], str] | None:
    # oneDNN's hardsigmoid is torch's: alpha 1/6, beta 0.5.
    alpha, beta = p
    return ("hardsigmoid", [], "") if abs(alpha - 1 / 6) < 1e-7 and beta == 0.5 else None


def _swish(x: Tensor, p: Sequence[float]) -> Tensor:
    return F.silu(x) if p[0] == 1.0 else x * torch.sigmoid(x * p[0])


def _swish_(x: Tensor, p: Sequence[float]) -> Tensor:
    return F.silu(x, inplace=True) if p[0] == 1.0 else x.mul_(torch.sigmoid(x * p[0]))


def _swish_onednn(p: Sequence[float]) -> tuple[str, list[float], str] | None:
    # torch's oneDNN "swish" post-op is SiLU: it takes no alpha.
    return ("swish", [], "") if p[0] == 1.0 else None


ACTIVATIONS: Mapping[str, Activation] = {
    "": Activation("", lambda x, p: x, lambda p: ("none", [], "")),
    "Relu": Activation("Relu", lambda x, p: torch.relu(x), lambda p: ("relu", [], ""),
                       lambda x, p: torch.relu_(x), "turns NaN into 0"),
    "Clip": Activation("Clip", lambda x, p: torch.clamp(x, p[0], p[1]), _clip_onednn,
                       lambda x, p: torch.clamp_(x, p[0], p[1]),
                       "turns NaN into the lower bound"),
    "LeakyRelu": Activation("LeakyRelu", lambda x, p: F.leaky_relu(x, p[0]),
                            lambda p: ("leaky_relu", [p[0]], ""),
                            lambda x, p: F.leaky_relu_(x, p[0])),
    "Sigmoid": Activation("Sigmoid", lambda x, p: torch.sigmoid(x), lambda p: ("sigmoid", [], ""),
                          lambda x, p: torch.sigmoid_(x)),
    "Tanh": Activation("Tanh", lambda x, p: torch.tanh(x), lambda p: ("tanh", [], ""),
                       lambda x, p: torch.tanh_(x)),
    "HardSigmoid": Activation("HardSigmoid",
                              lambda x, p: torch.clamp(x * p[0] + p[1], 0.0, 1.0),
                              _hardsigmoid_onednn, onednn_loses="turns NaN into 0"),
    "HardSwish": Activation("HardSwish", lambda x, p: F.hardswish(x),
                            lambda p: ("hardswish", [], "")),
    "Gelu": Activation("Gelu", lambda x, p: gelu_erf(x), lambda p: ("gelu", [], "none"),
                       lambda x, p: gelu_erf(x, inplace=True), "gives NaN for +inf"),
    "GeluTanh": Activation("GeluTanh", lambda x, p: F.gelu(x, approximate="tanh"),
                           lambda p: ("gelu", [], "tanh"),
                           lambda x, p: torch.ops.aten.gelu_(x, approximate="tanh")),
    # x * sigmoid(alpha x); oneDNN's swish, like onnxruntime's Sigmoid then Mul, gives
    # +inf for +inf and NaN for -inf (-inf * 0).
    "Swish": Activation("Swish", _swish, _swish_onednn, _swish_),
}

# Activations that evaluate a transcendental function per element. As a post-op of oneDNN's
# AVX2 matmul they are far slower than the same function run after it by torch in place
# (docs/performance.md, "Kernel selection"); the target says where they are fused
# (``CpuTarget.fuses_transcendental_post_ops``).
_TRANSCENDENTAL = frozenset({"Sigmoid", "Tanh", "Gelu", "GeluTanh", "Swish"})


def linear_post_op(act: Activation, params: Sequence[float], fuses_transcendental: bool
                   ) -> tuple[str, list[float], str] | None:
    """The oneDNN post-op a linear should fuse for ``act`` (None: run ``act`` after it).

    Like ``act.onednn(params)``, except that a transcendental activation is fused only
    where ``fuses_transcendental`` (the target's call): see ``_TRANSCENDENTAL``.
    """
    post = act.onednn(params)
    if post is not None and act.name in _TRANSCENDENTAL and not fuses_transcendental:
        return None
    return post


def exact_post_op(node: Node, act: Activation, post: tuple[str, list[float], str] | None,
                  ctx: BindContext) -> tuple[str, list[float], str] | None:
    """``post`` (``act``'s oneDNN post-op), or None where oneDNN's form of ``act`` loses a
    NaN or an infinity (``Activation.onednn_loses``) and ``node`` must keep them: the
    activation then runs after the kernel, in torch."""
    if post is None or post[0] == "none" or not act.onednn_loses:
        return post
    reason = f"oneDNN's {act.name} post-op {act.onednn_loses}"
    return post if ctx.allow_inexact(node, reason) else None


class ExactKernel:
    """A fused node's kernel bound without a post-op that loses NaN (:func:`exact_post_op`
    refused it): generated code calls it as bound, since the oneDNN form codegen would
    otherwise inline brings that post-op back."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel

    def __call__(self, inputs: Sequence[Tensor | None]) -> Sequence[Tensor]:
        return self.kernel(inputs)


def activation_of(node: Node) -> tuple[Activation, list[float]]:
    name = str(node.attrs.get("activation", ""))
    params = [float(v) for v in node.attrs.get("activation_params", [])]
    return ACTIVATIONS[name], params


@dataclass(frozen=True, slots=True)
class Inline:
    """A Python expression computing a node's output (a tuple of its outputs where it
    has several), for generated code.

    ``expr`` names the node's inputs ``{in0}``, ``{in1}`` ... and every object in
    ``bound`` by its key; the code generator substitutes locals and closure names.
    """

    expr: str
    bound: Mapping[str, object] = field(default_factory=dict)


# -- FusedConv -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ConvSpec:
    """A FusedConv's attributes, parsed once."""

    spatial: int
    strides: list[int]
    pads: list[int]          # symmetric pads, one per spatial dim
    begin_end: list[int]     # ONNX [begin..., end...] pads when asymmetric, else []
    dilations: list[int]
    group: int
    has_bias: bool
    has_residual: bool

    @property
    def begin_end_pads(self) -> list[int]:
        """The pads as ONNX writes them, ``[begin..., end...]``, symmetric or not (what
        libdnnl's convolution takes: ``kernels/onednn/geometry.py``)."""
        return self.begin_end or self.pads + self.pads

    @property
    def input_pad(self) -> list[int] | None:
        """``F.pad``'s pads that make an asymmetric padding explicit before a kernel that
        takes one pad per dim (torch's), which then pads by :attr:`pads` (zeros); None
        where the padding is symmetric."""
        return torch_pad(self.begin_end) if self.begin_end else None


def conv_spec(node: Node) -> ConvSpec:
    weight = node.inputs[1]
    assert weight is not None and weight.spec.rank is not None
    spatial = weight.spec.rank - 2
    attrs = node.attrs
    pads = list(attrs.get("pads", [0] * (2 * spatial)))
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise ValueError("FusedConv needs explicit pads (the fuse pass resolves auto_pad)")
    if attrs.get("auto_pad") == "VALID":
        pads = [0] * (2 * spatial)
    symmetric = pads[:spatial] == pads[spatial:]
    return ConvSpec(
        spatial=spatial,
        strides=list(attrs.get("strides", [1] * spatial)),
        pads=pads[:spatial] if symmetric else [0] * spatial,
        begin_end=[] if symmetric else pads,
        dilations=list(attrs.get("dilations", [1] * spatial)),
        group=int(attrs.get("group", 1)),
        has_bias=len(node.inputs) > 2 and node.inputs[2] is not None,
        has_residual=len(node.inputs) > 3 and node.inputs[3] is not None,
    )


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _conv_fn(node: Node) -> Callable[..., Tensor]:
    """``fn(x, w, b?, z?) -> act(conv(x, w) + b + z)`` in plain torch."""
    spec = conv_spec(node)
    act, params = activation_of(node)
    conv = _CONV[spec.spatial]
    pad = spec.input_pad

    def conv_fn(x: Tensor, w: Tensor, b: Tensor | None = None,
                z: Tensor | None = None) -> Tensor:
        if pad is not None:
            x = F.pad(x, pad)
        y = conv(x, w, b, spec.strides, spec.pads, spec.dilations, spec.group)
        if z is not None:
            y = y + z
        return act.apply(y, params)
    return conv_fn


def _fused_conv(node: Node, ctx: BindContext) -> Kernel:
    spec = conv_spec(node)
    act, params = activation_of(node)
    conv = _CONV[spec.spatial]
    pad = spec.input_pad

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        b = inputs[2] if spec.has_bias else None
        if pad is not None:
            x = F.pad(x, pad)
        y = conv(x, w, b, spec.strides, spec.pads, spec.dilations, spec.group)
        if spec.has_residual:
            z = inputs[3]
            assert z is not None
            y = y.add_(z) if y.shape == z.shape else y + z
        if act.inplace is not None:
            return [act.inplace(y, params)]
        return [act.apply(y, params)]
    return kernel


# -- FusedGemm ---------------------------------------------------------------------------
def linear_parts(node: Node) -> tuple[bool, Activation, list[float]]:
    act, params = activation_of(node)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    return has_bias, act, params


def static_macs(node: Node) -> int | None:
    """Multiply-adds per call where both shapes are static (None: they are not)."""
    x, w = node.inputs[0], node.inputs[1]
    if x is None or w is None or not x.spec.is_static or not w.spec.is_static:
        return None
    assert x.spec.shape is not None and w.spec.shape is not None
    dims = [int(d) for d in (*x.spec.shape[:-1], *w.spec.shape)]  # type: ignore[arg-type]
    rows = 1
    for d in dims[:-2]:
        rows *= d
    return rows * dims[-2] * dims[-1]


def linear_callable(node: Node, device: torch.device,
                    fused: tuple[str, list[float], str] | None, *, onednn: bool,
                    packed: bool = False) -> Callable[..., Tensor]:
    """``fn(x, w, b) -> act(x @ w.T + b)``, choosing MKL addmm or oneDNN by size (``onednn``:
    torch's oneDNN matmul is available on ``device``; ``packed``: the weight is torch's
    oneDNN packing, which only that matmul reads); ``fused`` is the post-op oneDNN's
    matmul takes (:func:`linear_post_op`; None: the activation runs after it)."""
    has_bias, act, params = linear_parts(node)
    post = act.onednn(params)
    # oneDNN's matmul with the activation fused where that pays (linear_post_op), else
    # the plain matmul followed by the activation in place.
    pointwise = torch.ops.mkldnn._linear_pointwise.default if onednn else None
    attr, scalars, algorithm = fused if fused is not None else ("none", [], "")
    after = None if fused is not None else (act.inplace or act.apply)
    static = static_macs(node)
    # torch's oneDNN keeps a primitive per input shape for the process, which no session
    # can free: with dynamic rows, the shapes handed to it are bounded
    # (shape_cache.py; the figures: docs/performance.md).
    admission = RowAdmission() if static is None else None

    def large(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if admission is not None and x.dim() >= 1 and x.shape[-1]:
            k = int(x.shape[-1])
            rows = x.numel() // k
            run = admission.rows_for(rows)
            if run != rows:
                padded = x.new_zeros((run, k))
                padded[:rows].copy_(x.reshape(rows, k))
                y = pointwise(padded, w, b, attr, scalars, algorithm)  # type: ignore[misc]
                y = y[:rows].view(*x.shape[:-1], y.shape[-1])
                return y if after is None else after(y, params)
        y = pointwise(x, w, b, attr, scalars, algorithm)  # type: ignore[misc]
        return y if after is None else after(y, params)

    if packed:   # a prepacked weight: only oneDNN reads it
        return large
    use_onednn = onednn and post is not None
    finish = act.inplace
    addmm = _ADDMM_RELU if act.name == "Relu" else torch.addmm

    def small(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if x.dim() == 2 and b is not None:
            y = addmm(b, x, w.t())
            if addmm is _ADDMM_RELU:
                return y
        elif x.dim() == 2:
            y = x @ w.t()
        else:
            y = F.linear(x, w, b)
        if finish is not None:
            return finish(y, params)
        return act.apply(y, params)

    if not use_onednn or (static is not None and static < LINEAR_ONEDNN_MIN_MACS):
        return small
    if static is not None:
        return large

    def by_size(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if x.numel() * w.shape[0] >= LINEAR_ONEDNN_MIN_MACS and x.dtype == torch.float32:
            return large(x, w, b)
        return small(x, w, b)
    return by_size


def _fused_gemm(node: Node, ctx: BindContext) -> Kernel:
    _, act, params = linear_parts(node)
    target = ctx.target
    wanted = linear_post_op(act, params, target.fuses_transcendental_post_ops())
    fused = exact_post_op(node, act, wanted, ctx)
    fn = linear_callable(node, ctx.device, fused,
                         onednn=ctx.device.type == "cpu" and target.onednn_ops)
    return linear_kernel(node, fn, exact=fused is not wanted)


def linear_kernel(node: Node, fn: Callable[[Tensor, Tensor, Tensor | None], Tensor], *,
                  exact: bool) -> Kernel:
    """A FusedGemm's kernel over ``fn(x, w, b)``; ``exact``: its post-op was kept out of
    the call so that a NaN or infinity stays exact (an :class:`ExactKernel`)."""
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        return [fn(x, w, inputs[2] if has_bias else None)]
    return ExactKernel(kernel) if exact else kernel


# -- Attention and AddLayerNorm: their reference kernels -----------------------------------
def attention(q: Tensor, kt: Tensor, v: Tensor, mask: Tensor | None, scale: float,
              heads: int, nan_to_zero: bool = False, exact: bool = False) -> Tensor:
    """``softmax(Q Kt * scale + M) V`` through torch: an Attention node's reference (and
    traceable) form, and its native kernel's fallback (``kernels/attention.py``). With
    ``heads`` H the inputs are ``[B, S, H * D]`` and the heads are merged back; with
    ``nan_to_zero`` the probabilities' NaNs are zeros. ``exact``: NaN and Inf where the
    unfused ops put them (torch's CPU ``scaled_dot_product_attention`` gives 0 for a row
    with a NaN score or no unmasked key, where the unfused ops give NaN)."""
    if not heads:
        return _sdpa(q, kt.transpose(-2, -1), v, mask, scale, nan_to_zero, exact)
    b, sq = q.shape[0], q.shape[1]
    qh, kh, vh = (t.reshape(t.shape[0], t.shape[1], heads, t.shape[2] // heads).transpose(1, 2)
                  for t in (q, kt, v))
    return _sdpa(qh, kh, vh, mask, scale, nan_to_zero, exact).transpose(1, 2).reshape(
        b, sq, v.shape[2])


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
          nan_to_zero: bool, exact: bool = False) -> Tensor:
    batch = q.shape[:-2]
    fits = k.shape[:-2] == batch and v.shape[:-2] == batch
    if mask is not None:
        if mask.dim() < 2:
            mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
        scores = (*batch, q.shape[-2], k.shape[-2])
        fits = fits and mask.dim() <= len(scores) and all(
            m in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores)))
    if not fits or nan_to_zero or exact:
        # Broadcasting SDPA does not do (batch dims that differ, a mask that grows the
        # scores), nor does it keep the NaNs of the softmax: the ops as the graph wrote
        # them.
        y = torch.matmul(q, k.transpose(-2, -1)) * scale
        y = y + mask if mask is not None else y
        p = torch.softmax(y, dim=-1)
        if nan_to_zero:
            p = torch.where(torch.isnan(p), 0.0, p)
        return torch.matmul(p, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def add_layer_norm(a: Tensor, b: Tensor | None, scale: Tensor, bias: Tensor | None,
                   epsilon: float, simplified: bool = False) -> tuple[Tensor, Tensor]:
    """The unfused ops, ``F.layer_norm(a + b)`` over the last axis (``simplified``:
    RMSNormalization's :func:`~segflow.ops._transformer.rms_norm`), and the sum: an
    AddLayerNorm node's reference form and its native kernel's fallback
    (``kernels/layer_norm.py``). ``b`` None: the sum is ``a``."""
    s = a if b is None else a + b
    shape = s.shape[-1:]
    if simplified:
        y = rms_norm(s, scale, -1, epsilon)
        return (y if bias is None else y + bias), s
    return F.layer_norm(s, shape, scale.expand(shape),
                        None if bias is None else bias.expand(shape), epsilon), s


def attention_fn(node: Node) -> Callable[..., Tensor]:
    """``fn(q, kt, v, mask=None)``: the node's reference form."""
    scale, heads = float(node.attrs["scale"]), int(node.attrs.get("heads", 0))
    nan_to_zero = bool(node.attrs.get("nan_to_zero", 0))

    def fn(q: Tensor, kt: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        return attention(q, kt, v, mask, scale, heads, nan_to_zero)
    return fn


@dataclass(frozen=True, slots=True)
class AddLayerNormSpec:
    """An AddLayerNorm node's attributes and outputs, parsed once."""

    epsilon: float
    simplified: bool      # RMSNormalization: no centring
    with_sum: bool        # the node's second output is the sum

    @classmethod
    def of(cls, node: Node) -> AddLayerNormSpec:
        return cls(float(node.attrs.get("epsilon", 1e-5)),
                   bool(int(node.attrs.get("simplified", 0))), len(node.outputs) > 1)


def add_layer_norm_fn(node: Node) -> Callable[..., Tensor | tuple[Tensor, Tensor]]:
    """``fn(a, b, scale, bias=None)``: the node's reference form (the normalized tensor,
    or it and the sum where the node has both outputs)."""
    spec = AddLayerNormSpec.of(node)

    def fn(a: Tensor, b: Tensor | None, scale: Tensor, bias: Tensor | None = None
           ) -> Tensor | tuple[Tensor, Tensor]:
        y, s = add_layer_norm(a, b, scale, bias, spec.epsilon, spec.simplified)
        return (y, s) if spec.with_sum else y
    return fn


def _reference(make: Callable[[Node], Callable[..., Tensor | tuple[Tensor, ...]]]
               ) -> Callable[[Node, BindContext], Kernel]:
    def bind(node: Node, ctx: BindContext) -> Kernel:
        fn = make(node)

        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            out = fn(*inputs)
            return list(out) if isinstance(out, tuple) else [out]
        return kernel
    return bind


# -- inline forms for generated code -------------------------------------------------------
def inline_fused(node: Node, device: torch.device, inplace_input: int | None,
                 consts: Sequence[Tensor | None], kernel: Kernel | None = None, *,
                 fuses_transcendental: bool = False, onednn: bool = False) -> Inline | None:
    """The expression codegen emits for a fused node bound to its reference kernel (None:
    call the kernel instead).

    ``inplace_input`` is the input the memory plan allows this node to overwrite;
    ``consts[i]`` is the bound (device-placed) constant behind input ``i``, if any;
    ``kernel`` the node's bound kernel; ``fuses_transcendental`` and ``onednn`` the
    target's answers (:func:`linear_post_op`, :func:`linear_callable`).
    """
    if isinstance(kernel, ExactKernel):
        return None
    n_in = len(node.inputs)
    args = ", ".join("None" if node.inputs[i] is None else f"{{in{i}}}" for i in range(n_in))
    if node.op_type == "FusedGemm":
        return _inline_gemm(node, device, consts, fuses_transcendental,
                            onednn and device.type == "cpu")
    if node.op_type == "Attention":
        return Inline(f"{{fn}}({args})", {"fn": attention_fn(node)})
    if node.op_type == "AddLayerNorm":
        return Inline(f"{{fn}}({args})", {"fn": add_layer_norm_fn(node)})
    return None


def _inline_gemm(node: Node, device: torch.device, consts: Sequence[Tensor | None],
                 fuses_transcendental: bool, onednn: bool) -> Inline | None:
    has_bias, act, params = linear_parts(node)
    fused = linear_post_op(act, params, fuses_transcendental)
    fn = linear_callable(node, device, fused, onednn=onednn)
    x = node.inputs[0]
    weight = consts[1] if len(consts) > 1 else None
    generic = Inline("{fn}({in0}, {in1}, " + ("{in2})" if has_bias else "None)"), {"fn": fn})
    post = act.onednn(params)
    if (weight is None or weight.dim() != 2 or x is None or x.spec.rank != 2 or not has_bias
            or act.name not in ("", "Relu")):
        return generic
    # addmm(b, x, w.t()) with the transposed view bound once; with Relu, ATen's
    # addmm+relu in one call (one dispatch less per layer, same bits).
    small = "{addmm_relu}({in2}, {in0}, {wt})" if act.name == "Relu" else \
        "{addmm}({in2}, {in0}, {wt})"
    bound: dict[str, object] = {"addmm": torch.addmm, "addmm_relu": _ADDMM_RELU,
                                "wt": weight.t(), "fn": fn}
    if not onednn or post is None:
        return Inline(small, bound)
    static = static_macs(node)
    if static is not None:
        return Inline(small, bound) if static < LINEAR_ONEDNN_MIN_MACS else generic
    # Batch is dynamic: pick by row count (one shape read) instead of a Python call.
    rows = -(-LINEAR_ONEDNN_MIN_MACS // weight.numel())
    return Inline(f"({small} if {{in0}}.shape[0] < {rows} else {{fn}}({{in0}}, {{in1}}, {{in2}}))",
                  bound)


def traceable_fused(node: Node) -> Inline | None:
    """A functional, torch-only form of a fused node bound to its reference kernel, for
    graph tracers (TorchScript).

    No oneDNN-specific ops, no in-place writes: tracers and oneDNN Graph see plain
    convolution / linear / add / activation ops they know how to fuse.
    """
    n_in = len(node.inputs)
    args = ", ".join("None" if node.inputs[i] is None else f"{{in{i}}}" for i in range(n_in))
    if node.op_type == "FusedConv":
        return Inline(f"{{fn}}({args})", {"fn": _conv_fn(node)})
    if node.op_type == "FusedGemm":
        act, params = activation_of(node)

        def linear_fn(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
            return act.apply(F.linear(x, w, b), params)
        return Inline(f"{{fn}}({args})", {"fn": linear_fn})
    if node.op_type == "Attention":   # torch's scaled_dot_product_attention
        return Inline(f"{{fn}}({args})", {"fn": attention_fn(node)})
    if node.op_type == "AddLayerNorm":   # its unfused ops: a + b, then F.layer_norm
        return Inline(f"{{fn}}({args})", {"fn": add_layer_norm_fn(node)})
    return None


OPS: list[OpDef] = [
    OpDef("FusedConv", _fused_conv, domain=FUSED_DOMAIN,
          doc="act(conv(X, W) + B + Z): Conv with folded BatchNorm, residual add, activation"),
    OpDef("FusedGemm", _fused_gemm, domain=FUSED_DOMAIN,
          doc="act(X @ W^T + B): Gemm/MatMul+Add with activation, W in [N, K] layout"),
    OpDef("Attention", _reference(attention_fn), domain=FUSED_DOMAIN,
          doc="softmax(Q @ Kt * scale + M) @ V as one scaled-dot-product-attention kernel "
              "(nan_to_zero: a NaN row of probabilities is zeros)"),
    OpDef("AddLayerNorm", _reference(add_layer_norm_fn), domain=FUSED_DOMAIN,
          doc="LayerNormalization (simplified: RMSNormalization) of A + B over the last "
              "axis in one kernel, and the sum as an optional second output"),
]
