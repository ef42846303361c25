"""Which runs of a generated segment's steps become one replayed call.

Generated code (``runtime/compile.py``) calls a run of two or more direct libdnnl
kernels as one :class:`~segflow.kernels.onednn.replay.DirectReplay` (with the pooled
linear tail after it), and a run of two or more native kernels (with constant-size
Splits between them) as one :class:`~segflow.kernels.replay.NativeReplay`. This module
finds those runs from the steps' choices and bound kernels and builds their replays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from segflow.kernels.attention import ScaledDotAttention
from segflow.kernels.choice import DIRECT_CONV_KINDS, KernelKind
from segflow.kernels.conv import adds_residual_in_place
from segflow.kernels.layer_norm import AddLayerNorm
from segflow.kernels.linear import NativeLinear
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.binary import DirectBinary
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.op import DirectKernel
from segflow.kernels.onednn.pool import DirectPool
from segflow.kernels.onednn.replay import DirectReplay, ReplayStep
from segflow.kernels.onednn.stretch import DirectReplayOp
from segflow.kernels.replay import NativeReplay, NativeStep, Replayable
from segflow.kernels.report import OpKernel
from segflow.kernels.target import CpuTarget
from segflow.runtime.binding import Step
from segflow.runtime.inline_forms import constants_of, inline_flatten, inline_split

Tensor = torch.Tensor


def _replay_op(step: Step) -> DirectReplayOp | None:
    """The direct convolution, pooling or binary a step calls, where its choice names one (None:
    another kind of step, or one bound to its fallback)."""
    kernel = step.kernel
    if len(step.outputs) != 1 or not step.choice.calls_libdnnl \
            or not isinstance(kernel, DirectKernel):
        return None
    op = kernel.op
    assert isinstance(op, DirectConv | DirectPool | DirectBinary)
    return op


def direct_runs(steps: Sequence[Step], live_out: set[int]
                 ) -> dict[int, int]:
    """``{first: end}`` for each run of two or more consecutive direct-kernel steps, and
    the pooled linear tail after it where there is one (:func:`_linear_tail_after`)."""
    runs: dict[int, int] = {}
    start = None
    for index in range(len(steps) + 1):
        direct = index < len(steps) and _replay_op(steps[index]) is not None
        if direct and start is None:
            start = index
        elif not direct and start is not None:
            if index - start >= 2:
                runs[start] = index + _linear_tail_after(steps, index, live_out)
            start = None
    return runs


def _linear_tail_after(steps: Sequence[Step], end: int, live_out: set[int]) -> int:
    """2 where a run of direct kernels ending before ``end`` is followed by a Flatten at
    axis 1 of its last output (a pooled ``[N, C, 1, 1]`` becomes ``[N, C]``) and a native
    linear over that, the flattened value read by nothing else: the replay takes both in
    (``kernels/onednn/replay.py``). Else 0."""
    if end + 1 >= len(steps):
        return 0
    flatten, linear = steps[end], steps[end + 1]
    if flatten.node.domain != "" or flatten.node.op_type != "Flatten" \
            or inline_flatten(flatten.node) is None or len(flatten.outputs) != 1 \
            or flatten.inputs[0] not in steps[end - 1].outputs:
        return 0
    if linear.choice.kind is not KernelKind.NATIVE_LINEAR \
            or not isinstance(_native_op(linear), NativeLinear) \
            or linear.inputs[0] != flatten.outputs[0]:
        return 0
    viewed = flatten.outputs[0]
    if viewed in live_out or any(viewed in later.inputs for later in steps[end + 2:]):
        return 0
    return 2


def _run_inputs(run: Sequence[Step]) -> tuple[list[int], dict[int, int]]:
    """The slots a run reads from outside, in order of first use, and each one's value
    index in a replay of the run (its position in that list)."""
    inputs: list[int] = []
    position: dict[int, int] = {}
    made = {slot for step in run for slot in step.outputs}
    for step in run:
        for slot in step.inputs:
            if slot and slot not in made and slot not in position:
                position[slot] = len(inputs)
                inputs.append(slot)
    return inputs, position


def direct_replay(run: Sequence[Step], inplace_input: Callable[[Step], int | None],
                 read_after: set[int], target: CpuTarget
                 ) -> tuple[DirectReplay, list[int], list[int]]:
    """The replay for ``run``, the slots it reads from outside (its arguments, in
    order) and the slots it returns (those read after it)."""
    inputs, position = _run_inputs(run)
    replay_steps = []
    n_inputs = len(inputs)
    for offset, step in enumerate(run):
        # A direct kernel, or the linear tail after the run: its Flatten (None) and linear.
        op: DirectReplayOp | NativeLinear | None = _replay_op(step)
        if op is None and step.node.op_type != "Flatten":
            native = _native_op(step)
            assert isinstance(native, NativeLinear)
            op = native
        inplace = in_place(step, inplace_input(step))
        args = tuple(position[s] if s else None for s in step.inputs)
        (slot,) = step.outputs
        position[slot] = n_inputs + offset
        replay_steps.append(ReplayStep(op, inplace, args, n_inputs + offset, step.node.label))
    outputs = [slot for step in run for slot in step.outputs if slot in read_after]
    # The C loop over its executes where native kernels are on for this session.
    replay = DirectReplay(replay_steps, n_inputs, [position[s] for s in outputs],
                          native=target.native, native_why=target.native_why)
    return replay, inputs, outputs


def in_place(step: Step, slot: int | None) -> bool:
    """Whether a replayed direct step writes over its input ``slot`` (None: none), which
    the memory plan lets it overwrite: a residual convolution's residual, or a channel
    scale's big operand."""
    choice = step.choice
    if choice.kind in DIRECT_CONV_KINDS:
        return adds_residual_in_place(step.node, slot)
    return choice.kind is KernelKind.DIRECT_BINARY and choice.broadcast_input is not None \
        and slot == 1 - choice.broadcast_input


