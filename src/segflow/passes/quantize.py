"""The ``quantize`` pass: QDQ regions become integer nodes, so activations stay 8-bit.

A QDQ graph (onnxruntime's quantizer, ``QuantFormat.QDQ``) spells an int8 convolution
in float ops: ``DequantizeLinear(x_q)`` and ``DequantizeLinear(w_q)`` (a constant)
into a Conv, optionally a Relu, then ``QuantizeLinear``. Run as it is, every
activation is dequantized to float and quantized again, and the weights' dequantize
is folded into float constants: nothing runs in int8. This pass runs before constant
folding and rewrites

- ``Q(Relu?(Conv(DQ(x_q), DQ(w_q), DQ(b)?)))`` into one ``segflow.QConv`` over
  ``x_q`` and ``w_q`` (``ops/qconv.py``), whose output is the Q's integer tensor;
- with ``residual`` on, ``Q(Relu?(Add(DQ(QConv(..)), DQ(r_q))))`` into that QConv with
  ``r_q`` as its residual input; the convolution's own rounding before the Add is kept
  (libdnnl's post-ops round, saturate and dequantize it before adding ``r_q``), so
  the fused node computes the unfused graph's values.

Between two lowered convolutions the uint8 tensor flows directly; DequantizeLinear /
QuantizeLinear remain only at a region's edges (the image's quantization, a pooling or
a classifier that stays float). A Conv that does not fit (per-tensor activation
parameters, int8 weights per output channel, 2-D, known pads, a float32 bias) stays
float and correct; the pass's log line names how many did not and why.

>>> quantize_pass(graph, context)   # doctest: +SKIP
PassResult(graph, True, ('quantize: 53 Conv -> QConv (int8), 16 residual Adds fused; ...',))
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType, TensorSpec
from segflow.ops.fused import FUSED_DOMAIN
from segflow.ops.qconv import QCONV
from segflow.passes._rewrite import new_const, remove_dead
from segflow.passes.fuse._match import const_tensor, is_op, live_nodes, only_consumer
from segflow.passes.fuse.conv import _explicit_pads
from segflow.passes.result import PassResult

if TYPE_CHECKING:
    from segflow.passes.pipeline import PassContext

_ACTIVATION_DTYPES = {torch.uint8: "uint8", torch.int8: "int8"}


@dataclass(frozen=True, slots=True)
class Quantization:
    """A (de)quantize node's constant parameters: one scale and zero point per entry
    (one entry: per tensor) and the integer type."""

    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    dtype: torch.dtype


def _params(node: Node) -> Quantization | str:
    """The constant parameters of a QuantizeLinear / DequantizeLinear, or why not."""
    if int(node.attrs.get("block_size", 0) or 0):
        return "blocked quantization"
    scale = const_tensor(node.inputs[1] if len(node.inputs) > 1 else None)
    if scale is None:
        return "scale is not a constant"
    zp_value = node.inputs[2] if len(node.inputs) > 2 else None
    zp = const_tensor(zp_value)
    if zp_value is not None and zp is None:
        return "zero point is not a constant"
    if scale.dtype != torch.float32:
        return f"scale is {scale.dtype}"
    for value in (node.inputs[0], zp_value, node.outputs[0]):
        if value is not None and value.spec.dtype is not None and value.spec.dtype.is_lowbit:
            # int4 shares int8's container: the int8 kernels would saturate to the wrong range.
            return f"{value.spec.dtype.onnx_name} values"
    dtype = zp.dtype if zp is not None else torch.uint8
    if node.op_type == "DequantizeLinear" and node.inputs[0] is not None \
            and node.inputs[0].spec.dtype is not None:
        dtype = node.inputs[0].spec.dtype.torch
    zero = zp.reshape(-1).tolist() if zp is not None else [0] * scale.numel()
    return Quantization(tuple(float(s) for s in scale.reshape(-1).tolist()),
                        tuple(int(z) for z in zero), dtype)


def _per_tensor(node: Node | None, op_type: str) -> Quantization | str:
    if node is None or not is_op(node, op_type):
        return f"not from {op_type}"
    got = _params(node)
    if isinstance(got, str):
        return got
    if len(got.scale) != 1 or len(got.zero_point) != 1:
        return "per-axis activation quantization"
    if got.dtype not in _ACTIVATION_DTYPES:
        return f"{got.dtype} activations"
    return got


def _axis_is_zero(node: Node, rank: int) -> bool:
    axis = int(node.attrs.get("axis", 1))
    return (axis + rank if axis < 0 else axis) == 0


def _lower_conv(graph: Graph, conv: Node) -> str:
    """Rewrite ``conv`` and its QDQ neighbours into a QConv; '' on success, else why not."""
    if len(conv.inputs) < 2 or conv.inputs[0] is None or conv.inputs[1] is None:
        return "malformed"
    x = _per_tensor(conv.inputs[0].producer, "DequantizeLinear")
    if isinstance(x, str):
        return f"input {x}"
    dq_w = conv.inputs[1].producer
    if dq_w is None or not is_op(dq_w, "DequantizeLinear"):
        return "weight not from DequantizeLinear"
    w_q = const_tensor(dq_w.inputs[0])
    w = _params(dq_w)
    if w_q is None or isinstance(w, str):
        return "weight is not a constant" if w_q is None else f"weight {w}"
    if w_q.dim() != 4:
        return f"{w_q.dim() - 2}-D convolution"
    if w_q.dtype != torch.int8:
        return f"{w_q.dtype} weights"
    channels = int(w_q.shape[0])
    if len(w.scale) not in (1, channels) or (len(w.scale) > 1 and not _axis_is_zero(dq_w, 4)):
        return "weight scales not per tensor or per output channel"
    bias = _bias(conv, channels)
    if isinstance(bias, str):
        return bias
    pads = _explicit_pads(conv)
    if pads is None:
        return "auto_pad over unknown spatial sizes"
    relu, after, y = _quantized_output(graph, conv.outputs[0])
    if isinstance(y, str):
        return f"output {y}"
    assert after is not None
    attrs = {"pads": pads, "strides": list(conv.attrs.get("strides", [1, 1])),
             "dilations": list(conv.attrs.get("dilations", [1, 1])),
             "group": int(conv.attrs.get("group", 1)),
             "x_scale": x.scale[0], "x_zero_point": x.zero_point[0],
             "w_scale": list(w.scale) * (channels // len(w.scale)),
             "w_zero_point": list(w.zero_point) * (channels // len(w.zero_point)),
             "y_scale": y.scale[0], "y_zero_point": y.zero_point[0],
             "y_dtype": _ACTIVATION_DTYPES[y.dtype], "relu": int(relu)}
    x_q = conv.inputs[0].producer.inputs[0]  # type: ignore[union-attr]
    bias_value = None
    if bias is not None:
        bias_value = new_const(graph, f"{conv.name or 'conv'}.bias_dequantized", bias)
    old = after.outputs[0]
    out = Value(old.name, TensorSpec(DType.from_torch(y.dtype), old.spec.shape))
    node = Node(QCONV, [x_q, dq_w.inputs[0], bias_value], [out], attrs, name=conv.name,
                domain=FUSED_DOMAIN, opset=1)
    graph.insert_before(conv, node)
    graph.replace_all_uses(old, out)
    for dead in (after, *([only_consumer(graph, conv.outputs[0])] if relu else []), conv):
        if dead is not None and dead.graph is graph:
            graph.remove(dead)
    return ""


def _bias(conv: Node, channels: int) -> torch.Tensor | None | str:
    """The conv's bias as float32 values (a DequantizeLinear of a constant evaluated
    here, as folding would), None without one, else why it does not fit."""
    value = conv.inputs[2] if len(conv.inputs) > 2 else None
    if value is None:
        return None
    tensor = const_tensor(value)
    producer = value.producer
    if tensor is None and producer is not None and is_op(producer, "DequantizeLinear"):
        raw = const_tensor(producer.inputs[0])
        params = _params(producer)
        if raw is None or isinstance(params, str):
            return "bias is not a constant"
        scale = torch.tensor(params.scale, dtype=torch.float32)
        zero = torch.tensor(params.zero_point, dtype=torch.float32)
        tensor = (raw.to(torch.float32).reshape(-1) - zero) * scale
    if tensor is None:
        return "bias is not a constant"
    if tensor.dtype != torch.float32 or tensor.numel() != channels:
        return f"bias is {tensor.dtype}[{tensor.numel()}]"
    return tensor.reshape(-1).contiguous()


def _quantized_output(graph: Graph, value: Value
                      ) -> tuple[bool, Node | None, Quantization | str]:
    """What reads ``value``: an optional Relu, then a per-tensor QuantizeLinear; returns
    (whether the Relu is there, the QuantizeLinear node, its parameters or why not)."""
    after = only_consumer(graph, value)
    relu = is_op(after, "Relu")
    if relu:
        assert after is not None
        after = only_consumer(graph, after.outputs[0])
    return relu, after, _per_tensor(after, "QuantizeLinear")


def _fuse_residual(graph: Graph, add: Node) -> bool:
    """``Q(Relu?(Add(DQ(QConv), DQ(r_q))))`` -> the QConv with residual ``r_q``."""
    if len(add.inputs) != 2 or add.inputs[0] is None or add.inputs[1] is None:
        return False
    relu, after, y = _quantized_output(graph, add.outputs[0])
    if isinstance(y, str):
        return False
    assert after is not None
    for mine, other in ((0, 1), (1, 0)):
        dq_conv, dq_other = add.inputs[mine].producer, add.inputs[other].producer  # type: ignore[union-attr]
        r = _per_tensor(dq_other, "DequantizeLinear")
        if isinstance(r, str) or dq_conv is None or not is_op(dq_conv, "DequantizeLinear"):
            continue
        if only_consumer(graph, dq_conv.outputs[0]) is not add:
            continue
        qconv = dq_conv.inputs[0].producer if dq_conv.inputs[0] is not None else None
        if qconv is None or qconv.op_type != QCONV or qconv.domain != FUSED_DOMAIN \
                or len(qconv.inputs) > 3 or qconv.attrs["relu"] \
                or only_consumer(graph, qconv.outputs[0]) is not dq_conv:
            continue
        assert dq_other is not None
        r_q = dq_other.inputs[0]
        conv_out = qconv.outputs[0]
        if r_q is None or r_q.spec.shape is None or r_q.spec.shape != conv_out.spec.shape \
                or r_q.spec.dtype != conv_out.spec.dtype:
            continue
        inputs = [*qconv.inputs[:3], *[None] * (3 - len(qconv.inputs)), r_q]
        attrs = dict(qconv.attrs, c_scale=qconv.attrs["y_scale"],
                     c_zero_point=qconv.attrs["y_zero_point"], c_dtype=qconv.attrs["y_dtype"],
                     r_scale=r.scale[0], r_zero_point=r.zero_point[0],
                     y_scale=y.scale[0], y_zero_point=y.zero_point[0],
                     y_dtype=_ACTIVATION_DTYPES[y.dtype], relu=int(relu))
        old = after.outputs[0]
        out = Value(old.name, TensorSpec(DType.from_torch(y.dtype), old.spec.shape))
        fused = Node(QCONV, inputs, [out], attrs, name=qconv.name, domain=FUSED_DOMAIN,
                     opset=1)
        graph.insert_before(qconv, fused)
        graph.replace_all_uses(old, out)
        dead = [after, *([only_consumer(graph, add.outputs[0])] if relu else []), add,
                dq_conv, qconv]
        for node in dead:
            if node is not None and node.graph is graph:
                graph.remove(node)
        return True
    return False


# Ops that commute with a dequantization whose scale is positive (they select or move
# elements, never combine them), so ``Q(op(DQ(x_q)))`` with the same parameters on both
# sides is ``op(x_q)``: the integers are the values the Q would give back.
ORDER_PRESERVING = ("MaxPool",)


def _pass_through(graph: Graph, node: Node) -> bool:
    """``Q(node(DQ(x_q)))`` -> ``node(x_q)`` where the Q's parameters are the DQ's."""
    if len(node.outputs) != 1 or not node.inputs or node.inputs[0] is None:
        return False
    dq = node.inputs[0].producer
    x = _per_tensor(dq, "DequantizeLinear")
    q = only_consumer(graph, node.outputs[0])
    y = _per_tensor(q, "QuantizeLinear")
    if isinstance(x, str) or isinstance(y, str) or x != y or x.scale[0] <= 0:
        return False
    assert dq is not None and q is not None
    x_q = dq.inputs[0]
    old = q.outputs[0]
    out = Value(old.name, TensorSpec(DType.from_torch(y.dtype), old.spec.shape))
    moved = Node(node.op_type, [x_q, *node.inputs[1:]], [out], dict(node.attrs),
                 name=node.name, domain=node.domain, opset=node.opset)
    graph.insert_before(node, moved)
    graph.replace_all_uses(old, out)
    graph.remove(q)
    graph.remove(node)
    return True


def lower_qdq(graph: Graph, residual: bool = True) -> tuple[int, int, Counter[str]]:
    """Lower ``graph``'s quantized convolutions in place: (QConvs made, residual Adds
    fused, why each Conv left float stayed so). Order-preserving ops between a DQ and a
    Q of the same parameters run on the integers too."""
    kept: Counter[str] = Counter()
    lowered = 0
    for op_type in ORDER_PRESERVING:
        for node in live_nodes(graph, op_type):
            _pass_through(graph, node)
    for conv in live_nodes(graph, "Conv"):
        why = _lower_conv(graph, conv)
        if why:
            kept[why] += 1
        else:
            lowered += 1
    fused = 0
    if residual and lowered:
        fused = sum(_fuse_residual(graph, add) for add in live_nodes(graph, "Add"))
    graph.toposort()
    remove_dead(graph)
    return lowered, fused, kept


def quantize_pass(graph: Graph, context: PassContext) -> PassResult:
    """The pipeline's ``quantize`` row: :func:`lower_qdq` and its log line."""
    if not any(is_op(n, "QuantizeLinear") for n in graph.nodes):
        return PassResult(graph, False, ("quantize: no QuantizeLinear (not a QDQ graph)",))
    lowered, fused, kept = lower_qdq(graph, context.options.quantize_residual)
    float_ops = Counter(n.op_type for n in graph.nodes if n.domain == ""
                        and n.op_type not in ("QuantizeLinear", "DequantizeLinear"))
    parts = [f"{lowered} Conv -> QConv (int8)"]
    if fused:
        parts.append(f"{fused} residual Add{'s' if fused > 1 else ''} fused")
    line = "quantize: " + ", ".join(parts)
    if kept:
        line += "; Conv left float: " + ", ".join(f"{n} ({why})" for why, n in kept.items())
    if float_ops:
        line += "; float between Q/DQ: " + ", ".join(
            f"{n} {op}" for op, n in sorted(float_ops.items()))
    return PassResult(graph, bool(lowered), (line,))
