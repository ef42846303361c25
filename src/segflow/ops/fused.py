"""Fused operators (domain ``segflow``) created by the fuse pass.

Each fused op is one kernel: it counts as one node and one kernel in RunStats.

- ``FusedConv(X, W, B?, Z?)``: ``act(conv(X, W) + B + Z)``. ``Z`` is an optional
  residual added before the activation (ResNet's Conv -> Add -> Relu).
- ``FusedGemm(X, W, B?)``: ``act(X @ W^T + B)`` with ``W`` in ``[N, K]`` (torch
  ``Linear``) layout; ``X`` may have any rank >= 2.
- ``Attention(Q, Kt, V, M?)``: ``softmax(Q @ Kt * scale + M) @ V`` (``Kt`` is K
  already transposed, as exporters emit it); with a ``heads`` attribute H it reads
  ``[B, S, H * D]`` activations and writes the heads merged back
  (:mod:`segflow.kernels.attention`).
- ``AddLayerNorm(A, B, Scale, Bias?)``: ``LayerNormalization(A + B)`` over the last
  axis (:mod:`segflow.kernels.layer_norm`).

Every fused op has a plain-torch path that works on any device. On CPU the
convolution runs through oneDNN (``torch.ops.mkldnn._convolution_pointwise``)
when the layout pass has prepacked its weight, and large linears run through
oneDNN's matmul, which beats the MKL sgemm path on CPUs MKL does not tune for.

Besides the OpDef rows, :func:`inline_fused` gives the codegen backend
(``runtime/compile.py``) an expression per node, so a compiled segment calls
the torch op directly instead of going through the kernel wrapper.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from segflow.ir.graph import Node
from segflow.kernels.attention import AttentionKernel, ScaledDotAttention
from segflow.kernels.layer_norm import AddLayerNorm, AddLayerNormKernel
from segflow.kernels.linear import NativeLinear, NativeLinearKernel, kernel_activation
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.geometry import ConvGeometry, geometry
from segflow.kernels.onednn.library import Library, onednn_eltwise
from segflow.kernels.onednn.linear import DirectLinear
from segflow.kernels.onednn.op import DirectKernel
from segflow.kernels.shape_cache import RowAdmission
from segflow.kernels.staging import ChannelsLastStaging
from segflow.kernels.stem import NativeStem
from segflow.kernels.stem import vector_width as stem_vector_width
from segflow.kernels.winograd import Winograd, inverse_transform
from segflow.ops._common import gelu_erf, torch_pad
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
FUSED_DOMAIN = "segflow"

# Below this many multiply-adds per call, MKL's addmm (a few microseconds of fixed cost)
# beats oneDNN's matmul (~10 us of primitive overhead); above it oneDNN wins (2-3x on the
# AMD EPYC we measured, where MKL takes a slow code path). Measured with benchmarks/.
LINEAR_ONEDNN_MIN_MACS = 1 << 20
# A weight with at least this many elements is worth oneDNN even for a single row (measured
# equal at 768 x 768, oneDNN ahead above): the layout pass prepacks it, dropping the dense copy.
LINEAR_PACK_MIN_WEIGHT = 1 << 19
# relu(addmm(b, x, w)) in one ATen op: same bits as addmm then relu_, one dispatch less.
_ADDMM_RELU = torch._addmm_activation


def onednn_graph_available() -> bool:
    """Whether this torch can fuse TorchScript graphs with oneDNN Graph (``compile="onednn"``)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.jit,
                                                                  "enable_onednn_fusion")


