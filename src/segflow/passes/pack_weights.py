"""Pack weights for the kernels ``passes/select_kernels.py`` chose.

A convolution's weight becomes libdnnl's own packing for its input size (or torch's
``mkldnn`` packing where libdnnl is not called or describes none), a Winograd
convolution's the transform ``U`` (``[36, C, K]``), a large linear's the native
kernel's panels, libdnnl's inner-product packing or torch's. The packed constant
replaces the dense one, so the model holds one copy; one dense weight read by several
nodes with the same packing parameters is packed once (:class:`WeightPacker`), and it
is freed as soon as its last reader has its packed copy. Sessions planned over the
same weights (a session and its plans per input shape, ``runtime/specialized.py``)
share what is packed from them through a :class:`PackStore`: each weight is packed
once for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.kernels.target import CpuTarget


@dataclass(frozen=True, slots=True)
class PackParams:
    """What oneDNN's weight format depends on (equal params share one packed weight)."""

    pads: tuple[int, ...]            # ONNX's [begin..., end...], symmetric or not
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    groups: int
    input_size: tuple[int, ...] | None

    def torch_form(self) -> tuple[list[int], list[int] | None]:
        """The pads (one per dim) and the input size torch's packing is made for: an
        asymmetric padding runs torch's op over an input padded beforehand, with no
        pads of its own (``kernels/conv.py``, ``onednn_conv_callable``)."""
        spatial = len(self.pads) // 2
        begin, end = list(self.pads[:spatial]), list(self.pads[spatial:])
        if begin == end:
            return begin, None if self.input_size is None else list(self.input_size)
        size = None if self.input_size is None else [
            *self.input_size[:2],
            *(d + b + e for d, b, e in zip(self.input_size[2:], begin, end, strict=True))]
        return [0] * spatial, size


_T = TypeVar("_T")


class PackStore:
    """What was packed from a set of shared weights, by the source's bytes and layout and
    how it was packed; only sources inside those weights' storages are kept (a weight
    the passes computed, a folded BatchNorm's, is one session's own and is not kept).

    Packed tensors are read, never written, by the kernels, so sessions may share them.

    >>> store = PackStore(read.values())                      # doctest: +SKIP
    >>> panels = store.packed(w, ("panels",), lambda: pack(w))   # doctest: +SKIP
    """

    __slots__ = ("_weights", "_storages", "_packed", "hits")

    def __init__(self, weights: Iterable[torch.Tensor]) -> None:
        self._weights = tuple(weights)   # keeps the storages the keys point into alive
        self._storages = {w.untyped_storage().data_ptr() for w in self._weights
                          if not w.is_mkldnn}
        self._packed: dict[tuple[Any, ...], Any] = {}
        self.hits = 0

    def packed(self, source: torch.Tensor, how: tuple[Any, ...], make: Callable[[], _T]) -> _T:
        """``make()``'s result for ``source`` packed ``how``, made once across sessions."""
        if source.is_mkldnn or source.untyped_storage().data_ptr() not in self._storages:
            return make()
        key = (source.untyped_storage().data_ptr(), source.storage_offset(),
               tuple(source.shape), source.stride(), source.dtype, how)
        if key in self._packed:
            self.hits += 1
            return self._packed[key]    # type: ignore[no-any-return]
        result = self._packed[key] = make()
        return result


def _made(store: PackStore | None, source: torch.Tensor, how: tuple[Any, ...],
          make: Callable[[], _T]) -> _T:
    return store.packed(source, how, make) if store is not None else make()


@dataclass(frozen=True, slots=True)
class PackedConv:
    """A convolution weight as packed: the constant and what it was packed for."""

    value: Value                          # the packed initializer
    packed_for: tuple[int, ...] | None    # the input size it was packed for
    verified_for: tuple[int, ...] | None  # input size whose libdnnl format it is, checked
    libdnnl_bytes: bool                   # the constant is libdnnl's packing, not torch's


