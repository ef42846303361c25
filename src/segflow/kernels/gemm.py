"""The linear (``FusedGemm``) kernels a :class:`~segflow.kernels.choice.KernelChoice` names.

- ``NATIVE_LINEAR``: segflow's packed-panel kernel (:class:`~segflow.kernels.linear.
  NativeLinear`), possibly as Strassen where the weight check allows.
- ``DIRECT_LINEAR``: libdnnl's inner product over its own packing
  (:class:`~segflow.kernels.onednn.linear.DirectLinear`).
- ``ONEDNN_LINEAR``: torch's oneDNN matmul over torch's packing of the weight.

The reference kernel (MKL's addmm, or torch's oneDNN matmul by size, over the dense
weight) is the OpDef row's, in ``ops/fused.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from segflow.ir.graph import Node
from segflow.kernels.choice import KernelChoice, KernelKind
from segflow.kernels.conv import MAX_REPACKS, MAX_SHAPES, eltwise_of
from segflow.kernels.linear import NativeLinear, NativeLinearKernel, kernel_activation
from segflow.kernels.onednn.linear import DirectLinear
from segflow.kernels.onednn.op import DirectKernel
from segflow.ops.fused import (
    Activation,
    ExactKernel,
    Inline,
    activation_of,
    exact_post_op,
    linear_callable,
    linear_kernel,
    linear_parts,
    linear_post_op,
    static_macs,
)
from segflow.ops.registry import BindContext, Kernel

Tensor = torch.Tensor


def activation_after(act: Activation, params: list[float], fused: bool
                     ) -> tuple[Callable[[Tensor], Tensor] | None, Callable[[Tensor], Tensor]]:
    """``(after, apply)`` for a linear kernel: the activation run in place on its output
    (None: no activation, or ``fused`` into the kernel), and the activation itself (for
    its torch fallback)."""
    finish = act.inplace or act.apply
    after: Callable[[Tensor], Tensor] | None = None
    if act.name and not fused:
        def after(y: Tensor) -> Tensor:
            return finish(y, params)

    def apply(y: Tensor) -> Tensor:
        return act.apply(y, params)
    return after, apply


def _features(node: Node) -> tuple[int, int]:
    weight = node.inputs[1]
    assert weight is not None and weight.spec.shape is not None
    out_features, in_features = (int(d) for d in weight.spec.shape)  # type: ignore[arg-type]
    return in_features, out_features


def bind_native_linear(node: Node, ctx: BindContext) -> Kernel:
    """``NATIVE_LINEAR``: the packed panels through ``kernels/native/gemm.c``."""
    library = ctx.target.native
    if library is None:   # the panels were packed for this target, so it loaded then
        raise RuntimeError(f"{node.label}: its weight is packed for native kernels, which "
                           f"{ctx.target.native_why}")
    in_features, out_features = _features(node)
    act, params = activation_of(node)
    kernel_act = kernel_activation(act.name, params)
    after, apply = activation_after(act, params, kernel_act is not None)
    wmax = ctx.choice(node).strassen_wmax
    if wmax is not None and not ctx.allow_inexact(
            node, "Strassen's sums spread a NaN or an infinity into rows that do not read it"):
        wmax = None
    return NativeLinearKernel(NativeLinear(library, in_features, out_features, kernel_act,
                                           after, apply, wmax))


def bind_direct_linear(node: Node, ctx: BindContext) -> Kernel:
    """``DIRECT_LINEAR``: libdnnl's inner product over its packing for the choice's rows."""
    lib = ctx.target.dnnl
    rows = ctx.choice(node).direct_rows
    assert lib is not None and rows is not None
    in_features, out_features = _features(node)
    act, params = activation_of(node)
    post = linear_post_op(act, params, ctx.target.fuses_transcendental_post_ops())
    eltwise = eltwise_of(exact_post_op(node, act, post, ctx))
    after, apply = activation_after(act, params, eltwise is not None)
    return DirectKernel(DirectLinear(lib, in_features, out_features, rows, eltwise, after,
                                     apply, MAX_SHAPES, MAX_REPACKS))


def bind_onednn_linear(node: Node, ctx: BindContext) -> Kernel:
    """``ONEDNN_LINEAR``: torch's oneDNN matmul over torch's packing of the weight."""
    _, act, params = linear_parts(node)
    wanted = linear_post_op(act, params, ctx.target.fuses_transcendental_post_ops())
    fused = exact_post_op(node, act, wanted, ctx)
    fn = linear_callable(node, ctx.device, fused, onednn=True, packed=True)
    return linear_kernel(node, fn, exact=fused is not wanted)


def inline_linear(node: Node, choice: KernelChoice, kernel: Kernel | None,
                  fuses_transcendental: bool) -> Inline | None:
    """The expression codegen emits for a linear the choice packed (None: call the
    bound kernel)."""
    if isinstance(kernel, ExactKernel):
        return None
    n_in = len(node.inputs)
    args = ", ".join("None" if node.inputs[i] is None else f"{{in{i}}}" for i in range(n_in))
    if choice.kind in (KernelKind.DIRECT_LINEAR, KernelKind.NATIVE_LINEAR):
        if isinstance(kernel, DirectKernel | NativeLinearKernel):   # the kernel's own op
            return Inline(f"{{fn}}({args})", {"fn": kernel.op})
        return None
    has_bias, act, params = linear_parts(node)
    fused = linear_post_op(act, params, fuses_transcendental)
    if fused is not None and static_macs(node) is not None:
        attr, scalars, algorithm = fused
        bias = "{in2}" if has_bias else "None"
        return Inline(f"{{lin}}({{in0}}, {{in1}}, {bias}, {attr!r}, {{scalars}}, {algorithm!r})",
                      {"lin": torch.ops.mkldnn._linear_pointwise.default, "scalars": scalars})
    fn = linear_callable(node, torch.device("cpu"), fused, onednn=True, packed=True)
    return Inline("{fn}({in0}, {in1}, " + ("{in2})" if has_bias else "None)"), {"fn": fn})
