"""``DirectConv``: a convolution called straight into libdnnl, a primitive per input layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from segflow.kernels.onednn.geometry import ConvGeometry, channels_last_format, same_bytes
from segflow.kernels.onednn.library import (
    ARG_SRC_1,
    BLOCK,
    POST_OP_ARG_BASE,
    Destination,
    Library,
    Pointer,
    Tensor,
    reorder_weight,
)
from segflow.kernels.onednn.op import Call, DirectOp
from segflow.kernels.report import KernelReport

if TYPE_CHECKING:
    from segflow.kernels.stem import NativeStem
    from segflow.kernels.winograd import Winograd


class DirectConv(DirectOp):
    """``fn(x, w, b, z?) -> y``: a FusedConv over libdnnl, one primitive per input layout.

    ``w`` is the layout pass's packed weight. The primitive reads it in place
    when its bytes are the format this library wants for the shape; otherwise
    the convolution keeps its own packed copy, for at most ``max_copies``
    formats. ``fallback`` (torch's oneDNN op, same signature) serves what this
    path cannot take: a residual that broadcasts, a primitive the library
    cannot build or only has a reference implementation for, more formats than
    ``max_copies`` or more layouts than ``max_shapes``. ``why_not`` records why.
    ``destination()`` returns the storage the run planned for the output, if any
    (a channels-last tensor of the output's size), and ``staging()`` the storage
    for a plain (NCHW) input's channels-last copy (``runtime/arena.py``).

    With ``libdnnl_packed``, ``w`` is instead this library's own packing for a
    channels-last input of size ``verified_for`` (bytes; the layout pass keeps
    that where torch's packing is not this library's format), and ``fallback``
    must take it as it is. With ``blocked``, the output (and a residual) is
    ``nChw8c`` bytes under its logical shape, and so is the input with
    ``blocked_input`` (else it is plain NCHW, the blocked region's entry); the
    weight is then packed for that layout, and the fallback runs between
    reorders (``passes/select_kernels.py``, ``blocked_region``). With ``winograd``, ``w`` is
    the Winograd transform of the weight, and each layout is built as Winograd F(4x4,
    3x3) (``kernels/winograd.py``: a call whose ``run`` is the native kernel); one it
    declines (``winograd_not``) runs the fallback, over the plain weight recovered from
    ``w``. With ``stem``, a plain NCHW input is read in place by segflow's stem kernel
    (``kernels/stem.py``: a call whose ``run`` is the kernel); an input it declines
    (``stem_not``) is staged for libdnnl.
    """

    kind = "convolution"

    def __init__(self, lib: Library, spec: ConvGeometry, eltwise: tuple[int, float, float] | None,
                 after: Callable[[Tensor], Tensor] | None,
                 fallback: Callable[..., Tensor], max_shapes: int, max_copies: int,
                 verified_for: Sequence[int] | None = None,
                 destination: Destination | None = None,
                 staging: Destination | None = None,
                 fallback_inplace: Callable[..., Tensor] | None = None,
                 libdnnl_packed: bool = False, blocked: bool = False,
                 blocked_input: bool = False, winograd: Winograd | None = None,
                 stage: Callable[[Tensor, Tensor], Tensor] | None = None,
                 stem: NativeStem | None = None) -> None:
        super().__init__(lib, fallback, max_shapes, destination)
        if libdnnl_packed and not verified_for:
            raise ValueError("a weight in libdnnl's packing needs the input size it is for")
        if blocked_input and not blocked:
            raise ValueError("a convolution reading nChw8c must write nChw8c")
        self.libdnnl_packed = libdnnl_packed
        # nChw8c activations (the layout pass's blocked region): the output, and the
        # input unless it is the region's plain NCHW entry; a residual is blocked too.
        self.blocked = blocked
        self.blocked_input = blocked_input
        self.staging = staging
        # What copies an input into the staging storage (``stage(x, out) -> out``; None:
        # ``out.copy_(x)``): kernels/staging.py's native copy where the library loads.
        self.stage = stage
        self.fallback_inplace = fallback_inplace or fallback
        # The layout pass checked that ``w``'s bytes are this library's format for a
        # channels-last input of this size: a primitive whose weights descriptor equals
        # that one reads ``w`` without comparing bytes again (no dense temporaries).
        self.verified_for = tuple(verified_for) if verified_for else None
        self._verified_md: Pointer | None = None
        self.spec = spec
        self.eltwise = eltwise
        self.after = after
        self.max_copies = max_copies
        self.copies: list[tuple[Pointer, Tensor]] = []    # (weights descriptor, own packed copy)
        # Builds this convolution's calls as Winograd where they qualify (kernels/winograd.py).
        self.winograd = winograd
        self.winograd_not: dict[tuple[object, ...], str] = {}   # layouts it declined, why
        # Builds a plain NCHW input's call as segflow's stem kernel, the input read in
        # place (kernels/stem.py); None: such an input is staged for libdnnl.
        self.stem = stem
        self.stem_not: dict[tuple[object, ...], str] = {}       # inputs it declined, why

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None,
                 z: Tensor | None = None) -> Tensor:
        return self._conv(x, w, b, z, False)

    def inplace_call(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor) -> Tensor:
        """Like calling it, but the output overwrites the residual ``z`` (where the
        memory plan allows: ``z`` dies here)."""
        return self._conv(x, w, b, z, True)

    def call_for(self, x: Tensor, z: Tensor | None, inplace: bool) -> Call | None:
        """The primitive built for this input layout (None: none, or it falls back)."""
        return self.calls.get(self._key(x, z, inplace))

    def prebuild(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor | None,
                 inplace: bool) -> tuple[int, ...] | None:
        """Build the primitive a run calling with these tensors would build, without
        running it: ``x`` and ``z`` need only the run's sizes, strides and dtype (their
        values are not read), ``w`` and ``b`` must be the tensors runs pass. The output's
        sizes, or None where that call would fall back (runtime/prebuild.py)."""
        call = self._prebuilt(self._key(x, z, inplace),
                              lambda: self._make_call(x, w, b, z, inplace))
        if call is None or w is not call.source or b is not call.bias:
            return None
        return call.out_shape

    def counters(self) -> Mapping[str, int]:
        """The direct op's counters, and the input layouts its Winograd or stem strategy
        built and declined (where it has one)."""
        counts = dict(super().counters())
        for name in self._STRATEGIES:
            strategy = getattr(self, name)
            if strategy is not None:
                counts[f"{name}_layouts"] = strategy.layouts_built(self)
                counts[f"{name}_declined"] = len(getattr(self, f"{name}_not"))
        return counts

    def parts(self) -> Sequence[KernelReport]:
        """The native copy that stages an NCHW input (kernels/staging.py), if it has one."""
        return (self.stage,) if isinstance(self.stage, KernelReport) else ()

    # The strategies a convolution may build its calls with, by attribute, in the order
    # explain() describes them (each with ``describe_convs`` and ``layouts_built``).
    _STRATEGIES = ("winograd", "stem")

    @classmethod
    def describe_strategies(cls, ops: Sequence[tuple[str, Any]], limit: int) -> list[str]:
        """The Winograd and native stem lines (``describe_convs`` of ``kernels/winograd.py``
        and ``kernels/stem.py``), over the convolutions marked for each."""
        lines: list[str] = []
        for name in cls._STRATEGIES:
            marked = [(label, op) for label, op in ops
                      if isinstance(op, DirectConv) and getattr(op, name) is not None]
            if marked:
                lines += type(getattr(marked[0][1], name)).describe_convs(marked, limit)
        return lines

    @staticmethod
    def _key(x: Tensor, z: Tensor | None, inplace: bool) -> tuple[object, ...]:
        return (x.shape, x.stride(), x.dtype) if z is None else (x.shape, x.stride(), x.dtype,
                                                                    z.stride(), z.shape, inplace)

    def _conv(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor | None,
              inplace: bool) -> Tensor:
        key = self._key(x, z, inplace)
        try:
            call = self.calls[key]
        except KeyError:
            call = self._build(key, lambda: self._make_call(x, w, b, z, inplace))
        if call is None or w is not call.source or b is not call.bias:
            if self.blocked:
                return self._fallback_blocked(x, w, b, z, inplace)
            if z is None:
                return self.fallback(x, w, b)
            return (self.fallback_inplace if inplace else self.fallback)(x, w, b, z)
        if call.in_format is not None:
            x = self._staged(x, call.in_format)
        y = z if z is not None and inplace else self._output(call)
        self._run(call, x, y, z)
        return y if self.after is None else self.after(y)

    def _fallback_blocked(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor | None,
                          inplace: bool) -> Tensor:
        """The fallback between nChw8c tensors: reorder in, run it, reorder back."""
        lib = self.lib
        if self.blocked_input:
            x = lib.to_layout(x, blocked=False)
        if z is None:
            y = self.fallback(x, w, b)
        else:
            y = self.fallback(x, w, b, lib.to_layout(z, blocked=False))
        y = lib.to_layout(y.contiguous(memory_format=torch.channels_last), blocked=True)
        if z is not None and inplace:
            return z.copy_(y)
        return y

    def _staged(self, x: Tensor, layout: torch.memory_format) -> Tensor:
        """``x`` in channels-last: into the run's staging storage when it has some."""
        staged = self.staging() if self.staging is not None else None
        if staged is not None and staged.shape == x.shape:
            return self.stage(x, staged) if self.stage is not None else staged.copy_(x)
        return x.contiguous(memory_format=layout)

    def _make_call(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor | None,
                   inplace: bool) -> tuple[Call | None, str]:
        lib, spec = self.lib, self.spec
        if self.winograd is not None:
            # Its weight is the Winograd transform: a layout it declines is the fallback's.
            call, why = self.winograd.make_call(self, x, w, b, z, inplace)
            if call is None:
                self.winograd_not[self._key(x, z, inplace)] = why
            return call, why
        if self.stem is not None and not self.blocked and self.stem.takes(x, z):
            call, why = self.stem.make_call(self, x, w, b)
            if call is not None:
                return call, ""
            self.stem_not[self._key(x, z, inplace)] = why   # staged for libdnnl, as before
        packed = w.dtype == torch.uint8 if self.libdnnl_packed else w.is_mkldnn
        if x.dtype != torch.float32 or not packed or x.dim() not in (4, 5):
            return None, "not a packed float32 2-D/3-D convolution"
        # oneDNN has only reference kernels for plain NCHW input with channels-last output.
        want = channels_last_format(x.dim())
        in_format = None
        if not self.blocked and not x.is_contiguous(memory_format=want):
            in_format = want
            x = x.contiguous(memory_format=want)
        if self.blocked and (x.dim() != 4 or (not self.blocked_input and not x.is_contiguous())):
            return None, "not a 2-D convolution over a plain or nChw8c input"
        out_shape = spec.output_size(x.shape)
        if z is not None and (tuple(z.shape) != out_shape or z.dtype != torch.float32):
            return None, "residual shape differs from the output's"
        example = z if z is not None and inplace else torch.empty(out_shape, memory_format=want)
        attr, src1 = lib.post_ops(z, inplace, self.eltwise, self.blocked)
        if self.blocked:
            src_md = lib.blocked_desc(x.shape) if self.blocked_input else lib.memory_desc(x)
            dst_md = lib.blocked_desc(out_shape)
            if lib.size(dst_md) != example.numel() * 4:
                lib.destroy([("memory_desc", md) for md in (src_md, dst_md, src1)
                             if md is not None] + [("primitive_attr", attr)])
                return None, f"channels not a multiple of {BLOCK}"
        else:
            src_md = lib.memory_desc(x)
            dst_md = lib.memory_desc(example)
        bias_md = lib.vector_desc(spec.out_channels) if b is not None else None
        any_weights = lib.any_desc(spec.weight_dims)
        try:
            made, weights_md, impl = lib.convolution(
                src_md, any_weights, bias_md, dst_md, spec, attr)
        finally:
            lib.destroy([("memory_desc", any_weights), ("primitive_attr", attr)])
        assert made is not None
        prim = made
        owned = self._owned
        owned.extend(("memory_desc", md) for md in (src_md, dst_md, bias_md, src1, weights_md)
                     if md is not None)
        extra, why = self._weight_args(prim, impl, w, weights_md, b, bias_md)
        if extra is None:
            return None, why
        residual = None
        if src1 is not None:
            residual = lib.memory(src1)
            owned.append(("memory", residual))
            extra.append((POST_OP_ARG_BASE | ARG_SRC_1, residual))
        return self._finish(prim, src_md, dst_md, extra, residual=residual, in_format=in_format,
                            out_shape=out_shape, out_format=want, source=w, bias=b,
                            impl=impl), ""

    def dense_weight(self, w: Tensor) -> Tensor:
        """The float32 ``[K, C, *kernel]`` weight whose packing ``w`` is (a copy)."""
        spec = self.spec
        if self.libdnnl_packed:
            assert self.verified_for is not None
            dense = self.lib.unpack_weight(w, spec, self.verified_for, self.blocked,
                                           self.blocked and not self.blocked_input)
        else:
            dense = w.to_dense() if w.is_mkldnn else w.clone()
        return dense.reshape(spec.out_channels, -1, *spec.kernel)

    def _weight(self, w: Tensor, weights_md: Pointer) -> int | None:
        """The address of ``w``'s values in the format ``weights_md`` (None: over the cap)."""
        lib = self.lib
        for desc, copy in self.copies:
            if lib.equal(desc, weights_md):
                return int(copy.data_ptr())
        if self.verified_for is not None:
            if self._verified_md is None:
                self._verified_md = lib.preferred_desc(
                    self.spec, self.verified_for, self.blocked,
                    self.blocked and not self.blocked_input)
                self._owned.append(("memory_desc", self._verified_md))
            if lib.equal(self._verified_md, weights_md):
                return int(w.data_ptr() if self.libdnnl_packed else torch.ops.mkldnn.data_ptr(w))
        if self.libdnnl_packed:
            mine = reorder_weight(lib, self.dense_weight(w), weights_md, self.spec.weight_dims)
        else:
            mine = reorder_weight(lib, w, weights_md, self.spec.weight_dims)
            if same_bytes(w, mine):
                return int(torch.ops.mkldnn.data_ptr(w))
        if len(self.copies) >= self.max_copies:
            return None
        self.copies.append((weights_md, mine))
        return int(mine.data_ptr())
