"""Select kernels: decide, once, which kernel runs each convolution, pooling and linear.

On a CPU with torch's oneDNN ops, every 2-D/3-D ``segflow.FusedConv`` with a
float32 constant weight (any padding, symmetric or not) runs on a packed weight and
writes channels-last output, so a convolution stack stays NHWC from its first
convolution to its last and converts only where it starts (the torch ops in between
keep the memory format they are given). Each node's decision is a :class:`KernelChoice`
(``kernels/choice.py``), returned in a :class:`KernelChoices` that the Plan carries;
the weights are packed for it by ``passes/pack_weights.py``. In order:

- With libdnnl (``CpuTarget.dnnl``, option ``direct``), a convolution is a
  ``DIRECT_CONV``: a primitive built once per input shape over libdnnl's own packing.
  A max or global pooling reading such a convolution's output is a ``DIRECT_POOL``,
  and a Mul of it by a per-channel ``[N, C, 1, 1]`` scale (:func:`broadcast_scale`) a
  ``DIRECT_BINARY``, so that a squeeze-excitation block stays among direct kernels.
- On a target where it is preferred (``blocked``), a depthwise/1x1 stack runs on
  nChw8c activations (:func:`blocked_region`).
- A 3x3 stride-1 convolution outside that region that Winograd takes (``winograd``;
  :func:`winograd_fits`, ``CpuTarget.winograd_preferred``) is a ``WINOGRAD``: its
  weight becomes the transform ``U``.
- A direct convolution over the NCHW graph input that the native stem takes
  (``native_stem``; :func:`stem_fits`) is a ``NATIVE_STEM``: it reads the image in place.
- Without libdnnl, a convolution is an ``ONEDNN_CONV`` (torch's oneDNN op).
- A large ``FusedGemm`` is a ``NATIVE_LINEAR`` where the native kernel is preferred
  (``native_linear``), possibly with Strassen's weight check (``strassen``); else a
  ``DIRECT_LINEAR`` (libdnnl's inner product, where preferred) or an ``ONEDNN_LINEAR``.

Each option is True (on where the kernel can run), False (off) or None (where the
target prefers it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from segflow.ir.graph import Graph, Node
from segflow.ir.types import Device, DeviceKind, DType
from segflow.kernels.choice import (
    DIRECT_POOL_OPS,
    NATIVE_FUSED,
    NATIVE_STANDARD,
    KernelChoice,
    KernelChoices,
    KernelKind,
)
from segflow.kernels.target import CpuTarget
from segflow.ops.fused import FUSED_DOMAIN, LINEAR_PACK_MIN_WEIGHT, activation_of, conv_spec
from segflow.ops.qconv import QCONV
from segflow.passes.pack_weights import PackParams, PackStore, WeightPacker
from segflow.passes.result import PassResult

# The row count a linear whose rows are not known at load (a symbolic batch or
# sequence) has its weight packed for by libdnnl's inner product. libdnnl's format
# choice for a weight did not depend on the row count over the sizes measured
# (docs/performance.md, "Kernel selection"), so a mid-sized count serves
# every call; a call whose row count wants another format gets the kernel's own copy.
DIRECT_LINEAR_ROWS = 128


@dataclass(frozen=True, slots=True)
class Selection:
    """What :func:`select_kernels` did: the pass result and every node's choice."""

    result: PassResult
    choices: KernelChoices

    @property
    def modified(self) -> bool:
        return self.result.modified


