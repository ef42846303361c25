"""Model checks at load: what onnxruntime refuses, segflow refuses before it runs anything.

Why one module at ~500 lines: its four layers are one contract, the refusals onnxruntime
makes, each with the same one-line message naming the node; the op checks
(:data:`OP_CHECKS`) are the part that grows and the first to move to a module of their own.

Each failure is a :class:`segflow.errors.InvalidModel` (an ``UnsupportedOp`` for
what segflow does not implement) whose one-line message names the node (or
graph input), its op and what is wrong. Four layers, in the order the frontend
runs them:

- :func:`check_structure`, on the ModelProto before anything reads it: every
  value defined once (SSA, with ONNX's scoping of subgraphs), graph inputs
  segflow can feed, the opsets the model imports.
- :func:`inference_error`, on the errors of ONNX's own shape inference in strict
  mode: the per-node checks onnxruntime runs while resolving the graph (ranks,
  attribute values, broadcasting, a ``value_info`` dtype contradicting its
  producer). Shape merges onnxruntime resolves leniently are not errors.
- :func:`check_schema`, per node: the node against its ONNX schema (attributes
  known and present, input and output counts) and the dtypes of its inputs
  against the schema's type constraints, as onnxruntime verifies them.
- :data:`OP_CHECKS`, op type -> checker, on the imported graph where the specs
  are known: what onnxruntime's kernels refuse when created or at their first
  run (groups against channels, a kernel against its weight or its padded
  input, pool pads against the kernel), refused at load instead; for the
  com.microsoft ops segflow implements, :data:`CONTRIB_SIGNATURES`, the inputs and
  attributes onnxruntime's contrib schemas require (ONNX has none to check them by).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from segflow.errors import InvalidModel, UnsupportedOp
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType

# A declared dim of -1 is how several exporters write "unknown" (onnxruntime reads it so).
UNKNOWN_DIM = -1
AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def node_name(node: onnx.NodeProto) -> str:
    """How the frontend names a node: its name, else its first output, else its op."""
    return node.name or (node.output[0] if node.output else node.op_type)


# -- structure -----------------------------------------------------------------------
def check_structure(model: onnx.ModelProto, newest_opset: int) -> dict[str, int]:
    """Check opsets, graph inputs and single assignment; return domain -> opset version.

    A model must import the ONNX opset its nodes use (onnxruntime refuses a model that
    imports none); an opset newer than ``newest_opset`` is not implemented.
    """
    opsets = declared_opsets(model)
    first = next(_default_domain_nodes(model.graph), None)
    at = f"node {node_name(first)!r} ({first.op_type})" if first is not None else "the graph"
    if not model.opset_import:
        raise InvalidModel(f"{at}: the model imports no opset (opset_import is empty); it must "
                           "list the ai.onnx opset its nodes use")
    if "" not in opsets:
        if first is not None:
            raise InvalidModel(f"{at} is in the ai.onnx domain, which the model's "
                               "opset_import does not list")
    elif opsets[""] > newest_opset:
        raise UnsupportedOp(f"{at}: the model imports ai.onnx opset {opsets['']}; segflow "
                            f"implements ai.onnx opsets up to {newest_opset}")
    _check_inputs(model.graph)
    _check_single_assignment(model.graph, outer={})
    return opsets


def declared_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """Domain -> opset version as ``model`` imports them (``""`` for ai.onnx)."""
    return {(imp.domain if imp.domain != "ai.onnx" else ""): imp.version
            for imp in model.opset_import}


def _default_domain_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        if node.domain in ("", "ai.onnx"):
            yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                yield from _default_domain_nodes(sub)


def _check_inputs(graph: onnx.GraphProto) -> None:
    initializers = {t.name for t in graph.initializer}
    for vi in graph.input:
        if vi.name in initializers or not vi.type.HasField("tensor_type"):
            continue
        tensor = vi.type.tensor_type
        for axis, dim in enumerate(tensor.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value < 0 \
                    and dim.dim_value != UNKNOWN_DIM:
                raise InvalidModel(f"graph input {vi.name!r} declares dimension "
                                   f"{dim.dim_value} at axis {axis}; a dimension is >= 0, "
                                   f"or {UNKNOWN_DIM} or a name for an unknown one")


def _check_single_assignment(graph: onnx.GraphProto, outer: dict[str, str]) -> None:
    """Every name defined once (onnxruntime: "Duplicate definition of name").

    ``outer`` maps each name the enclosing graphs define, where this graph is read, to
    what defines it. A subgraph's inputs and initializers may shadow those names; its
    nodes may not redefine them (ONNX's checker rule, which onnxruntime applies). A
    repeated initializer, or a Constant node writing an initializer's name, is not an
    error: onnxruntime warns and keeps the last one, as segflow does.
    """
    defined: dict[str, str] = {}
    for vi in graph.input:
        if vi.name in defined:
            raise InvalidModel(f"graph input {vi.name!r} is declared twice in graph "
                               f"{graph.name!r}")
        defined[vi.name] = "a graph input"
    constants = set()
    for tensor in graph.initializer:
        defined.setdefault(tensor.name, "an initializer")
        constants.add(tensor.name)
    for sparse in graph.sparse_initializer:
        defined.setdefault(sparse.values.name, "an initializer")
        constants.add(sparse.values.name)
    for node in graph.node:
        label = node_name(node)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                _check_single_assignment(sub, {**outer, **defined})
        is_constant = node.op_type == "Constant" and node.domain in ("", "ai.onnx")
        for name in node.output:
            if not name:
                continue
            if is_constant and name in constants:
                continue  # onnxruntime: a duplicate initializer, the last one kept
            where = defined.get(name) or outer.get(name)
            if where is not None:
                raise InvalidModel(f"node {label!r} ({node.op_type}) writes {name!r}, which "
                                   f"{where} already defines")
            defined[name] = f"node {label!r} ({node.op_type})"
            if is_constant:
                constants.add(name)


# -- ONNX shape inference ------------------------------------------------------------
# One error of strict shape inference: "(op_type:Conv, node name: c1): <what is wrong>".
_INFERENCE_ERROR = re.compile(r"\(op_type:([^,]*), node name: ([^)]*)\): (.*)")
# A declared shape that contradicts the inferred one: onnxruntime warns and goes on. An
# input without a type follows from an earlier error (refused itself, or lenient).
_LENIENT = ("Inferred shape and existing shape differ", "Can't merge shape info",
            "expected to have type but instead is null")

# An error inside the expansion of a function op's body (MeanVarianceNormalization with
# its default axes trips onnx's own body): onnxruntime runs such ops by their kernels and
# loads the model. The node's types are still checked against its schema.
_IN_FUNCTION_BODY = re.compile(r"Inference error\(s\): \(op_type:\w+\): ")


def inference_error(exc: Exception) -> InvalidModel | None:
    """The refusal for a failed strict shape inference, or None where onnxruntime would
    accept the model (its errors are only declared shapes it merges leniently)."""
    text = str(exc)
    for line in text.splitlines():
        match = _INFERENCE_ERROR.search(line)
        if match is None:
            continue
        op_type, name, what = match.groups()
        if any(lenient in what for lenient in _LENIENT) or _IN_FUNCTION_BODY.search(what):
            continue
        what = re.sub(r"^(\[\w+\] )+", "", what).strip()
        types = _ELEM_TYPES.search(what)
        if types is not None:
            inferred, declared = (_type_name(int(code)) for code in types.groups())
            what = f"it yields {inferred}, but the model declares {declared} for its output"
        return InvalidModel(f"node {name!r} ({op_type}): {what}")
    return None


_ELEM_TYPES = re.compile(r"Inferred elem type differs from existing elem type: \((\d+)\) vs "
                         r"\((\d+)\)")


def _type_name(code: int) -> str:
    try:
        return onnx_type(DType.from_onnx(code))
    except ValueError:
        return onnx.TensorProto.DataType.Name(code).lower()


# -- schemas --------------------------------------------------------------------------
class SchemaChecker:
    """Checks nodes against their ONNX schemas (one per model: it caches the schemas)."""

    def __init__(self, opsets: dict[str, int], ir_version: int) -> None:
        self.context = onnx.checker.C.CheckerContext()
        self.context.ir_version = ir_version
        self.context.opset_imports = dict(opsets)
        self.opsets = opsets
        self._schemas: dict[tuple[str, int], Any] = {}

    def schema(self, op_type: str, opset: int) -> Any:
        key = (op_type, opset)
        if key not in self._schemas:
            try:
                schema = onnx.defs.get_schema(op_type, opset, "")
            except onnx.defs.SchemaError:
                schema = None
            self._schemas[key] = None if schema is None or schema.deprecated else schema
        return self._schemas[key]

    def check_node(self, node: onnx.NodeProto) -> None:
        """The node's attributes and arity against its schema (ai.onnx nodes only)."""
        if node.domain not in ("", "ai.onnx") or "" not in self.opsets:
            return
        if self.schema(node.op_type, self.opsets[""]) is None:
            return  # unknown to ONNX: the op registry names it
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):
            return  # a subgraph is checked node by node instead
        try:
            onnx.checker.check_node(node, self.context)
        except onnx.checker.ValidationError as exc:
            what = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid node"
            raise InvalidModel(f"node {node_name(node)!r} ({node.op_type}): {what}") from None

    def check_types(self, node: Node) -> None:
        """The dtypes of the node's inputs against its schema's type constraints."""
        if node.domain != "":
            return
        schema = self.schema(node.op_type, node.opset)
        if schema is None:
            return
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
        bound: dict[str, tuple[str, Value]] = {}
        for value, formal in zip(node.inputs, _formals(schema.inputs, len(node.inputs))):
            if value is None or value.spec.dtype is None or formal is None:
                continue
            type_str = onnx_type(value.spec.dtype)
            types = allowed.get(formal.type_str, {formal.type_str})
            if not any(t.startswith("tensor(") for t in types):
                continue  # sequences, optionals: segflow's specs describe tensors only
            if type_str not in types:
                raise InvalidModel(f"node {node.name!r} ({node.op_type}): input {value.name!r} "
                                   f"is {type_str}, which input {formal.name!r} does not "
                                   f"accept ({', '.join(sorted(types))})")
            if formal.type_str in allowed and formal.is_homogeneous:
                seen = bound.setdefault(formal.type_str, (type_str, value))
                if seen[0] != type_str:
                    raise InvalidModel(f"node {node.name!r} ({node.op_type}): inputs "
                                       f"{seen[1].name!r} ({seen[0]}) and {value.name!r} "
                                       f"({type_str}) must have one type "
                                       f"({formal.type_str})")


