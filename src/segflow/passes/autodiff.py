"""Reverse-mode autodiff: append the backward graph of a scalar loss to its forward graph.

Each OpDef row may declare a gradient rule (``OpDef.grad``)::

    rule(ctx: GradContext, node: Node, grad_outputs: Sequence[Value | None])
        -> Sequence[Value | None]          # one gradient per input (None: none)

A rule emits backward nodes through ``ctx`` and may ask the forward node for
residuals it needs (an optional output such as Dropout's mask, or a rewrite to
a training form that also returns saved statistics). The pass walks the nodes
between the parameters and the loss in reverse order, calls each rule once,
and sums gradients of values that are used more than once. A node on that
path whose op has no rule fails here, at plan time, naming the op.

>>> result = differentiate(graph, loss, wrt=params, registry=default_registry())  # doctest: +SKIP
>>> result.gradients[params[0]]                                                    # doctest: +SKIP
%grad/conv1.weight
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from segflow.errors import InvalidModel, UnsupportedOp
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType, TensorSpec
from segflow.ops.backward import DOMAIN as GRAD_DOMAIN
from segflow.ops.registry import OpDef, OpRegistry


@dataclass(frozen=True, slots=True)
class Differentiated:
    """What :func:`differentiate` returns (the graph is modified in place)."""

    graph: Graph
    loss: Value
    gradients: Mapping[Value, Value]   # wrt value -> its gradient (only those with a path)
    forward_nodes: tuple[Node, ...]
    backward_nodes: tuple[Node, ...]
    unreachable: tuple[Value, ...]     # wrt values the loss does not depend on

    @property
    def changed(self) -> bool:
        return bool(self.backward_nodes)

    @property
    def modified(self) -> bool:
        """``changed``, as :class:`segflow.passes.result.PassResult` names it too."""
        return self.changed


class GradContext:
    """What a gradient rule may do: emit backward nodes and request forward residuals."""

    def __init__(self, graph: Graph, registry: OpRegistry) -> None:
        self.graph = graph
        self.registry = registry
        self.backward: list[Node] = []
        self.inserted_forward: list[Node] = []
        self._needs: tuple[bool, ...] = ()
        self._node: Node | None = None
        self._shapes: dict[Value, Value] = {}
        self._names: set[str] = {v.name for v in graph.values()}

    # -- for rules ---------------------------------------------------------------------
    def need(self, index: int) -> bool:
        """Whether input ``index`` of the node being differentiated wants a gradient."""
        return index < len(self._needs) and self._needs[index]

    @property
    def needs(self) -> tuple[bool, ...]:
        return self._needs

    def emit(self, op_type: str, inputs: Sequence[Value | None], outputs: int = 1, *,
             domain: str = GRAD_DOMAIN, like: Sequence[Value | None] = (),
             **attrs: Any) -> list[Value]:
        """Append a backward node; output ``i`` takes the spec of ``like[i]`` when given."""
        stem = f"grad/{self._node.name if self._node else 'seed'}/{op_type}"
        node_name = self._fresh(stem)
        outs = []
        for i in range(outputs):
            model = like[i] if i < len(like) else None
            spec = model.spec if model is not None else TensorSpec()
            outs.append(Value(self._fresh(f"{node_name}:{i}"), spec))
        opset = self.graph.opsets.get("", 17) if domain == "" else 1
        node = Node(op_type, inputs, outs, attrs, name=node_name, domain=domain, opset=opset)
        self.graph.append(node)
        self.backward.append(node)
        return outs

    def emit1(self, op_type: str, inputs: Sequence[Value | None], *,
              domain: str = GRAD_DOMAIN, like: Value | None = None, **attrs: Any) -> Value:
        return self.emit(op_type, inputs, 1, domain=domain, like=(like,), **attrs)[0]

    def const(self, data: torch.Tensor, name: str = "const") -> Value:
        """A constant value (bound once on each device that reads it)."""
        value = Value(self._fresh(f"grad/{name}"),
                      TensorSpec(DType.from_torch(data.dtype), tuple(data.shape)), const=data)
        self.graph.add_initializer(value)
        return value

    def shape_of(self, value: Value) -> Value:
        """An int64 shape tensor of ``value``: a constant when its shape is static,
        otherwise a ``Shape`` node placed right after the value's producer, so the
        backward pass does not keep the value itself alive."""
        cached = self._shapes.get(value)
        if cached is not None:
            return cached
        spec = value.spec
        if spec.is_static:
            assert spec.shape is not None
            dims = [d for d in spec.shape if isinstance(d, int)]
            shape = self.const(torch.tensor(dims, dtype=torch.int64),
                               f"shape/{value.name}")
        else:
            shape = Value(self._fresh(f"shape/{value.name}"),
                          TensorSpec(DType.INT64, (spec.rank,) if spec.rank is not None else None))
            node = Node("Shape", [value], [shape], name=self._fresh(f"shape_of/{value.name}"),
                        opset=self.graph.opsets.get("", 17))
            self._insert_forward(node, after=value.producer)
        self._shapes[value] = shape
        return shape

    def forward_output(self, node: Node, index: int) -> Value:
        """Output ``index`` of forward ``node``, adding omitted optional outputs if needed."""
        while len(node.outputs) <= index:
            value = Value(self._fresh(f"{node.name}:out{len(node.outputs)}"))
            value.producer = node
            node.outputs = (*node.outputs, value)
        return node.outputs[index]

    def rewrite(self, node: Node, op_type: str, extra_outputs: int, *,
                domain: str = GRAD_DOMAIN, **attrs: Any) -> list[Value]:
        """Turn forward ``node`` into its training form ``domain.op_type``.

        The training form computes the same outputs plus ``extra_outputs``
        residuals (e.g. saved statistics) that the backward kernels read.
        """
        first = len(node.outputs)
        for i in range(extra_outputs):
            self.forward_output(node, first + i)
        node.op_type = op_type
        node.domain = domain
        node.opset = 1
        node.attrs.update(attrs)
        return list(node.outputs[first:])

    def same_shape(self, a: Value, b: Value) -> bool:
        """True when both specs prove the shapes are equal (symbolic dims included)."""
        sa, sb = a.spec.shape, b.spec.shape
        return (sa is not None and sb is not None and len(sa) == len(sb)
                and all(x is not None and x == y for x, y in zip(sa, sb)))

    def sum_to(self, grad: Value, like: Value, reference: Value | None = None) -> Value:
        """Reduce a broadcast gradient to ``like``'s shape (no node when provably equal)."""
        if reference is not None and self.same_shape(like, reference):
            return grad
        return self.emit1("SumToShape", [grad, self.shape_of(like)], like=like)

    def opdef(self, node: Node) -> OpDef:
        return self.registry.resolve(node)

    # -- internals ---------------------------------------------------------------------
    def _fresh(self, stem: str) -> str:
        name = stem
        counter = 0
        while name in self._names:
            counter += 1
            name = f"{stem}_{counter}"
        self._names.add(name)
        return name

    def _insert_forward(self, node: Node, after: Node | None) -> None:
        nodes = self.graph.nodes
        position = 0 if after is None else nodes.index(after) + 1
        anchor = nodes[position] if position < len(nodes) else None
        if anchor is None:
            self.graph.append(node)
        else:
            self.graph.insert_before(anchor, node)
        self.inserted_forward.append(node)

    def _begin(self, node: Node, needs: tuple[bool, ...]) -> None:
        self._node = node
        self._needs = needs


