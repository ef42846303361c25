"""segflow graph -> ONNX ModelProto: what ``SessionOptions.optimized_model_filepath``
writes.

Only graphs of standard ONNX ops can be written: segflow's fused ops
(``segflow.FusedGemm``, ``segflow.Attention``, ...) and packed weights have no ONNX
form, and :func:`export_model` refuses a graph holding one, naming it. Attributes get
their ONNX types from the op's schema (an empty list has no type of its own).

>>> proto = export_model(graph, describe_model(original))     # doctest: +SKIP
>>> onnx.save(proto, "optimized.onnx")                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from segflow.errors import InvalidModel
from segflow.frontend.model_info import ModelInfo
from segflow.ir import lowbit
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType, OptionalSpec, SequenceSpec, TensorSpec


def export_model(graph: Graph, info: ModelInfo,
                 specs: Mapping[str, TensorSpec] | None = None) -> onnx.ModelProto:
    """``graph`` as a ModelProto with the original model's IR version, opsets and
    metadata; ``specs``: declared input/output specs by name, for values a pass
    replaced without one."""
    opsets = dict(info.opsets)
    proto = helper.make_model(_graph(graph, opsets, specs or {}),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    proto.ir_version = info.ir_version
    meta = info.metadata
    proto.producer_name = "segflow"
    proto.domain = meta.domain
    proto.model_version = meta.version
    proto.doc_string = meta.description
    proto.graph.doc_string = meta.graph_description
    helper.set_model_props(proto, dict(meta.custom_metadata_map))
    return proto


def _graph(graph: Graph, opsets: dict[str, int], specs: Mapping[str, TensorSpec]
           ) -> onnx.GraphProto:
    nodes = [_node(node, opsets, specs) for node in graph.nodes]
    used = {v.name for node in graph.walk() for v in node.inputs if v is not None}
    used |= {v.name for v in graph.outputs}
    initializers = [_initializer(value) for name, value in graph.initializers.items()
                    if name in used]
    return helper.make_graph(nodes, graph.name,
                             [_value_info(v, specs) for v in graph.inputs],
                             [_value_info(v, specs) for v in graph.outputs],
                             initializer=initializers)


def _node(node: Node, opsets: dict[str, int], specs: Mapping[str, TensorSpec]) -> onnx.NodeProto:
    if node.domain not in opsets:
        raise InvalidModel(f"node {node.label} is segflow's {node.domain}.{node.op_type}, "
                           "which has no ONNX form")
    schema = _schema(node)
    attrs = [_attribute(node, schema, name, value) for name, value in node.attrs.items()]
    attrs += [helper.make_attribute(name, _graph(sub, opsets, specs))
              for name, sub in node.subgraphs.items()]
    proto = helper.make_node(node.op_type, [v.name if v is not None else "" for v in node.inputs],
                             [v.name for v in node.outputs], name=node.name,
                             domain=node.domain)
    proto.attribute.extend(attrs)
    return proto


def _schema(node: Node) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(node.op_type, node.opset, node.domain)
    except onnx.defs.SchemaError:
        return None


def _attribute(node: Node, schema: onnx.defs.OpSchema | None, name: str,
               value: Any) -> onnx.AttributeProto:
    if isinstance(value, torch.Tensor):
        return helper.make_attribute(name, _tensor_proto(value, ""))
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return helper.make_attribute(name, [_tensor_proto(t, "") for t in value])
    declared = schema.attributes.get(name) if schema is not None else None
    if declared is None:
        if isinstance(value, list) and not value:
            raise InvalidModel(f"node {node.label}: attribute {name} is an empty list of "
                               "unknown type")
        return helper.make_attribute(name, value)
    proto_type, convert = _ATTR_TYPES.get(declared.type, (None, _same))
    return helper.make_attribute(name, convert(value), attr_type=proto_type)


def _same(value: Any) -> Any:
    return value


_Attr = onnx.defs.OpSchema.AttrType
# Schema attribute type -> (AttributeProto type, the conversion of segflow's value).
_ATTR_TYPES: dict[Any, tuple[int, Callable[[Any], Any]]] = {
    _Attr.FLOAT: (onnx.AttributeProto.FLOAT, float),
    _Attr.INT: (onnx.AttributeProto.INT, int),
    _Attr.STRING: (onnx.AttributeProto.STRING, str),
    _Attr.FLOATS: (onnx.AttributeProto.FLOATS, lambda v: [float(x) for x in v]),
    _Attr.INTS: (onnx.AttributeProto.INTS, lambda v: [int(x) for x in v]),
    _Attr.STRINGS: (onnx.AttributeProto.STRINGS, lambda v: [str(x) for x in v]),
}


def _initializer(value: Value) -> onnx.TensorProto:
    tensor = value.const
    assert tensor is not None
    if isinstance(tensor, np.ndarray):  # a string constant (ops/strings.py)
        return onnx.numpy_helper.from_array(tensor, value.name)
    if tensor.is_mkldnn or tensor.layout != torch.strided:
        raise InvalidModel(f"constant {value.name!r} is packed for a segflow kernel and has "
                           "no ONNX form")
    return _tensor_proto(tensor, value.name, value.spec.dtype)


def _tensor_proto(tensor: torch.Tensor, name: str,
                  declared: DType | None = None) -> onnx.TensorProto:
    t = tensor.detach().cpu().contiguous()
    dtype = DType.from_container(t.dtype, declared)
    if dtype.is_lowbit:   # as ml_dtypes' array, which onnx packs (two int4 a byte ...)
        array = lowbit.to_numpy(t, dtype)
    elif t.dtype == torch.bfloat16:
        array = t.view(torch.uint16).numpy().view(DType.BFLOAT16.numpy)
    else:
        array = t.numpy()
    return numpy_helper.from_array(np.asarray(array), name)


def _value_info(value: Value, specs: Mapping[str, TensorSpec]) -> onnx.ValueInfoProto:
    if value.container is not None:
        return helper.make_value_info(value.name, _type_proto(value.container))
    spec = value.spec if value.spec.dtype is not None else specs.get(value.name, value.spec)
    if spec.dtype is None:
        return helper.make_empty_tensor_value_info(value.name)
    shape = None if spec.shape is None else list(spec.shape)
    return helper.make_tensor_value_info(value.name, spec.dtype.value, shape)


def _type_proto(spec: TensorSpec | SequenceSpec | OptionalSpec) -> onnx.TypeProto:
    """A sequence's or an optional's type, down to the tensors it holds."""
    if isinstance(spec, SequenceSpec):
        return helper.make_sequence_type_proto(_type_proto(spec.elem))
    if isinstance(spec, OptionalSpec):
        return helper.make_optional_type_proto(_type_proto(spec.elem))
    shape = None if spec.shape is None else list(spec.shape)
    return helper.make_tensor_type_proto(spec.dtype.value if spec.dtype else 0, shape)
