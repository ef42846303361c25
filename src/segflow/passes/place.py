"""Device placement: assign every node a device and insert COPY nodes at crossings.

Placement rules map a node-name glob (``"layer1.*"``) or an op type
(``"Conv"``) to a device, like MXNet's group2ctx; the first rule that matches
wins and unmatched nodes go to the default device. Graph inputs arrive on the
default device. Constants are bound on every device that reads them (once, at
bind time), so they never need a COPY node.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import Device
from segflow.passes.result import PassResult

COPY_DOMAIN = "segflow"
COPY_OP = "Copy"


def place(graph: Graph, default: Device, rules: Mapping[str, str | Device] | None = None
          ) -> PassResult:
    """Set ``node.device`` for every node; insert ``segflow.Copy`` nodes where values cross."""
    parsed = [(pattern, Device.parse(dev)) for pattern, dev in (rules or {}).items()]
    for node in graph.nodes:
        node.device = _match(node, parsed) or default
    home: dict[int, Device] = {id(v): default for v in graph.inputs}
    copies: dict[tuple[int, Device], Value] = {}
    changed = False
    for node in list(graph.nodes):
        assert node.device is not None
        for index, value in enumerate(node.inputs):
            if value is None or value.is_const:
                continue
            source = home.get(id(value), default)
            if source == node.device:
                continue
            key = (id(value), node.device)
            copy = copies.get(key)
            if copy is None:
                copy = Value(f"{value.name}@{node.device}", value.spec)
                copy_node = Node(COPY_OP, [value], [copy], {"to": str(node.device)},
                                 name=f"copy:{value.name}->{node.device}", domain=COPY_DOMAIN)
                copy_node.device = node.device
                graph.insert_before(node, copy_node)
                copies[key] = copy
                home[id(copy)] = node.device
            graph.set_input(node, index, copy)
            changed = True
        for value in node.outputs:
            home[id(value)] = node.device
    if changed:
        graph.opsets.setdefault(COPY_DOMAIN, 1)
    return PassResult(graph, changed)


def _match(node: Node, rules: list[tuple[str, Device]]) -> Device | None:
    for pattern, device in rules:
        if pattern == node.op_type or fnmatch.fnmatchcase(node.name, pattern):
            return device
    return None