def onednn_available() -> bool:
    """Whether torch ships the oneDNN fused CPU ops this module uses."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn,
                                                                  "_convolution_pointwise")


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
}

# Activations that evaluate a transcendental function per element. As a post-op of oneDNN's
# AVX2 matmul (brg_matmul:avx2) they are far slower than the same function run after it by
# torch: at 128 x 768 -> 3072 (BERT-base's FFN) erf-GELU adds 1.6-2.0 ms to a 4.4 ms matmul,
# tanh-GELU 4 ms, while torch's in-place gelu_ over the output takes 0.2-0.4 ms. On AVX-512
# the fused form was what BERT-base was measured with (0.92x onnxruntime), so it stays there.
# (Large linears where the native library has AVX2 and FMA run segflow's own kernel, which
# applies erf-GELU itself as it stores each output, with its own rational erf:
# native_linear.kernel_activation.)
_TRANSCENDENTAL = frozenset({"Sigmoid", "Tanh", "Gelu", "GeluTanh"})


def linear_post_op(act: Activation, params: Sequence[float]
                   ) -> tuple[str, list[float], str] | None:
    """The oneDNN post-op a linear should fuse for ``act`` (None: run ``act`` after it).

    Like ``act.onednn(params)``, except that a transcendental activation is not fused
    where torch's CPU kernels are AVX2 (or older): see ``_TRANSCENDENTAL``.
    """
    post = act.onednn(params)
    if post is not None and act.name in _TRANSCENDENTAL and not _cpu_has_avx512():
        return None
    return post


def eltwise_of(post: tuple[str, list[float], str] | None) -> tuple[int, float, float] | None:
    """libdnnl's eltwise ``(algorithm, alpha, beta)`` for a post-op from
    ``Activation.onednn`` (None: no activation, or one that runs after the kernel)."""
    return None if post is None or post[0] == "none" else onednn_eltwise(*post)


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


def direct_linear_preferred() -> bool:
    """Whether large linears should run through libdnnl's inner product
    (:class:`DirectLinear`) rather than torch's oneDNN matmul, when libdnnl loads.

    Measured on a Zen 3 CPU (AVX2): BERT-base's 128-row linears ran at 82-85 GMAC/s
    there against 65-69 through torch (72 of them back to back: 144 against 161 ms,
    onnxruntime 138). On AVX-512 CPUs torch's path is what BERT-base was measured
    with (0.92x onnxruntime), and the library's was not, so torch's stays there.
    """
    return not _cpu_has_avx512()


def blocked_layout_preferred() -> bool:
    """Whether the layout pass may run a depthwise region on nChw8c activations
    (``passes/layout.py``). Measured faster on a Zen 3 CPU (AVX2), where nChw8c is
    the vector width; on AVX-512 CPUs that region was not measured, so they keep NHWC.
    """
    return not _cpu_has_avx512()


def native_stem_preferred(library: NativeLibrary) -> bool:
    """Whether a direct convolution over the NCHW image runs segflow's stem kernel
    (``kernels/stem.py``) unless told (``SEGFLOW_NATIVE_STEM``): where ``library`` is
    the AVX-512 build (16-float vectors), as measured (MobileNetV2 ~4% faster there,
    ResNet-50 ~0.5%). Not with AVX2: on the same VM with the kernel built without
    AVX-512 and libdnnl held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``), MobileNetV2's stem
    ran even with staging and libdnnl (0.28 ms as a model, either way) and ResNet-50's
    slower (1.67 against 1.54 ms), so the image is staged there as before.
    """
    return stem_vector_width(library) == 16


# Tiles (4x4 outputs) an image must give a 3x3 convolution for Winograd to be the default
# on AVX-512 CPUs. Each call reads the whole transformed weight (36 C K floats) for its
# tiles: with few tiles the transforms and that read cost more than they save.
# ResNet-50 at batch 1 (2-core AVX-512 VM, segflow profile, 2026-12-06): 196 tiles
# (56x56) 0.54-0.64 of the direct convolution's time, 49 (28x28) 0.58-0.66, 16 (14x14)
# 0.96-1.06, 4 (7x7) 2.6-2.7; at batch 8 (8x the tiles) 0.48-0.78 at every size.
WINOGRAD_MIN_TILES = 32


def winograd_preferred(tiles: int | None) -> bool:
    """Whether a 3x3 convolution runs as Winograd unless told (``SEGFLOW_WINOGRAD``),
    given the 4x4 tiles one image makes of its output (None: not known at load).

    On CPUs without AVX-512, always: measured faster on a Zen 1 CPU (ResNet-50
    ~0.85x). On AVX-512 CPUs, where libdnnl's direct kernels are twice as wide, where
    an image makes at least :data:`WINOGRAD_MIN_TILES` tiles (ResNet-50's 56x56 and
    28x28 stages, not its 14x14 and 7x7 ones).
    """
    if not _cpu_has_avx512():
        return True
    return tiles is not None and tiles >= WINOGRAD_MIN_TILES


@functools.cache
def _cpu_has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def activation_of(node: Node) -> tuple[Activation, list[float]]:
    name = str(node.attrs.get("activation", ""))
    params = [float(v) for v in node.attrs.get("activation_params", [])]
    return ACTIVATIONS[name], params


@dataclass(frozen=True, slots=True)
class Inline:
    """A Python expression computing a node's single output, for generated code.

    ``expr`` names the node's inputs ``{in0}``, ``{in1}`` ... and every object in
    ``bound`` by its key; the code generator substitutes locals and closure names.
    """

    expr: str
    bound: Mapping[str, object] = field(default_factory=dict)


# -- FusedConv -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _ConvSpec:
    spatial: int
    strides: list[int]
    pads: list[int]          # symmetric pads, one per spatial dim
    begin_end: list[int]     # ONNX [begin..., end...] pads when asymmetric, else []
    dilations: list[int]
    group: int
    has_bias: bool
    has_residual: bool


def _conv_spec(node: Node) -> _ConvSpec:
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
    return _ConvSpec(
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


def conv_uses_onednn(node: Node) -> bool:
    """True when the layout pass prepacked this FusedConv's weight for oneDNN."""
    weight = node.inputs[1]
    return weight is not None and weight.const is not None and (
        weight.const.is_mkldnn or conv_reads_libdnnl_packing(node)
        or conv_reads_winograd_weight(node))