def _formals(params: Sequence[Any], count: int) -> list[Any]:
    """The schema's formal parameter of each of ``count`` inputs (None past the end)."""
    out: list[Any] = []
    for i in range(count):
        if i < len(params):
            out.append(params[i])
        elif params and params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
            out.append(params[-1])
        else:
            out.append(None)
    return out


# -- op checks -------------------------------------------------------------------------
Checker = Callable[[Node], None]


def check_ops(graph: Graph) -> None:
    """Run :data:`OP_CHECKS` (ai.onnx) and :data:`CONTRIB_SIGNATURES` (com.microsoft) over
    every node of ``graph`` and its subgraphs."""
    for node in graph.walk():
        if node.domain == "":
            check = OP_CHECKS.get(node.op_type)
            if check is not None:
                check(node)
        elif node.domain == CONTRIB_DOMAIN:
            check_contrib(node)


def _refuse(node: Node, what: str) -> InvalidModel:
    return InvalidModel(f"node {node.name!r} ({node.op_type}): {what}")


def _ints(node: Node, name: str) -> list[int] | None:
    value = node.attrs.get(name)
    return None if value is None else [int(v) for v in value]


def _shape(value: Value | None) -> tuple[Any, ...] | None:
    return None if value is None else value.spec.shape


def _check_window(node: Node, spatial: int | None) -> None:
    """The attributes Conv, ConvTranspose and the pools share, against each other."""
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        raise _refuse(node, f"auto_pad {auto_pad!r} is not one of {', '.join(AUTO_PADS)}")
    kernel = _ints(node, "kernel_shape")
    if spatial is None and kernel is not None:
        spatial = len(kernel)
    for name, positive in (("kernel_shape", True), ("strides", True), ("dilations", True),
                           ("pads", False), ("output_padding", False)):
        values = _ints(node, name)
        if values is None:
            continue
        if any(v <= 0 if positive else v < 0 for v in values):
            rule = "positive" if positive else ">= 0"
            raise _refuse(node, f"attribute {name} {values} must be {rule}")
        want = 2 * spatial if name == "pads" and spatial is not None else spatial
        if want is not None and len(values) != want:
            raise _refuse(node, f"attribute {name} {values} has {len(values)} values, "
                                f"expected {want} for {spatial} spatial axes")


