"""Training: BatchNorm normalizes with batch statistics and returns running ones;
Dropout drops."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType, TensorSpec
from segflow.passes.result import PassResult


@dataclass(frozen=True, slots=True)
class TrainingMode(PassResult):
    """What :func:`training_mode` returns: also each running statistic's name -> the
    value holding its update (the session copies it into its state after a step)."""

    running: Mapping[str, Value] = field(default_factory=dict)


def training_mode(graph: Graph) -> TrainingMode:
    """Switch ``graph``'s BatchNormalization and Dropout nodes to training behaviour.

    BatchNorm gets ``training_mode=1`` and its running mean and variance outputs
    (for statistics that are graph inputs: the session's state); Dropout (opset
    12 and later) gets a constant ``training_mode`` input that is true.
    """
    running: dict[str, Value] = {}
    norms = drops = 0
    for node in list(graph.nodes):
        if node.domain != "":
            continue
        if node.op_type == "BatchNormalization":
            node.attrs["training_mode"] = 1
            norms += 1
            for index in (1, 2):
                out = _ensure_output(node, index)
                stat = node.inputs[2 + index]
                if stat is not None and stat in graph.inputs:
                    running[stat.name] = out
        elif node.op_type == "Dropout" and node.opset >= 12:
            flag = Value(f"{node.name}:training", TensorSpec(DType.BOOL, ()),
                         const=torch.tensor(True))
            graph.add_initializer(flag)
            if len(node.inputs) < 3:
                node.inputs = (*node.inputs, *([None] * (3 - len(node.inputs))))
            graph.set_input(node, 2, flag)
            drops += 1
    line = (f"training_mode: {norms} BatchNormalization, {drops} Dropout in training mode, "
            f"{len(running)} running statistics")
    return TrainingMode(graph, bool(norms or drops), (line,), running=running)


def _ensure_output(node: Node, index: int) -> Value:
    while len(node.outputs) <= index:
        value = Value(f"{node.name}:out{len(node.outputs)}")
        value.producer = node
        node.outputs = (*node.outputs, value)
    return node.outputs[index]