def conv_reads_libdnnl_packing(node: Node) -> bool:
    """True when the layout pass kept this FusedConv's weight in libdnnl's own packing
    (``onednn_direct_packed``): its constant is that packing's bytes, read in place by
    :class:`DirectConv`; torch's packing is made from it only if a fallback needs it."""
    return bool(node.attrs.get("onednn_direct_packed"))


def conv_reads_winograd_weight(node: Node) -> bool:
    """True when the layout pass made this FusedConv's weight constant the Winograd
    transform ``U`` (``winograd``, ``[36, C, K]``: kernels/winograd.py), read in place by
    its kernel; torch's packing is made from it only if a fallback needs it."""
    return bool(node.attrs.get("winograd"))


def reads_libdnnl_packing(node: Node) -> bool:
    """Whether this node's weight constant is a kernel's own format (libdnnl's packing,
    the Winograd transform or the native linear's panels), not the weight's values in
    its shape."""
    return (linear_calls_libdnnl(node) or linear_calls_native(node)
            or conv_reads_libdnnl_packing(node) or conv_reads_winograd_weight(node))


def _fused_conv(node: Node, ctx: BindContext) -> Kernel:
    spec = _conv_spec(node)
    act, params = activation_of(node)
    if conv_uses_onednn(node):
        return _onednn_conv_kernel(node, spec, act, params, ctx)
    conv = _CONV[spec.spatial]
    pad = torch_pad(spec.begin_end) if spec.begin_end else None
    channels_last = bool(node.attrs.get("channels_last", 0)) and spec.spatial == 2

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        b = inputs[2] if spec.has_bias else None
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
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