def select_kernels(graph: Graph, device: Device, target: CpuTarget, *, direct: bool = True,
                   blocked: bool = True, winograd: bool | None = None,
                   native_linear: bool | None = None, strassen: bool | None = None,
                   native_stem: bool | None = None, packs: PackStore | None = None
                   ) -> Selection:
    """Choose the kernels of ``graph``'s convolutions, poolings and large linears on
    ``target`` and pack their weights for them (in place), and give segflow's fused ops
    their native kernel; a no-op off the CPU. ``packs``: packings shared with other
    sessions over the same weights."""
    if device.kind is not DeviceKind.CPU:
        return Selection(PassResult(graph, False), KernelChoices())
    # Not a change of the graph: these kernels read the node's own inputs.
    fused = {node: KernelChoice(NATIVE_FUSED[node.op_type]) for node in graph.nodes
             if node.domain == FUSED_DOMAIN and node.op_type in NATIVE_FUSED}
    fused.update({node: KernelChoice(NATIVE_STANDARD[node.op_type]) for node in graph.nodes
                  if node.domain == "" and node.op_type in NATIVE_STANDARD})
    # A quantized convolution runs libdnnl's int8 primitive where the library is there
    # (its kernel falls back to the reference, counted, for what that declines).
    if direct and target.dnnl is not None:
        fused.update({node: KernelChoice(KernelKind.INT8_CONV) for node in graph.nodes
                      if node.domain == FUSED_DOMAIN and node.op_type == QCONV})
    if not target.onednn_ops:
        return Selection(PassResult(graph, False), KernelChoices.of_mapping(fused))
    packer = WeightPacker(graph, target, packs)
    choices: dict[Node, KernelChoice] = {}
    use_dnnl = direct and target.dnnl is not None
    region: set[int] = set()
    convs = [n for n in graph.nodes if n.domain == FUSED_DOMAIN and n.op_type == "FusedConv"]
    if use_dnnl and blocked and target.blocked_layout_preferred() \
            and any(packable(n) is not None for n in convs):
        region = blocked_region(graph, target)
    use_native = target.native is not None and (native_linear is True or (
        native_linear is None and target.native_linear_preferred()))
    use_strassen = use_native and (target.strassen_preferred() if strassen is None
                                   else strassen)
    direct_linear = use_dnnl and target.direct_linear_preferred()
    for node in graph.nodes:
        if node.domain == FUSED_DOMAIN and node.op_type == "FusedGemm":
            choice = _select_linear(node, packer, use_native, use_strassen, direct_linear)
            if choice is not None:
                choices[node] = choice
            continue
        if use_dnnl and _direct_pool(node, choices):
            source = node.inputs[0]
            choices[node] = KernelChoice(
                KernelKind.DIRECT_POOL,
                blocked_input=source is not None and id(source.producer) in region)
            continue
        scale = broadcast_scale(node, choices) if use_dnnl else None
        if scale is not None:
            # In the region (its big operand nChw8c), its output is nChw8c too.
            choices[node] = KernelChoice(KernelKind.DIRECT_BINARY, broadcast_input=scale,
                                         blocked_input=id(node) in region)
            continue
        if node.domain != FUSED_DOMAIN or node.op_type != "FusedConv":
            continue
        params = packable(node)
        if params is None:
            continue
        choices[node] = _select_conv(node, params, packer, target, use_dnnl, region, winograd,
                                     native_stem)
    if choices:
        packer.drop_unused()
    return Selection(PassResult(graph, bool(choices)),
                     KernelChoices.of_mapping({**choices, **fused}))


def _select_conv(node: Node, params: PackParams, packer: WeightPacker, target: CpuTarget,
                 direct: bool, region: set[int], winograd: bool | None,
                 native_stem: bool | None) -> KernelChoice:
    weight = node.inputs[1]
    assert weight is not None and weight.const is not None
    dense_shape = list(weight.const.shape)     # read before the dense weight is freed
    in_region = id(node) in region
    x = node.inputs[0]
    plain_input = in_region and x is not None and id(x.producer) not in region
    use_winograd = winograd if winograd is not None else \
        target.winograd_preferred(winograd_tiles(node, params))
    if direct and use_winograd and not in_region \
            and winograd_fits(node, weight.const, params, target):
        packer.winograd_weight(node)
        return KernelChoice(KernelKind.WINOGRAD, channels_last=True)
    done = packer.conv(node, params, direct, in_region, plain_input)
    if not direct:
        return KernelChoice(KernelKind.ONEDNN_CONV, channels_last=True,
                            packed_for=done.packed_for)
    kind = KernelKind.DIRECT_CONV
    if not in_region and stem_fits(node, dense_shape, params, native_stem, target):
        kind = KernelKind.NATIVE_STEM
    return KernelChoice(kind, channels_last=True, blocked=in_region,
                        blocked_input=in_region and not plain_input,
                        packed_for=done.packed_for, verified_for=done.verified_for,
                        libdnnl_packed=done.libdnnl_bytes)


