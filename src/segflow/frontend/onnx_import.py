"""ONNX frontend: ModelProto (or a path to one) -> :class:`segflow.ir.Graph`.

Everything ONNX-specific is parsed here, once: element types become
:class:`DType`, attributes become Python values (tensors become torch tensors,
graphs become subgraphs), Constant nodes become constant values, and every
node is checked against the op registry so an unsupported model fails at
load, naming the op, its domain, the opset and the node.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from segflow.errors import InvalidModel, UnsupportedOp
from segflow.frontend.symbolic_dims import unify_dims
from segflow.frontend.validate import (
    SchemaChecker,
    check_ops,
    check_structure,
    declared_opsets,
    inference_error,
    node_name,
)
from segflow.ir import lowbit
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import ContainerSpec, Dim, DType, OptionalSpec, SequenceSpec, TensorSpec
from segflow.ops import default_registry
from segflow.ops.registry import NEWEST_ONNX_OPSET, OpRegistry
from segflow.ops.strings import string_array

# Initializers with more data bytes than this go to shape inference without their data.
INFERENCE_DATA_LIMIT = 4096
# Tensors over more bytes than this are read in place from the bytes protobuf hands back.
SHARED_MIN_BYTES = 64


def load_model(model: str | os.PathLike[str] | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """Read a model file (with its external data) or pass a ModelProto through."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        try:
            return onnx.load_from_string(model)
        except Exception as exc:
            raise InvalidModel(f"cannot parse model bytes: {_one_line(exc)}") from None
    path = Path(model)
    if not path.exists():
        raise InvalidModel(f"model file not found: {path}")
    if path.is_dir():
        raise InvalidModel(f"model path is a directory, not an ONNX file: {path}")
    try:
        proto = onnx.load(str(path), load_external_data=True)
    except Exception as exc:
        raise InvalidModel(f"cannot read ONNX model {path}: {_one_line(exc)}") from None
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise InvalidModel(f"{path} is not an ONNX model (no graph found)")
    return proto


def declared_inputs(proto: onnx.ModelProto) -> list[Value]:
    """The inputs ``proto``'s graph declares (initializers listed as inputs left out), with
    their declared specs: what a feed is checked against, read without importing the model.

    >>> [v.spec.describe() for v in declared_inputs(onnx.load("model.onnx"))]  # doctest: +SKIP
    ['float[N,3,H,W]']
    """
    initializers = {t.name for t in proto.graph.initializer}
    return [_typed_value(vi.name, vi.type) for vi in proto.graph.input
            if vi.name not in initializers]


def import_model(model: str | os.PathLike[str] | bytes | onnx.ModelProto,
                 registry: OpRegistry | None = None, *,
                 tensors: Mapping[str, torch.Tensor] | None = None,
                 checked: bool = False) -> Graph:
    """Parse and check a model; return the segflow graph.

    ``tensors``: initializers of the main graph by name, taken as they are instead of
    read from the model (whose copies of them may then hold dims but no data): how a
    graph planned again for one input shape shares its weights with the session's.
    ``checked``: the model is one this function checked already, with only its inputs'
    dims bound since (a plan per input shape): the checks no dim changes (structure and
    single assignment, attributes against the schemas, input types) are not made
    again; ONNX's shape inference and the op checks, which read shapes, still run.

    >>> graph = import_model("model.onnx")  # doctest: +SKIP
    """
    proto = load_model(model)
    opsets = (declared_opsets(proto) if checked
              else check_structure(proto, NEWEST_ONNX_OPSET))
    inferred = _with_inferred_shapes(proto)
    schemas = SchemaChecker(opsets, proto.ir_version)
    importer = _Importer(registry or default_registry(), opsets,
                         None if checked else schemas, tensors)
    graph = importer.graph(inferred.graph, parent=None, scope={},
                           initializers=proto.graph.initializer)
    graph.name = proto.graph.name or "main"
    unify_dims(graph)
    if not checked:
        for node in graph.walk():
            schemas.check_types(node)
    check_ops(graph)
    return graph