def _onednn_conv_kernel(node: Node, spec: _ConvSpec, act: Activation, params: list[float],
                        ctx: BindContext) -> Kernel:
    """A prepacked FusedConv's kernel: over libdnnl when the layout pass chose that
    (``onednn_direct``; codegen then calls the same op), else torch's oneDNN op."""
    weight_for = _weight_for(node, spec)
    wanted = act.onednn(params)
    post = exact_post_op(node, act, wanted, ctx)
    fallback = _onednn_conv_callable(spec, act, params, False, weight_for, post)
    lib = Library.load() if node.attrs.get("onednn_direct") else None
    weight = node.inputs[1]
    if lib is None or weight is None or weight.spec.shape is None:
        def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
            return [fallback(*inputs)]
        return kernel if post is wanted else ExactKernel(kernel)
    eltwise = eltwise_of(post)
    after: Callable[[Tensor], Tensor] | None = None
    if act.name and eltwise is None:
        finish = act.inplace or act.apply
        def after(y: Tensor) -> Tensor:
            return finish(y, params)
    geo = geometry([int(d) for d in weight.spec.shape], spec.strides, spec.pads,  # type: ignore[arg-type]
                   spec.dilations, spec.group)
    verified = node.attrs.get("onednn_direct_verified_for")
    fallback_inplace = (_onednn_conv_callable(spec, act, params, True, weight_for, post)
                        if spec.has_residual else None)
    winograd = None
    if conv_reads_winograd_weight(node) and weight.const is not None and ctx.allow_inexact(
            node, "Winograd's transforms spread a NaN or an infinity over a 6x6 input tile"):
        native, _ = NativeLibrary.for_session()
        if native is not None:   # else the fallback, over the recovered plain weight
            winograd = Winograd(native, ctx.workspace(), weight.const)
    staging = ctx.staging(node)
    stage = None
    if staging is not None:     # an input that may arrive NCHW: copied natively
        native, _ = NativeLibrary.for_session()
        stage = ChannelsLastStaging(native) if native is not None else None
    stem = None
    if node.attrs.get("native_stem"):   # the NCHW image read in place
        native, _ = NativeLibrary.for_session()
        stem = NativeStem(native) if native is not None else None
    return DirectKernel(DirectConv(
        lib, geo, eltwise, after, fallback, MAX_SHAPES, MAX_REPACKS,
        [int(d) for d in verified] if verified else None, ctx.destination(node.outputs[0]),
        staging, fallback_inplace, conv_reads_libdnnl_packing(node),
        bool(node.attrs.get("onednn_blocked")), bool(node.attrs.get("onednn_blocked_input")),
        winograd, stage, stem))


MAX_REPACKS = 2
MAX_SHAPES = 32


