"""A small Python API for building graphs without writing ONNX by hand.

Parameters become ONNX initializers (a :class:`segflow.TrainingSession`
trains them); constants become ``Constant`` nodes, so they are never mistaken
for parameters.

>>> import numpy as np
>>> from segflow.frontend.builder import GraphBuilder
>>> from segflow.ir import DType
>>> b = GraphBuilder()
>>> x = b.input("x", DType.FLOAT32, ["N", 1, 8, 8])
>>> w = b.param("w", np.zeros((4, 1, 3, 3), np.float32))
>>> y = b.op("Relu", b.op("Conv", x, w, pads=[1, 1, 1, 1]))
>>> b.output(y, "y")
>>> graph = b.to_graph()
>>> [n.op_type for n in graph.nodes]
['Conv', 'Relu']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from segflow.ir.graph import Graph
from segflow.ir.types import Dim, DType

ArrayLike = np.ndarray | torch.Tensor | float | int | Sequence[float] | Sequence[int]


@dataclass(frozen=True, slots=True, eq=False)
class Sym:
    """A named value under construction; arithmetic operators emit nodes."""

    builder: GraphBuilder = field(repr=False)
    name: str

    def __add__(self, other: Sym | ArrayLike) -> Sym:
        return self.builder.op("Add", self, other)

    def __radd__(self, other: ArrayLike) -> Sym:
        return self.builder.op("Add", other, self)

    def __sub__(self, other: Sym | ArrayLike) -> Sym:
        return self.builder.op("Sub", self, other)

    def __rsub__(self, other: ArrayLike) -> Sym:
        return self.builder.op("Sub", other, self)

    def __mul__(self, other: Sym | ArrayLike) -> Sym:
        return self.builder.op("Mul", self, other)

    def __rmul__(self, other: ArrayLike) -> Sym:
        return self.builder.op("Mul", other, self)

    def __truediv__(self, other: Sym | ArrayLike) -> Sym:
        return self.builder.op("Div", self, other)

    def __rtruediv__(self, other: ArrayLike) -> Sym:
        return self.builder.op("Div", other, self)

    def __matmul__(self, other: Sym) -> Sym:
        return self.builder.op("MatMul", self, other)

    def __neg__(self) -> Sym:
        return self.builder.op("Neg", self)


class GraphBuilder:
    """Accumulates inputs, parameters, nodes and outputs of one graph.

    ``op`` returns one :class:`Sym` (or a tuple when ``outputs`` > 1); plain
    numbers and arrays passed as inputs become constants of the dtype of the
    first float input (or their own dtype).
    """

    def __init__(self, name: str = "graph", opset: int = 17) -> None:
        self.name = name
        self.opset = opset
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[str] = []
        self._initializers: list[onnx.TensorProto] = []
        self._nodes: list[onnx.NodeProto] = []
        self._dtypes: dict[str, DType] = {}
        self._used: set[str] = set()
        self._counter = 0
        self._renamed: dict[str, str] = {}

    # -- declarations ------------------------------------------------------------------
    def input(self, name: str, dtype: DType, shape: Sequence[Dim]) -> Sym:
        """A graph input; dims may be ints, symbolic names or None."""
        self._claim(name)
        dims = [d if d is not None else "?" for d in shape]
        self._inputs.append(helper.make_tensor_value_info(name, dtype.value, dims))
        self._dtypes[name] = dtype
        return Sym(self, name)

    def param(self, name: str, data: ArrayLike) -> Sym:
        """A trainable parameter (an ONNX initializer) holding ``data``."""
        self._claim(name)
        array = _as_array(data)
        self._initializers.append(numpy_helper.from_array(array, name))
        self._dtypes[name] = DType.from_numpy(array.dtype)
        return Sym(self, name)

    def const(self, data: ArrayLike, name: str | None = None,
              dtype: DType | None = None) -> Sym:
        """A constant (a ``Constant`` node: not a parameter)."""
        array = _as_array(data, dtype)
        out = self._fresh(name or "const")
        self._nodes.append(helper.make_node("Constant", [], [out], name=out,
                                            value=numpy_helper.from_array(array, out)))
        self._dtypes[out] = DType.from_numpy(array.dtype)
        return Sym(self, out)

    def op(self, op_type: str, *inputs: Sym | ArrayLike | None, outputs: int = 1,
           name: str | None = None, domain: str = "", **attrs: Any) -> Any:
        """Emit ``op_type`` over ``inputs`` (None: an omitted optional input)."""
        floats = (DType.FLOAT32, DType.FLOAT64)
        known = [self._dtypes.get(self._renamed.get(v.name, v.name)) for v in inputs
                 if isinstance(v, Sym)]
        like = next((d for d in known if d in floats), None)
        names = []
        for value in inputs:
            if value is None:
                names.append("")
            elif isinstance(value, Sym):
                names.append(self._renamed.get(value.name, value.name))
            else:
                names.append(self.const(value, dtype=like if _is_float(value) else None).name)
        node_name = self._fresh(name or op_type)
        outs = [node_name if outputs == 1 else f"{node_name}:{i}" for i in range(outputs)]
        for out in outs[1:]:
            self._claim(out)
        parsed = {k: _attr(v) for k, v in attrs.items()}
        self._nodes.append(helper.make_node(op_type, names, outs, name=node_name,
                                            domain=domain or None, **parsed))
        if like is not None and op_type not in _TYPE_CHANGING:
            self._dtypes.update(dict.fromkeys(outs, like))
        syms = tuple(Sym(self, o) for o in outs)
        return syms[0] if outputs == 1 else syms

    def output(self, value: Sym, name: str | None = None) -> Sym:
        """Mark ``value`` as a graph output, optionally renamed to ``name``."""
        value = Sym(self, self._renamed.get(value.name, value.name))
        if name is not None and name != value.name:
            self._claim(name)
            if not self._rename(value.name, name):
                self._nodes.append(helper.make_node("Identity", [value.name], [name], name=name))
            value = Sym(self, name)
        self._outputs.append(value.name)
        return value

    # -- results -----------------------------------------------------------------------
    def to_model(self) -> onnx.ModelProto:
        """The ONNX model (output types filled in by ONNX shape inference)."""
        graph = helper.make_graph(self._nodes, self.name, self._inputs, [],
                                  initializer=self._initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="segflow.builder")
        model.ir_version = 8
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:
            inferred = model
        infos = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.input]}
        for name in self._outputs:
            info = infos.get(name)
            model.graph.output.append(info if info is not None
                                      else helper.make_empty_tensor_value_info(name))
        return model

    def to_graph(self) -> Graph:
        """The segflow :class:`Graph` (through the ONNX importer, so it is checked)."""
        from segflow.frontend.onnx_import import import_model
        return import_model(self.to_model())

    # -- helpers -----------------------------------------------------------------------
    def _claim(self, name: str) -> None:
        if name in self._used:
            raise ValueError(f"name {name!r} is already used in graph {self.name!r}")
        self._used.add(name)

    def _rename(self, old: str, new: str) -> bool:
        """Rename a node output (and its uses); False for inputs and parameters."""
        if old in self._outputs or not any(old in n.output for n in self._nodes):
            return False
        for node in self._nodes:
            for field_ in (node.output, node.input):
                for i, name in enumerate(field_):
                    if name == old:
                        field_[i] = new
        if old in self._dtypes:
            self._dtypes[new] = self._dtypes[old]
        self._renamed[old] = new  # Syms the caller still holds keep working
        return True

    def _fresh(self, stem: str) -> str:
        name = stem
        while name in self._used:
            self._counter += 1
            name = f"{stem}_{self._counter}"
        self._used.add(name)
        return name


# Ops whose outputs need not share the dtype of their float inputs.
_TYPE_CHANGING = frozenset({
    "Cast", "CastLike", "Shape", "Size", "NonZero", "ArgMax", "ArgMin", "TopK", "Equal", "Less",
    "Greater", "LessOrEqual", "GreaterOrEqual", "IsNaN", "IsInf", "Not", "And", "Or", "Xor",
    "Dropout", "MaxPool", "Unique", "QuantizeLinear", "DynamicQuantizeLinear",
})


def _is_float(value: ArrayLike) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    return np.asarray(value).dtype.kind == "f"


def _as_array(data: ArrayLike, dtype: DType | None = None) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    array = np.asarray(data)
    if dtype is not None:
        array = array.astype(dtype.numpy)
    elif array.dtype == np.float64 and not isinstance(data, np.ndarray):
        array = array.astype(np.float32)  # Python floats default to float32 constants
    return np.ascontiguousarray(array) if array.ndim else array


def _attr(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return numpy_helper.from_array(value)
    if isinstance(value, torch.Tensor):
        return numpy_helper.from_array(value.detach().cpu().numpy())
    if isinstance(value, tuple):
        return list(value)
    return value
