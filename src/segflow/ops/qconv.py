"""``segflow.QConv``: a quantized 2-D convolution whose activations stay integer.

What ``passes/quantize.py`` lowers a QDQ region to: ``DequantizeLinear(x_q)`` and
``DequantizeLinear(w_q)`` into a Conv (optionally a Relu after it, optionally a residual
Add of another dequantized tensor) and the ``QuantizeLinear`` after them. Inputs
``(x_q, w_q, bias, residual_q)``: ``x_q`` uint8 or int8, ``w_q`` int8 (or uint8) with
its output channels first, ``bias`` float32 (the dequantized bias) or absent,
``residual_q`` of the output's shape or absent. The quantization parameters are
attributes, fixed at load: ``x_scale``, ``x_zero_point``, ``w_scale`` and
``w_zero_point`` (one per output channel), ``y_scale``, ``y_zero_point``, ``y_dtype``,
and, with a residual, the convolution's own quantization before the Add
(``c_scale``, ``c_zero_point``, ``c_dtype``) and the residual's (``r_scale``,
``r_zero_point``); ``relu`` (0/1).

The reference kernel is the definition::

    acc[m] = sum over the window of (x_q - x_zero_point) * (w_q[m] - w_zero_point[m])
    y      = acc[m] * x_scale * w_scale[m] + bias[m]
    with a residual:
      c_q  = quantize(y, c_scale, c_zero_point, c_dtype)
      y    = (c_q - c_zero_point) * c_scale + r_scale * (residual_q - r_zero_point)
    y      = max(y, 0)                                     with relu
    y_q    = quantize(y, y_scale, y_zero_point, y_dtype)

    quantize(v, s, z, t) = saturate_t(round_half_even(v / s) + z)

integer accumulation (exact in float64 for these ranges), the rest in float64, then
rounding half to even and saturation, as QuantizeLinear does: the unfused graph's
values, the convolution's own rounding before the Add included. Without a residual
this is onnxruntime's QLinearConv over the same parameters.
The fast kernel (libdnnl's int8 convolution) is bound through the node's
``KernelChoice`` (``kernels/onednn/qconv.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from segflow.ir.graph import Node
from segflow.ops.fused import FUSED_DOMAIN
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor

QCONV = "QConv"
INT_RANGES = {torch.uint8: (0, 255), torch.int8: (-128, 127)}
DTYPES = {"uint8": torch.uint8, "int8": torch.int8}


class QuantParams:
    """A QConv node's quantization attributes, read once at bind."""

    __slots__ = ("x_scale", "x_zero_point", "w_scale", "w_zero_point", "y_scale",
                 "y_zero_point", "y_dtype", "c_scale", "c_zero_point", "c_dtype", "r_scale",
                 "r_zero_point", "relu", "pads",
                 "strides", "dilations", "group")

    def __init__(self, node: Node) -> None:
        attrs = node.attrs
        self.x_scale = float(attrs["x_scale"])
        self.x_zero_point = int(attrs["x_zero_point"])
        self.w_scale = tuple(float(s) for s in attrs["w_scale"])
        self.w_zero_point = tuple(int(z) for z in attrs["w_zero_point"])
        self.y_scale = float(attrs["y_scale"])
        self.y_zero_point = int(attrs["y_zero_point"])
        self.y_dtype = DTYPES[str(attrs["y_dtype"])]
        self.c_scale = float(attrs.get("c_scale", 1.0))
        self.c_zero_point = int(attrs.get("c_zero_point", 0))
        self.c_dtype = DTYPES[str(attrs.get("c_dtype", "uint8"))]
        self.r_scale = float(attrs.get("r_scale", 0.0))
        self.r_zero_point = int(attrs.get("r_zero_point", 0))
        self.relu = bool(attrs.get("relu", 0))
        self.pads = [int(p) for p in attrs["pads"]]
        self.strides = [int(s) for s in attrs.get("strides", [1, 1])]
        self.dilations = [int(d) for d in attrs.get("dilations", [1, 1])]
        self.group = int(attrs.get("group", 1))

    @property
    def per_channel(self) -> bool:
        return len(set(self.w_scale)) > 1

    def requantize(self, y: Tensor) -> Tensor:
        """float64 ``y`` -> the output's integer type (round half to even, saturate)."""
        return quantize(y, self.y_scale, self.y_zero_point, self.y_dtype)


def quantize(y: Tensor, scale: float, zero_point: int, dtype: torch.dtype) -> Tensor:
    """QuantizeLinear of float64 ``y``: round half to even, then saturate to ``dtype``."""
    lo, hi = INT_RANGES[dtype]
    return (torch.round(y / scale) + zero_point).clamp(lo, hi).to(dtype)


def qconv_reference(params: QuantParams, x: Tensor, w: Tensor, bias: Tensor | None,
                    residual: Tensor | None) -> Tensor:
    """The definition in the module docstring, over plain torch tensors."""
    channels = w.shape[0]
    per_out = [1, channels, 1, 1]
    xc = x.to(torch.float64) - params.x_zero_point
    w_zp = torch.tensor(params.w_zero_point, dtype=torch.float64)
    wc = w.to(torch.float64) - w_zp.expand(channels).reshape(-1, 1, 1, 1)
    top, left, bottom, right = params.pads[0], params.pads[1], params.pads[2], params.pads[3]
    # Zero points are subtracted first, so padded positions contribute nothing.
    xc = F.pad(xc, [left, right, top, bottom])
    acc = F.conv2d(xc, wc, None, params.strides, 0, params.dilations, params.group)
    w_scale = torch.tensor(params.w_scale, dtype=torch.float64).expand(channels)
    y = acc * (params.x_scale * w_scale).reshape(per_out)
    if bias is not None:
        y = y + bias.to(torch.float64).reshape(per_out)
    if residual is not None:
        c_q = quantize(y, params.c_scale, params.c_zero_point, params.c_dtype)
        y = (c_q.to(torch.float64) - params.c_zero_point) * params.c_scale \
            + params.r_scale * (residual.to(torch.float64) - params.r_zero_point)
    if params.relu:
        y = y.clamp_min(0.0)
    return params.requantize(y)


def _qconv(node: Node, ctx: BindContext) -> Kernel:
    params = QuantParams(node)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        bias = inputs[2] if len(inputs) > 2 else None
        residual = inputs[3] if len(inputs) > 3 else None
        return [qconv_reference(params, x, w, bias, residual)]
    return kernel


OPS: list[OpDef] = [
    OpDef(QCONV, _qconv, domain=FUSED_DOMAIN,
          doc="quantized 2-D convolution (integer in and out; passes/quantize.py)"),
]