def _spatial(node: Node) -> int | None:
    shape = _shape(node.inputs[0]) if node.inputs else None
    return len(shape) - 2 if shape is not None and len(shape) >= 2 else None


def check_conv(node: Node) -> None:
    """Conv and ConvTranspose: attributes, groups against channels, kernel against weight
    and (Conv) against the padded input."""
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    x, w = _shape(node.inputs[0]), _shape(weight)
    spatial = _spatial(node)
    if spatial is None and w is not None and len(w) >= 2:
        spatial = len(w) - 2
    _check_window(node, spatial)
    group = int(node.attrs.get("group", 1))
    if group < 1:
        raise _refuse(node, f"group {group} must be positive")
    if weight is None or w is None or len(w) < 2:
        return
    if x is not None and spatial is not None and len(w) != spatial + 2:
        raise _refuse(node, f"weight {weight.name!r} has rank {len(w)}, expected "
                            f"{spatial + 2} for an input of rank {len(x)}")
    channels = x[1] if x is not None and len(x) >= 2 and isinstance(x[1], int) else None
    transpose = node.op_type == "ConvTranspose"
    if transpose:
        if channels is not None and isinstance(w[0], int) and w[0] != channels:
            raise _refuse(node, f"weight {weight.name!r} has {w[0]} input channels, "
                                f"the input has {channels}")
        if channels is not None and channels % group:
            raise _refuse(node, f"input channels {channels} are not divisible by group {group}")
    else:
        if channels is not None and isinstance(w[1], int) and w[1] * group != channels:
            raise _refuse(node, f"input channels {channels} != group {group} x weight "
                                f"channels {w[1]} (weight {weight.name!r})")
        if isinstance(w[0], int) and w[0] % group:
            raise _refuse(node, f"output channels {w[0]} are not divisible by group {group}")
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    out_channels = w[1] * group if transpose else w[0]
    if isinstance(out_channels, int):
        _check_vector(node, bias, out_channels, "output channels")
    kernel = _ints(node, "kernel_shape")
    window = list(w[2:])
    if kernel is not None and all(isinstance(k, int) for k in window) and kernel != window:
        raise _refuse(node, f"kernel_shape {kernel} contradicts weight "
                            f"{weight.name!r} of shape {list(w)}")
    if transpose:
        strides = _ints(node, "strides") or [1] * len(window)
        dilations = _ints(node, "dilations") or [1] * len(window)
        for axis, pad in enumerate(_ints(node, "output_padding") or []):
            limit = max(strides[axis], dilations[axis]) if axis < len(strides) else 1
            if pad >= limit:
                raise _refuse(node, f"output_padding {pad} at spatial axis {axis} must be less "
                                    f"than max(stride, dilation) = {limit}")
        return
    if x is not None:
        _check_fits(node, list(x[2:]), window)


