"""The convolution kernels a :class:`~segflow.kernels.choice.KernelChoice` names.

- ``ONEDNN_CONV``: torch's oneDNN fused convolution ops over the prepacked weight
  (:func:`bind_onednn_conv`).
- ``DIRECT_CONV``: libdnnl's convolution, a primitive built once per input shape
  (:class:`~segflow.kernels.onednn.conv.DirectConv`, :func:`bind_direct_conv`), with
  torch's oneDNN op as its fallback. Two strategies of the same kernel:
  ``WINOGRAD`` runs its calls as Winograd F(4x4, 3x3) over the transformed weight
  (``kernels/winograd.py``), ``NATIVE_STEM`` reads the NCHW image in place
  (``kernels/stem.py``); each declines a call it cannot take, which then runs direct.

The reference kernel (plain ``F.conv2d``) is the OpDef row's, in ``ops/fused.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from segflow.ir.graph import Node
from segflow.kernels.choice import KernelChoice, KernelKind
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.geometry import ConvGeometry, geometry
from segflow.kernels.onednn.library import Library
from segflow.kernels.onednn.op import DirectKernel
from segflow.kernels.staging import ChannelsLastStaging
from segflow.kernels.stem import NativeStem
from segflow.kernels.target import CpuTarget
from segflow.kernels.winograd import Winograd, inverse_transform
from segflow.ops.fused import (
    Activation,
    ConvSpec,
    ExactKernel,
    Inline,
    activation_of,
    conv_spec,
    exact_post_op,
)
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor

# Input shapes one convolution packs its weight for beyond the one it was packed for
# (each a copy of the weight), and input shapes it remembers at all.
MAX_REPACKS = 2
MAX_SHAPES = 32


eltwise_of = CpuTarget.eltwise


def blocked_layout(t: Tensor) -> bytes | None:
    """oneDNN's serialized memory descriptor of a packed tensor (None: not queryable)."""
    describe = getattr(torch.ops.mkldnn, "_get_mkldnn_serialized_md", None)
    if describe is None or not t.is_mkldnn:
        return None
    try:
        return bytes(describe(t).numpy())
    except RuntimeError:
        return None


class WeightForInput:
    """The prepacked conv weight in the blocked format oneDNN picks for this input shape.

    The weight is packed for the spec's input shape (batch 1 when the batch is
    symbolic). Another shape may get another format, and oneDNN would then reorder the
    whole weight on every call. So the weight is packed once per new input shape. Mostly
    the format comes out the same, and then the packed weight already held serves that
    shape too; a different format is kept as one more copy of the weight, for at most
    ``MAX_REPACKS`` shapes. At most ``MAX_SHAPES`` shapes are remembered; beyond that
    oneDNN reorders on the fly where it must.
    """

    def __init__(self, spec: ConvSpec, packed_for: Sequence[int] | None,
                 torch_packing: Callable[[Tensor], Tensor] | None = None) -> None:
        self.spec = spec
        self.packed_for = tuple(packed_for) if packed_for else None
        self.cache: dict[tuple[int, ...], Tensor] = {}
        self.copies = 0
        self.torch_packing = torch_packing

    def __call__(self, x: Tensor, w: Tensor) -> Tensor:
        if self.torch_packing is not None:
            w = self.torch_packing(w)
        shape = tuple(x.shape)
        if shape == self.packed_for:
            return w
        packed = self.cache.get(shape)
        if packed is None:
            packed = self._pack(shape, w)
        return packed

    def _pack(self, shape: tuple[int, ...], w: Tensor) -> Tensor:
        if len(self.cache) >= MAX_SHAPES:
            return w
        held = blocked_layout(w)
        packed = w
        if held is not None or self.copies < MAX_REPACKS:
            spec = self.spec
            fresh = torch.ops.mkldnn._reorder_convolution_weight(
                w.to_dense(), spec.pads, spec.strides, spec.dilations, spec.group, list(shape))
            if (held is None or blocked_layout(fresh) != held) and self.copies < MAX_REPACKS:
                packed = fresh              # another format: one more copy of the weight
                self.copies += 1
        self.cache[shape] = packed
        return packed


