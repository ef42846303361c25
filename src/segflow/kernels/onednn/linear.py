"""``DirectLinear``: a large linear as libdnnl's inner product over its own packed weight."""

from __future__ import annotations

from collections.abc import Callable

import torch

from segflow.kernels.onednn.library import Library, Pointer, Tensor, reorder_weight
from segflow.kernels.onednn.op import Call, DirectOp


class DirectLinear(DirectOp):
    """``fn(x, w, b) -> act(x @ W^T + b)``: a FusedGemm over libdnnl's inner product,
    one primitive per input layout (the row count ``x.numel() / K`` varies with batch
    and sequence length).

    ``w`` is the layout pass's packing of ``W`` ([N, K]) in this library's format for
    ``packed_rows`` rows (:meth:`Library.pack_linear`): bytes, the model's only copy
    of the weight. A primitive reads it in place when its weights format is that one,
    which is what the library picks for any row count so far; otherwise the op keeps
    its own repacked copy, for at most ``max_copies`` formats. ``eltwise`` is the
    post-op fused into the primitive and ``after`` an activation run after it.

    Nothing falls back to torch's packed op (there is no torch packing to read):
    input that is not float32, more layouts than ``max_shapes``, or a primitive with
    only a reference kernel run ``F.linear`` over a dense copy of the weight, which
    is unpacked at the first such call and kept. Why bother: on AVX2 CPUs this
    library's inner product (brgemm:avx2) ran large linears of 128 rows faster than
    torch's oneDNN matmul (brg_matmul:avx2); the figures are in docs/performance.md.
    """

    kind = "linear"

    def __init__(self, lib: Library, in_features: int, out_features: int, packed_rows: int,
                 eltwise: tuple[int, float, float] | None,
                 after: Callable[[Tensor], Tensor] | None, act: Callable[[Tensor], Tensor],
                 max_shapes: int, max_copies: int) -> None:
        super().__init__(lib, self._fallback, max_shapes, None)
        self.in_features = in_features
        self.out_features = out_features
        self.eltwise = eltwise
        self.after = after
        self.act = act
        self.max_copies = max_copies
        self.copies: list[tuple[Pointer, Tensor]] = []
        self.packed_md, _ = lib.linear_desc(out_features, in_features, packed_rows)
        self._owned.append(("memory_desc", self.packed_md))
        self._dense: Tensor | None = None

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        key = (x.shape, x.stride(), x.dtype)
        try:
            call = self.calls[key]
        except KeyError:
            call = self._build(key, lambda: self._make_call(x, w, b))
        if call is None or w is not call.source or b is not call.bias:
            return self._fallback(x, w, b)
        y = torch.empty(call.out_shape)
        self._run(call, x, y)
        return y if self.after is None else self.after(y)

    def dense_weight(self, w: Tensor) -> Tensor:
        """``W`` ([N, K] float32) unpacked from ``w`` (kept for later fallbacks)."""
        if self._dense is None:
            dense = torch.empty(self.out_features, self.in_features)
            plain = self.lib.memory_desc(dense)
            try:
                self.lib.reorder(self.packed_md, w.data_ptr(), plain, dense.data_ptr())
            finally:
                self.lib.destroy([("memory_desc", plain)])
            self._dense = dense
        return self._dense

    def _fallback(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        dense = self.dense_weight(w)
        if x.dtype != dense.dtype:
            dense = dense.to(x.dtype)
            b = None if b is None else b.to(x.dtype)
        return self.act(torch.nn.functional.linear(x, dense, b))

    def _make_call(self, x: Tensor, w: Tensor, b: Tensor | None) -> tuple[Call | None, str]:
        lib = self.lib
        k, n = self.in_features, self.out_features
        if x.dtype != torch.float32 or w.dtype != torch.uint8 or x.dim() < 1 \
                or int(x.shape[-1]) != k or not x.is_contiguous():
            return None, "not a contiguous float32 input of the weight's width"
        rows = x.numel() // k
        if rows < 1:
            return None, "an empty input"
        attr, _ = lib.post_ops(None, False, self.eltwise)
        src_md = lib.memory_desc(torch.empty(rows, k))
        dst_md = lib.memory_desc(torch.empty(rows, n))
        bias_md = lib.vector_desc(n) if b is not None else None
        try:
            # The packed format first: read ``w`` in place when the library takes it.
            made, weights_md, impl = lib.inner_product(src_md, self.packed_md, bias_md, dst_md,
                                                       attr)
            if impl.startswith("ref"):
                lib.destroy([("primitive", made), ("memory_desc", weights_md)])  # type: ignore[list-item]
                any_weights = lib.any_desc((n, k))
                try:
                    made, weights_md, impl = lib.inner_product(src_md, any_weights, bias_md,
                                                               dst_md, attr)
                finally:
                    lib.destroy([("memory_desc", any_weights)])
        finally:
            lib.destroy([("primitive_attr", attr)])
        assert made is not None
        prim = made
        self._owned.extend(("memory_desc", md) for md in (src_md, dst_md, bias_md, weights_md)
                           if md is not None)
        extra, why = self._weight_args(prim, impl, w, weights_md, b, bias_md)
        if extra is None:
            return None, why
        return self._finish(prim, src_md, dst_md, extra, residual=None, in_format=None,
                            out_shape=(*x.shape[:-1], n), out_format=torch.contiguous_format,
                            source=w, bias=b, impl=impl), ""

    def _weight(self, w: Tensor, weights_md: Pointer) -> int | None:
        """The address of the weight in the format ``weights_md`` (None: over the cap)."""
        lib = self.lib
        if lib.equal(self.packed_md, weights_md):
            return int(w.data_ptr())
        for desc, copy in self.copies:
            if lib.equal(desc, weights_md):
                return int(copy.data_ptr())
        if len(self.copies) >= self.max_copies:
            return None
        mine = reorder_weight(lib, self.dense_weight(w), weights_md,
                               (self.out_features, self.in_features))
        self.copies.append((weights_md, mine))
        return int(mine.data_ptr())
