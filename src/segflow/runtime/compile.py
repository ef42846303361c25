"""Segment compilation backends: lower a bulk segment to one Python callable.

The executor's default task function interprets a segment: for every node it
builds an input list from the slot array, calls the bound kernel and stores
the outputs. A compiled segment does the same work without the dispatch:

- ``codegen``: generates a straight-line Python function per segment. Values
  are locals, constants and kernels are closure constants, hot ops (fused
  conv/linear, elementwise arithmetic) are called directly as torch ops, and
  the memory plan's in-place decisions become ``relu_`` / ``add_`` / oneDNN's
  in-place residual conv. Builds in milliseconds.
- ``inductor``: the pure generated function exported with ``torch.export`` and
  compiled ahead of time by AOTInductor with freezing, one package per input
  signature, cached on disk so a second process loads it instead of compiling
  (:mod:`segflow.runtime.aot_inductor`). Optional: a cold compile costs tens
  of seconds per model on 2 cores and the package holds a second, prepacked
  copy of the weights. Compilation happens on a segment's first run; that
  time is reported as compile time.
- ``onednn`` (CPU): the pure generated function traced to TorchScript, frozen
  and fused by oneDNN Graph, verified against ``codegen`` on its first run
  (:mod:`segflow.runtime.onednn_graph`).
- ``none``: the interpreter.

``auto`` picks ``codegen``: always available, fastest to build, one copy of the
weights, and on CPU its convolutions call libdnnl directly. Only where libdnnl is
not called directly does a CPU graph with depthwise convolutions get ``onednn``
(at the cost of a second, packed copy of the weights; benchmarks/cpu_targets.py,
docs/performance.md). :func:`segflow.passes.pipeline.choose_backend` decides. Under
``auto``, a small segment (:func:`uses_cached_package`) whose
inductor package is already in the disk cache, because the model ran once with
``compile="inductor"``, runs that package: the fastest backend that is
available without compiling.

The counters do not change: a compiled segment is still one task and its
nodes are still one kernel each. A generated segment counts its kernel calls
itself when it runs (its replays count theirs); a segment another backend
compiled counts its nodes, as the executor runs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from segflow.engine.base import ExecType
from segflow.errors import ExecutionError, node_failed
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.kernels.attention import ScaledDotAttention
from segflow.kernels.choice import CONV_KINDS, DIRECT_CONV_KINDS, KernelChoice, KernelKind
from segflow.kernels.conv import adds_residual_in_place, inline_conv
from segflow.kernels.gemm import inline_linear
from segflow.kernels.layer_norm import AddLayerNorm
from segflow.kernels.linear import NativeLinear
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.op import DirectKernel
from segflow.kernels.onednn.pool import DirectPool
from segflow.kernels.onednn.replay import DirectReplay, ReplayStep
from segflow.kernels.replay import NativeReplay, NativeStep, Replayable
from segflow.kernels.report import OpKernel
from segflow.kernels.target import CpuTarget
from segflow.ops import default_registry
from segflow.ops.dense_chain import inline_chain, traceable_chain
from segflow.ops.fused import FUSED_DOMAIN, Inline, inline_fused, traceable_fused
from segflow.ops.registry import InlineOp, Kernel
from segflow.passes.pipeline import CompileMode
from segflow.passes.plan_memory import MemoryPlan
from segflow.passes.segment import Segment
from segflow.runtime.aot_inductor import AotInductorSegment, has_packages
from segflow.runtime.binding import Step, UploadInputs, counts_own_calls
from segflow.runtime.onednn_graph import OneDnnGraphSegment
from segflow.runtime.program import CompileReport, Program, SegmentFn

Tensor = torch.Tensor
class SegmentCompiler:
    """Lowers the bulk segments of an executor's plan through one backend."""

    def __init__(self, mode: CompileMode | str = CompileMode.AUTO,
                 memory: MemoryPlan | None = None, device: torch.device | None = None,
                 cached_packages: bool = False, replay: bool = True,
                 keeps_nonfinite: Callable[[Node], bool] | None = None,
                 target: CpuTarget | None = None) -> None:
        """``cached_packages``: ``auto`` chose ``codegen``; a small segment whose
        inductor package is already in the disk cache runs that package instead
        (:func:`uses_cached_package`). Nothing is compiled for it. ``replay``: runs
        of direct libdnnl kernels become one :class:`DirectReplay` call.
        ``keeps_nonfinite(node)``: the node must keep NaN and infinities
        (runtime/nonfinite.py); a segment holding one is generated, not handed to
        inductor or oneDNN Graph, whose fused kernels choose their own post-ops.
        ``target``: the CPU the session's kernels were chosen for."""
        self.mode = CompileMode.parse(mode).resolve()
        self.memory = memory
        self.device = device or torch.device("cpu")
        # An empty cache (the usual case) costs one directory listing, nothing per segment.
        self.cached_packages = cached_packages and self.mode is CompileMode.CODEGEN \
            and self.device.type == "cpu" and has_packages()
        self.replay = replay
        self.keeps_nonfinite = keeps_nonfinite
        self.target = target if target is not None else CpuTarget.detect()
        self.report = CompileReport(self.mode.value)

    def compile_tasks(self, tasks: Sequence[tuple[Segment, Sequence[Step]]],
                      template: Sequence[Tensor | None],
                      output_slots: Sequence[int]) -> list[SegmentFn | None]:
        """One callable ``fn(env)`` per task (None: interpret it)."""
        if self.mode is CompileMode.NONE:
            return [None] * len(tasks)
        start = time.perf_counter()
        read_elsewhere = _reads_by_task(tasks, output_slots)
        compiled: list[SegmentFn | None] = []
        for index, (segment, steps) in enumerate(tasks):
            if segment.exec_type is not ExecType.SYNC or not steps:
                compiled.append(None)
                continue
            live_out = {slot for step in steps for slot in step.outputs
                        if slot in read_elsewhere.get(index, set())}
            program = generate(steps, template, live_out, self.memory, self.device,
                               replay=self.replay, target=self.target)
            cached_only = self.cached_packages and uses_cached_package(steps)
            keeps = self.keeps_nonfinite
            lowered = keeps is None or not any(keeps(step.node) for step in steps)
            if lowered and (self.mode in (CompileMode.INDUCTOR, CompileMode.ONEDNN)
                            or cached_only):
                pure = generate(steps, template, live_out, None, self.device, pure=True,
                                traceable=True, target=self.target)
                if self.mode is CompileMode.ONEDNN:
                    compiled.append(OneDnnGraphSegment(pure, program.fn, self.report))
                else:
                    nodes = [step.node for step in steps]
                    compiled.append(AotInductorSegment(pure, program.fn, self.report, nodes,
                                                       cached_only=cached_only))
            else:
                compiled.append(program.fn)
                self.report.replays.extend(program.replays)
                self.report.native_replays.extend(program.native_replays)
            self.report.segments += 1
        self.report.build_time_s = time.perf_counter() - start
        return compiled