def _with_inferred_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX's own shape inference: it enriches value specs, and refuses a model it finds
    invalid where onnxruntime would.

    Inference round-trips the whole model through serialized bytes several
    times (a peak of several times the weights' size), so it runs
    on a copy whose large initializers keep their name, type and dims but not
    their data; the caller takes the data from the original model.

    Inference runs in strict mode, so that a node onnxruntime would refuse while
    resolving the graph is refused here, naming it (frontend/validate.py); where its
    only errors are declared shapes onnxruntime merges leniently, it runs again
    leniently. A declared dim of -1 goes to it as an unknown dim.
    """
    light = onnx.ModelProto()
    light.ir_version = proto.ir_version
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    graph, source = light.graph, proto.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(_unknown_negative_dims(v) for v in source.input)
    # An output that is a graph input is declared as that input: declared without a
    # shape, it made onnx forget the input's shape, and every shape computed from it.
    inputs = {v.name: v for v in graph.input}
    graph.output.extend(inputs.get(v.name, _unknown_negative_dims(v)) for v in source.output)
    graph.value_info.extend(_unknown_negative_dims(v) for v in source.value_info)
    graph.sparse_initializer.extend(source.sparse_initializer)
    for tensor in source.initializer:
        if _data_bytes(tensor) <= INFERENCE_DATA_LIMIT:
            graph.initializer.append(tensor)  # small ones may feed shape arithmetic
        else:
            graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    try:
        return onnx.shape_inference.infer_shapes(light, strict_mode=True, data_prop=True)
    except Exception as exc:
        refusal = inference_error(exc)
        if refusal is not None:
            raise refusal from None
    try:
        return onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    except Exception:
        return light


def _unknown_negative_dims(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """``vi``, or a copy of it whose negative dims are unknown (neither value nor name)."""
    if not vi.type.HasField("tensor_type") or not any(
            d.HasField("dim_value") and d.dim_value < 0 for d in vi.type.tensor_type.shape.dim):
        return vi
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(vi)
    for dim in copy.type.tensor_type.shape.dim:
        if dim.HasField("dim_value") and dim.dim_value < 0:
            dim.Clear()
    return copy


class _Importer:
    def __init__(self, registry: OpRegistry, opsets: dict[str, int],
                 schemas: SchemaChecker | None,
                 tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        self.registry = registry
        self.opsets = opsets
        self.schemas = schemas   # None: the nodes were checked against theirs already
        self.tensors = tensors or {}

    def graph(self, gp: onnx.GraphProto, parent: Graph | None, scope: dict[str, Value],
              initializers: Sequence[onnx.TensorProto] | None = None) -> Graph:
        """Import ``gp``; ``initializers`` (with their data) replace ``gp``'s when given."""
        graph = Graph(gp.name or "subgraph", parent=parent)
        graph.opsets = dict(self.opsets)
        # Visible names: the enclosing scope, shadowed by this graph's own definitions.
        names: dict[str, Value] = dict(scope)
        infos = {vi.name: vi for vi in [*gp.value_info, *gp.input, *gp.output]}

        given = self.tensors if parent is None else {}
        for tensor in gp.initializer if initializers is None else initializers:
            const = given.get(tensor.name)
            value = Value(tensor.name, const=_tensor(tensor) if const is None else const)
            value.spec = _spec_of_tensor(value.const, tensor.data_type)
            graph.add_initializer(value)
            names[tensor.name] = value
        for tensor in gp.sparse_initializer:
            dense = _sparse_to_dense(tensor)
            value = Value(tensor.values.name, const=dense)
            value.spec = _spec_of_tensor(dense)
            graph.add_initializer(value)
            names[value.name] = value
        for vi in gp.input:
            if vi.name in graph.initializers:
                continue  # an overridable default (old-style models): stays a constant
            value = _typed_value(vi.name, vi.type)
            graph.add_input(value)
            names[vi.name] = value

        for np_ in gp.node:
            self._node(graph, np_, names, infos)

        for vi in gp.output:
            if vi.name not in names:
                raise InvalidModel(f"graph output {vi.name!r} is not produced by any node")
            value = names[vi.name]
            if parent is not None and value is scope.get(vi.name):
                # A subgraph returning an outer value as is: route it through an Identity
                # so the subgraph visibly reads (captures) it.
                copy = Value(f"{vi.name}:{graph.name}_out", value.spec,
                             container=value.container)
                graph.append(Node("Identity", [value], [copy], name=copy.name,
                                  opset=self.opsets.get("", 1)))
                value = copy
            declared = _spec(vi.type)
            if value.container is None:
                value.container = _container(vi.type)
            if value.spec.shape is None and declared.shape is not None:
                value.spec = declared
            elif value.spec.dtype is None:
                value.spec = TensorSpec(declared.dtype, value.spec.shape)
            graph.outputs.append(value)
        return graph

    def _node(self, graph: Graph, np_: onnx.NodeProto, names: dict[str, Value],
              infos: dict[str, onnx.ValueInfoProto]) -> None:
        domain = "" if np_.domain in ("", "ai.onnx") else np_.domain
        label = node_name(np_)
        if domain not in self.opsets:
            raise UnsupportedOp(f"op {np_.op_type} in node {label!r} uses domain "
                                f"{domain!r}, which the model does not import")
        opset = self.opsets[domain]
        if self.schemas is not None:
            self.schemas.check_node(np_)
        if np_.op_type == "Constant" and domain == "":
            const = _constant_value(np_)
            value = Value(np_.output[0], _spec_of_tensor(const, _constant_type(np_)),
                          const=const)
            graph.add_initializer(value)
            names[value.name] = value
            return
        # Fail at load, naming op, domain, opset and node; the planner binds it later.
        self.registry.lookup(domain, np_.op_type, opset, label)
        inputs: list[Value | None] = []
        for name in np_.input:
            if name == "":
                inputs.append(None)
                continue
            if name not in names:
                raise InvalidModel(f"node {label!r} ({np_.op_type}) reads {name!r}, "
                                   f"which is not defined before it")
            inputs.append(names[name])
        attrs: dict[str, Any] = {}
        subgraphs: dict[str, Graph] = {}
        for attr in np_.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                subgraphs[attr.name] = self.graph(attr.g, graph, names)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                raise UnsupportedOp(f"attribute {attr.name} of node {label!r} holds a list "
                                    f"of graphs, which segflow does not support")
            else:
                attrs[attr.name] = _attribute(attr)
        outputs: list[Value] = []
        for name in np_.output:
            outputs.append(_typed_value(name or f"{label}:unused{len(outputs)}",
                                        infos[name].type if name in infos else None))
        node = Node(np_.op_type, inputs, outputs, attrs, name=np_.name or label,
                    domain=domain, opset=opset, subgraphs=subgraphs)
        graph.append(node)
        for value in outputs:
            names[value.name] = value


def _attribute(attr: onnx.AttributeProto) -> Any:
    value = onnx.helper.get_attribute_value(attr)
    if attr.type == onnx.AttributeProto.TENSOR:
        return _tensor(value)
    if attr.type == onnx.AttributeProto.SPARSE_TENSOR:
        return _sparse_to_dense(value)
    if attr.type == onnx.AttributeProto.STRING:
        return value.decode("utf-8", errors="replace")
    if attr.type == onnx.AttributeProto.STRINGS:
        return [v.decode("utf-8", errors="replace") for v in value]
    if attr.type == onnx.AttributeProto.TENSORS:
        return [_tensor(t) for t in value]
    if attr.type in (onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS):
        return list(value)
    return value


def _constant_value(np_: onnx.NodeProto) -> torch.Tensor:
    for attr in np_.attribute:
        v = onnx.helper.get_attribute_value(attr)
        if attr.name == "value":
            return _tensor(v)
        if attr.name == "sparse_value":
            return _sparse_to_dense(v)
        if attr.name == "value_float":
            return torch.tensor(v, dtype=torch.float32)
        if attr.name == "value_floats":
            return torch.tensor(list(v), dtype=torch.float32)
        if attr.name == "value_int":
            return torch.tensor(v, dtype=torch.int64)
        if attr.name == "value_ints":
            return torch.tensor(list(v), dtype=torch.int64)
        if attr.name in ("value_string", "value_strings"):
            return _strings(onnx.helper.get_attribute_value(attr))
    raise InvalidModel(f"Constant node {np_.name!r} has no value attribute")


def _raw_dtype(code: int) -> np.dtype[Any] | None:
    """The numpy dtype whose bytes are an element type's ``raw_data`` (DType's), or
    None for strings, bfloat16 (torch reads no ml_dtypes array) and the types numpy
    lacks (float8, int4, ...)."""
    try:
        dtype = DType.from_onnx(code)
        return None if dtype in (DType.STRING, DType.BFLOAT16) or dtype.is_lowbit \
            else dtype.numpy
    except ValueError:
        return None


def _data_bytes(tp: onnx.TensorProto) -> int:
    """The bytes of ``tp``'s elements, from its dims and type (8 an element for a type
    :func:`_raw_dtype` does not size): reading ``raw_data`` to measure it would copy
    it (~0.1 s for 420 MB of weights)."""
    numel = 1
    for d in tp.dims:
        numel *= int(d)
    dtype = _raw_dtype(tp.data_type)
    return numel * (dtype.itemsize if dtype is not None else 8)


def _tensor(tp: onnx.TensorProto) -> torch.Tensor:
    dtype = _raw_dtype(tp.data_type)
    if dtype is not None and tp.HasField("raw_data") and sys.byteorder == "little" \
            and tp.data_location != onnx.TensorProto.EXTERNAL:
        # The common case: reading raw_data hands back a new bytes object (protobuf
        # copies the field out of the message), which the tensor keeps and reads in
        # place; numpy_helper.to_array and a copy after it make two more. Only a buffer
        # of the size the dims and type give is taken.
        raw = tp.raw_data
        if len(raw) == _data_bytes(tp):
            return _over_bytes(raw, dtype, DType.from_onnx(tp.data_type).torch,
                               tuple(tp.dims))
    try:
        array = numpy_helper.to_array(tp)
    except Exception as exc:
        raise InvalidModel(f"cannot read tensor {tp.name!r}: {_one_line(exc)}") from None
    if tp.data_type == onnx.TensorProto.STRING:
        return _strings(array)
    if tp.data_type == onnx.TensorProto.BFLOAT16:
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    try:
        element = DType.from_onnx(tp.data_type)
    except ValueError:
        element = None
    if element is not None and element.is_lowbit:   # an ml_dtypes array, one element a byte
        return lowbit.to_tensor(array)
    if array.dtype.kind not in "biufc?":  # float6 and other types segflow lacks
        raise UnsupportedOp(f"tensor {tp.name!r} has element type "
                            f"{onnx.TensorProto.DataType.Name(tp.data_type)}, "
                            "which segflow does not support")
    return torch.from_numpy(np.array(array, copy=True))


def _strings(data: Any) -> torch.Tensor:
    """String data as the object array of ``str`` string values are (``ops/strings.py``):
    they stay on the host, and only the string rows, which take arrays, read them."""
    return cast("torch.Tensor", string_array(data))


def _over_bytes(raw: bytes, dtype: np.dtype[Any], torch_dtype: torch.dtype,
                dims: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dims`` reading ``raw`` in place (its length checked by the caller),
    or a copy where ``raw`` is small (CPython shares the one-byte and empty ones) or its
    address is not a multiple of the element size.

    torch marks a tensor over a read-only buffer as such and warns; the bytes object is
    new and no one else holds it, so nothing observes a kernel writing into it.

    >>> _over_bytes(bytes(256), np.dtype(np.float32), torch.float32, (8, 8)).shape
    torch.Size([8, 8])
    """
    array = np.frombuffer(raw, dtype).reshape(dims)
    if len(raw) <= SHARED_MIN_BYTES or array.ctypes.data % dtype.itemsize:
        return torch.from_numpy(array.copy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=torch_dtype).reshape(dims)


def _sparse_to_dense(sp: onnx.SparseTensorProto) -> torch.Tensor:
    values = _tensor(sp.values)
    indices = _tensor(sp.indices).to(torch.int64)
    shape = list(sp.dims)
    dense = torch.zeros(int(np.prod(shape)), dtype=values.dtype)
    if indices.dim() == 2:
        flat = torch.zeros(indices.shape[0], dtype=torch.int64)
        for axis, size in enumerate(shape):
            flat = flat * size + indices[:, axis]
        indices = flat
    dense[indices.reshape(-1)] = values.reshape(-1)
    return dense.reshape(shape)


def _spec(tp: onnx.TypeProto) -> TensorSpec:
    if not tp.HasField("tensor_type"):
        return TensorSpec()
    tt = tp.tensor_type
    try:
        dtype = DType.from_onnx(tt.elem_type) if tt.elem_type else None
    except ValueError:
        dtype = None
    if not tt.HasField("shape"):
        return TensorSpec(dtype, None)
    dims: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value") and d.dim_value >= 0:
            dims.append(int(d.dim_value))  # a negative one is unknown (frontend/validate.py)
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return TensorSpec(dtype, tuple(dims))


def _container(tp: onnx.TypeProto) -> ContainerSpec | None:
    """A sequence or optional type as the IR's spec of it; None for a tensor type."""
    if tp.HasField("sequence_type"):
        return SequenceSpec(_spec(tp.sequence_type.elem_type))
    if tp.HasField("optional_type"):
        inner = tp.optional_type.elem_type
        held = _container(inner)
        return OptionalSpec(held if isinstance(held, SequenceSpec) else _spec(inner))
    return None


def _typed_value(name: str, tp: onnx.TypeProto | None) -> Value:
    """A value of the declared (or inferred) type ``tp``: a tensor's spec, or the
    sequence or optional it holds (None: nothing known)."""
    if tp is None:
        return Value(name)
    return Value(name, _spec(tp), container=_container(tp))


def _spec_of_tensor(t: torch.Tensor | None, code: int = 0) -> TensorSpec:
    """The spec of ``t``, read from a TensorProto of element type ``code`` (0: not one),
    which tells a sub-byte type from the ordinary type of its container."""
    if t is None:
        return TensorSpec()
    if isinstance(t, np.ndarray):  # a string constant (_strings)
        return TensorSpec(DType.STRING, tuple(int(d) for d in t.shape))
    try:
        declared = DType.from_onnx(code) if code else None
    except ValueError:
        declared = None
    return TensorSpec(DType.from_container(t.dtype, declared), tuple(int(d) for d in t.shape))


def _constant_type(np_: onnx.NodeProto) -> int:
    """The element type code of a Constant node's ``value`` tensor (0: another attribute)."""
    for attr in np_.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return int(attr.t.data_type)
    return 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