def _select_linear(node: Node, packer: WeightPacker, native: bool, strassen: bool,
                   direct: bool) -> KernelChoice | None:
    """A large float32 FusedGemm's kernel (None: it stays dense, for MKL or torch)."""
    weight, x = node.inputs[1], node.inputs[0]
    if weight is None or weight.const is None or weight.const.is_mkldnn or x is None:
        return None
    w = weight.const
    if w.dtype != torch.float32 or w.dim() != 2 or w.numel() < LINEAR_PACK_MIN_WEIGHT:
        return None
    if native and w.device.type == "cpu":
        wmax = packer.native_linear(node, strassen)
        return KernelChoice(KernelKind.NATIVE_LINEAR, strassen_wmax=wmax)
    act, params = activation_of(node)
    if act.onednn(params) is None:
        return None
    shape = x.spec.shape
    rows = None
    if shape is not None and all(isinstance(d, int) for d in shape[:-1]):
        rows = 1
        for d in shape[:-1]:
            rows *= int(d)  # type: ignore[arg-type]
    if direct:
        direct_rows = rows if rows is not None else DIRECT_LINEAR_ROWS
        if packer.direct_linear(node, direct_rows):
            return KernelChoice(KernelKind.DIRECT_LINEAR, direct_rows=direct_rows)
    packer.onednn_linear(node, rows)
    return KernelChoice(KernelKind.ONEDNN_LINEAR)


def reads_graph_input(node: Node) -> bool:
    """A convolution whose input is a graph input (which may arrive plain NCHW)."""
    x = node.inputs[0] if node.inputs else None
    return node.op_type == "FusedConv" and x is not None and x.producer is None \
        and x.const is None


def stem_fits(node: Node, shape: list[int], params: PackParams, choice: bool | None,
              target: CpuTarget) -> bool:
    """Whether a direct convolution runs as the native stem (``kernels/stem.py``): on
    where ``choice`` says so (None: where ``CpuTarget.native_stem_preferred``), over a
    graph input, a geometry and activation the kernel takes (``stem.unfit``: at most
    four input channels, ungrouped, undilated, output channels a multiple of its vector
    width, no activation or ReLU, LeakyReLU, Clip), and the native library loads."""
    if choice is False or not reads_graph_input(node) or len(shape) != 4:
        return False
    applied, eltwise = kernel_eltwise(node)
    if not applied or target.native is None:
        return False
    if choice is None and not target.native_stem_preferred():
        return False
    spec = target.conv_geometry(shape, params.strides, params.pads, params.dilations,
                                params.groups)
    return target.stem_unfit(spec, shape[1], eltwise) is None


def _direct_pool(node: Node, choices: dict[Node, KernelChoice]) -> bool:
    """A single-output pooling over a direct kernel's (channels-last) output."""
    source = node.inputs[0] if node.inputs else None
    producer = source.producer if source is not None else None
    return (node.domain == "" and node.op_type in DIRECT_POOL_OPS and len(node.outputs) == 1
            and producer is not None and producer in choices
            and choices[producer].calls_libdnnl)


def broadcast_scale(node: Node, choices: dict[Node, KernelChoice]) -> int | None:
    """The input (0 or 1) of a float32 Mul that is a per-channel scale of the other:
    ``[N, C, H, W]`` (or 5-D) from a direct kernel (channels-last) times ``[N or 1, C,
    1, 1]``, the product the big operand's shape. None where the Mul is not one."""
    return _per_channel_operand(
        node, lambda producer: producer in choices and choices[producer].calls_libdnnl)