def _check_fits(node: Node, sizes: list[Any], kernel: list[Any], ceil_mode: bool = False) -> None:
    """A window no larger than the input and its explicit pads (auto_pad NOTSET or
    VALID: SAME pads to fit). With ``ceil_mode`` (pools) the output size is rounded up,
    so a window that overhangs the padded input by less than a stride still makes one
    output, over the part it covers (onnxruntime's and torch's pools agree): global
    pooling written as a kernel larger than the input, as transformers' EfficientNet
    does (``AvgPool2d(1280, ceil_mode=True)`` over 7x7)."""
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID"):
        return
    pads = _ints(node, "pads") if auto_pad == "NOTSET" else None
    pads = pads or [0] * (2 * len(kernel))
    dilations = _ints(node, "dilations") or [1] * len(kernel)
    strides = _ints(node, "strides") or [1] * len(kernel)
    for axis, (size, k) in enumerate(zip(sizes, kernel)):
        if not isinstance(size, int) or not isinstance(k, int) or axis >= len(dilations):
            continue
        reach = dilations[axis] * (k - 1) + 1
        padded = size + pads[axis] + pads[axis + len(kernel)]
        overhang = strides[axis] - 1 if ceil_mode and axis < len(strides) else 0
        if reach > padded + overhang:
            raise _refuse(node, f"kernel of {reach} (dilated) at spatial axis {axis} is larger "
                                f"than the padded input ({padded})")