def _native_op(step: Step) -> Replayable | None:
    """The native kernel's op a step calls, where a replay can record it (None: another
    kind of step)."""
    kernel = step.kernel
    if not isinstance(kernel, OpKernel):
        return None
    op = kernel.op
    return op if isinstance(op, NativeLinear | AddLayerNorm | ScaledDotAttention) else None


def _split_step(step: Step, template: Sequence[Tensor | None], produced: set[int]
                ) -> tuple[list[int], int] | None:
    """A Split of constant sizes (generated code's one line), as ``(sizes, axis)``."""
    return inline_split(step.node, constants_of(step, template, produced))


def native_runs(steps: Sequence[Step], template: Sequence[Tensor | None], produced: set[int],
                 live_out: set[int]) -> dict[int, int]:
    """``{first: end}`` for each run of consecutive native kernels (and constant-size
    Splits between them) with two kernels or more. A run ends before a Split any of
    whose parts is read after it (the parts would be views of the run's storage)."""
    runs: dict[int, int] = {}
    index = 0
    while index < len(steps):
        end = index
        while end < len(steps) and (_native_op(steps[end]) is not None or
                                    _split_step(steps[end], template, produced) is not None):
            end += 1
        while end > index:
            read_after = {s for later in steps[end:] for s in later.inputs} | live_out
            split = next((i for i in range(index, end) if _native_op(steps[i]) is None
                          and read_after.intersection(steps[i].outputs)), None)
            if split is None:
                break
            end = split
        if sum(1 for step in steps[index:end] if _native_op(step) is not None) >= 2:
            runs[index] = end
        index = max(end, index + 1)
    return runs


def native_replay(run: Sequence[Step], template: Sequence[Tensor | None],
                        produced: set[int], read_after: set[int], library: NativeLibrary
                        ) -> tuple[NativeReplay, list[int], list[int]]:
    """The replay for ``run``, the slots it reads from outside (its arguments, in
    order) and the slots it returns (those read after it)."""
    inputs, position = _run_inputs(run)
    constants = [i for i, slot in enumerate(inputs)
                 if slot < len(template) and template[slot] is not None and slot not in produced]
    native_steps = []
    for step in run:
        args = tuple(position[s] if s else None for s in step.inputs)
        for slot in step.outputs:
            position[slot] = len(position)
        outputs = tuple(position[s] for s in step.outputs)
        op = _native_op(step)
        if op is None:
            split = _split_step(step, template, produced)
            assert split is not None
            native_steps.append(NativeStep(None, args[:1], outputs, step.node.label,
                                           tuple(split[0]), split[1]))
        else:
            native_steps.append(NativeStep(op, args, outputs, step.node.label))
    returns = [slot for step in run for slot in step.outputs if slot in read_after]
    replay = NativeReplay(native_steps, len(inputs), constants,
                          [position[s] for s in returns], library)
    return replay, inputs, returns
