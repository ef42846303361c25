"""The kernel a ``DIRECT_BINARY`` choice names: libdnnl's binary primitive, called directly.

A Mul of a direct kernel's output by a per-channel ``[N, C, 1, 1]`` scale (a
squeeze-excitation block's, or any broadcasting channel scale between direct kernels)
runs :class:`~segflow.kernels.onednn.binary.DirectBinary` over it, with the OpDef row's
reference kernel (``ops/elementwise.py``) as its fallback.
"""

from __future__ import annotations

from segflow.ir.graph import Node
from segflow.kernels.onednn.binary import DirectBinary
from segflow.kernels.onednn.library import BINARY_MUL, MAX_LAYOUTS
from segflow.kernels.onednn.op import DirectKernel
from segflow.ops.registry import BindContext, Kernel


def bind_direct_binary(node: Node, ctx: BindContext) -> Kernel:
    """``DIRECT_BINARY``: the Mul straight into libdnnl, the reference kernel its fallback
    (and the kernel itself without libdnnl)."""
    kernel = ctx.reference(node)
    lib = ctx.target.dnnl
    choice = ctx.choice(node)
    if lib is None or choice.broadcast_input is None:
        return kernel
    return DirectKernel(DirectBinary(lib, BINARY_MUL, choice.broadcast_input,
                                     lambda a, b: kernel((a, b))[0], MAX_LAYOUTS,
                                     ctx.destination(node.outputs[0]), choice.blocked_input))
