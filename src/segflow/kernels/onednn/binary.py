"""``DirectBinary``: a per-channel scale (``[N, C, H, W]`` times ``[N, C, 1, 1]``) called
straight into libdnnl's binary primitive, in the layout of the direct kernel before it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from segflow.kernels.onednn.geometry import channels_last_format
from segflow.kernels.onednn.library import ARG_SRC_1, BLOCK, Destination, Library, Tensor
from segflow.kernels.onednn.op import Call, DirectOp


def per_channel(x: torch.Size | tuple[int, ...], s: torch.Size | tuple[int, ...]) -> bool:
    """Whether ``s`` broadcasts over ``x`` per channel: ``[N or 1, C, 1, ...]`` against
    ``[N, C, ...]`` of rank 4 or 5."""
    return len(x) in (4, 5) and len(s) == len(x) and s[1] == x[1] \
        and s[0] in (1, x[0]) and all(d == 1 for d in s[2:])


class DirectBinary(DirectOp):
    """``fn(a, b) -> a * b`` over libdnnl where one operand (``broadcast_input``: 0 or 1)
    is a per-channel ``[N, C, 1, 1]`` (or ``[1, C, 1, 1]``) scale of the other, a
    channels-last float32 tensor (``blocked_input``: ``nChw8c`` bytes, the layout pass's
    blocked region); the output has the big operand's layout and is written into the
    run's planned storage.

    The scale is the same bytes in every layout (its spatial dims are 1), so it may come
    from a direct kernel or from torch. Why: a squeeze-excitation block's scale sits
    between direct convolutions, and a torch op there ends a replayed run of direct
    kernels (``kernels/onednn/replay.py``) and the chain of primitives built at load
    (``runtime/prebuild.py``). ``fallback`` (the op's reference, ``fallback(a, b)``)
    serves every other shape, layout or dtype, between reorders for a blocked input.
    The product is IEEE's, NaN and Inf included.
    """

    kind = "channel scale"

    def __init__(self, lib: Library, algorithm: int, broadcast_input: int,
                 fallback: Callable[[Tensor, Tensor], Tensor], max_shapes: int,
                 destination: Destination | None = None, blocked_input: bool = False) -> None:
        super().__init__(lib, fallback, max_shapes, destination)
        if broadcast_input not in (0, 1):
            raise ValueError(f"broadcast_input must be 0 or 1, not {broadcast_input}")
        self.algorithm = algorithm
        self.broadcast_input = broadcast_input
        self.blocked_input = blocked_input

    def operands(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """``(big, scale)`` of the node's inputs in their order."""
        return (a, b) if self.broadcast_input == 1 else (b, a)

    def call_for(self, x: Tensor, s: Tensor) -> Call | None:
        """The primitive built for these operands' layouts (None: none, or it falls back)."""
        return self.calls.get(self._key(x, s))

    def prebuild(self, x: Tensor, s: Tensor) -> tuple[int, ...] | None:
        """Like :meth:`DirectConv.prebuild`: the primitive for ``x`` and ``s``'s layouts
        (the big operand and the scale), built now."""
        call = self._prebuilt(self._key(x, s), lambda: self._make_call(x, s))
        return None if call is None else call.out_shape

    @staticmethod
    def _key(x: Tensor, s: Tensor) -> tuple[object, ...]:
        return (x.shape, x.stride(), x.dtype, s.shape, s.stride(), s.dtype)

    def _call_for(self, x: Tensor, s: Tensor) -> Call | None:
        """The built call for these operands (built now on first sight), or None where
        the primitive does not serve them."""
        key = self._key(x, s)
        try:
            return self.calls[key]
        except KeyError:
            return self._build(key, lambda: self._make_call(x, s))

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        x, s = self.operands(a, b)
        call = self._call_for(x, s)
        if call is None:
            return self._fallback(x, s)
        y = self._output(call)
        self._run(call, x, y, s)
        return y

    def inplace_call(self, a: Tensor, b: Tensor) -> Tensor:
        """The product written over the big operand, where the memory plan lets it
        overwrite that input (it dies here), as generated code calls it: libdnnl's binary
        runs with its destination at its source. A call the primitive does not serve
        returns a new tensor (the fallback's)."""
        x, s = self.operands(a, b)
        call = self._call_for(x, s)
        if call is None:
            return self._fallback(x, s)
        self._run(call, x, x, s)
        return x

    def _fallback(self, x: Tensor, s: Tensor) -> Tensor:
        if not self.blocked_input:
            return self.fallback(*self.operands(x, s))
        lib = self.lib
        y = self.fallback(*self.operands(lib.to_layout(x, blocked=False), s))
        return lib.to_layout(y.contiguous(memory_format=torch.channels_last), blocked=True)

    def _make_call(self, x: Tensor, s: Tensor) -> tuple[Call | None, str]:
        if x.dtype != torch.float32 or s.dtype != torch.float32:
            return None, "not float32 operands"
        if not per_channel(tuple(x.shape), tuple(s.shape)):
            return None, f"{list(s.shape)} is not a per-channel scale of {list(x.shape)}"
        if s.stride(1) != 1 or (s.shape[0] > 1 and s.stride(0) != s.shape[1]):
            return None, "a scale that is not dense"
        layout = channels_last_format(x.dim())
        if self.blocked_input:
            if x.dim() != 4:
                return None, "an nChw8c input that is not 4-D"
        elif not x.is_contiguous(memory_format=layout):
            return None, "not a channels-last input"
        lib = self.lib
        if self.blocked_input:
            src_md, dst_md = lib.blocked_desc(x.shape), lib.blocked_desc(x.shape)
        else:
            src_md = lib.memory_desc(x)
            dst_md = lib.memory_desc(torch.empty(x.shape, memory_format=layout))
        # libdnnl's jit kernels want the scale described in the big operand's layout:
        # for [N, C, 1, 1] the same bytes (C a multiple of the block, as in the region).
        blocked_scale = self.blocked_input and x.shape[1] % BLOCK == 0
        scale_md = lib.blocked_desc(s.shape) if blocked_scale else lib.plain_desc(tuple(s.shape))
        self._owned.extend(("memory_desc", md) for md in (src_md, dst_md, scale_md))
        prim, impl = lib.binary(src_md, scale_md, dst_md, self.algorithm)
        if impl.startswith("ref"):
            lib.destroy([("primitive", prim)])
            return None, f"only a reference implementation ({impl})"
        scale = lib.memory(scale_md)
        self._owned.append(("memory", scale))
        # The scale's memory is the call's third one (``residual``): replays point it
        # like a convolution's residual.
        return self._finish(prim, src_md, dst_md, [(ARG_SRC_1, scale)], residual=scale,
                            in_format=None, out_shape=tuple(x.shape), out_format=layout,
                            source=None, bias=None, impl=impl), ""