@dataclass(slots=True)
class WeightPacker:
    """Packs the weights of one graph, each dense weight once per packing."""

    graph: Graph
    target: CpuTarget
    store: PackStore | None = None      # packings shared with other sessions' packers
    convs: dict[tuple[int, PackParams, int], PackedConv] = field(default_factory=dict)
    linears: dict[tuple[int, str, int | None], Value] = field(default_factory=dict)
    strassen_wmax: dict[int, float | None] = field(default_factory=dict)  # id(panels) -> check
    winograd: dict[int, Value] = field(default_factory=dict)     # id(dense) -> transformed
    # Dense weights freed, kept (without their tensors) so that no new Value reuses the
    # id() the dicts above key on.
    released: list[Value] = field(default_factory=list)

    def conv(self, node: Node, params: PackParams, direct: bool, blocked: bool,
             plain_input: bool) -> PackedConv:
        """Give ``node`` its packed weight (libdnnl's where it will be ``direct`` and
        libdnnl describes one, for the nChw8c layout with ``blocked``, for its NCHW
        entry with ``plain_input``)."""
        weight = node.inputs[1]
        assert weight is not None and weight.const is not None
        key = (id(weight), params, blocked + plain_input)
        done = self.convs.get(key)
        if done is None:
            const = weight.const
            tensor, packed_for, verified, libdnnl_bytes = _made(
                self.store, const, ("conv", params, direct, blocked, plain_input),
                lambda: pack_conv(const, params, self.target if direct else None, blocked,
                                  plain_input))
            value = Value(fresh_name(self.graph, f"{weight.name}.onednn"), weight.spec,
                          const=tensor)
            self.graph.add_initializer(value)
            done = self.convs[key] = PackedConv(value, packed_for, verified, libdnnl_bytes)
        self.graph.set_input(node, 1, done.value)
        self.release(weight)
        return done

    def winograd_weight(self, node: Node) -> None:
        """Give ``node`` the Winograd transform of its weight (``U``, ``[36, C, K]``:
        kernels/winograd.py), made once per dense weight. Nothing packs the dense one
        for it: its kernel reads ``U`` in place, and a fallback recovers the plain
        weight from ``U`` if it ever needs it."""
        weight = node.inputs[1]
        assert weight is not None and weight.const is not None
        value = self.winograd.get(id(weight))
        if value is None:
            const = weight.const
            value = Value(fresh_name(self.graph, f"{weight.name}.winograd"), weight.spec,
                          const=_made(self.store, const, ("winograd",),
                                      lambda: self.target.winograd_weight(const)))
            self.graph.add_initializer(value)
            self.winograd[id(weight)] = value
        self.graph.set_input(node, 1, value)
        self.release(weight)

    def native_linear(self, node: Node, strassen: bool) -> float | None:
        """Give ``node`` its weight packed into ``kernels/native/gemm.c``'s panels; with
        ``strassen``, return Strassen's weight check where the weight allows it
        (:func:`~segflow.kernels.linear.strassen_spread`, from each output's largest
        ``|W|``, taken while packing; None: classic calls only)."""
        weight = node.inputs[1]
        assert weight is not None and weight.const is not None
        w = weight.const
        n, k = (int(d) for d in w.shape)
        key = (id(weight), "panels", None)
        value = self.linears.get(key)
        if value is None:
            def make() -> tuple[torch.Tensor, float | None]:
                top = torch.empty(n) if strassen else None
                panels = self.target.native_linear_weight(w, top)
                return panels, (self.target.strassen_spread(top, n, k)
                                if top is not None else None)
            panels, spread = _made(self.store, w, ("panels", strassen), make)
            value = Value(fresh_name(self.graph, f"{weight.name}.panels"), weight.spec,
                          const=panels)
            self.graph.add_initializer(value)
            self.linears[key] = value
            if strassen:
                self.strassen_wmax[id(value)] = spread
        self.graph.set_input(node, 1, value)
        self.release(weight)
        return self.strassen_wmax.get(id(value)) if strassen else None

    def direct_linear(self, node: Node, rows: int) -> bool:
        """Give ``node`` libdnnl's inner-product packing of its weight for ``rows`` rows;
        False (nothing changed) where libdnnl describes none."""
        weight = node.inputs[1]
        assert weight is not None and weight.const is not None
        const = weight.const
        return self._packed_linear(node, weight, "dnnl", rows,
                                   lambda: self.target.libdnnl_linear_weight(const, rows))

    def onednn_linear(self, node: Node, rows: int | None) -> None:
        """Give ``node`` torch's oneDNN packing of its weight (for ``mkldnn._linear_pointwise``)."""
        weight = node.inputs[1]
        assert weight is not None and weight.const is not None
        const = weight.const
        self._packed_linear(node, weight, "onednn", rows,
                            lambda: torch.ops.mkldnn._reorder_linear_weight(const.contiguous(),
                                                                            rows))

    def _packed_linear(self, node: Node, weight: Value, packing: str, rows: int | None,
                       pack: Callable[[], torch.Tensor | None]) -> bool:
        """Point ``node`` at ``weight``'s ``packing`` for ``rows`` rows, made by ``pack``
        once and shared by every linear reading that weight; False (nothing changed)
        where ``pack`` makes none."""
        key = (id(weight), packing, rows)
        value = self.linears.get(key)
        if value is None:
            assert weight.const is not None
            tensor = _made(self.store, weight.const, (packing, rows), pack)
            if tensor is None:
                return False
            value = Value(fresh_name(self.graph, f"{weight.name}.{packing}"), weight.spec,
                          const=tensor)
            self.graph.add_initializer(value)
            self.linears[key] = value
        self.graph.set_input(node, 1, value)
        self.release(weight)
        return True

    def release(self, dense: Value | None) -> None:
        """Free a dense weight as soon as its last reader has its packed (or transformed)
        one, not when the pass ends: the dense and packed copies of every weight then
        never coexist, and loading peaks that much lower."""
        graph = self.graph
        if dense is None or dense.uses or dense in graph.outputs \
                or graph.initializers.get(dense.name) is not dense:
            return
        del graph.initializers[dense.name]
        dense.const = None
        self.released.append(dense)

    def drop_unused(self) -> None:
        """Remove the initializers nothing reads any more."""
        graph = self.graph
        for name, value in list(graph.initializers.items()):
            if not value.uses and value not in graph.outputs:
                del graph.initializers[name]