class TorchPacking:
    """torch's packing of a weight kept in libdnnl's (``KernelChoice.libdnnl_packed``),
    made from those bytes on first use: only a fallback of the direct convolution
    (torch's oneDNN op) reads it. Subclasses recover the plain weight from another
    kernel's format (:meth:`dense`)."""

    def __init__(self, spec: ConvSpec, geo: ConvGeometry | None,
                 input_size: Sequence[int] | None, blocked: bool = False,
                 plain_input: bool = False, lib: Library | None = None) -> None:
        self.spec = spec
        self.geo = geo
        self.input_size = [int(d) for d in input_size] if input_size is not None else None
        self.blocked = blocked          # packed for nChw8c activations
        self.plain_input = plain_input  # ... from a plain NCHW input
        self.lib = lib
        self.made: tuple[Tensor, Tensor] | None = None     # (the constant, torch packing)

    def dense(self, w: Tensor) -> Tensor:
        """The plain weight behind the constant ``w``."""
        if self.lib is None:
            raise RuntimeError("a weight in libdnnl's packing, and libdnnl is not loaded")
        assert self.geo is not None and self.input_size is not None
        dense = self.lib.unpack_weight(w, self.geo, self.input_size, self.blocked,
                                       self.plain_input)
        # [G, O/G, I/G, kh, kw] for a grouped convolution: torch wants [O, I/G, kh, kw].
        return dense.reshape(-1, *dense.shape[-1 - self.spec.spatial:])

    def __call__(self, w: Tensor) -> Tensor:
        if w.is_mkldnn:
            return w
        made = self.made
        if made is None or made[0] is not w:
            spec = self.spec
            made = (w, torch.ops.mkldnn._reorder_convolution_weight(
                self.dense(w), spec.pads, spec.strides, spec.dilations, spec.group,
                self.input_size))
            self.made = made
        return made[1]


class WinogradPacking(TorchPacking):
    """torch's packing of a convolution whose weight constant is the Winograd transform,
    made from ``U`` on first use (``winograd.inverse_transform``): only a fallback of the
    Winograd call reads it, and a session that never falls back never holds it."""

    def __init__(self, spec: ConvSpec) -> None:
        super().__init__(spec, None, None)

    def dense(self, w: Tensor) -> Tensor:
        return inverse_transform(w)


def padded_size(spec: ConvSpec, size: Sequence[int]) -> tuple[int, ...]:
    """The size of an input of ``size`` once ``spec.input_pad`` padded it (``size``
    itself where the padding is symmetric): what torch's op sees."""
    if not spec.begin_end:
        return tuple(int(d) for d in size)
    n = spec.spatial
    return (*(int(d) for d in size[:2]),
            *(int(d) + spec.begin_end[i] + spec.begin_end[n + i]
              for i, d in enumerate(size[2:])))


def weight_for(node: Node, spec: ConvSpec, choice: KernelChoice,
               lib: Library | None) -> WeightForInput:
    """How a call finds torch's packing of ``node``'s weight for its input shape (the
    padded one, where the padding is asymmetric: ``onednn_conv_callable``)."""
    packed_for = choice.packed_for
    torch_packing = None
    weight = node.inputs[1]
    if choice.kind is KernelKind.WINOGRAD:
        return WeightForInput(spec, None, WinogradPacking(spec))
    if choice.libdnnl_packed and packed_for and weight is not None \
            and weight.spec.shape is not None:
        geo = geometry([int(d) for d in weight.spec.shape], spec.strides,  # type: ignore[arg-type]
                       spec.begin_end_pads, spec.dilations, spec.group)
        torch_packing = TorchPacking(spec, geo, packed_for, choice.blocked,
                                     choice.blocked and not choice.blocked_input, lib)
    return WeightForInput(spec, padded_size(spec, packed_for) if packed_for else None,
                          torch_packing)


