"""What a session keeps of the ModelProto besides its graph: the metadata onnxruntime
reports (``get_modelmeta``), the dim names the model itself declares, the
initializers it lets a caller override, and the format facts (IR version, opsets) an
exported optimized model must carry.

The graph's value specs hold ONNX shape inference's results, which name every dim it
cannot tie to a known one (``unk__0``, ...). onnxruntime reports those dims as None;
:attr:`ModelInfo.declared_dims` is what tells the two kinds of names apart.

>>> info = describe_model(onnx.load("model.onnx"))   # doctest: +SKIP
>>> info.metadata.producer_name                      # doctest: +SKIP
'pytorch'
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import onnx


def _no_entries() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """The model's metadata, as onnxruntime's ``InferenceSession.get_modelmeta()`` gives it."""

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""            # the model's doc_string
    graph_description: str = ""      # the graph's doc_string
    version: int = 0                 # model_version
    custom_metadata_map: Mapping[str, str] = field(default_factory=_no_entries)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The facts of a ModelProto a session needs after import (the proto itself, with
    its weights, is not kept)."""

    metadata: ModelMetadata
    declared_dims: frozenset[str]
    # Initializers that are also graph inputs (old exporters): name -> ValueInfo-like
    # (elem type, dims), in graph input order.
    overridable: tuple[tuple[str, int, tuple[int, ...]], ...]
    ir_version: int
    opsets: tuple[tuple[str, int], ...]

    def reported_dim(self, dim: int | str | None) -> int | str | None:
        """``dim`` as onnxruntime reports it: a name the model does not declare is one
        shape inference invented, reported as unknown (None)."""
        if isinstance(dim, str) and dim not in self.declared_dims:
            return None
        return dim


def describe_model(proto: onnx.ModelProto) -> ModelInfo:
    """Read :class:`ModelInfo` from ``proto`` (cheap: no tensor data is touched)."""
    graph = proto.graph
    metadata = ModelMetadata(
        producer_name=proto.producer_name, graph_name=graph.name, domain=proto.domain,
        description=proto.doc_string, graph_description=graph.doc_string,
        version=int(proto.model_version),
        custom_metadata_map=MappingProxyType({p.key: p.value for p in proto.metadata_props}))
    initializers = {t.name: t for t in graph.initializer}
    overridable = tuple((vi.name, initializers[vi.name].data_type,
                         tuple(int(d) for d in initializers[vi.name].dims))
                        for vi in graph.input if vi.name in initializers)
    return ModelInfo(metadata, frozenset(_dim_names(graph)), overridable,
                     int(proto.ir_version),
                     tuple((o.domain, int(o.version)) for o in proto.opset_import))


def _dim_names(graph: onnx.GraphProto) -> Iterator[str]:
    """Every dim_param the graph (and its subgraphs) declares on a value."""
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for dim in vi.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") and dim.dim_param:
                    yield dim.dim_param
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _dim_names(attr.g)
