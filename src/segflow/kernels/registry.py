"""The kernel a :class:`~segflow.kernels.choice.KernelKind` binds: one row per kind.

The runtime binds a node through this table when its choice names a kernel, and
through its OpDef row (the reference kernel) when it does not. Adding a kernel is its
module, its tests, one :class:`KernelKind` and one row here.
"""

from __future__ import annotations

from collections.abc import Mapping

from segflow.kernels.choice import KernelKind
from segflow.kernels.conv import bind_direct_conv, bind_onednn_conv
from segflow.kernels.gemm import bind_direct_linear, bind_native_linear, bind_onednn_linear
from segflow.kernels.pool import bind_direct_pool
from segflow.ops.registry import Bind

KERNELS: Mapping[KernelKind, Bind] = {
    KernelKind.ONEDNN_CONV: bind_onednn_conv,
    KernelKind.DIRECT_CONV: bind_direct_conv,
    KernelKind.WINOGRAD: bind_direct_conv,       # a strategy of the direct convolution
    KernelKind.NATIVE_STEM: bind_direct_conv,    # likewise
    KernelKind.DIRECT_POOL: bind_direct_pool,
    KernelKind.ONEDNN_LINEAR: bind_onednn_linear,
    KernelKind.DIRECT_LINEAR: bind_direct_linear,
    KernelKind.NATIVE_LINEAR: bind_native_linear,
}


def binder(kind: KernelKind) -> Bind | None:
    """The factory for ``kind`` (None: ``REFERENCE``, the OpDef row's own)."""
    return KERNELS.get(kind)