def _per_channel_operand(node: Node, big_from: Callable[[Node], bool]) -> int | None:
    """:func:`broadcast_scale`'s shapes, the big operand's producer one ``big_from``
    accepts."""
    if node.domain != "" or node.op_type != "Mul" or len(node.inputs) != 2 \
            or len(node.outputs) != 1:
        return None
    a, b = node.inputs
    out = node.outputs[0].spec.shape
    if a is None or b is None or a is b or out is None:
        return None
    for scale, big in ((1, a), (0, b)):
        small = node.inputs[scale]
        assert small is not None
        producer = big.producer
        if producer is None or not big_from(producer):
            continue
        shape, scale_shape = big.spec.shape, small.spec.shape
        if shape is None or scale_shape is None or tuple(out) != tuple(shape) \
                or big.spec.dtype is not DType.FLOAT32 or small.spec.dtype is not DType.FLOAT32:
            continue
        if len(shape) in (4, 5) and len(scale_shape) == len(shape) \
                and scale_shape[1] == shape[1] and scale_shape[0] in (1, shape[0]) \
                and all(d == 1 for d in scale_shape[2:]):
            return scale
    return None


def blocked_region(graph: Graph, target: CpuTarget) -> set[int]:
    """The convolutions (``id``s) that run on ``nChw8c`` activations.

    libdnnl runs depthwise convolutions on channels blocked by 8 faster than on NHWC
    where 8 floats are a vector, and the 1x1 convolutions around them as fast; dense 3x3
    convolutions are faster on NHWC (docs/performance.md, "Kernel selection"), and
    libdnnl, left to choose, picks NHWC for all but a 3-channel stem. It has kernels
    only where a convolution's input and output share the layout, so the blocked
    activations form a region: depthwise and 1x1 convolutions (and a first convolution
    over a plain NCHW graph input) with a kernel for nChw8c, whose inputs and residuals
    come from the region and whose outputs go only to region convolutions or to global
    poolings (whose [N, C, 1, 1] output is the same bytes in any layout), kept only if
    it holds a depthwise convolution. The tensors in between hold nChw8c bytes under
    their logical shape; nothing outside the region reads one.
    """
    lib = target.dnnl
    assert lib is not None
    candidates: set[int] = set()
    depthwise: set[int] = set()
    for node in graph.nodes:
        if node.domain != FUSED_DOMAIN or node.op_type != "FusedConv":
            continue
        params = packable(node)
        weight, x = node.inputs[1], node.inputs[0]
        if params is None or params.input_size is None or len(params.input_size) != 4 \
                or weight is None or weight.const is None or x is None:
            continue
        shape = list(weight.const.shape)
        geo = target.conv_geometry(shape, params.strides, params.pads, params.dilations,
                                   params.groups)
        if geo.output_size(params.input_size)[1] % target.blocked_channels:
            continue
        plain_input = x.producer is None
        is_depthwise = params.groups > 1 and shape[1] == 1
        pointwise = shape[2:] == [1, 1] and params.groups == 1
        if (plain_input and x.const is not None) or not (
                is_depthwise or pointwise or plain_input):
            continue
        if lib.blocked_kernel(geo, params.input_size, plain_input) is not None:
            candidates.add(id(node))
            if is_depthwise:
                depthwise.add(id(node))
    # Per-channel scales of a candidate's output (a squeeze-excitation block's) run on
    # its nChw8c bytes too (``DIRECT_BINARY``): by node id, the scale operand's index.
    scales: dict[int, int] = {}
    for node in graph.nodes:
        scale = _per_channel_operand(node, lambda producer: id(producer) in candidates)
        if scale is not None:
            scales[id(node)] = scale
    region = set(candidates) | set(scales)
    shrinking = True
    while shrinking:
        shrinking = False
        for node in graph.nodes:
            if id(node) in region and not _fits_region(graph, node, region, scales):
                region.discard(id(node))
                shrinking = True
    return region if region & depthwise else set()