CACHED_PACKAGE_MAX_BYTES = 16 << 20


def uses_cached_package(steps: Sequence[Step]) -> bool:
    """Whether ``auto`` looks in the disk cache for an inductor package for this segment.

    Small segments only: every constant dense, at most ``CACHED_PACKAGE_MAX_BYTES``
    in all. There a package has no Python or ATen dispatch between small kernels,
    its second copy of the weights is cheap, and hashing the weights for its key
    takes milliseconds. (A chain of tiny layers, which the ``dense_chain`` pass already
    runs as one native call, runs about as fast from its package as native
    (docs/performance.md), and the package is kept when present.) A package gets
    there by running the model once with ``compile="inductor"``; ``auto`` never
    compiles one (a cold compile takes a minute or more).
    """
    total = 0
    seen: set[int] = set()
    for step in steps:
        if step.choice.reads_own_format:   # its weight is a kernel's format, not values
            return False
        for value in step.node.inputs:
            const = None if value is None else value.const
            if const is None or id(const) in seen:
                continue
            if const.is_mkldnn:
                return False
            seen.add(id(const))
            total += const.numel() * const.element_size()
    return total <= CACHED_PACKAGE_MAX_BYTES


def _reads_by_task(tasks: Sequence[tuple[Segment, Sequence[Step]]],
                   output_slots: Sequence[int]) -> dict[int, set[int]]:
    """task index -> slots it writes that another task (or the caller) reads."""
    writer: dict[int, int] = {}
    for index, (_, steps) in enumerate(tasks):
        for step in steps:
            for slot in step.outputs:
                writer[slot] = index
    needed: dict[int, set[int]] = {}
    for index, (_, steps) in enumerate(tasks):
        for step in steps:
            for slot in step.inputs:
                owner = writer.get(slot)
                if owner is not None and owner != index:
                    needed.setdefault(owner, set()).add(slot)
    for slot in output_slots:
        owner = writer.get(slot)
        if owner is not None:
            needed.setdefault(owner, set()).add(slot)
    return needed


