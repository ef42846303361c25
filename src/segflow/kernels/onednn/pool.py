"""``DirectPool``: max and global poolings called straight into libdnnl."""

from __future__ import annotations

from collections.abc import Callable

import torch

from segflow.kernels.onednn.geometry import channels_last_format
from segflow.kernels.onednn.library import POOL_MAX, Destination, Library, PoolWindow, Tensor
from segflow.kernels.onednn.op import Call, DirectOp


class DirectPool(DirectOp):
    """``fn(x) -> y``: a pooling over libdnnl for a channels-last float32 input, one
    primitive per input layout, writing into the run's planned storage.

    ``window(x)`` gives (kernel, strides, dilations, begin pads, end pads) for
    ``x``'s size (``auto_pad`` and global pooling depend on it); ``algorithm``
    is one of ``POOL_*``. ``fallback`` (torch's pooling, same signature) serves
    a plain-layout or non-float32 input, ``ceil_mode``, what has only a
    reference kernel (dilated windows), and with ``keeps_nan`` every max pooling.
    Why bother: torch's CPU max pool also allocates the int64 argmax it then drops
    (8 bytes per output element) and is several times slower at batch 1, and the
    first call of torch's mean faults in its reduction code.
    """

    kind = "pooling"

    def __init__(self, lib: Library, algorithm: int, window: Callable[[Tensor], PoolWindow],
                 ceil_mode: bool, fallback: Callable[[Tensor], Tensor], max_shapes: int,
                 destination: Destination | None = None, blocked_input: bool = False,
                 keeps_nan: bool = False) -> None:
        super().__init__(lib, fallback, max_shapes, destination)
        self.algorithm = algorithm
        # A max pooling that must return NaN for a window holding one runs the fallback.
        self.keeps_nan = keeps_nan and algorithm == POOL_MAX
        self.window = window
        self.ceil_mode = ceil_mode
        # The input is nChw8c (the end of the layout pass's blocked region); the output
        # of a global pooling, [N, C, 1, 1], is then the same bytes in any layout.
        self.blocked_input = blocked_input

    def call_for(self, x: Tensor) -> Call | None:
        """The primitive built for this input layout (None: none, or it falls back)."""
        return self.calls.get(self._key(x))

    def prebuild(self, x: Tensor) -> tuple[int, ...] | None:
        """Like :meth:`DirectConv.prebuild`: the primitive for ``x``'s layout, built now."""
        call = self._prebuilt(self._key(x), lambda: self._make_call(x))
        return None if call is None else call.out_shape

    @staticmethod
    def _key(x: Tensor) -> tuple[object, ...]:
        return (x.shape, x.stride(), x.dtype)

    def __call__(self, x: Tensor) -> Tensor:
        key = self._key(x)
        try:
            call = self.calls[key]
        except KeyError:
            call = self._build(key, lambda: self._make_call(x))
        if call is None:
            if self.blocked_input:
                return self.fallback(self.lib.to_layout(x, blocked=False))
            return self.fallback(x)
        y = self._output(call)
        self._run(call, x, y)
        return y

    def _make_call(self, x: Tensor) -> tuple[Call | None, str]:
        if self.keeps_nan:
            return None, "a NaN can reach it (libdnnl's max pooling skips NaN)"
        if self.ceil_mode:
            return None, "ceil_mode"
        if x.dtype != torch.float32 or x.dim() not in (4, 5) or not (
                self.blocked_input or x.is_contiguous(memory_format=channels_last_format(x.dim()))):
            return None, "not a channels-last float32 input"
        window = self.window(x)
        kernel, strides, dilations, begin, end = window
        out_shape = (int(x.shape[0]), int(x.shape[1]), *(
            (size + b + e - d * (k - 1) - 1) // s + 1 for size, b, e, d, k, s in
            zip(x.shape[2:], begin, end, dilations, kernel, strides, strict=True)))
        if min(out_shape) < 1:
            return None, "an empty output"
        lib = self.lib
        layout = channels_last_format(x.dim())
        if self.blocked_input:
            if x.dim() != 4 or out_shape[2:] != (1, 1):
                return None, "an nChw8c input to a pooling that is not global"
            src_md, dst_md = lib.blocked_desc(x.shape), lib.blocked_desc(out_shape)
        else:
            src_md = lib.memory_desc(x)
            dst_md = lib.memory_desc(torch.empty(out_shape, memory_format=layout))
        self._owned.extend(("memory_desc", md) for md in (src_md, dst_md))
        prim, impl = lib.pooling(src_md, dst_md, self.algorithm, window)
        if impl.startswith("ref"):
            lib.destroy([("primitive", prim)])
            return None, f"only a reference implementation ({impl})"
        return self._finish(prim, src_md, dst_md, (), residual=None, in_format=None,
                            out_shape=out_shape, out_format=layout, source=None, bias=None,
                            impl=impl), ""