def _fits_region(graph: Graph, node: Node, region: set[int], scales: dict[int, int]) -> bool:
    """Whether a region convolution's input, residual and output (a region scale's big
    operand and output) all stay inside it."""
    if id(node) in scales:
        big = node.inputs[1 - scales[id(node)]]
        if big is None or big.producer is None or id(big.producer) not in region:
            return False
    else:
        x = node.inputs[0]
        if x is None or (x.producer is not None and id(x.producer) not in region):
            return False
        z = node.inputs[3] if len(node.inputs) > 3 else None
        if z is not None and (z.producer is None or id(z.producer) not in region):
            return False
    out = node.outputs[0]
    if out in graph.outputs or not out.uses or len(node.outputs) != 1:
        return False
    for user in out.uses:
        slots = [i for i, v in enumerate(user.inputs) if v is out]
        reads = [1 - scales[id(user)]] if id(user) in scales else [0, 3]
        if id(user) in region and all(i in reads for i in slots):
            continue
        if user.domain == "" and user.op_type in ("GlobalAveragePool", "GlobalMaxPool") \
                and len(user.outputs) == 1:
            continue
        return False
    return True


def winograd_tiles(node: Node, params: PackParams) -> int | None:
    """The 4x4 output tiles one image makes of a 3x3 stride-1 convolution, from its
    input's static size (None where that is symbolic or not 2-D)."""
    x = node.inputs[0]
    shape = x.spec.shape if x is not None else None
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
        return None
    pads = list(params.pads) or [0, 0, 0, 0]
    out = [int(shape[2 + i]) + int(pads[i]) + int(pads[2 + i]) - 2  # type: ignore[arg-type]
           for i in range(2)]
    return math.ceil(out[0] / 4) * math.ceil(out[1] / 4)


def kernel_eltwise(node: Node) -> tuple[bool, tuple[int, float, float] | None]:
    """A convolution's activation for a native kernel's epilogue: ``(True, eltwise)``
    (None: no activation), or ``(False, None)`` where it has no oneDNN eltwise form and
    runs after the kernel (the direct path handles that)."""
    act, scalars = activation_of(node)
    eltwise = CpuTarget.eltwise(act.onednn(scalars))
    return not (act.name and eltwise is None), eltwise


def winograd_fits(node: Node, weight: torch.Tensor, params: PackParams,
                  target: CpuTarget) -> bool:
    """Whether a direct convolution runs as Winograd F(4x4, 3x3) (``kernels/winograd.py``):
    3x3, stride 1, undilated, ungrouped, channels in multiples of 8, no activation or
    one the transforms apply (ReLU, LeakyReLU, Clip), and the native kernels available."""
    if params.groups != 1:
        return False
    applied, eltwise = kernel_eltwise(node)
    if not applied:
        return False
    spec = target.conv_geometry(list(weight.shape), params.strides, params.pads,
                                params.dilations, 1)
    if target.winograd_unfit(spec, int(weight.shape[1]), eltwise) is not None:
        return False
    return target.native is not None


def packable(node: Node) -> PackParams | None:
    """The packing parameters when oneDNN can run ``node``, else None."""
    weight = node.inputs[1]
    x = node.inputs[0]
    if weight is None or weight.const is None or weight.const.is_mkldnn or x is None:
        return None
    w = weight.const
    if w.dtype != torch.float32 or w.dim() not in (4, 5):
        return None
    spec = conv_spec(node)
    input_size = None
    shape = x.spec.shape
    if shape is not None and len(shape) == w.dim() and all(isinstance(d, int) for d in shape[1:]):
        # A symbolic batch packs for batch 1; oneDNN accepts any batch with this weight.
        input_size = tuple(d if isinstance(d, int) else 1 for d in shape)
    # Asymmetric pads too: libdnnl takes the begin and end pads apart, and torch's op
    # (the fallback, or the kernel without libdnnl) reads an input padded beforehand.
    return PackParams(tuple(int(p) for p in spec.begin_end_pads),
                      tuple(int(s) for s in spec.strides), tuple(int(d) for d in spec.dilations),
                      spec.group, input_size)