def differentiable(value: Value) -> bool:
    """Gradients flow only through floating-point values (unknown dtypes count as float)."""
    dtype = value.spec.dtype
    return dtype is None or dtype.is_float


def differentiate(graph: Graph, loss: Value, wrt: Sequence[Value], registry: OpRegistry, *,
                  seed: Value | None = None) -> Differentiated:
    """Append to ``graph`` the nodes computing d``loss``/d``w`` for every ``w`` in ``wrt``.

    ``loss`` must be a scalar unless ``seed`` (a value holding d``loss``, e.g. a
    graph input) is given. The graph is modified in place; its outputs are not.
    """
    forward = list(graph.nodes)
    requires = _requires_grad(forward, wrt)
    reaches = _reaches(forward, loss)
    if loss not in requires:
        unreachable = tuple(wrt)
        return Differentiated(graph, loss, {}, tuple(forward), (), unreachable)
    ctx = GradContext(graph, registry)
    grads: dict[Value, Value] = {}
    if seed is None:
        seed = _seed(ctx, loss)
    grads[loss] = seed
    for node in reversed(forward):
        outs = [grads.get(v) for v in node.outputs]
        if all(g is None for g in outs):
            continue
        needs = tuple(v is not None and v in requires and v in reaches for v in node.inputs)
        if not any(needs):
            continue
        opdef = ctx.opdef(node)
        if opdef.grad is None:
            wanted = ", ".join(v.name for v in wrt if v in _ancestors_in(node, requires))
            raise UnsupportedOp(f"no gradient rule for op {node.op_type} (node {node.name!r}, "
                                f"{node.label}); it lies between the loss and {wanted or 'inputs'}")
        ctx._begin(node, needs)
        in_grads = list(opdef.grad(ctx, node, outs))
        if len(in_grads) < len(node.inputs):
            in_grads += [None] * (len(node.inputs) - len(in_grads))
        for value, grad, need in zip(node.inputs, in_grads, needs):
            if value is None or grad is None or not need:
                continue
            if grad.spec.shape is None and grad.spec.dtype is None:
                grad.spec = value.spec
            grads[value] = _accumulate(ctx, grads.get(value), grad, value)
    gradients = {w: grads[w] for w in wrt if w in grads}
    unreachable = tuple(w for w in wrt if w not in grads)
    fwd = tuple(n for n in graph.nodes if n not in set(ctx.backward))
    return Differentiated(graph, loss, gradients, fwd, tuple(ctx.backward), unreachable)