def check_pool(node: Node) -> None:
    """MaxPool, AveragePool, LpPool: attributes, pads smaller than the kernel (as
    onnxruntime requires), the kernel within the padded input."""
    _check_window(node, _spatial(node))
    kernel = _ints(node, "kernel_shape")
    if kernel is None:
        raise _refuse(node, "attribute kernel_shape is required")
    pads = _ints(node, "pads") or []
    for i, pad in enumerate(pads):
        if pad >= kernel[i % len(kernel)]:
            raise _refuse(node, f"pads {pads} must be smaller than kernel_shape {kernel}")
    x = _shape(node.inputs[0]) if node.inputs else None
    if x is not None:
        # onnxruntime returns an empty tensor here; segflow's pools have no such case.
        _check_fits(node, list(x[2:]), list(kernel),
                    ceil_mode=bool(node.attrs.get("ceil_mode", 0)))


def check_slice(node: Node) -> None:
    """Slice: constant steps are non-zero."""
    steps = node.inputs[4] if len(node.inputs) > 4 else None
    if steps is not None and steps.const is not None and bool((steps.const == 0).any()):
        raise _refuse(node, f"steps {steps.const.tolist()} must be non-zero")


def _check_vector(node: Node, value: Value | None, size: int, what: str) -> None:
    """``value`` (when given, with a known shape) is a vector of ``size`` (``what``)."""
    shape = _shape(value)
    if value is None or shape is None or not all(isinstance(d, int) for d in shape):
        return
    if list(shape) != [size]:
        raise _refuse(node, f"{value.name!r} has shape {list(shape)}, expected [{size}] "
                            f"(the {what})")


def _check_broadcasts(node: Node, value: Value | None, target: Sequence[Any],
                      what: str) -> None:
    """``value`` (when given) broadcasts one way to ``target``: no more dims, each 1 or
    the target's."""
    shape = _shape(value)
    if value is None or shape is None:
        return
    fits = len(shape) <= len(target) and all(
        not isinstance(d, int) or not isinstance(t, int) or d in (1, t)
        for d, t in zip(reversed(shape), reversed(target)))
    if not fits:
        raise _refuse(node, f"{value.name!r} of shape {list(shape)} does not broadcast to "
                            f"{what} {list(target)}")


def check_batch_norm(node: Node) -> None:
    """BatchNormalization: scale, bias, mean and variance are vectors over the channels."""
    x = _shape(node.inputs[0] if node.inputs else None)
    if x is None or len(x) < 2 or not isinstance(x[1], int):
        return
    for value in node.inputs[1:5]:
        _check_vector(node, value, x[1], "input's channels")


def check_layer_norm(node: Node) -> None:
    """LayerNormalization: the axis is in range; scale and bias broadcast to the
    normalized dims."""
    _axis_within(0)(node)
    x = _shape(node.inputs[0] if node.inputs else None)
    if x is None:
        return
    axis = int(node.attrs.get("axis", -1))
    normalized = list(x[axis % len(x):]) if x else []
    for value in node.inputs[1:3]:
        _check_broadcasts(node, value, normalized, "the normalized dims")


def check_gemm(node: Node) -> None:
    """Gemm: C broadcasts to the (M, N) result."""
    a, b = (_shape(node.inputs[i]) if len(node.inputs) > i else None for i in (0, 1))
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return
    m = a[1] if node.attrs.get("transA", 0) else a[0]
    n = b[0] if node.attrs.get("transB", 0) else b[1]
    _check_broadcasts(node, node.inputs[2] if len(node.inputs) > 2 else None, [m, n],
                      "the result")


def _axis_within(extra: int) -> Checker:
    """A checker that the ``axis`` attribute indexes the first input's rank ``r``:
    ``-r <= axis < r + extra`` (``extra`` 1 where the axis may name the end, as
    Flatten's)."""
    def check(node: Node) -> None:
        axis = node.attrs.get("axis")
        shape = _shape(node.inputs[0] if node.inputs else None)
        if axis is None or shape is None:
            return
        rank = len(shape)
        if not -rank <= int(axis) < rank + extra:
            raise _refuse(node, f"axis {axis} is out of range for a rank-{rank} input")
    return check