def onednn_conv_callable(spec: ConvSpec, act: Activation, params: list[float],
                         inplace: bool, weight_for: WeightForInput,
                         post: tuple[str, list[float], str] | None) -> Callable[..., Tensor]:
    """``fn(x, w, b, z?) -> y`` over oneDNN's fused convolution ops, with ``post`` fused
    (None: the activation runs after them). torch's op takes one pad per dim: an
    asymmetric padding pads the input first (``ConvSpec.input_pad``)."""
    fn = _onednn_conv_callable(spec, act, params, inplace, weight_for, post)
    pad = spec.input_pad
    if pad is None:
        return fn

    def padded(x: Tensor, *rest: Tensor | None) -> Tensor:
        return fn(F.pad(x, pad), *rest)
    return padded


def _onednn_conv_callable(spec: ConvSpec, act: Activation, params: list[float],
                          inplace: bool, weight_for: WeightForInput,
                          post: tuple[str, list[float], str] | None) -> Callable[..., Tensor]:
    ops = torch.ops.mkldnn
    conv = ops._convolution_pointwise.default
    args = (spec.pads, spec.strides, spec.dilations, spec.group)
    if not spec.has_residual:
        if post is None:
            def plain_then_act(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
                w = weight_for(x, w)
                return act.apply(conv(x, w, b, *args, "none", [], ""), params)
            return plain_then_act
        attr, scalars, algorithm = post

        def fused(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return conv(x, weight_for(x, w), b, *args, attr, scalars, algorithm)
        return fused
    # oneDNN fuses a residual add followed by nothing or by relu.
    unary = "relu" if act.name == "Relu" and post is not None else None
    rest = None if act.name == "" or unary is not None else act

    if inplace:
        conv_ = ops._convolution_pointwise_.binary

        def residual_inplace(x: Tensor, w: Tensor, b: Tensor | None, z: Tensor) -> Tensor:
            y = conv_(z, x, weight_for(x, w), b, *args, "add", 1.0, unary, [], None)
            return y if rest is None else rest.apply(y, params)
        return residual_inplace
    conv_binary = ops._convolution_pointwise.binary

    def residual(x: Tensor, w: Tensor, b: Tensor | None, z: Tensor) -> Tensor:
        y = conv_binary(x, z, weight_for(x, w), b, *args, "add", None, unary, [], "")
        return y if rest is None else rest.apply(y, params)
    return residual


def bind_onednn_conv(node: Node, ctx: BindContext) -> Kernel:
    """``ONEDNN_CONV``: torch's oneDNN op over the prepacked weight."""
    spec = conv_spec(node)
    act, params = activation_of(node)
    wanted = act.onednn(params)
    post = exact_post_op(node, act, wanted, ctx)
    fallback = onednn_conv_callable(spec, act, params, False,
                                    weight_for(node, spec, ctx.choice(node), ctx.target.dnnl),
                                    post)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        return [fallback(*inputs)]
    return kernel if post is wanted else ExactKernel(kernel)


def bind_direct_conv(node: Node, ctx: BindContext) -> Kernel:
    """``DIRECT_CONV``, ``WINOGRAD``, ``NATIVE_STEM``: libdnnl's convolution (codegen
    then calls the same op), its calls run by the choice's strategy where it takes
    them, torch's oneDNN op as the fallback."""
    choice = ctx.choice(node)
    target = ctx.target
    lib = target.dnnl
    weight = node.inputs[1]
    if lib is None or weight is None or weight.spec.shape is None:
        return bind_onednn_conv(node, ctx)
    spec = conv_spec(node)
    act, params = activation_of(node)
    weights = weight_for(node, spec, choice, lib)
    post = exact_post_op(node, act, act.onednn(params), ctx)
    fallback = onednn_conv_callable(spec, act, params, False, weights, post)
    eltwise = eltwise_of(post)
    after: Callable[[Tensor], Tensor] | None = None
    if act.name and eltwise is None:
        finish = act.inplace or act.apply

        def after(y: Tensor) -> Tensor:
            return finish(y, params)
    geo = geometry([int(d) for d in weight.spec.shape], spec.strides,  # type: ignore[arg-type]
                   spec.begin_end_pads, spec.dilations, spec.group)
    fallback_inplace = (onednn_conv_callable(spec, act, params, True, weights, post)
                        if spec.has_residual else None)
    native = target.native
    winograd = None
    if choice.kind is KernelKind.WINOGRAD and weight.const is not None and native is not None \
            and ctx.allow_inexact(node, "Winograd's transforms spread a NaN or an infinity "
                                  "over a 6x6 input tile"):
        winograd = Winograd(native, ctx.workspace(), weight.const)
    staging = ctx.staging(node)
    stage = None
    if staging is not None and native is not None:   # an input that may arrive NCHW
        stage = ChannelsLastStaging(native)
    stem = None
    if choice.kind is KernelKind.NATIVE_STEM and native is not None:
        stem = NativeStem(native)                   # the NCHW image read in place
    return DirectKernel(DirectConv(
        lib, geo, eltwise, after, fallback, MAX_SHAPES, MAX_REPACKS,
        list(choice.verified_for) if choice.verified_for else None,
        ctx.destination(node.outputs[0]), staging, fallback_inplace, choice.libdnnl_packed,
        choice.blocked, choice.blocked_input, winograd, stage, stem))


def adds_residual_in_place(node: Node, inplace_input: int | None) -> bool:
    """Whether a FusedConv writes its output over its residual (input 3): it has one,
    and the memory plan lets it overwrite that input (``inplace_input``)."""
    return len(node.inputs) > 3 and node.inputs[3] is not None and inplace_input == 3


def inline_conv(node: Node, choice: KernelChoice, inplace_input: int | None,
                kernel: Kernel | None, lib: Library | None) -> Inline | None:
    """The expression codegen emits for a convolution the choice sends to oneDNN (None:
    call the bound kernel)."""
    if isinstance(kernel, ExactKernel):
        return None
    n_in = len(node.inputs)
    args = ", ".join("None" if node.inputs[i] is None else f"{{in{i}}}" for i in range(n_in))
    spec = conv_spec(node)
    act, params = activation_of(node)
    post = act.onednn(params)
    if not spec.has_residual and post is not None and not choice.calls_libdnnl \
            and spec.input_pad is None:
        # Call the oneDNN op itself: one ATen call, no Python frame in between.
        attr, scalars, algorithm = post
        bound = {"conv": torch.ops.mkldnn._convolution_pointwise.default,
                 "pads": spec.pads, "strides": spec.strides, "dil": spec.dilations,
                 "scalars": scalars, "weight_for": weight_for(node, spec, choice, lib)}
        bias = "{in2}" if spec.has_bias else "None"
        return Inline(f"{{conv}}({{in0}}, {{weight_for}}({{in0}}, {{in1}}), {bias}, {{pads}}, "
                      f"{{strides}}, {{dil}}, {spec.group}, {attr!r}, {{scalars}}, "
                      f"{algorithm!r})", bound)
    inplace = adds_residual_in_place(node, inplace_input)
    if choice.calls_libdnnl and isinstance(kernel, DirectKernel):
        op = kernel.op              # the kernel's own op: one set of primitives per node
        assert isinstance(op, DirectConv)
        return Inline(f"{{fn}}({args})", {"fn": op.inplace_call if inplace else op})
    fn = onednn_conv_callable(spec, act, params, inplace, weight_for(node, spec, choice, lib),
                              post)
    return Inline(f"{{fn}}({args})", {"fn": fn})