# -- code generation -------------------------------------------------------------------
_FLOAT = (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16)


def _core_forms() -> Mapping[str, InlineOp]:
    """The core ops' direct calls, from their rows (``OpDef.inline``, ops/elementwise.py)."""
    return {name: row.inline for (domain, name), rows in default_registry().rows.items()
            if domain == "" for row in rows if row.inline is not None}


_CORE: Mapping[str, InlineOp] = _core_forms()


def _inline(node: Node, inplace_input: int | None, device: torch.device,
            consts: Sequence[Tensor | None], traceable: bool, kernel: Kernel | None,
            choice: KernelChoice, target: CpuTarget) -> Inline | None:
    if choice.kind is not KernelKind.REFERENCE:
        # The chosen kernel's own form; a tracer gets none (its weight is packed).
        if traceable:
            return None
        if choice.kind in CONV_KINDS:
            return inline_conv(node, choice, inplace_input, kernel, target.dnnl)
        if node.op_type == "FusedGemm":
            return inline_linear(node, choice, kernel, target.fuses_transcendental_post_ops())
        return None
    if node.domain == FUSED_DOMAIN and node.op_type == "DenseChain":
        return traceable_chain(node) if traceable else inline_chain(node, kernel)
    if node.domain == FUSED_DOMAIN:
        if traceable:
            return traceable_fused(node)
        return inline_fused(node, device, inplace_input, consts, kernel,
                            fuses_transcendental=target.fuses_transcendental_post_ops(),
                            onednn=target.onednn_ops)
    if node.domain == "" and node.op_type == "Flatten":
        return _inline_flatten(node)
    op = _CORE.get(node.op_type)
    if node.domain != "" or op is None or len(node.outputs) != 1:
        return None
    if len(node.inputs) != op.expr.count("{in") or any(v is None for v in node.inputs):
        return None
    if op.float_only and node.outputs[0].spec.dtype not in _FLOAT:
        return None
    expr = op.inplace.get(inplace_input, op.expr) if inplace_input is not None else op.expr
    return Inline(expr, op.bound)


def _inline_split(node: Node, consts: Sequence[Tensor | None]
                  ) -> tuple[list[int], int] | None:
    """``(sizes, axis)`` where a Split's sizes are constant (its ``split`` attribute before
    opset 13, a constant input after) and one per output: generated code then splits in
    one line (``v1, v2, v3, = x.split(sizes, axis)``, views as the kernel's). As a kernel
    the Split after the sibling rule's merged linear reads its sizes tensor each call,
    tens of microseconds, once a transformer layer. Sizes that do not add up to the
    input's extent fail in ``split`` at run time, naming the node, as the kernel does."""
    if node.domain != "" or node.op_type != "Split" or node.inputs[0] is None:
        return None
    if node.opset < 13:
        raw = node.attrs.get("split")
        sizes = [int(v) for v in raw] if raw is not None else None
    else:
        const = consts[1] if len(consts) > 1 else None
        sizes = [int(v) for v in const.reshape(-1).tolist()] if const is not None else None
    if not sizes or len(sizes) != len(node.outputs) or min(sizes) < 0:
        return None
    return sizes, int(node.attrs.get("axis", 0))


def _inline_flatten(node: Node) -> Inline | None:
    """Flatten at axis 1 of an input of known rank 2 or more: ``x.flatten(1)``, the same
    ``[d0, d1 * d2 ...]`` view or copy the kernel's reshape makes, without a kernel
    call's Python frame between a pooling and the linear after it."""
    x = node.inputs[0]
    shape = x.spec.shape if x is not None else None
    axis = int(node.attrs.get("axis", 1))
    if shape is None or len(node.outputs) != 1 or len(shape) < 2:
        return None
    if axis != 1 and axis != 1 - len(shape):
        return None
    return Inline("{in0}.flatten(1)")