OP_CHECKS: dict[str, Checker] = {
    "Conv": check_conv,
    "ConvTranspose": check_conv,
    "MaxPool": check_pool,
    "AveragePool": check_pool,
    "LpPool": check_pool,
    "Slice": check_slice,
    "BatchNormalization": check_batch_norm,
    "Gemm": check_gemm,
    # Axes onnxruntime refuses out of range (onnx's inference skips LayerNormalization's).
    "LayerNormalization": check_layer_norm,
    "Softmax": _axis_within(0),
    "LogSoftmax": _axis_within(0),
    "Hardmax": _axis_within(0),
    "Flatten": _axis_within(1),
}


# -- com.microsoft ----------------------------------------------------------------------
CONTRIB_DOMAIN = "com.microsoft"


@dataclass(frozen=True, slots=True)
class ContribSignature:
    """What onnxruntime's schema of a contrib op requires: the input positions that must be
    given and the attributes without a default. ONNX knows no contrib schemas, so neither
    its checker nor :class:`SchemaChecker` sees these."""

    inputs: tuple[int, ...]
    attrs: tuple[str, ...] = ()


_QLINEAR_BINARY = ContribSignature((0, 1, 3, 4, 6))
_QLINEAR_UNARY = ContribSignature((0, 1, 3))

CONTRIB_SIGNATURES: dict[str, ContribSignature] = {
    "QLinearAdd": _QLINEAR_BINARY,
    "QLinearMul": _QLINEAR_BINARY,
    "QLinearConcat": ContribSignature((0, 1, 2, 3, 4), ("axis",)),
    "QLinearGlobalAveragePool": _QLINEAR_UNARY,
    "QLinearAveragePool": ContribSignature((0, 1, 3), ("kernel_shape",)),
    "QLinearSigmoid": _QLINEAR_UNARY,
    "QLinearLeakyRelu": _QLINEAR_UNARY,
    "QLinearSoftmax": ContribSignature((0, 1, 3), ("opset",)),
    "QGemm": ContribSignature((0, 1, 2, 3, 4, 5)),
    "DynamicQuantizeMatMul": ContribSignature((0, 1, 2)),
    "MatMulIntegerToFloat": ContribSignature((0, 1, 2, 3)),
    "QuantizeLinear": ContribSignature((0, 1)),
    "DequantizeLinear": ContribSignature((0, 1)),
    "FusedConv": ContribSignature((0, 1)),
    "FusedGemm": ContribSignature((0, 1)),
    "FusedMatMul": ContribSignature((0, 1)),
    "Gelu": ContribSignature((0,)),
    "FastGelu": ContribSignature((0,)),
    "BiasGelu": ContribSignature((0, 1)),
    "SkipLayerNormalization": ContribSignature((0, 1, 2)),
    "EmbedLayerNormalization": ContribSignature((0, 2, 3, 5, 6)),
    "Attention": ContribSignature((0, 1), ("num_heads",)),
    "MultiHeadAttention": ContribSignature((0,), ("num_heads",)),
    "MatMulNBits": ContribSignature((0, 1, 2), ("K", "N", "block_size")),
}


def check_contrib(node: Node) -> None:
    """A com.microsoft node against its :data:`CONTRIB_SIGNATURES` row (an op without one
    is refused by the op registry, which names it)."""
    signature = CONTRIB_SIGNATURES.get(node.op_type)
    if signature is None:
        return
    for index in signature.inputs:
        if index >= len(node.inputs) or node.inputs[index] is None:
            raise _refuse(node, f"input {index} is required ({node.op_type} has "
                                f"{len(node.inputs)} inputs)")
    for name in signature.attrs:
        if name not in node.attrs:
            raise _refuse(node, f"attribute {name} is required")
    if node.op_type == "QLinearConcat" and (len(node.inputs) - 2) % 3:
        raise _refuse(node, "inputs after y_scale and y_zero_point come in (x, scale, "
                            f"zero point) triples; it has {len(node.inputs) - 2}")


def onnx_type(dtype: DType) -> str:
    """``tensor(float)``: how ONNX's schemas name a tensor type."""
    return f"tensor({dtype.onnx_name})"
