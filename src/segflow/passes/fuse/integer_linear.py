"""Rule ``integer_linear``: an integer matmul scaled back to float, as onnxruntime's
dynamic quantizer writes every linear of a model, becomes one
``com.microsoft.MatMulIntegerToFloat`` (onnxruntime's own fused op for it).

``quantize_dynamic`` writes ``DynamicQuantizeLinear(x) -> MatMulInteger(xq, W, xzp, wzp)
-> Cast(to=float) -> Mul(., xs * ws) [-> Add(., bias)]``. Unfused, the int32 product is
written, read and written again as float three times over (the Cast, the scaling, the
bias) and each step is a kernel dispatch; fused, the kernel scales and biases the product
of its int8 GEMM in place (``ops/contrib_quant.py``). The arithmetic is the graph's: the
exact integer product converted to float32, times the scale, plus the bias, each rounded
once as the separate nodes round it. The scale stays a runtime value (the
activation's scale is computed per run): where it is the quantizer's ``Mul(xs, ws)``
the op takes the two factors as its A and B scales and forms the same float32 product;
any other scale becomes its B scale, with a constant 1.0 as its A scale (``1.0 * s``
is ``s``). The DynamicQuantizeLinear stays apart: one quantized activation feeds
several linears (a transformer's query, key and value).
"""

from __future__ import annotations

import onnx
import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ops.contrib_quant import MS_DOMAIN
from segflow.passes._rewrite import new_const, replace_nodes
from segflow.passes.fuse._match import is_float32, is_op, live_nodes, only_consumer, other_input


def fuse_integer_linear(graph: Graph) -> int:
    """``MatMulInteger -> Cast(float) -> Mul(scale) [-> Add(bias)]`` ->
    ``MatMulIntegerToFloat``; returns how many it fused."""
    count = 0
    for node in live_nodes(graph, "MatMulInteger"):
        b = node.inputs[1] if len(node.inputs) > 1 else None
        columns = b.spec.shape[-1] if b is not None and b.spec.shape else None
        cast = only_consumer(graph, node.outputs[0])
        if not isinstance(columns, int) or not is_op(cast, "Cast") \
                or int(cast.attrs.get("to", 0)) != onnx.TensorProto.FLOAT:  # type: ignore[union-attr]
            continue
        assert cast is not None
        product = cast.outputs[0]
        mul = only_consumer(graph, product)
        if not is_op(mul, "Mul"):
            continue
        assert mul is not None
        scale = other_input(mul, product)
        if scale is None or scale is product or not _per_column(scale, columns, product):
            continue
        absorbed = [node, cast]
        anchor, bias = mul, None
        add = only_consumer(graph, mul.outputs[0])
        if is_op(add, "Add"):
            assert add is not None
            addend = other_input(add, mul.outputs[0])
            if addend is not None and addend is not mul.outputs[0] \
                    and addend.spec.shape == (columns,) and is_float32(addend):
                absorbed.append(mul)
                anchor, bias = add, addend
        a, a_zp, b_zp = (node.inputs[i] if len(node.inputs) > i else None for i in (0, 2, 3))
        scales = _scale_factors(graph, scale, mul)
        if scales is None:
            one = new_const(graph, f"{node.name}:a_scale", torch.ones((), dtype=torch.float32))
            scales = (one, scale)
        else:
            absorbed.insert(0, scale.producer)  # type: ignore[arg-type]
        fused = Node("MatMulIntegerToFloat", [a, b, *scales, a_zp, b_zp, bias],
                     [Value(anchor.outputs[0].name)], {}, name=node.name, domain=MS_DOMAIN,
                     opset=1)
        replace_nodes(graph, anchor, absorbed, fused)
        graph.opsets.setdefault(MS_DOMAIN, 1)
        count += 1
    return count


def _scale_factors(graph: Graph, scale: Value, reader: Node) -> tuple[Value, Value] | None:
    """``(a_scale, b_scale)`` where ``scale`` is ``Mul(xs, ws)`` read only by ``reader``,
    one factor a single value (the op's A scale, as the quantizer's activation scale is):
    the op forms the same float32 product. None otherwise."""
    producer = scale.producer
    if not is_op(producer, "Mul") or only_consumer(graph, scale) is not reader:
        return None
    assert producer is not None
    first, second = producer.inputs[0], producer.inputs[1]
    for a, b in ((first, second), (second, first)):
        if a is not None and b is not None and is_float32(a) and is_float32(b) \
                and _size(a) == 1 and _size(b) is not None:
            return a, b
    return None


def _size(value: Value) -> int | None:
    """Elements of ``value`` where its shape is static (None: unknown or symbolic)."""
    shape = value.spec.shape
    if shape is None:
        return None
    size = 1
    for d in shape:
        if not isinstance(d, int):
            return None
        size *= d
    return size


def _per_column(scale: Value, columns: int, product: Value) -> bool:
    """``scale`` is float32, one value or one per output column, and multiplying by it
    does not widen the product's rank."""
    shape = scale.spec.shape
    if not is_float32(scale) or shape is None:
        return False
    rank = product.spec.rank
    if rank is not None and len(shape) > rank:
        return False
    size = _size(scale)
    return size == 1 or (size is not None and tuple(shape) == (columns,))