def _blocked_layout(t: Tensor) -> bytes | None:
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

    The layout pass packs for the spec's input shape (batch 1 when the batch is
    symbolic). Another shape may get another format, and oneDNN would then
    reorder the whole weight on every call (36 ms of ResNet-50's ~200 ms at
    batch 8). So the weight is packed once per new input shape. Mostly the
    format comes out the same (ResNet-50 at batch 8: 47 of 53 convolutions), and
    then the packed weight already held serves that shape too; a different
    format is kept as one more copy of the weight, for at most ``MAX_REPACKS``
    shapes. At most ``MAX_SHAPES`` shapes are remembered; beyond that oneDNN
    reorders on the fly where it must.
    """

    def __init__(self, spec: _ConvSpec, packed_for: Sequence[int] | None,
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
        held = _blocked_layout(w)
        packed = w
        if held is not None or self.copies < MAX_REPACKS:
            spec = self.spec
            fresh = torch.ops.mkldnn._reorder_convolution_weight(
                w.to_dense(), spec.pads, spec.strides, spec.dilations, spec.group, list(shape))
            if (held is None or _blocked_layout(fresh) != held) and self.copies < MAX_REPACKS:
                packed = fresh              # another format: one more copy of the weight
                self.copies += 1
        self.cache[shape] = packed
        return packed


class TorchPacking:
    """torch's packing of a weight the layout pass kept in libdnnl's
    (:func:`conv_reads_libdnnl_packing`), made from those bytes on first use: only a
    fallback of the direct convolution (torch's oneDNN op) reads it. Subclasses
    recover the plain weight from another kernel's format (:meth:`dense`)."""

    def __init__(self, spec: _ConvSpec, geo: ConvGeometry | None,
                 input_size: Sequence[int] | None, blocked: bool = False,
                 plain_input: bool = False) -> None:
        self.spec = spec
        self.geo = geo
        self.input_size = [int(d) for d in input_size] if input_size is not None else None
        self.blocked = blocked          # packed for nChw8c activations
        self.plain_input = plain_input  # ... from a plain NCHW input
        self.made: tuple[Tensor, Tensor] | None = None     # (the constant, torch packing)

    def dense(self, w: Tensor) -> Tensor:
        """The plain weight behind the constant ``w``."""
        lib = Library.load()
        if lib is None:
            raise RuntimeError("a weight in libdnnl's packing, and libdnnl is not loaded")
        assert self.geo is not None and self.input_size is not None
        dense = lib.unpack_weight(w, self.geo, self.input_size, self.blocked, self.plain_input)
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
    """torch's packing of a convolution whose weight constant is the Winograd transform
    (:func:`conv_reads_winograd_weight`), made from ``U`` on first use
    (``winograd.inverse_transform``): only a fallback of the Winograd call reads it,
    and a session that never falls back never holds it."""

    def __init__(self, spec: _ConvSpec) -> None:
        super().__init__(spec, None, None)

    def dense(self, w: Tensor) -> Tensor:
        return inverse_transform(w)


def _weight_for(node: Node, spec: _ConvSpec) -> WeightForInput:
    packed_for = node.attrs.get("onednn_input_size")
    torch_packing = None
    weight = node.inputs[1]
    if conv_reads_winograd_weight(node):
        return WeightForInput(spec, None, WinogradPacking(spec))
    if conv_reads_libdnnl_packing(node) and packed_for and weight is not None \
            and weight.spec.shape is not None:
        geo = geometry([int(d) for d in weight.spec.shape], spec.strides,  # type: ignore[arg-type]
                       spec.pads, spec.dilations, spec.group)
        blocked = bool(node.attrs.get("onednn_blocked"))
        torch_packing = TorchPacking(spec, geo, [int(d) for d in packed_for], blocked,
                                     blocked and not node.attrs.get("onednn_blocked_input"))
    return WeightForInput(spec, [int(d) for d in packed_for] if packed_for else None,
                          torch_packing)


def _onednn_conv_callable(spec: _ConvSpec, act: Activation, params: list[float],
                          inplace: bool, weight_for: WeightForInput,
                          post: tuple[str, list[float], str] | None) -> Callable[..., Tensor]:
    """``fn(x, w, b, z?) -> y`` over oneDNN's fused convolution ops, with ``post`` fused
    (None: the activation runs after them)."""
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


# -- FusedGemm ---------------------------------------------------------------------------
def _linear_parts(node: Node) -> tuple[bool, Activation, list[float]]:
    act, params = activation_of(node)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    return has_bias, act, params


def _static_macs(node: Node) -> int | None:
    x, w = node.inputs[0], node.inputs[1]
    if x is None or w is None or not x.spec.is_static or not w.spec.is_static:
        return None
    assert x.spec.shape is not None and w.spec.shape is not None
    dims = [int(d) for d in (*x.spec.shape[:-1], *w.spec.shape)]  # type: ignore[arg-type]
    rows = 1
    for d in dims[:-2]:
        rows *= d
    return rows * dims[-2] * dims[-1]


def linear_uses_onednn(node: Node) -> bool:
    """True when the layout pass prepacked this FusedGemm's weight for oneDNN (torch's
    or, with :func:`linear_calls_libdnnl`, libdnnl's own format)."""
    weight = node.inputs[1]
    return weight is not None and weight.const is not None and (
        weight.const.is_mkldnn or linear_calls_libdnnl(node))


def linear_calls_libdnnl(node: Node) -> bool:
    """True when the layout pass packed this FusedGemm's weight for libdnnl's inner
    product (``onednn_direct_linear``): its weight constant is then that packing's
    bytes, and only :class:`DirectLinear` reads it."""
    return bool(node.attrs.get("onednn_direct_linear"))


def linear_calls_native(node: Node) -> bool:
    """True when the layout pass packed this FusedGemm's weight into the panels of
    ``kernels/native/gemm.c`` (``native_linear``): only :class:`NativeLinear` reads it."""
    return bool(node.attrs.get("native_linear"))


def _native_linear(node: Node, ctx: BindContext) -> NativeLinear:
    library, why = NativeLibrary.probe()
    weight = node.inputs[1]
    if library is None:   # packed by this process's layout pass, so it loaded then
        raise RuntimeError(f"{node.label}: its weight is packed for native kernels, which {why}")
    assert weight is not None and weight.spec.shape is not None
    out_features, in_features = (int(d) for d in weight.spec.shape)  # type: ignore[arg-type]
    act, params = activation_of(node)
    kernel_act = kernel_activation(act.name, params)
    after, apply = _activation_after(act, params, kernel_act is not None)
    wmax = node.attrs.get("strassen_wmax")
    if wmax is not None and not ctx.allow_inexact(
            node, "Strassen's sums spread a NaN or an infinity into rows that do not read it"):
        wmax = None
    return NativeLinear(library, in_features, out_features, kernel_act, after, apply,
                        None if wmax is None else float(wmax))


def _activation_after(act: Activation, params: list[float], fused: bool
                      ) -> tuple[Callable[[Tensor], Tensor] | None, Callable[[Tensor], Tensor]]:
    """``(after, apply)`` for a linear kernel: the activation run in place on its output
    (None: no activation, or ``fused`` into the kernel), and the activation itself (for
    its torch fallback)."""
    finish = act.inplace or act.apply
    after: Callable[[Tensor], Tensor] | None = None
    if act.name and not fused:
        def after(y: Tensor) -> Tensor:
            return finish(y, params)

    def apply(y: Tensor) -> Tensor:
        return act.apply(y, params)
    return after, apply


def _direct_linear(node: Node, ctx: BindContext) -> DirectLinear:
    lib = Library.load()
    weight = node.inputs[1]
    assert lib is not None and weight is not None and weight.spec.shape is not None
    out_features, in_features = (int(d) for d in weight.spec.shape)  # type: ignore[arg-type]
    act, params = activation_of(node)
    eltwise = eltwise_of(exact_post_op(node, act, linear_post_op(act, params), ctx))
    after, apply = _activation_after(act, params, eltwise is not None)
    return DirectLinear(lib, in_features, out_features, int(node.attrs["onednn_direct_linear"]),
                        eltwise, after, apply, MAX_SHAPES, MAX_REPACKS)


def _linear_callable(node: Node, device: torch.device,
                     fused: tuple[str, list[float], str] | None) -> Callable[..., Tensor]:
    """``fn(x, w, b) -> act(x @ w.T + b)``, choosing MKL addmm or oneDNN by size; ``fused``
    is the post-op oneDNN's matmul takes (:func:`linear_post_op`; None: the activation runs
    after it)."""
    has_bias, act, params = _linear_parts(node)
    post = act.onednn(params)
    # oneDNN's matmul with the activation fused where that pays (linear_post_op), else
    # the plain matmul followed by the activation in place.
    onednn = device.type == "cpu" and onednn_available()
    pointwise = torch.ops.mkldnn._linear_pointwise.default if onednn else None
    attr, scalars, algorithm = fused if fused is not None else ("none", [], "")
    after = None if fused is not None else (act.inplace or act.apply)
    static = _static_macs(node)
    # torch's oneDNN keeps a primitive per input shape for the process, which no session
    # can free: with dynamic rows, the shapes handed to it are bounded
    # (kernels/shape_cache.py; the figures: docs/performance.md).
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

    if linear_uses_onednn(node):   # a prepacked weight: only oneDNN reads it
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
    if linear_calls_native(node):
        return NativeLinearKernel(_native_linear(node, ctx))
    if linear_calls_libdnnl(node):
        return DirectKernel(_direct_linear(node, ctx))
    _, act, params = _linear_parts(node)
    wanted = linear_post_op(act, params)
    fused = exact_post_op(node, act, wanted, ctx)
    fn = _linear_callable(node, ctx.device, fused)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        return [fn(x, w, inputs[2] if has_bias else None)]
    return kernel if fused is wanted else ExactKernel(kernel)


# -- Attention ---------------------------------------------------------------------------
def _attention_op(node: Node, library: NativeLibrary | None, why: str) -> ScaledDotAttention:
    return ScaledDotAttention(float(node.attrs["scale"]), int(node.attrs.get("heads", 0)),
                              library, why)


def _attention(node: Node, ctx: BindContext) -> Kernel:
    library, why = NativeLibrary.for_session() if ctx.device.type == "cpu" else \
        (None, f"are CPU-only (the node runs on {ctx.device.type})")
    return AttentionKernel(_attention_op(node, library, why))


# -- inline forms for generated code -------------------------------------------------------
def inline_fused(node: Node, device: torch.device, inplace_input: int | None,
                 consts: Sequence[Tensor | None], kernel: Kernel | None = None
                 ) -> Inline | None:
    """The expression codegen emits for a fused node (None: call the kernel instead).

    ``inplace_input`` is the input the memory plan allows this node to overwrite;
    ``consts[i]`` is the bound (device-placed) constant behind input ``i``, if any;
    ``kernel`` the node's bound kernel (a direct convolution's op is called as is).
    """
    if isinstance(kernel, ExactKernel):
        return None
    n_in = len(node.inputs)
    args = ", ".join("None" if node.inputs[i] is None else f"{{in{i}}}" for i in range(n_in))
    if node.op_type == "FusedConv":
        return _inline_conv(node, inplace_input, args, kernel)
    if node.op_type == "FusedGemm":
        if isinstance(kernel, DirectKernel | NativeLinearKernel):   # the kernel's own op
            return Inline(f"{{fn}}({args})", {"fn": kernel.op})
        if linear_calls_libdnnl(node) or linear_calls_native(node):
            return None
        return _inline_gemm(node, device, consts)
    if node.op_type == "Attention" and isinstance(kernel, AttentionKernel):
        return Inline(f"{{fn}}({args})", {"fn": kernel.op})
    if node.op_type == "AddLayerNorm" and isinstance(kernel, AddLayerNormKernel):
        return Inline(f"{{fn}}({args})", {"fn": kernel.op})
    return None


def adds_residual_in_place(node: Node, inplace_input: int | None) -> bool:
    """Whether a FusedConv writes its output over its residual (input 3): it has one,
    and the memory plan lets it overwrite that input (``inplace_input``)."""
    return len(node.inputs) > 3 and node.inputs[3] is not None and inplace_input == 3


def _inline_conv(node: Node, inplace_input: int | None, args: str, kernel: Kernel | None
                 ) -> Inline | None:
    if not conv_uses_onednn(node):
        return None
    spec = _conv_spec(node)
    act, params = activation_of(node)
    post = act.onednn(params)
    if not spec.has_residual and post is not None and not node.attrs.get("onednn_direct"):
        # Call the oneDNN op itself: one ATen call, no Python frame in between.
        attr, scalars, algorithm = post
        bound = {"conv": torch.ops.mkldnn._convolution_pointwise.default,
                 "pads": spec.pads, "strides": spec.strides, "dil": spec.dilations,
                 "scalars": scalars, "weight_for": _weight_for(node, spec)}
        bias = "{in2}" if spec.has_bias else "None"
        return Inline(f"{{conv}}({{in0}}, {{weight_for}}({{in0}}, {{in1}}), {bias}, {{pads}}, "
                      f"{{strides}}, {{dil}}, {spec.group}, {attr!r}, {{scalars}}, "
                      f"{algorithm!r})", bound)
    inplace = adds_residual_in_place(node, inplace_input)
    op = kernel.op if isinstance(kernel, DirectKernel) else None
    if isinstance(op, DirectConv):   # the kernel's own op: one set of primitives per node
        return Inline(f"{{fn}}({args})", {"fn": op.inplace_call if inplace else op})
    fn = _onednn_conv_callable(spec, act, params, inplace, _weight_for(node, spec), post)
    return Inline(f"{{fn}}({args})", {"fn": fn})


def _inline_gemm(node: Node, device: torch.device, consts: Sequence[Tensor | None]
                 ) -> Inline | None:
    has_bias, act, params = _linear_parts(node)
    fused = linear_post_op(act, params)
    fn = _linear_callable(node, device, fused)
    x = node.inputs[0]
    weight = consts[1] if len(consts) > 1 else None
    generic = Inline("{fn}({in0}, {in1}, " + ("{in2})" if has_bias else "None)"), {"fn": fn})
    post = act.onednn(params)
    if linear_uses_onednn(node) and fused is not None and _static_macs(node) is not None:
        attr, scalars, algorithm = fused
        bias = "{in2}" if has_bias else "None"
        return Inline(f"{{lin}}({{in0}}, {{in1}}, {bias}, {attr!r}, {{scalars}}, {algorithm!r})",
                      {"lin": torch.ops.mkldnn._linear_pointwise.default, "scalars": scalars})
    if (weight is None or weight.dim() != 2 or x is None or x.spec.rank != 2 or not has_bias
            or act.name not in ("", "Relu")):
        return generic
    # addmm(b, x, w.t()) with the transposed view bound once; with Relu, ATen's
    # addmm+relu in one call (one dispatch less per layer: the 200-layer MLP chain
    # 1.12 -> 1.02-1.05 ms, same bits).
    small = "{addmm_relu}({in2}, {in0}, {wt})" if act.name == "Relu" else \
        "{addmm}({in2}, {in0}, {wt})"
    bound: dict[str, object] = {"addmm": torch.addmm, "addmm_relu": _ADDMM_RELU,
                                "wt": weight.t(), "fn": fn}
    if device.type != "cpu" or not onednn_available() or post is None:
        return Inline(small, bound)
    static = _static_macs(node)
    if static is not None:
        return Inline(small, bound) if static < LINEAR_ONEDNN_MIN_MACS else generic
    # Batch is dynamic: pick by row count (one shape read) instead of a Python call.
    rows = -(-LINEAR_ONEDNN_MIN_MACS // weight.numel())
    return Inline(f"({small} if {{in0}}.shape[0] < {rows} else {{fn}}({{in0}}, {{in1}}, {{in2}}))",
                  bound)


def traceable_fused(node: Node) -> Inline | None:
    """A functional, torch-only form of a fused node, for graph tracers (TorchScript).

    No oneDNN-specific ops, no in-place writes: tracers and oneDNN Graph see plain
    convolution / linear / add / activation ops they know how to fuse.
    """
    n_in = len(node.inputs)
    args = ", ".join("None" if node.inputs[i] is None else f"{{in{i}}}" for i in range(n_in))
    if node.op_type == "FusedConv":
        if conv_uses_onednn(node):
            return None
        spec = _conv_spec(node)
        act, params = activation_of(node)
        conv = _CONV[spec.spatial]
        pad = torch_pad(spec.begin_end) if spec.begin_end else None

        def conv_fn(x: Tensor, w: Tensor, b: Tensor | None = None,
                    z: Tensor | None = None) -> Tensor:
            if pad is not None:
                x = F.pad(x, pad)
            y = conv(x, w, b, spec.strides, spec.pads, spec.dilations, spec.group)
            if z is not None:
                y = y + z
            return act.apply(y, params)
        return Inline(f"{{fn}}({args})", {"fn": conv_fn})
    if node.op_type == "FusedGemm":
        if linear_uses_onednn(node) or linear_calls_native(node):
            return None
        act, params = activation_of(node)

        def linear_fn(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
            return act.apply(F.linear(x, w, b), params)
        return Inline(f"{{fn}}({args})", {"fn": linear_fn})
    if node.op_type == "Attention":   # torch's scaled_dot_product_attention
        return Inline(f"{{fn}}({args})", {"fn": _attention_op(node, None, "traced").through_torch})
    if node.op_type == "AddLayerNorm":   # its unfused ops: a + b, then F.layer_norm
        unfused = AddLayerNorm(float(node.attrs.get("epsilon", 1e-5)), None, "traced")
        return Inline(f"{{fn}}({args})", {"fn": unfused.through_torch})
    return None


def _add_layer_norm(node: Node, ctx: BindContext) -> Kernel:
    library, why = NativeLibrary.for_session() if ctx.device.type == "cpu" else \
        (None, f"are CPU-only (the node runs on {ctx.device.type})")
    return AddLayerNormKernel(AddLayerNorm(float(node.attrs.get("epsilon", 1e-5)), library, why))


OPS: list[OpDef] = [
    OpDef("FusedConv", _fused_conv, domain=FUSED_DOMAIN,
          doc="act(conv(X, W) + B + Z): Conv with folded BatchNorm, residual add, activation"),
    OpDef("FusedGemm", _fused_gemm, domain=FUSED_DOMAIN,
          doc="act(X @ W^T + B): Gemm/MatMul+Add with activation, W in [N, K] layout"),
    OpDef("Attention", _attention, domain=FUSED_DOMAIN,
          doc="softmax(Q @ Kt * scale + M) @ V as one scaled-dot-product-attention kernel"),
    OpDef("AddLayerNorm", _add_layer_norm, domain=FUSED_DOMAIN,
          doc="LayerNormalization(A + B, Scale, Bias) over the last axis in one kernel"),
]
