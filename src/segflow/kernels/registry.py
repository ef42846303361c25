"""The kernel a :class:`~segflow.kernels.choice.KernelKind` binds: one row per kind.

The runtime binds a node through this table when its choice names a kernel, and
through its OpDef row (the reference kernel) when it does not. Adding a kernel is its
module, its tests, one :class:`KernelKind` and one row here.
"""

from __future__ import annotations

from collections.abc import Mapping

from segflow.ir.graph import Node
from segflow.kernels.attention import bind_attention
from segflow.kernels.binary import bind_direct_binary
from segflow.kernels.choice import KernelKind
from segflow.kernels.conv import bind_direct_conv, bind_onednn_conv
from segflow.kernels.dense_chain import bind_dense_chain, inline_chain
from segflow.kernels.dynamic_quantize import bind_dynamic_quantize
from segflow.kernels.gemm import bind_direct_linear, bind_native_linear, bind_onednn_linear
from segflow.kernels.layer_norm import bind_add_layer_norm
from segflow.kernels.onednn.qconv import bind_int8_conv
from segflow.kernels.pool import bind_direct_pool
from segflow.kernels.report import OpKernel
from segflow.ops.fused import Inline
from segflow.ops.registry import Bind

KERNELS: Mapping[KernelKind, Bind] = {
    KernelKind.ONEDNN_CONV: bind_onednn_conv,
    KernelKind.DIRECT_CONV: bind_direct_conv,
    KernelKind.WINOGRAD: bind_direct_conv,       # a strategy of the direct convolution
    KernelKind.NATIVE_STEM: bind_direct_conv,    # likewise
    KernelKind.DIRECT_POOL: bind_direct_pool,
    KernelKind.DIRECT_BINARY: bind_direct_binary,
    KernelKind.ONEDNN_LINEAR: bind_onednn_linear,
    KernelKind.DIRECT_LINEAR: bind_direct_linear,
    KernelKind.NATIVE_LINEAR: bind_native_linear,
    KernelKind.NATIVE_ATTENTION: bind_attention,
    KernelKind.NATIVE_ADD_LAYER_NORM: bind_add_layer_norm,
    KernelKind.NATIVE_DENSE_CHAIN: bind_dense_chain,
    KernelKind.INT8_CONV: bind_int8_conv,
    KernelKind.NATIVE_DYNAMIC_QUANTIZE: bind_dynamic_quantize,
}


def binder(kind: KernelKind) -> Bind | None:
    """The factory for ``kind`` (None: ``REFERENCE``, the OpDef row's own)."""
    return KERNELS.get(kind)


def inline_native_fused(node: Node, kernel: object) -> Inline | None:
    """Generated code's call of a fused op's native kernel: its op over the node's inputs
    (a dense chain's over its input only; the op holds the weights)."""
    if node.op_type == "DenseChain":
        return inline_chain(kernel)
    if not isinstance(kernel, OpKernel):
        return None
    args = ", ".join("None" if v is None else f"{{in{i}}}" for i, v in enumerate(node.inputs))
    return Inline(f"{{fn}}({args})", {"fn": kernel.op})