def pack_conv(dense: torch.Tensor, params: PackParams, target: CpuTarget | None,
              blocked: bool = False, plain_input: bool = False
              ) -> tuple[torch.Tensor, tuple[int, ...] | None, tuple[int, ...] | None, bool]:
    """The packed weight, the input size it was packed for, the input size for which
    its bytes are libdnnl's format (None: not libdnnl's) and whether they are.

    A convolution that will call libdnnl (``target`` given) gets libdnnl's own packing for its input
    size (for the nChw8c layout with ``blocked``, for its NCHW entry with
    ``plain_input``): the kernel reads it in place, and torch's packing is made from it
    only if a fallback ever needs it (``kernels/conv.py`` ``TorchPacking``), so loading
    packs each weight once. Without libdnnl, or where it describes no packing, the
    weight is torch's, for torch's oneDNN op.
    """
    def pack() -> torch.Tensor:
        pads, torch_size = params.torch_form()
        return torch.ops.mkldnn._reorder_convolution_weight(
            dense, pads, list(params.strides), list(params.dilations), params.groups,
            torch_size)

    size = params.input_size
    if target is None or target.dnnl is None or size is None:
        return pack(), size, None, False
    geo = target.conv_geometry(list(dense.shape), params.strides, params.pads,
                               params.dilations, params.groups)
    packed = target.libdnnl_conv_weight(dense, geo, size, blocked, plain_input)
    if packed is None:
        return pack(), size, None, False
    return packed, size, size, True


def fresh_name(graph: Graph, name: str) -> str:
    """``name``, or ``name.1``, ``name.2``, ... where the graph has an initializer so
    called already: one weight packed twice (two convolutions of different strides
    share it) gives two packed initializers, and the second must not displace the
    first."""
    fresh, n = name, 0
    while fresh in graph.initializers:
        n += 1
        fresh = f"{name}.{n}"
    return fresh
