"""Sequence ops: SequenceConstruct/Empty/At/Insert/Erase/Length, SplitToSequence,
ConcatFromSequence and SequenceMap.

A sequence value is a Python list of tensors at run time (``ir.types.SequenceSpec`` in
the IR). Every row is LOCAL: the list lives on the host, so the ops run on the
scheduling thread; the tensors in it stay where their producers put them. A kernel never
changes a list it was given (a Loop may still hold it as carried state): ops that insert
or erase return a new list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from segflow.engine.base import ExecType
from segflow.ir.graph import Node
from segflow.ops._common import ints, normalize_axis
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
Inputs = Sequence[Any]   # tensors, lists of tensors (sequences) and None (omitted)


def _sequence(x: Any, op: str) -> list[Tensor]:
    """``x`` as the sequence an op reads, refusing what is not one."""
    if not isinstance(x, list):
        raise ValueError(f"{op}: input is {type(x).__name__}, expected a sequence")
    return x


def _position(t: Tensor, length: int, op: str, *, inserting: bool = False) -> int:
    """A ``position`` input as a list index: negative counts from the end; ONNX accepts
    [-n, n-1], and [-n, n] where an op inserts."""
    if t.numel() != 1:
        raise ValueError(f"{op}: position must be a scalar, got shape {list(t.shape)}")
    position = int(t.reshape(-1)[0])
    high = length if inserting else length - 1
    if not -length <= position <= high:
        raise ValueError(f"{op}: position {position} is out of range for a sequence of "
                         f"{length} tensors (accepted: {-length}..{high})")
    return position + length if position < 0 else position


def _construct(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        return [list(inputs)]
    return kernel


def _empty(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        return [[]]
    return kernel


def _at(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        seq = _sequence(inputs[0], "SequenceAt")
        return [seq[_position(inputs[1], len(seq), "SequenceAt")]]
    return kernel


def _insert(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        seq = list(_sequence(inputs[0], "SequenceInsert"))
        tensor = inputs[1]
        position = inputs[2] if len(inputs) > 2 else None
        if seq and tensor.dtype != seq[0].dtype:
            raise ValueError(f"SequenceInsert: a {tensor.dtype} tensor cannot join a "
                             f"sequence of {seq[0].dtype} tensors")
        if position is None:
            seq.append(tensor)
        else:
            seq.insert(_position(position, len(seq), "SequenceInsert", inserting=True),
                       tensor)
        return [seq]
    return kernel


def _erase(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        seq = list(_sequence(inputs[0], "SequenceErase"))
        position = inputs[1] if len(inputs) > 1 else None
        if not seq:
            raise ValueError("SequenceErase: the sequence is empty")
        index = len(seq) - 1 if position is None else _position(position, len(seq),
                                                                 "SequenceErase")
        del seq[index]
        return [seq]
    return kernel


def _length(node: Node, ctx: BindContext) -> Kernel:
    def kernel(inputs: Inputs) -> list[Any]:
        seq = _sequence(inputs[0], "SequenceLength")
        return [torch.tensor(len(seq), dtype=torch.int64, device=ctx.device)]
    return kernel


def _split_to_sequence(node: Node, ctx: BindContext) -> Kernel:
    axis_attr = int(node.attrs.get("axis", 0))
    keepdims = bool(node.attrs.get("keepdims", 1))

    def kernel(inputs: Inputs) -> list[Any]:
        x: Tensor = inputs[0]
        split = inputs[1] if len(inputs) > 1 else None
        axis = normalize_axis(axis_attr, x.dim())
        size = x.shape[axis]
        if split is None:
            # keepdims applies only here: without a split every piece has length 1.
            pieces = list(torch.split(x, 1, dim=axis))
            return [pieces if keepdims else [p.squeeze(axis) for p in pieces]]
        if split.dim() == 0:
            length = int(split)
            if length <= 0:
                raise ValueError(f"SplitToSequence: split {length} must be positive")
            return [list(torch.split(x, length, dim=axis))]
        lengths = ints(split)
        if any(n < 0 for n in lengths) or sum(lengths) != size:
            raise ValueError(f"SplitToSequence: split {lengths} does not add up to the "
                             f"{size} elements of axis {axis}")
        return [list(torch.split(x, lengths, dim=axis))]
    return kernel


def _concat_from_sequence(node: Node, ctx: BindContext) -> Kernel:
    if "axis" not in node.attrs:
        raise ValueError("ConcatFromSequence needs an axis attribute")
    axis_attr = int(node.attrs["axis"])
    new_axis = bool(node.attrs.get("new_axis", 0))

    def kernel(inputs: Inputs) -> list[Any]:
        seq = _sequence(inputs[0], "ConcatFromSequence")
        if not seq:
            raise ValueError("ConcatFromSequence: the sequence is empty")
        # With new_axis the result has one more axis, and axis may name it (-r-1..r).
        rank = seq[0].dim() + (1 if new_axis else 0)
        if not -rank <= axis_attr < rank:
            raise ValueError(f"ConcatFromSequence: axis {axis_attr} is out of range for "
                             f"rank {rank}")
        axis = normalize_axis(axis_attr, rank)
        joined = torch.stack(seq, dim=axis) if new_axis else torch.cat(seq, dim=axis)
        return [joined]
    return kernel


def _sequence_map(node: Node, ctx: BindContext) -> Kernel:
    run = ctx.subgraph(node.subgraphs["body"])
    captured = ctx.captured(node)
    n_explicit = len(node.inputs)
    n_out = len(node.outputs)

    def kernel(inputs: Inputs) -> list[Any]:
        outer = dict(zip(captured, inputs[n_explicit:]))
        explicit = list(inputs[:n_explicit])
        first = _sequence(explicit[0], "SequenceMap")
        for i, extra in enumerate(explicit[1:], start=1):
            if isinstance(extra, list) and len(extra) != len(first):
                raise ValueError(f"SequenceMap: input {i} holds {len(extra)} tensors, "
                                 f"the input sequence {len(first)}")
        results: list[list[Tensor]] = [[] for _ in range(n_out)]
        for i in range(len(first)):
            # A sequence input gives the body its i-th tensor, a tensor input itself.
            feeds = [x[i] if isinstance(x, list) else x for x in explicit]
            for acc, y in zip(results, run(feeds, outer)):
                acc.append(y)
        return results
    return kernel


OPS: list[OpDef] = [
    OpDef("SequenceConstruct", _construct, since=11, exec_type=ExecType.LOCAL,
          doc="a sequence of its inputs"),
    OpDef("SequenceEmpty", _empty, since=11, exec_type=ExecType.LOCAL,
          doc="an empty sequence"),
    OpDef("SequenceAt", _at, since=11, exec_type=ExecType.LOCAL,
          doc="the tensor at a position"),
    OpDef("SequenceInsert", _insert, since=11, exec_type=ExecType.LOCAL,
          doc="a new sequence with a tensor inserted"),
    OpDef("SequenceErase", _erase, since=11, exec_type=ExecType.LOCAL,
          doc="a new sequence without the tensor at a position"),
    OpDef("SequenceLength", _length, since=11, exec_type=ExecType.LOCAL,
          doc="the number of tensors, int64"),
    OpDef("SplitToSequence", _split_to_sequence, since=11, exec_type=ExecType.LOCAL,
          doc="a tensor split along an axis into a sequence"),
    OpDef("ConcatFromSequence", _concat_from_sequence, since=11, exec_type=ExecType.LOCAL,
          doc="a sequence concatenated (or stacked, new_axis) into a tensor"),
    OpDef("SequenceMap", _sequence_map, since=17, exec_type=ExecType.LOCAL,
          doc="a subgraph run on each element; its outputs gathered into sequences"),
]
