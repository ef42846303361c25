"""Graph, Node and Value: segflow's in-memory IR.

A :class:`Graph` owns its nodes in topological order. Values are edges: each
has at most one producer (a node, or nothing for graph inputs, initializers
and values captured from an enclosing graph) and a list of uses. Mutate
through the Graph's methods so producers and uses stay consistent; call
:meth:`Graph.validate` to check that they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from segflow.ir.types import ContainerSpec, Device, TensorSpec


class IRError(Exception):
    """The graph is structurally broken (a bug in a frontend or a pass)."""


class Value:
    """An edge of the graph: a tensor, or a sequence or optional value (``container``).

    ``spec`` describes a tensor value; a sequence's or an optional's is empty (nothing
    about it is a tensor's shape), and ``container`` says what it holds instead.
    """

    __slots__ = ("name", "spec", "producer", "uses", "const", "container")

    def __init__(self, name: str, spec: TensorSpec | None = None,
                 const: torch.Tensor | None = None,
                 container: ContainerSpec | None = None) -> None:
        self.name = name
        self.spec = spec or TensorSpec()
        # The value's kind beyond tensors (a sequence, an optional); None: a tensor.
        self.container = container
        self.producer: Node | None = None
        self.uses: list[Node] = []
        # Initializer / folded constant data; None for computed values.
        self.const = const

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def is_tensor(self) -> bool:
        return self.container is None

    def describe(self) -> str:
        """The value's type as errors show it: ``float[1,3]``, ``seq(float[?])``."""
        return self.spec.describe() if self.container is None else self.container.describe()

    def __repr__(self) -> str:
        return f"%{self.name}"


class Node:
    """One operator application. ``inputs`` may hold None for omitted optional inputs."""

    __slots__ = ("name", "op_type", "domain", "inputs", "outputs", "attrs",
                 "subgraphs", "opset", "device", "graph")

    def __init__(self, op_type: str, inputs: Iterable[Value | None], outputs: Iterable[Value],
                 attrs: dict[str, Any] | None = None, *, name: str = "", domain: str = "",
                 opset: int = 17, subgraphs: dict[str, Graph] | None = None) -> None:
        self.name = name
        self.op_type = op_type
        self.domain = domain
        self.inputs: tuple[Value | None, ...] = tuple(inputs)
        self.outputs: tuple[Value, ...] = tuple(outputs)
        self.attrs: dict[str, Any] = dict(attrs or {})
        self.subgraphs: dict[str, Graph] = dict(subgraphs or {})
        self.opset = opset
        self.device: Device | None = None
        self.graph: Graph | None = None

    @property
    def label(self) -> str:
        """``%y = Conv(%x, %w)`` — how errors name a node."""
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        ins = ", ".join("None" if v is None else f"%{v.name}" for v in self.inputs)
        name = f" [{self.name}]" if self.name else ""
        return f"{outs} = {self.op_type}({ins}){name}"

    @property
    def touches_containers(self) -> bool:
        """Whether the node reads or writes a sequence or optional value: such a node runs
        on the host as a LOCAL task, and passes that rewrite tensors leave it alone."""
        return any(v is not None and v.container is not None
                   for v in (*self.inputs, *self.outputs))

    def __repr__(self) -> str:
        return f"<Node {self.label}>"


class Graph:
    """A dataflow graph with explicit inputs, outputs and initializers."""

    def __init__(self, name: str = "graph", *, parent: Graph | None = None) -> None:
        self.name = name
        self.parent = parent
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.initializers: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.opsets: dict[str, int] = {"": 17}

    # -- construction ----------------------------------------------------------------
    def add_input(self, value: Value) -> Value:
        self.inputs.append(value)
        return value

    def add_initializer(self, value: Value) -> Value:
        if value.const is None:
            raise IRError(f"initializer {value.name} has no data")
        self.initializers[value.name] = value
        return value

    def append(self, node: Node) -> Node:
        """Add ``node`` at the end (callers append in topological order)."""
        self._attach(node)
        self.nodes.append(node)
        return node

    def insert_before(self, anchor: Node, node: Node) -> Node:
        self._attach(node)
        self.nodes.insert(self.nodes.index(anchor), node)
        return node

    def _attach(self, node: Node) -> None:
        node.graph = self
        for value in node.inputs:
            if value is not None:
                value.uses.append(node)
        for value in node.outputs:
            if value.producer is not None and value.producer is not node:
                raise IRError(f"value %{value.name} already produced by {value.producer.label}")
            value.producer = node

    # -- mutation --------------------------------------------------------------------
    def remove(self, node: Node) -> None:
        """Remove a node whose outputs are no longer used."""
        for value in node.outputs:
            if value.uses or value in self.outputs:
                raise IRError(f"cannot remove {node.label}: %{value.name} is still used")
            value.producer = None
        for operand in node.inputs:
            if operand is not None:
                operand.uses.remove(node)
        self.nodes.remove(node)
        node.graph = None

    def set_input(self, node: Node, index: int, value: Value | None) -> None:
        old = node.inputs[index]
        if old is not None:
            old.uses.remove(node)
        if value is not None:
            value.uses.append(node)
        inputs = list(node.inputs)
        inputs[index] = value
        node.inputs = tuple(inputs)

    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Point every consumer of ``old`` (and graph outputs) at ``new``."""
        for node in list(old.uses):
            for i, value in enumerate(node.inputs):
                if value is old:
                    self.set_input(node, i, new)
        self.outputs = [new if v is old else v for v in self.outputs]

    # -- queries ---------------------------------------------------------------------
    def values(self) -> Iterator[Value]:
        seen: set[int] = set()
        for value in [*self.inputs, *self.initializers.values()]:
            seen.add(id(value))
            yield value
        for node in self.nodes:
            for edge in (*node.inputs, *node.outputs):
                if edge is not None and id(edge) not in seen:
                    seen.add(id(edge))
                    yield edge

    def walk(self) -> Iterator[Node]:
        """All nodes, including those inside subgraphs."""
        for node in self.nodes:
            yield node
            for sub in node.subgraphs.values():
                yield from sub.walk()

    def captured_values(self) -> list[Value]:
        """Values read by this graph (or its subgraphs) that it neither defines nor imports."""
        defined = {id(v) for v in [*self.inputs, *self.initializers.values()]}
        defined.update(id(v) for n in self.nodes for v in n.outputs)
        captured: dict[int, Value] = {}
        for node in self.nodes:
            reads = [v for v in node.inputs if v is not None]
            for sub in node.subgraphs.values():
                reads.extend(sub.captured_values())
            for value in reads:
                if id(value) not in defined:
                    captured.setdefault(id(value), value)
        return list(captured.values())

    def toposort(self) -> None:
        """Reorder nodes topologically (stable: keeps the existing order where legal)."""
        available = {id(v) for v in [*self.inputs, *self.initializers.values()]}
        available.update(id(v) for v in self.captured_values())
        pending = list(self.nodes)
        ordered: list[Node] = []
        while pending:
            progressed = False
            rest: list[Node] = []
            for node in pending:
                if all(v is None or id(v) in available for v in node_reads(node)):
                    ordered.append(node)
                    available.update(id(v) for v in node.outputs)
                    progressed = True
                else:
                    rest.append(node)
            if not progressed:
                raise IRError(f"graph {self.name} has a cycle through {rest[0].label}")
            pending = rest
        self.nodes = ordered

    def validate(self) -> None:
        """Check ownership, producer/use consistency and topological order."""
        defined: set[int] = {id(v) for v in [*self.inputs, *self.initializers.values()]}
        outer = {id(v) for v in self._outer_values()}
        for node in self.nodes:
            if node.graph is not self:
                raise IRError(f"{node.label} is not owned by graph {self.name}")
            for value in node_reads(node):
                if value is None:
                    continue
                if id(value) not in defined and id(value) not in outer:
                    raise IRError(f"{node.label} reads %{value.name} before it is defined")
            for value in node.inputs:
                if value is not None and node not in value.uses:
                    raise IRError(f"%{value.name} does not record its use by {node.label}")
            for value in node.outputs:
                if value.producer is not node:
                    raise IRError(f"%{value.name} does not record {node.label} as producer")
                if id(value) in defined:
                    raise IRError(f"%{value.name} is defined twice")
                defined.add(id(value))
            for sub in node.subgraphs.values():
                sub.validate()
        for value in self.outputs:
            if id(value) not in defined and id(value) not in outer:
                raise IRError(f"graph output %{value.name} is never defined")

    def _outer_values(self) -> list[Value]:
        """Values visible from enclosing graphs (for subgraph bodies)."""
        out: list[Value] = []
        graph = self.parent
        while graph is not None:
            out.extend(graph.values())
            graph = graph.parent
        return out

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self.nodes)} nodes>"


def captured_inputs(node: Node) -> list[Value]:
    """Outer values a node's subgraphs read, deduplicated, in a stable order."""
    seen: dict[int, Value] = {}
    for sub in node.subgraphs.values():
        for value in sub.captured_values():
            seen.setdefault(id(value), value)
    return list(seen.values())


def node_reads(node: Node) -> list[Value | None]:
    """Explicit inputs followed by captured values: everything a node depends on
    (and, in this order, what its bound kernel receives)."""
    return [*node.inputs, *captured_inputs(node)]