def _seed(ctx: GradContext, loss: Value) -> Value:
    shape = loss.spec.shape
    if shape is not None and any(d != 1 for d in shape):
        raise InvalidModel(f"loss %{loss.name} must be a scalar, its shape is "
                           f"{loss.spec.describe()}; reduce it first (e.g. ReduceMean)")
    dtype = loss.spec.dtype
    if dtype is None or shape is None or not loss.spec.is_static:
        return ctx.emit1("OnesLike", [loss], like=loss)
    dims = [d for d in shape if isinstance(d, int)]
    return ctx.const(torch.ones(dims, dtype=dtype.torch), "seed")


def _accumulate(ctx: GradContext, old: Value | None, new: Value, value: Value) -> Value:
    if old is None:
        return new
    return ctx.emit1("Add", [old, new], domain="", like=value)


def _requires_grad(nodes: Sequence[Node], wrt: Sequence[Value]) -> set[Value]:
    requires = set(wrt)
    for node in nodes:
        if any(v is not None and v in requires for v in node.inputs):
            requires.update(v for v in node.outputs if differentiable(v))
    return requires


def _reaches(nodes: Sequence[Node], loss: Value) -> set[Value]:
    reaches = {loss}
    for node in reversed(nodes):
        if any(v in reaches for v in node.outputs):
            reaches.update(v for v in node.inputs if v is not None)
    return reaches


def _ancestors_in(node: Node, values: set[Value]) -> set[Value]:
    seen: set[Value] = set()
    stack = [v for v in node.inputs if v is not None]
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if value.producer is not None:
            stack.extend(v for v in value.producer.inputs if v is not None)
    return seen & values
