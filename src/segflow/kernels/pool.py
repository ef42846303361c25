"""The pooling kernel a ``DIRECT_POOL`` choice names: libdnnl's pooling, called directly.

A max or global pooling that reads a direct convolution's channels-last output runs
:class:`~segflow.kernels.onednn.pool.DirectPool` over it, with the OpDef row's
reference kernel (``ops/nn.py``) as its fallback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from segflow.ir.graph import Node
from segflow.kernels.onednn.library import (
    MAX_LAYOUTS,
    POOL_AVG_EXCLUDE_PADDING,
    POOL_MAX,
    PoolWindow,
)
from segflow.kernels.onednn.op import DirectKernel
from segflow.kernels.onednn.pool import DirectPool
from segflow.ops.nn import Window, pool_out_pad
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor


def _global_window(x: Tensor) -> PoolWindow:
    spatial = x.dim() - 2
    return list(x.shape[2:]), [1] * spatial, [1] * spatial, [0] * spatial, [0] * spatial


def bind_direct_pool(node: Node, ctx: BindContext) -> Kernel:
    """``DIRECT_POOL``: a pooling straight into libdnnl, the reference kernel its fallback
    (and the kernel itself where libdnnl takes no such pooling: indices, 1-D)."""
    kernel = ctx.reference(node)
    lib = ctx.target.dnnl
    if lib is None:
        return kernel
    window: Callable[[Tensor], PoolWindow]
    if node.op_type == "MaxPool":
        kshape = list(node.attrs["kernel_shape"])
        n = len(kshape)
        if len(node.outputs) > 1 or n not in (2, 3):
            return kernel
        win = Window(node, n, kshape)
        ceil_mode = bool(node.attrs.get("ceil_mode", 0))
        algorithm = POOL_MAX

        def window(x: Tensor) -> PoolWindow:
            begin, end = pool_out_pad(x, win)
            return list(kshape), list(win.strides), list(win.dilations), begin, end
    else:
        window, ceil_mode = _global_window, False
        algorithm = POOL_AVG_EXCLUDE_PADDING if node.op_type == "GlobalAveragePool" \
            else POOL_MAX
    # torch's max pooling returns NaN for a window holding one; libdnnl's skips it.
    keeps_nan = algorithm == POOL_MAX and not ctx.allow_inexact(
        node, "libdnnl's max pooling skips NaN")
    return DirectKernel(DirectPool(lib, algorithm, window, ceil_mode,
                                   lambda x: kernel((x,))[0], MAX_LAYOUTS,
                                   ctx.destination(node.outputs[0]),
                                   ctx.choice(node).blocked_input, keeps_nan))