class _Emitter:
    """Builds the source and the closure namespace of one generated function."""

    def __init__(self) -> None:
        self.bound: dict[str, object] = {}
        self.ids: dict[int, str] = {}
        self.lines: list[str] = []

    def bind(self, obj: object, prefix: str) -> str:
        name = self.ids.get(id(obj))
        if name is None:
            # Readable sources: torch functions keep their name (``addmm_3``).
            label = getattr(obj, "__name__", "") if prefix == "b" else ""
            label = "".join(c if c.isalnum() else "_" for c in str(label)).strip("_")
            name = f"{label}_{len(self.bound)}" if label else f"{prefix}{len(self.bound)}"
            self.ids[id(obj)] = name
            self.bound[name] = obj
        return name


def generate(steps: Sequence[Step], template: Sequence[Tensor | None], live_out: set[int],
             memory: MemoryPlan | None = None, device: torch.device | None = None, *,
             pure: bool = False, traceable: bool = False, replay: bool = False,
             target: CpuTarget | None = None) -> Program:
    """Generate the straight-line function for ``steps`` (see the module docstring).

    ``live_out``: slots other tasks or the caller read, written back to the slot array.
    ``pure``: also build ``f(*inputs) -> outputs`` without the slot array (for tracing).
    ``traceable``: plain functional torch ops only (no oneDNN ops, no in-place writes).
    ``replay``: each run of two or more direct libdnnl convolutions / poolings is one
    :class:`~segflow.kernels.onednn.replay.DirectReplay` call (not with ``pure``/``traceable``).
    """
    device = device or torch.device("cpu")
    target = target if target is not None else CpuTarget.detect()
    em = _Emitter()
    inplace = memory.inplace if memory is not None else {}
    local: set[int] = set()
    loaded: list[int] = []
    cleared: list[int] = []
    released_here = {slot for step in steps for slot in step.release}
    produced = {slot for step in steps for slot in step.outputs}
    body: list[str] = []

    def ref(slot: int) -> str:
        if slot == 0:
            return "None"
        const = template[slot] if slot < len(template) else None
        if const is not None and slot not in produced:
            return em.bind(const, "c")
        if slot not in local:
            local.add(slot)
            loaded.append(slot)
            if slot in released_here:
                cleared.append(slot)
        return f"v{slot}"

    def inplace_input(step: Step) -> int | None:
        slot_inplace = inplace.get(step.node)
        if slot_inplace is not None and step.inputs[slot_inplace] not in step.release:
            return None  # another task may still read it: not ours to overwrite
        return slot_inplace

    runs = {} if pure or traceable or not replay else _replay_runs(steps, live_out)
    library = target.native if replay and not (pure or traceable) else None
    native_runs = {} if library is None else _native_runs(steps, template, produced, live_out)
    replays: list[DirectReplay] = []
    native_replays: list[NativeReplay] = []
    kernels = 0  # the kernel calls of the body outside replays (counted when it runs)
    skip_to = 0
    for index, step in enumerate(steps):
        if index < skip_to:
            continue
        node = step.node
        if index in native_runs or index in runs:
            end = native_runs.get(index) or runs[index]
            run = steps[index:end]
            skip_to = end
            body.append(f"_i = {index}")
            read_after = {slot for later in steps[end:] for slot in later.inputs} | live_out
            replay_fn: DirectReplay | NativeReplay
            if index in native_runs:
                assert library is not None
                replay_fn, reads, returns = _native_replay_call(run, template, produced,
                                                                read_after, library)
                native_replays.append(replay_fn)
            else:
                replay_fn, reads, returns = _replay_call(run, inplace_input, read_after,
                                                         target)
                replays.append(replay_fn)
            targets = "".join(f"v{slot}, " for slot in returns)
            # The replay counts the kernels it runs and its calls into native code.
            body.append(f"({targets}) = {em.bind(replay_fn, 'r')}"
                        f"({''.join(ref(s) + ', ' for s in reads)}counts=counts)")
            for slot in returns:
                local.add(slot)
                if slot in live_out:
                    body.append(f"env[{slot}] = v{slot}")
            gone = [f"v{slot}" for later in run for slot in later.release if slot in local]
            if gone:
                body.append(f"del {', '.join(dict.fromkeys(gone))}")
            continue
        args = [ref(slot) for slot in step.inputs]
        consts = _constants(step, template, produced)
        slot_inplace = inplace_input(step)
        body.append(f"_i = {index}")
        kernels += 1  # one kernel call below: a torch op, a view, or the bound kernel
        # A kernel that uploads host inputs first is called as it is.
        inline = (_inline(node, None if traceable else slot_inplace, device, consts, traceable,
                          step.kernel, step.choice, target)
                  if len(step.outputs) == 1 and not isinstance(step.kernel, UploadInputs)
                  else None)
        split = _inline_split(node, consts) if not isinstance(step.kernel, UploadInputs) \
            else None
        if split is not None:
            sizes, axis = split
            body.append(f"{''.join(f'v{slot}, ' for slot in step.outputs)}= "
                        f"{args[0]}.split({sizes}, {axis})")
        elif inline is not None:
            names = {key: em.bind(obj, "b") for key, obj in inline.bound.items()
                     if "{" + key + "}" in inline.expr}
            expr = inline.expr.format(**{f"in{i}": a for i, a in enumerate(args)}, **names)
            body.append(f"v{step.outputs[0]} = {expr}")
        else:
            kernel = em.bind(step.kernel, "k")
            call = f"{kernel}(({', '.join(args)}{',' if len(args) == 1 else ''}))"
            if not pure and counts_own_calls(step.kernel):
                call = f"{call[:-1]}, counts)"   # it counts its calls itself
                kernels -= 1
            if len(step.outputs) == 1:
                body.append(f"v{step.outputs[0]} = {call}[0]")
            else:
                body.append(f"_r = {call}")
                for i, slot in enumerate(step.outputs):
                    body.append(f"v{slot} = _r[{i}]" if i == 0 else
                                f"v{slot} = _r[{i}] if len(_r) > {i} else None")
        for slot in step.outputs:
            local.add(slot)
            if slot in live_out and not pure:
                body.append(f"env[{slot}] = v{slot}")
        gone = [f"v{slot}" for slot in step.release if slot in local]
        if gone:
            body.append(f"del {', '.join(gone)}")
    outputs = tuple(sorted(live_out))
    # The pure form takes its tensor constants as arguments: export and tracing then see them
    # as module buffers it can freeze, instead of closure cells.
    # Only float tensors (weights): integer constants (shapes, indices) that kernels read
    # into Python stay closure constants, so a tracer does not see them as traced values.
    lifted = [name for name, obj in em.bound.items()
              if pure and isinstance(obj, Tensor) and obj.is_floating_point()]
    source = _assemble(em, body, loaded, cleared, outputs, pure, lifted, kernels)
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<segflow segment {steps[0].node.name}>", "exec"), namespace)
    labels = [step.node.label for step in steps]
    factory = namespace["_factory"]
    fn = factory(_failure(labels), **{k: v for k, v in em.bound.items() if k not in lifted})
    if pure:
        constants = tuple(t for t in (em.bound[name] for name in lifted) if isinstance(t, Tensor))
        return Program(source, _pure_to_env(fn, constants, tuple(loaded), outputs),
                       tuple(loaded), outputs, fn, constants, tuple(cleared))
    return Program(source, fn, replays=tuple(replays), native_replays=tuple(native_replays))


