"""Layout: run convolutions in the layout the CPU kernels prefer.

On CPU with oneDNN, every 2-D/3-D ``segflow.FusedConv`` gets its weight
reordered once, at plan time, into oneDNN's blocked format (an opaque
``mkldnn`` tensor that replaces the dense weight constant, so the model holds
one copy), and is marked ``channels_last``. oneDNN then reads NCHW or NHWC
activations and writes NHWC ones, so a conv stack stays channels-last from its
first conv to its last and converts only where it starts: the torch ops between
convs (Add, MaxPool, GlobalAveragePool, Flatten) keep the memory format they
are given. When oneDNN's own library is installed (``onednn-cpu-gomp``), each
packed convolution is marked ``onednn_direct``: its kernel calls libdnnl with a
primitive built once per input shape, reading the same packed weight
(``kernels/onednn/``); so is a max or global pooling that reads such a
convolution's output. The weight constant of a direct convolution is then
libdnnl's own packing instead of torch's (bytes, marked ``onednn_direct_packed``;
torch bundles a newer oneDNN whose format can differ), so the model still holds
one copy. A graph with depthwise convolutions runs its depthwise/1x1 stack on
oneDNN's blocked ``nChw8c`` activations (``onednn_blocked``; see
:func:`_blocked_region`, ``SEGFLOW_ONEDNN_BLOCKED=0`` turns it off). A direct
stride-1 3x3 convolution outside that region, with channels in multiples of 8
and no activation, or ReLU, LeakyReLU or Clip, is marked ``winograd``: it runs as Winograd
F(4x4, 3x3) on CPUs without AVX-512, and on AVX-512 ones where an image makes 32 or
more 4x4 tiles of its output (``fused.winograd_preferred``, ``kernels/winograd.py``;
``SEGFLOW_WINOGRAD=0`` turns it off, ``=1`` on everywhere), and its weight constant becomes the
transformed one (``[36, C, K]``) instead of a packed one. A large linear
(``FusedGemm``) gets its weight packed once too: into the panels of segflow's own
kernel where the native library loads, built with AVX2 and FMA (``native_linear``,
``kernels/linear.py``; ``SEGFLOW_NATIVE_LINEAR=0`` turns it off, ``=1`` on
everywhere), else for libdnnl's inner product or torch's oneDNN matmul; where the
library's panels are the AVX2 build's (``strassen_preferred``), a packed weight whose
paired output columns are alike in scale is also marked ``strassen_wmax``, and its
calls may run as one level of Strassen (``kernels/native/strassen.c``;
``SEGFLOW_STRASSEN=0`` turns it off, ``=1`` on everywhere). Measured
on ResNet-50 / MobileNetV2 at batch 1 (see benchmarks/cpu_targets.py): torch's
NCHW ``conv2d`` is several times slower, and its 3-channel stem conv alone costs
more than oneDNN's whole network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import Device, DeviceKind
from segflow.kernels.linear import (
    native_linear_preferred,
    strassen_preferred,
    strassen_spread,
)
from segflow.kernels.linear import pack as native_pack
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.geometry import geometry
from segflow.kernels.onednn.library import BLOCK, DnnlError, Library
from segflow.kernels.stem import unfit as stem_unfit
from segflow.kernels.stem import vector_width as stem_vector_width
from segflow.kernels.winograd import transform_weight, unfit
from segflow.ops.fused import (
    FUSED_DOMAIN,
    LINEAR_PACK_MIN_WEIGHT,
    activation_of,
    blocked_layout_preferred,
    direct_linear_preferred,
    eltwise_of,
    native_stem_preferred,
    onednn_available,
    winograd_preferred,
)
from segflow.passes.result import PassResult

# The row count a linear with a dynamic batch (or sequence) is packed for: BERT-base at
# sequence 128. libdnnl's inner product chose the same weight format for 1, 8, 128 and
# 256 rows at every BERT/ResNet/MobileNet linear size tried (1024 x 1024 differed at
# 1 row); a row count that wants another format gets the kernel's own copy.
DIRECT_LINEAR_ROWS = 128


def layout(graph: Graph, device: Device, *, direct: bool = True,
           blocked: bool = True, winograd: bool | None = None,
           native_linear: bool | None = None, strassen: bool | None = None,
           native_stem: bool | None = None) -> PassResult:
    """Prepack FusedConv and large FusedGemm weights on CPU (in place); a no-op elsewhere.

    ``direct``: mark the packed convolutions to call libdnnl when it loads;
    ``blocked``: and run a depthwise region on nChw8c activations (:func:`_blocked_region`);
    ``winograd``: and run the 3x3 ones that qualify as Winograd (:func:`_winograd_fits`;
    None: where ``winograd_preferred``: on CPUs without AVX-512, and on AVX-512 ones
    for outputs of 32 or more 4x4 tiles an image);
    ``native_linear``: pack large linears for ``kernels/linear.py`` where the native
    library loads (None: where ``native_linear_preferred``);
    ``strassen``: and let those whose weight allows it run as Strassen (the node's
    ``strassen_wmax``: :func:`~segflow.kernels.linear.strassen_spread`; None: where
    ``strassen_preferred``);
    ``native_stem``: and run a direct convolution over the NCHW image as segflow's
    stem kernel, which reads it in place, where it fits (:func:`_stem_fits`; None:
    where ``native_stem_preferred``: the native library's AVX-512 build).
    """
    if device.kind is not DeviceKind.CPU or not onednn_available():
        return PassResult(graph, False)
    packed: dict[tuple[int, _PackParams, int], Value] = {}
    strassen_wmax: dict[int, float | None] = {}  # id(panels) -> its weight's Strassen check
    packed_as: dict[int, PackedConv] = {}
    winograd_weights: dict[int, Value] = {}     # id(dense weight) -> its transformed one
    released: list[Value] = []   # dense weights freed (kept: the dicts above key on id())
    changed = 0
    lib: Library | None = None
    region: set[int] = set()
    convs = [n for n in graph.nodes if n.domain == FUSED_DOMAIN and n.op_type == "FusedConv"]
    if direct and blocked and blocked_layout_preferred() \
            and any(_packable(n) is not None for n in convs):
        lib = Library.load()
        if lib is not None:
            region = _blocked_region(graph, lib)
    native: NativeLibrary | None = None
    native_known = False     # resolved at the first linear: a graph with none never builds it
    use_strassen = False     # ... and with it whether its linears may run as Strassen
    for node in graph.nodes:
        if node.domain == FUSED_DOMAIN and node.op_type == "FusedGemm":
            if not native_known:
                native, native_known = _native_for_linears(native_linear), True
                use_strassen = native is not None and (
                    strassen_preferred(native) if strassen is None else strassen)
            dense = node.inputs[1]
            if native is not None and _pack_native(graph, node, packed, native,
                                                   strassen_wmax if use_strassen else None):
                changed += 1
                _release(graph, dense, released)
                continue
            if direct and lib is None and direct_linear_preferred():
                lib = Library.load()
            changed += _pack_linear(graph, node, packed,
                                    lib if direct and direct_linear_preferred() else None)
            _release(graph, dense, released)
            continue
        if _direct_pool(node, lib):
            node.attrs["onednn_direct"] = 1   # max pooling through libdnnl too
            source = node.inputs[0]
            if source is not None and id(source.producer) in region:
                node.attrs["onednn_blocked_input"] = 1
            changed += 1
            continue
        if node.domain != FUSED_DOMAIN or node.op_type != "FusedConv":
            continue
        params = _packable(node)
        if params is None:
            continue
        if direct and lib is None:
            # Loaded at the first convolution to pack: a process that packs none never
            # maps the library.
            lib = Library.load()
        weight = node.inputs[1]
        assert weight is not None and weight.const is not None
        dense_shape = list(weight.const.shape)     # read before the dense weight is freed
        in_region = id(node) in region
        x = node.inputs[0]
        plain_input = in_region and x is not None and id(x.producer) not in region
        use_winograd = winograd if winograd is not None else \
            winograd_preferred(_winograd_tiles(node, params))
        if lib is not None and use_winograd and not in_region \
                and _winograd_fits(node, weight.const, params):
            _as_winograd(graph, node, weight, winograd_weights)
            _release(graph, weight, released)
            changed += 1
            continue
        key = (id(weight), params, in_region + plain_input)
        value = packed.get(key)
        if value is None:
            done = _pack_conv(weight.const, params, lib, in_region, plain_input)
            value = Value(_fresh_name(graph, f"{weight.name}.onednn"), weight.spec,
                          const=done.tensor)
            graph.add_initializer(value)
            packed[key] = value
            packed_as[id(value)] = done
        graph.set_input(node, 1, value)
        _release(graph, weight, released)
        node.attrs["channels_last"] = 1
        done = packed_as[id(value)]
        packed_for, verified = done.packed_for, done.verified_for
        if lib is not None:
            node.attrs["onednn_direct"] = 1   # called through libdnnl (kernels/onednn/)
            if verified is not None:
                node.attrs["onednn_direct_verified_for"] = list(verified)
            if done.libdnnl_bytes:
                # The weight constant is libdnnl's packing: only DirectConv reads it.
                node.attrs["onednn_direct_packed"] = 1
            if in_region:
                node.attrs["onednn_blocked"] = 1
                if not plain_input:
                    node.attrs["onednn_blocked_input"] = 1
            elif _stem_fits(node, dense_shape, params, native_stem):
                node.attrs["native_stem"] = 1    # kernels/stem.py: the image in place
        if packed_for is not None:
            # The kernel repacks for other input shapes (ops/fused.py WeightForInput).
            node.attrs["onednn_input_size"] = list(packed_for)
        changed += 1
    if changed:
        for name, value in list(graph.initializers.items()):
            if not value.uses and value not in graph.outputs:
                del graph.initializers[name]
    return PassResult(graph, changed > 0)


def calls_libdnnl(node: Node) -> bool:
    """Whether the layout pass sent this node's kernel straight into libdnnl: it then
    writes its output where the run says (runtime/arena.py)."""
    return bool(node.attrs.get("onednn_direct"))


def converts_input(node: Node) -> bool:
    """A direct convolution over a graph input: its kernel first copies that (plain,
    NCHW) input to channels-last, since libdnnl has only reference kernels for plain
    input with channels-last output. A native stem reads it in place, but the run's
    storage for the copy stays planned for a call it declines (a large batch)."""
    return calls_libdnnl(node) and _reads_graph_input(node)


def _reads_graph_input(node: Node) -> bool:
    """A convolution whose input is a graph input (which may arrive plain NCHW)."""
    x = node.inputs[0] if node.inputs else None
    return node.op_type == "FusedConv" and x is not None and x.producer is None \
        and x.const is None


def _stem_fits(node: Node, shape: list[int], params: _PackParams, choice: bool | None
               ) -> bool:
    """Whether a direct convolution runs as the native stem (``kernels/stem.py``):
    on where ``choice`` says so (None: where ``native_stem_preferred``), over a graph
    input, a geometry and activation the kernel takes (``native_stem.unfit``: at most
    four input channels, ungrouped, undilated, output channels a multiple of its vector
    width, no activation or ReLU, LeakyReLU, Clip), and the native library loads."""
    if choice is False or not _reads_graph_input(node) or len(shape) != 4:
        return False
    applied, eltwise = _kernel_eltwise(node)
    if not applied:
        return False
    library, _ = NativeLibrary.for_session()
    if library is None or (choice is None and not native_stem_preferred(library)):
        return False
    spec = geometry(shape, params.strides, params.pads, params.dilations, params.groups)
    return stem_unfit(spec, shape[1], stem_vector_width(library), eltwise) is None


POOLS = ("MaxPool", "GlobalAveragePool", "GlobalMaxPool")


def _direct_pool(node: Node, lib: Library | None) -> bool:
    """A single-output pooling over a direct kernel's (channels-last) output."""
    source = node.inputs[0] if node.inputs else None
    producer = source.producer if source is not None else None
    return (lib is not None and node.domain == "" and node.op_type in POOLS
            and len(node.outputs) == 1 and producer is not None
            and bool(producer.attrs.get("onednn_direct")))


class PackedConv(NamedTuple):
    """A convolution weight as the layout pass packed it."""

    tensor: torch.Tensor                  # torch's packing (mkldnn), or libdnnl's (bytes)
    packed_for: tuple[int, ...] | None    # the input size it was packed for
    verified_for: tuple[int, ...] | None  # input size whose libdnnl format it is, checked
    libdnnl_bytes: bool                   # ``tensor`` is libdnnl's packing, not torch's


def _blocked_region(graph: Graph, lib: Library) -> set[int]:
    """The convolutions (``id``s) that run on ``nChw8c`` activations.

    libdnnl runs depthwise convolutions on channels blocked by 8 faster than on
    NHWC (AVX2, MobileNetV2's at batch 1: its ``jit_dw`` kernel took 0.23-0.25 ms
    where ``brdgmm_dw`` took 0.36-0.40 on the 144- and 96-channel ones), and the
    1x1 convolutions around them as fast (``jit_1x1``); MobileNetV2's 52
    convolutions chained on nChw8c ran 13.5-16.7 ms against 16.9-19.8 on NHWC. Dense
    3x3 convolutions are faster on NHWC (``brgconv``: ResNet-50's 53 convolutions
    all blocked ran 124-129 ms against 112-117), and libdnnl, left to choose,
    picks NHWC for all but a 3-channel stem. It has kernels only where a
    convolution's input and output share the layout, so the blocked activations
    form a region: depthwise and 1x1 convolutions (and a first convolution over a
    plain NCHW graph input) with a kernel for nChw8c, whose inputs and residuals
    come from the region and whose outputs go only to region convolutions or to
    global poolings (whose [N, C, 1, 1] output is the same bytes in any layout),
    kept only if it holds a depthwise convolution. The tensors in between hold
    nChw8c bytes under their logical shape; nothing outside the region reads one.
    Only where :func:`blocked_layout_preferred` (no AVX-512: not measured there).
    """
    candidates: set[int] = set()
    depthwise: set[int] = set()
    for node in graph.nodes:
        if node.domain != FUSED_DOMAIN or node.op_type != "FusedConv":
            continue
        params = _packable(node)
        weight, x = node.inputs[1], node.inputs[0]
        if params is None or params.input_size is None or len(params.input_size) != 4 \
                or weight is None or weight.const is None or x is None:
            continue
        shape = list(weight.const.shape)
        geo = geometry(shape, params.strides, params.pads, params.dilations, params.groups)
        if geo.output_size(params.input_size)[1] % BLOCK:
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
    region = set(candidates)
    shrinking = True
    while shrinking:
        shrinking = False
        for node in graph.nodes:
            if id(node) in region and not _fits_region(graph, node, region):
                region.discard(id(node))
                shrinking = True
    return region if region & depthwise else set()


def _fits_region(graph: Graph, node: Node, region: set[int]) -> bool:
    """Whether a region convolution's input, residual and output all stay inside it."""
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
        if id(user) in region and all(i in (0, 3) for i in slots):
            continue
        if user.domain == "" and user.op_type in ("GlobalAveragePool", "GlobalMaxPool") \
                and len(user.outputs) == 1:
            continue
        return False
    return True


def _pack_conv(dense: torch.Tensor, params: _PackParams, lib: Library | None,
               blocked: bool = False, plain_input: bool = False) -> PackedConv:
    """The packed weight, the input size it was packed for, and the input size for
    which its bytes are libdnnl's format (None: not libdnnl's).

    A convolution that will call libdnnl gets libdnnl's own packing for its input
    size (``libdnnl_bytes``; for the nChw8c layout with ``blocked``, for its NCHW
    entry with ``plain_input``): the kernel reads it in place, and torch's packing
    is made from it only if a fallback ever needs it (``fused.WeightForInput``).
    Until 2026-12-06 torch's packing was made first and kept where its bytes were
    libdnnl's format (they differ for some shapes: torch bundles a newer oneDNN),
    which packed most weights twice at load: ResNet-50's ``_pack_conv`` took
    112-137 ms of a ~600 ms load, 33-40 packing once. Without libdnnl, or where it
    describes no packing, the weight is torch's, for torch's oneDNN op.
    """
    def pack(size: tuple[int, ...] | None) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_convolution_weight(
            dense, list(params.pads), list(params.strides), list(params.dilations),
            params.groups, None if size is None else list(size))

    size = params.input_size
    if lib is None or size is None:
        return PackedConv(pack(size), size, None, False)
    geo = geometry(list(dense.shape), params.strides, params.pads, params.dilations,
                   params.groups)
    try:
        return PackedConv(lib.preferred_weight(dense, geo, size, blocked, plain_input),
                          size, size, True)
    except DnnlError:
        return PackedConv(pack(size), size, None, False)


def _native_for_linears(choice: bool | None) -> NativeLibrary | None:
    """The native library where large linears should be packed for it: on when
    ``choice`` says so (None: where ``native_linear_preferred``) and it loads."""
    if choice is False:
        return None
    library, _ = NativeLibrary.for_session()
    if library is None or (choice is None and not native_linear_preferred(library)):
        return None
    return library


def _pack_native(graph: Graph, node: Node, packed: dict[tuple[int, _PackParams, int], Value],
                 library: NativeLibrary, strassen_wmax: dict[int, float | None] | None) -> bool:
    """Pack a large float32 FusedGemm weight into ``kernels/native/gemm.c``'s panels and
    mark the node ``native_linear``; with ``strassen_wmax`` (the check of each packing
    made, by ``id``), also ``strassen_wmax`` where the weight allows Strassen
    (:func:`~segflow.kernels.linear.strassen_spread`, from each output's largest
    ``|W|``, taken while packing). False where the weight does not qualify."""
    weight, x = node.inputs[1], node.inputs[0]
    if weight is None or weight.const is None or weight.const.is_mkldnn or x is None:
        return False
    w = weight.const
    if w.dtype != torch.float32 or w.dim() != 2 or w.numel() < LINEAR_PACK_MIN_WEIGHT \
            or w.device.type != "cpu":
        return False
    n, k = (int(d) for d in w.shape)
    key = (id(weight), _PackParams((), (), (), -2, None), 0)
    value = packed.get(key)
    if value is None:
        top = torch.empty(n) if strassen_wmax is not None else None
        value = Value(_fresh_name(graph, f"{weight.name}.panels"), weight.spec,
                      const=native_pack(library, w, top))
        graph.add_initializer(value)
        packed[key] = value
        if strassen_wmax is not None and top is not None:
            strassen_wmax[id(value)] = strassen_spread(library, top, n, k)
    graph.set_input(node, 1, value)
    node.attrs["native_linear"] = 1
    wmax = strassen_wmax.get(id(value)) if strassen_wmax is not None else None
    if wmax is not None:
        node.attrs["strassen_wmax"] = wmax
    return True


def _pack_linear(graph: Graph, node: Node, packed: dict[tuple[int, _PackParams, int], Value],
                 lib: Library | None) -> int:
    """Prepack a large FusedGemm weight for oneDNN (small ones stay dense for MKL).

    With ``lib``, the packing is libdnnl's own, for its inner product, and the node is
    marked ``onednn_direct_linear`` (the row count it was packed for): its kernel is
    ``DirectLinear``. Otherwise it is torch's, for ``mkldnn._linear_pointwise``.
    """
    weight, x = node.inputs[1], node.inputs[0]
    if weight is None or weight.const is None or weight.const.is_mkldnn or x is None:
        return 0
    w = weight.const
    act, params = activation_of(node)
    if w.dtype != torch.float32 or w.dim() != 2 or w.numel() < LINEAR_PACK_MIN_WEIGHT \
            or act.onednn(params) is None:
        return 0
    shape = x.spec.shape
    rows = None
    if shape is not None and all(isinstance(d, int) for d in shape[:-1]):
        rows = 1
        for d in shape[:-1]:
            rows *= int(d)  # type: ignore[arg-type]
    if lib is not None:
        direct_rows = rows if rows is not None else DIRECT_LINEAR_ROWS
        key = (id(weight), _PackParams((), (), (), -1, (direct_rows,)), 0)
        value = packed.get(key)
        if value is None:
            try:
                tensor = lib.pack_linear(w, direct_rows)
            except DnnlError:
                tensor = None
            if tensor is not None:
                value = Value(_fresh_name(graph, f"{weight.name}.dnnl"), weight.spec,
                              const=tensor)
                graph.add_initializer(value)
                packed[key] = value
        if value is not None:
            graph.set_input(node, 1, value)
            node.attrs["onednn_direct_linear"] = direct_rows
            return 1
    key = (id(weight), _PackParams((), (), (), 0, None if rows is None else (rows,)), 0)
    value = packed.get(key)
    if value is None:
        tensor = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
        value = Value(_fresh_name(graph, f"{weight.name}.onednn"), weight.spec, const=tensor)
        graph.add_initializer(value)
        packed[key] = value
    graph.set_input(node, 1, value)
    return 1


@dataclass(frozen=True, slots=True)
class _PackParams:
    """What oneDNN's weight format depends on (equal params share one packed weight)."""

    pads: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    groups: int
    input_size: tuple[int, ...] | None


def _fresh_name(graph: Graph, name: str) -> str:
    """``name``, or ``name.1``, ``name.2``, ... where the graph has an initializer so
    called already: one weight packed twice (two convolutions of different strides
    share it) gives two packed initializers, and the second must not displace the
    first."""
    fresh, n = name, 0
    while fresh in graph.initializers:
        n += 1
        fresh = f"{name}.{n}"
    return fresh


def _release(graph: Graph, dense: Value | None, released: list[Value]) -> None:
    """Free a dense weight as soon as its last reader has its packed (or transformed)
    one, not when the pass ends: the dense and packed copies of every weight then
    never coexist, and loading peaks that much lower. The Value is kept in
    ``released`` (without its tensor) so that no new Value reuses its ``id()``."""
    if dense is None or dense.uses or dense in graph.outputs \
            or graph.initializers.get(dense.name) is not dense:
        return
    del graph.initializers[dense.name]
    dense.const = None
    released.append(dense)


def _as_winograd(graph: Graph, node: Node, weight: Value, made: dict[int, Value]) -> None:
    """Mark ``node`` ``winograd`` and give it the transformed weight as its constant
    (``U``, ``[36, C, K]``: kernels/winograd.py), made once per dense weight. Nothing
    packs the dense one for it: its kernel reads ``U`` in place, and a fallback
    recovers the plain weight from ``U`` if it ever needs it."""
    value = made.get(id(weight))
    if value is None:
        assert weight.const is not None
        value = Value(_fresh_name(graph, f"{weight.name}.winograd"), weight.spec,
                      const=transform_weight(weight.const))
        graph.add_initializer(value)
        made[id(weight)] = value
    graph.set_input(node, 1, value)
    node.attrs["channels_last"] = 1
    node.attrs["onednn_direct"] = 1
    node.attrs["winograd"] = 1


def _winograd_tiles(node: Node, params: _PackParams) -> int | None:
    """The 4x4 output tiles one image makes of a 3x3 stride-1 convolution, from its
    input's static size (None where that is symbolic or not 2-D)."""
    x = node.inputs[0]
    shape = x.spec.shape if x is not None else None
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
        return None
    pads = list(params.pads) or [0, 0]
    out = [int(shape[2 + i]) + 2 * int(pads[i]) - 2 for i in range(2)]  # type: ignore[arg-type]
    return math.ceil(out[0] / 4) * math.ceil(out[1] / 4)


def _kernel_eltwise(node: Node) -> tuple[bool, tuple[int, float, float] | None]:
    """A convolution's activation for a native kernel's epilogue: ``(True, eltwise)``
    (None: no activation), or ``(False, None)`` where it has no oneDNN eltwise form and
    runs after the kernel (the direct path handles that)."""
    act, scalars = activation_of(node)
    eltwise = eltwise_of(act.onednn(scalars))
    return not (act.name and eltwise is None), eltwise


def _winograd_fits(node: Node, weight: torch.Tensor, params: _PackParams) -> bool:
    """Whether a direct convolution runs as Winograd F(4x4, 3x3) (``kernels/winograd.py``):
    3x3, stride 1, undilated, ungrouped, channels in multiples of 8, no activation or
    one the transforms apply (ReLU, LeakyReLU, Clip), and the native kernels available."""
    if params.groups != 1:
        return False
    applied, eltwise = _kernel_eltwise(node)
    if not applied:
        return False
    spec = geometry(list(weight.shape), params.strides, params.pads, params.dilations, 1)
    if unfit(spec, int(weight.shape[1]), eltwise) is not None:
        return False
    return NativeLibrary.for_session()[0] is not None


def _packable(node: Node) -> _PackParams | None:
    """The packing parameters when oneDNN can run ``node``, else None."""
    weight = node.inputs[1]
    x = node.inputs[0]
    if weight is None or weight.const is None or weight.const.is_mkldnn or x is None:
        return None
    w = weight.const
    if w.dtype != torch.float32 or w.dim() not in (4, 5):
        return None
    spatial = w.dim() - 2
    attrs = node.attrs
    pads = list(attrs.get("pads", [0] * (2 * spatial)))
    if pads[:spatial] != pads[spatial:]:
        return None  # oneDNN takes symmetric padding only
    strides = tuple(int(s) for s in attrs.get("strides", [1] * spatial))
    dilations = tuple(int(d) for d in attrs.get("dilations", [1] * spatial))
    groups = int(attrs.get("group", 1))
    input_size = None
    shape = x.spec.shape
    if shape is not None and len(shape) == w.dim() and all(isinstance(d, int) for d in shape[1:]):
        # A symbolic batch packs for batch 1; oneDNN accepts any batch with this weight.
        input_size = tuple(d if isinstance(d, int) else 1 for d in shape)
    return _PackParams(tuple(int(p) for p in pads[:spatial]), strides, dilations, groups,
                       input_size)
