"""Pass ``specialize``: where a graph computes shapes at run time from symbolic input
dims, it is planned again for each input shape it runs at.

Exporters write a model's reshapes over symbolic batch and sequence dims as arithmetic
on ``Shape`` outputs (``Shape -> Gather -> Unsqueeze -> Concat -> Reshape``, with
``Slice``, ``Squeeze``, ``Mul`` and ``Div`` between). With the dims symbolic, that
arithmetic runs on every call (dozens of one-element kernels a layer) and the reshapes
it feeds have unknown output shapes, so the fuse rules that need shapes (the heads of
an attention, a reshape that changes nothing) cannot match. Bound to one input shape
the graph is static: ONNX's shape inference gives every value its shape, constant
folding evaluates the whole arithmetic, and the pipeline sees what a fixed-shape export
would have given it.

The pass itself changes nothing: it finds the nodes that compute shapes at run time
(:func:`runtime_shape_nodes`) and logs them. The session then keeps a copy of the model
without its large weights (:func:`shape_skeleton`) and, for each input shape a run
brings, binds the inputs' dims (:func:`bind_input_shapes`) and plans that graph with the
session's weights and options (``runtime/specialized.py``).

>>> sorted(runtime_shape_nodes(graph))            # doctest: +SKIP
['Shape']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import onnx

from segflow.ir.graph import Graph
from segflow.passes.result import PassResult

if TYPE_CHECKING:
    from segflow.passes.pipeline import PassContext

# The ops whose output is a shape (or a size) read off their input's dims at run time.
SHAPE_OPS = ("Shape", "Size")
# Ops whose output shape depends on their input's values, not only on its shape: a shape
# read downstream of one stays a run-time value whatever the input dims are bound to.
DATA_DEPENDENT_SHAPE_OPS = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression"})
# Specialized plans a session keeps; a shape past them runs the session's own plan
# (no eviction: a workload cycling over more shapes would otherwise plan on every call).
SPECIALIZE_CAP = 8


def symbolic_inputs(graph: Graph) -> list[str]:
    """The graph inputs with a dim that is not a fixed size (a name or unknown)."""
    return [v.name for v in graph.inputs
            if v.spec.shape is None or any(not isinstance(d, int) for d in v.spec.shape)]


def runtime_shape_nodes(graph: Graph) -> Counter[str]:
    """How many nodes of each op type read a shape off a value at run time (``Shape``,
    ``Size``) in ``graph`` as it stands; empty when its inputs' dims are all fixed (the
    pipeline has folded every such node then). A shape read off a value downstream of a
    NonZero (or another op whose output shape depends on data) is not counted: binding
    the input dims would not fold it."""
    if not symbolic_inputs(graph):
        return Counter()
    dependent = _data_dependent_values(graph)
    return Counter(n.op_type for n in graph.nodes if n.domain == "" and n.op_type in SHAPE_OPS
                   and not (n.inputs and n.inputs[0] is not None
                            and n.inputs[0].name in dependent))


def _data_dependent_values(graph: Graph) -> set[str]:
    """The values whose shape may depend on data (downstream of a NonZero and the like);
    binding the input dims does not fix a shape read off them (nodes in order)."""
    dependent: set[str] = set()
    for node in graph.nodes:
        if (node.domain == "" and node.op_type in DATA_DEPENDENT_SHAPE_OPS) or any(
                v is not None and v.name in dependent for v in node.inputs):
            dependent.update(v.name for v in node.outputs)
    return dependent


def unbound_dims(graph: Graph) -> list[str]:
    """The symbolic dims of computed values that no graph input declares (sorted): shape
    inference could not relate them to the inputs' (a convolution whose padding was
    computed from its input's size, say), so the memory plan and the kernels see sizes
    unknown until run time; empty when the inputs' dims are all fixed. Values downstream
    of a NonZero and the like are left out: their dims depend on data."""
    if not symbolic_inputs(graph):
        return []
    declared = {d for v in graph.inputs for d in (v.spec.shape or ()) if isinstance(d, str)}
    dependent = _data_dependent_values(graph)   # binding the inputs would not fix these
    return sorted({d for node in graph.nodes for v in node.outputs if v.name not in dependent
                   for d in (v.spec.shape or ()) if isinstance(d, str) and d not in declared})


def specialize_reason(graph: Graph) -> str | None:
    """Why a plan per input shape pays for ``graph`` (None: it does not): shapes it
    computes at run time (:func:`runtime_shape_nodes`), or dims of its values that are
    unknown until run time (:func:`unbound_dims`)."""
    if not all(v.is_tensor for v in graph.inputs):
        return None   # a sequence or optional feed has no one shape to plan for
    nodes = runtime_shape_nodes(graph)
    if nodes:
        counts = ", ".join(f"{op} {n}" for op, n in sorted(nodes.items()))
        return f"shapes computed at run time from {', '.join(symbolic_inputs(graph))} ({counts})"
    unbound = unbound_dims(graph)
    if unbound:
        shown = ", ".join(unbound[:3]) + (f", ... ({len(unbound)})" if len(unbound) > 3 else "")
        return (f"dims unknown until run time ({shown}) over "
                f"{', '.join(symbolic_inputs(graph))}")
    return None


def specialize_pass(graph: Graph, context: PassContext) -> PassResult:
    """Log what a plan per input shape would fold (the session builds those plans)."""
    reason = specialize_reason(graph)
    if reason is None:
        return PassResult(graph, False, ("specialize: nothing computes shapes at run time",))
    return PassResult(graph, False, (
        f"specialize: {reason}; planned again for each input shape, up to {SPECIALIZE_CAP}",))


def shape_skeleton(proto: onnx.ModelProto, keep_bytes: int
                   ) -> tuple[onnx.ModelProto, frozenset[str]]:
    """A copy of ``proto`` whose initializers over ``keep_bytes`` keep their name, type and
    dims but not their data (the session supplies those tensors, named in the returned
    set), and without the exporter's value_info (shape inference derives it again for
    the bound shape)."""
    light = onnx.ModelProto()
    _copy_but_graph(proto, light)
    graph, source = light.graph, proto.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.sparse_initializer.extend(source.sparse_initializer)
    stripped = set()
    for tensor in source.initializer:
        if _bytes(tensor) <= keep_bytes:
            graph.initializer.append(tensor)
        else:
            graph.initializer.add(name=tensor.name, data_type=tensor.data_type,
                                  dims=tensor.dims)
            stripped.add(tensor.name)
    return light, frozenset(stripped)


def _copy_but_graph(proto: onnx.ModelProto, light: onnx.ModelProto) -> None:
    light.ir_version = proto.ir_version
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    light.metadata_props.extend(proto.metadata_props)
    light.producer_name = proto.producer_name
    light.producer_version = proto.producer_version
    light.domain = proto.domain
    light.model_version = proto.model_version
    light.doc_string = proto.doc_string


def _bytes(tensor: onnx.TensorProto) -> int:
    numel = 1
    for d in tensor.dims:
        numel *= int(d)
    return numel * 8       # an upper bound: only small ones are kept whole


def bind_input_shapes(skeleton: onnx.ModelProto,
                      shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """A copy of ``skeleton`` whose graph inputs named in ``shapes`` have those dims.

    >>> bound = bind_input_shapes(skeleton, {"x": (1, 128, 256)})   # doctest: +SKIP
    """
    bound = onnx.ModelProto()
    bound.CopyFrom(skeleton)
    for vi in bound.graph.input:
        dims = shapes.get(vi.name)
        if dims is None or not vi.type.HasField("tensor_type"):
            continue
        shape = vi.type.tensor_type.shape
        shape.ClearField("dim")
        for size in dims:
            shape.dim.add().dim_value = int(size)
    return bound