def _replay_op(step: Step) -> DirectConv | DirectPool | None:
    """The direct convolution or pooling a step calls, where its choice names one (None:
    another kind of step, or one bound to its fallback)."""
    kernel = step.kernel
    if len(step.outputs) != 1 or not step.choice.calls_libdnnl \
            or not isinstance(kernel, DirectKernel):
        return None
    op = kernel.op
    assert isinstance(op, DirectConv | DirectPool)
    return op


def _replay_runs(steps: Sequence[Step], live_out: set[int]
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
            or _inline_flatten(flatten.node) is None or len(flatten.outputs) != 1 \
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


def _replay_call(run: Sequence[Step], inplace_input: Callable[[Step], int | None],
                 read_after: set[int], target: CpuTarget
                 ) -> tuple[DirectReplay, list[int], list[int]]:
    """The replay for ``run``, the slots it reads from outside (its arguments, in
    order) and the slots it returns (those read after it)."""
    inputs, position = _run_inputs(run)
    replay_steps = []
    n_inputs = len(inputs)
    for offset, step in enumerate(run):
        # A direct kernel, or the linear tail after the run: its Flatten (None) and linear.
        op: DirectConv | DirectPool | NativeLinear | None = _replay_op(step)
        if op is None and step.node.op_type != "Flatten":
            native = _native_op(step)
            assert isinstance(native, NativeLinear)
            op = native
        inplace = step.choice.kind in DIRECT_CONV_KINDS and adds_residual_in_place(
            step.node, inplace_input(step))
        args = tuple(position[s] if s else None for s in step.inputs)
        (slot,) = step.outputs
        position[slot] = n_inputs + offset
        replay_steps.append(ReplayStep(op, inplace, args, n_inputs + offset, step.node.label))
    outputs = [slot for step in run for slot in step.outputs if slot in read_after]
    # The C loop over its executes where native kernels are on for this session.
    replay = DirectReplay(replay_steps, n_inputs, [position[s] for s in outputs],
                          native=target.native, native_why=target.native_why)
    return replay, inputs, outputs


def _native_op(step: Step) -> Replayable | None:
    """The native kernel's op a step calls, where a replay can record it (None: another
    kind of step)."""
    kernel = step.kernel
    if len(step.outputs) != 1 or not isinstance(kernel, OpKernel):
        return None
    op = kernel.op
    return op if isinstance(op, NativeLinear | AddLayerNorm | ScaledDotAttention) else None


def _constants(step: Step, template: Sequence[Tensor | None], produced: set[int]
               ) -> list[Tensor | None]:
    """The constant behind each of a step's inputs (None: computed, or none)."""
    return [template[s] if 0 < s < len(template) and s not in produced else None
            for s in step.inputs]


def _split_step(step: Step, template: Sequence[Tensor | None], produced: set[int]
                ) -> tuple[list[int], int] | None:
    """A Split of constant sizes (generated code's one line), as ``(sizes, axis)``."""
    return _inline_split(step.node, _constants(step, template, produced))


def _native_runs(steps: Sequence[Step], template: Sequence[Tensor | None], produced: set[int],
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


def _native_replay_call(run: Sequence[Step], template: Sequence[Tensor | None],
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


def _assemble(em: _Emitter, body: list[str], loaded: list[int], cleared: list[int],
              outputs: tuple[int, ...], pure: bool, lifted: Sequence[str] = (),
              kernels: int = 0) -> str:
    """The factory source. Pure form: ``segment(*lifted, *inputs) -> outputs``, no env.
    Env form: ``segment(env, counts=None)``, which adds its ``kernels`` calls to
    ``counts`` (a RunCounters) when its body has run."""
    params = ", ".join(["_fail", *(k for k in em.bound if k not in lifted)])
    lines = [f"def _factory({params}):"]
    if pure:
        args = [*lifted, *(f"v{s}" for s in loaded)]
        lines.append(f"    def segment({', '.join(args)}):")
        # No try/except: tracers handle straight-line code best; errors surface on fallback.
        lines.extend(f"        {line}" for line in body)
        values = ", ".join(f"v{s}" for s in outputs)
        lines.append(f"        return ({values}{',' if len(outputs) == 1 else ''})")
        lines.append("    return segment")
        return "\n".join(lines) + "\n"
    lines.append("    def segment(env, counts=None):")
    for slot in loaded:
        lines.append(f"        v{slot} = env[{slot}]")
    for slot in cleared:
        # Released by this segment: its other readers finished before it started.
        lines.append(f"        env[{slot}] = None")
    lines.append("        _i = 0")
    lines.append("        try:")
    lines.extend(f"            {line}" for line in body)
    lines.append("        except Exception as exc:")
    lines.append("            _fail(_i, exc)")
    if kernels:
        lines.append("        if counts is not None:")
        lines.append(f"            counts.count_kernels({kernels})")
    lines.append("    return segment")
    return "\n".join(lines) + "\n"


def _failure(labels: Sequence[str]) -> Callable[[int, Exception], None]:
    def fail(index: int, exc: Exception) -> None:
        if isinstance(exc, ExecutionError):
            raise exc
        raise node_failed(labels[index], exc) from exc
    return fail


def _pure_to_env(fn: Callable[..., tuple[Tensor, ...]], constants: tuple[Tensor, ...],
                 inputs: tuple[int, ...], outputs: tuple[int, ...]) -> SegmentFn:
    def segment(env: list[Any]) -> None:
        results = fn(*constants, *[env[s] for s in inputs])
        for slot, tensor in zip(outputs, results):
            env[slot] = tensor
    return segment


# -- inductor ----------------------------------------------------------------------------
