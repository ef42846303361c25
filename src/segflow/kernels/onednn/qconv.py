"""``segflow.QConv`` on libdnnl's int8 convolution, called through ctypes.

One primitive per input shape: u8 (or s8) channels-last source and destination, s8
weights packed once into the format the primitive chooses, an f32 bias, runtime
scales and zero points (source, destination), and post-ops: the per-channel
requantizing multiplication, the node's residual (the convolution's own
requantization, then a binary add reading the residual's integers in place, see
``Int8Conv._post_ops``), ReLU. libdnnl accumulates in int32 and adds the bias, both
exact in float32 for a quantizer's int32 bias; the post-ops multiply once by
x_scale * w_scale / y_scale and round; the destination's zero point is added to the
whole value and the result saturated. That is onnxruntime's QLinearConv arithmetic
step for step, so without a residual the outputs are onnxruntime's bit for bit. A
bias that is not whole in accumulator units is scaled apart instead (a value at a
rounding tie may then move by one step). With a residual, the Add is done in float32
in libdnnl's order, not in onnxruntime's QLinearAdd order: values near a rounding tie
may differ by one step.

A call this kernel declines (a weight zero point other than 0, which libdnnl's
convolution does not take; a shape whose primitive libdnnl has only a reference
implementation for, or none) runs the reference kernel, counted with why.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from segflow.ir.graph import Node
from segflow.kernels.onednn.library import (
    ARG_ATTR_SCALES,
    ARG_ATTR_ZERO_POINTS,
    ARG_BIAS,
    ARG_DST,
    ARG_SRC,
    ARG_SRC_1,
    ARG_WEIGHTS,
    ELTWISE_CLIP_V2,
    ELTWISE_LINEAR,
    ELTWISE_RELU,
    ELTWISE_ROUND,
    POST_OP_ARG_BASE,
    DnnlError,
    ExecArg,
    Library,
    Pointer,
    PostOp,
    int8_attr,
    typed_any_desc,
    typed_desc,
)
from segflow.kernels.report import (
    KernelReport,
    NativeOrTorch,
    OpKernel,
    ReportFamily,
    short_label,
)
from segflow.ops.qconv import INT_RANGES, QuantParams, qconv_reference
from segflow.ops.registry import BindContext

Tensor = torch.Tensor


class _Primitive:
    """A built primitive for one input shape, its memories and execute arguments."""

    __slots__ = ("primitive", "src", "dst", "residual", "args", "out_shape", "impl", "weight",
                 "handles")

    def __init__(self, primitive: Pointer, src: Pointer, dst: Pointer, residual: Pointer | None,
                 args: Any, out_shape: list[int], impl: str, weight: Tensor) -> None:
        self.primitive = primitive
        self.src = src
        self.dst = dst
        self.residual = residual
        self.args = args
        self.out_shape = out_shape
        self.impl = impl
        self.weight = weight           # the packed weight the weights memory points at
        self.handles = [0, 0, 0]       # the addresses src, dst, residual point at now


def _whole_bias(bias: Tensor | None, params: QuantParams, channels: int) -> Tensor | None:
    """The bias in accumulator units (x_scale * w_scale), as float32 integers, where every
    value is whole there up to float32 rounding (a quantizer's int32 bias dequantized by
    that scale); None otherwise. No bias is a whole zero."""
    if bias is None:
        return torch.zeros(channels)
    step = (torch.tensor([params.x_scale], dtype=torch.float32)
            * torch.tensor(params.w_scale, dtype=torch.float32)).expand(channels).double()
    units = bias.double().reshape(-1) / step
    whole = torch.round(units)
    # float32's rounding of the dequantized value: half an ulp, 2**-24 relative
    if not bool(((units - whole).abs() <= units.abs() * 2.0**-23 + 1e-6).all()):
        return None
    if bool((whole.abs() >= 2.0**24).any()):
        return None  # not exact in float32
    return whole.to(torch.float32).contiguous()


def _channels_last(shape: Sequence[int]) -> list[int]:
    n, c, h, w = shape
    return [c * h * w, 1, w * c, c]


class Int8Conv(NativeOrTorch):
    """A QConv node's kernel: libdnnl's int8 convolution, the reference where it declines."""

    family = ReportFamily.INT8

    def __init__(self, lib: Library | None, why: str, params: QuantParams, weight: Tensor,
                 bias: Tensor | None, residual: bool) -> None:
        super().__init__(lib, why)
        self.params = params
        self.weight = weight.contiguous()
        self.bias = bias
        self.residual = residual
        self.impls: dict[tuple[int, ...], str] = {}
        self.declined: dict[tuple[int, ...], str] = {}
        self._built: dict[tuple[int, ...], _Primitive | None] = {}
        self._owned: list[tuple[str, Pointer]] = []
        self._build_lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._stream: Pointer | None = None
        channels = int(weight.shape[0])
        # Runtime quantization arguments: tensors kept alive, memories made once.
        # The accumulator is scaled straight into the units of the next rounding (the
        # output's, or with a residual the convolution's own quantization) by one float32
        # multiplier per channel, x_scale * w_scale / unit, formed as onnxruntime's
        # QLinearConv forms it.
        unit = params.c_scale if residual else params.y_scale
        multiplier = (torch.tensor([params.x_scale], dtype=torch.float32)
                      * torch.tensor(params.w_scale, dtype=torch.float32)
                      / torch.tensor([unit], dtype=torch.float32)).expand(channels)
        whole = _whole_bias(bias, params, channels)
        # A bias that is whole in accumulator units (a quantizer's int32 bias) joins the
        # accumulator before the one multiplication, a binary post-op: (acc + bias) * m,
        # rounded once, which is onnxruntime's arithmetic. Scaling the accumulator and the
        # bias apart rounds three times and moves a value at a rounding tie by one step
        # (rarely, but every later layer inherits it).
        self.single_rounding = whole is not None
        if whole is not None:
            self._multiplier: Tensor | None = multiplier.contiguous()
            weight_scale = torch.ones(channels if params.per_channel else 1)
            self._bias = whole
        else:
            self._multiplier = None
            weight_scale = multiplier.contiguous() if params.per_channel else multiplier[:1]
            self._bias = (bias.to(torch.float32) / unit).contiguous()  # type: ignore[union-attr]
        self._scales = {ARG_SRC: torch.ones(1),
                        ARG_WEIGHTS: weight_scale,
                        ARG_DST: torch.tensor([params.y_scale / params.r_scale if residual
                                               else 1.0], dtype=torch.float32)}
        self._zero_points = {arg: torch.tensor([zp], dtype=torch.int32) for arg, zp in
                             ((ARG_SRC, params.x_zero_point), (ARG_DST, params.y_zero_point))
                             if zp}
        self.why_not = ""
        if any(params.w_zero_point):
            self.why_not = "weight zero point is not 0 (libdnnl's convolution takes none)"
        elif weight.dtype != torch.int8:
            self.why_not = f"{weight.dtype} weights"

    # -- building -------------------------------------------------------------------
    def _weight_dims(self) -> list[int]:
        m, c, kh, kw = (int(d) for d in self.weight.shape)
        g = self.params.group
        return [m, c, kh, kw] if g == 1 else [g, m // g, c, kh, kw]

    def _post_ops(self, residual_md: Pointer | None, multiplier_md: Pointer | None
                  ) -> tuple[list[PostOp], int | None]:
        """The post-op chain and the index of its residual add (None: no residual).

        With ``multiplier_md`` the chain starts with the per-channel multiplication of the
        accumulator plus bias (``single_rounding``).

        With a residual the chain first quantizes the convolution's result as the graph's
        QuantizeLinear before the Add does (scale, round, saturate), dequantizes it, and
        adds the residual, all in units of the residual's scale so that the residual's
        integers are added as they are (a binary add reads them unscaled); the
        destination's scale is then ``y_scale / r_scale``."""
        p = self.params
        ops: list[PostOp] = []
        if multiplier_md is not None:
            ops.append(("mul", multiplier_md))
        add_at = None
        if residual_md is not None:
            lo, hi = INT_RANGES[p.c_dtype]
            ratio = p.c_scale / p.r_scale
            # Round, then add the zero point (exact on a whole value), as QuantizeLinear
            # does: added first, in float32, it would move values just under a half.
            ops += [("eltwise", ELTWISE_ROUND, 0.0, 0.0),
                    ("eltwise", ELTWISE_LINEAR, 1.0, float(p.c_zero_point)),
                    ("eltwise", ELTWISE_CLIP_V2, float(lo), float(hi)),
                    ("eltwise", ELTWISE_LINEAR, ratio,
                     -p.c_zero_point * ratio - p.r_zero_point)]
            add_at = len(ops)
            ops.append(("add", residual_md))
        if p.relu:
            ops.append(("eltwise", ELTWISE_RELU, 0.0, 0.0))
        if multiplier_md is not None and residual_md is None and p.y_zero_point:
            # libdnnl adds the destination's zero point in float before it rounds; near
            # 150 float32 keeps too few fraction bits, and a value just under a half
            # rounds up. Rounding first makes the zero point's add exact, as
            # onnxruntime's round-then-add is.
            ops.append(("eltwise", ELTWISE_ROUND, 0.0, 0.0))
        return ops, add_at

    def _build(self, lib: Library, x: Tensor, residual: Tensor | None) -> _Primitive:
        p = self.params
        n, c, h, w = (int(d) for d in x.shape)
        m, _, kh, kw = (int(d) for d in self.weight.shape)
        oh = (h + p.pads[0] + p.pads[2] - (p.dilations[0] * (kh - 1) + 1)) // p.strides[0] + 1
        ow = (w + p.pads[1] + p.pads[3] - (p.dilations[1] * (kw - 1) + 1)) // p.strides[1] + 1
        out_shape = [n, m, oh, ow]
        owned: list[tuple[str, Pointer]] = []
        src_md = typed_desc(lib, [n, c, h, w], _channels_last([n, c, h, w]), x.dtype)
        dst_md = typed_desc(lib, out_shape, _channels_last(out_shape), p.y_dtype)
        dims = self._weight_dims()
        any_w = typed_any_desc(lib, dims, torch.int8)
        bias_md = lib.vector_desc(m)
        owned += [("memory_desc", d) for d in (src_md, dst_md, any_w, bias_md)]
        weight_mask = (1 if p.group == 1 else 3) if p.per_channel else 0
        residual_md = None
        if residual is not None:
            residual_md = typed_desc(lib, out_shape, _channels_last(out_shape), residual.dtype)
            self._owned.append(("memory_desc", residual_md))
        multiplier_md = None
        if self._multiplier is not None:
            multiplier_md = typed_desc(lib, [1, m, 1, 1], [m, 1, 1, 1], torch.float32)
            self._owned.append(("memory_desc", multiplier_md))
        post_ops, add_at = self._post_ops(residual_md, multiplier_md)
        attr = int8_attr(lib, weight_mask, bool(p.x_zero_point), bool(p.y_zero_point),
                         post_ops)
        owned.append(("primitive_attr", attr))
        geometry = _Geometry(p)
        try:
            prim, weights_md, impl = lib.convolution(src_md, any_w, bias_md, dst_md,
                                                     geometry, attr)  # type: ignore[arg-type]
        finally:
            lib.destroy(owned)
        assert prim is not None
        self._owned.append(("primitive", prim))
        self._owned.append(("memory_desc", weights_md))
        packed = torch.empty(lib.size(weights_md), dtype=torch.uint8)
        plain_md = typed_desc(lib, dims, _contiguous_strides(dims), torch.int8)
        try:
            lib.reorder(plain_md, self.weight.data_ptr(), weights_md, packed.data_ptr())
        finally:
            lib.destroy([("memory_desc", plain_md)])
        src_md = typed_desc(lib, [n, c, h, w], _channels_last([n, c, h, w]), x.dtype)
        dst_md = typed_desc(lib, out_shape, _channels_last(out_shape), p.y_dtype)
        bias_md = lib.vector_desc(m)
        self._owned += [("memory_desc", d) for d in (src_md, dst_md, bias_md)]
        src = lib.memory(src_md, None)
        dst = lib.memory(dst_md, None)
        weights = lib.memory(weights_md, packed.data_ptr())
        bias = lib.memory(bias_md, self._bias.data_ptr())
        self._owned += [("memory", mem) for mem in (src, dst, weights, bias)]
        args = [ExecArg(ARG_SRC, src), ExecArg(ARG_WEIGHTS, weights), ExecArg(ARG_BIAS, bias),
                ExecArg(ARG_DST, dst)]
        residual_mem = None
        if residual_md is not None and add_at is not None:
            residual_mem = lib.memory(residual_md, None)
            self._owned.append(("memory", residual_mem))
            args.append(ExecArg(POST_OP_ARG_BASE * (add_at + 1) | ARG_SRC_1, residual_mem))
        if self._multiplier is not None:
            assert multiplier_md is not None
            multiplier = lib.memory(multiplier_md, self._multiplier.data_ptr())
            self._owned.append(("memory", multiplier))
            args.append(ExecArg(POST_OP_ARG_BASE | ARG_SRC_1, multiplier))  # post-op 0
        for arg, tensor in self._scales.items():
            args.append(ExecArg(ARG_ATTR_SCALES | arg, self._vector(lib, tensor)))
        for arg, tensor in self._zero_points.items():
            args.append(ExecArg(ARG_ATTR_ZERO_POINTS | arg, self._vector(lib, tensor)))
        if self._stream is None:
            self._stream = lib.stream()
            self._owned.append(("stream", self._stream))
        return _Primitive(prim, src, dst, residual_mem, (ExecArg * len(args))(*args), out_shape,
                          impl, packed)

    def _vector(self, lib: Library, tensor: Tensor) -> Pointer:
        md = typed_desc(lib, [tensor.numel()], [1], tensor.dtype)
        self._owned.append(("memory_desc", md))
        mem = lib.memory(md, tensor.data_ptr())
        self._owned.append(("memory", mem))
        return mem

    def _primitive(self, x: Tensor, residual: Tensor | None) -> _Primitive | None:
        key = tuple(int(d) for d in x.shape)
        if key in self._built:
            return self._built[key]
        with self._build_lock:
            if key in self._built:
                return self._built[key]
            built: _Primitive | None = None
            lib = self.library
            if lib is None:
                self.declined[key] = self.why_native
            elif self.why_not:
                self.declined[key] = self.why_not
            else:
                try:
                    built = self._build(lib, x, residual)
                except DnnlError as exc:
                    self.declined[key] = f"libdnnl refused it ({exc})"
                if built is not None and built.impl.startswith("ref"):
                    self.declined[key] = f"libdnnl has only its reference kernel ({built.impl})"
                    built = None
                if built is not None:
                    self.impls[key] = built.impl
            self._built[key] = built
            return built

    # -- running --------------------------------------------------------------------
    def __call__(self, x: Tensor, w: Tensor, bias: Tensor | None = None,
                 residual: Tensor | None = None) -> Tensor:
        call = self._built.get(x.shape)   # a torch.Size hashes as its tuple
        if call is None:
            if (residual is not None) != self.residual:
                raise ValueError("QConv: a residual input where the node has none, or none "
                                 "where it has one")
            call = self._primitive(x, residual) if x.dim() == 4 else None
            if call is None:
                key = tuple(int(d) for d in x.shape)
                self.count_torch_call(self.declined.get(key, f"{x.dim()}-D input"))
                return qconv_reference(self.params, x, w, bias, residual)
        x = x.contiguous(memory_format=torch.channels_last)
        out = torch.empty(call.out_shape, dtype=self.params.y_dtype,
                          memory_format=torch.channels_last)
        lib = self.library
        assert lib is not None
        with self._run_lock:
            handles = call.handles
            src, dst = x.data_ptr(), out.data_ptr()
            if handles[0] != src:
                lib.set_handle(call.src, src)
                handles[0] = src
            if handles[1] != dst:
                lib.set_handle(call.dst, dst)
                handles[1] = dst
            if call.residual is not None and residual is not None:
                residual = residual.contiguous(memory_format=torch.channels_last)
                res = residual.data_ptr()
                if handles[2] != res:
                    lib.set_handle(call.residual, res)
                    handles[2] = res
            status = lib.execute(call.primitive, self._stream, len(call.args), call.args)
        if status != 0:
            raise DnnlError(f"int8 convolution ({call.impl}): oneDNN status {status}")
        self.count_native_call()
        return out

    def __del__(self) -> None:
        if getattr(self, "library", None) is not None and getattr(self, "_owned", None):
            try:
                self.library.destroy(self._owned)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    # -- reporting ------------------------------------------------------------------
    def counters(self) -> Mapping[str, int]:
        return {"int8_calls": self.native_calls, "reference_calls": self.torch_calls}

    def parts(self) -> Sequence[KernelReport]:
        return ()

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, Any]], limit: int = 8) -> list[str]:
        if not ops:
            return []
        native = sum(op.native_calls for _, op in ops)
        reference = sum(op.torch_calls for _, op in ops)
        impls = sorted({impl for _, op in ops for impl in op.impls.values()})
        lines = [f"int8 convolutions (libdnnl): {len(ops)} QConv nodes; {native} calls int8"
                 + (f" ({', '.join(impls)})" if impls else "")
                 + f", {reference} through the reference kernel"]
        reasons = [(label, why) for label, op in ops for why in op.why_torch]
        lines += [f"  reference: {short_label(label)}: {why}" for label, why in reasons[:limit]]
        if len(reasons) > limit:
            lines.append(f"  ... and {len(reasons) - limit} more")
        return lines


class _Geometry:
    """What :meth:`Library.convolution` reads of a geometry: strides, dilations, pads."""

    def __init__(self, params: QuantParams) -> None:
        self.strides = params.strides
        self.dilations = params.dilations
        self.pads_begin = params.pads[:2]
        self.pads_end = params.pads[2:]


def _contiguous_strides(dims: Sequence[int]) -> list[int]:
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * int(dims[i + 1])
    return strides


def bind_int8_conv(node: Node, ctx: BindContext) -> OpKernel:
    """A QConv node's kernel: :class:`Int8Conv` over its constant weight and bias."""
    weight = node.inputs[1].const if node.inputs[1] is not None else None
    if weight is None:
        raise ValueError("QConv's weight must be a constant")
    bias_value = node.inputs[2] if len(node.inputs) > 2 else None
    bias = bias_value.const if bias_value is not None else None
    residual = len(node.inputs) > 3 and node.inputs[3] is not None
    target = ctx.target
    return OpKernel(Int8Conv(target.dnnl, f"libdnnl {target.dnnl_why}", QuantParams(node),
                             weight, bias, residual))
