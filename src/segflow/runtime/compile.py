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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from segflow.cache_descriptions import ModelLabel
from segflow.engine.base import ExecType
from segflow.errors import ExecutionError, node_failed
from segflow.ir.graph import Node
from segflow.kernels.onednn.replay import DirectReplay
from segflow.kernels.replay import NativeReplay
from segflow.kernels.target import CpuTarget
from segflow.passes.pipeline import CompileMode
from segflow.passes.plan_memory import MemoryPlan
from segflow.passes.segment import Segment
from segflow.runtime.aot_inductor import AotInductorSegment, has_packages
from segflow.runtime.binding import Step, UploadInputs, counts_own_calls
from segflow.runtime.inline_forms import constants_of, inline_form, inline_split
from segflow.runtime.onednn_graph import OneDnnGraphSegment
from segflow.runtime.program import CompileReport, Program, SegmentFn
from segflow.runtime.replay_runs import direct_replay, direct_runs, native_replay, native_runs

Tensor = torch.Tensor
class SegmentCompiler:
    """Lowers the bulk segments of an executor's plan through one backend."""

    def __init__(self, mode: CompileMode | str = CompileMode.AUTO,
                 memory: MemoryPlan | None = None, device: torch.device | None = None,
                 cached_packages: bool = False, replay: bool = True,
                 keeps_nonfinite: Callable[[Node], bool] | None = None,
                 target: CpuTarget | None = None, model: object = None,
                 model_name: str = "") -> None:
        """``cached_packages``: ``auto`` chose ``codegen``; a small segment whose
        inductor package is already in the disk cache runs that package instead
        (:func:`uses_cached_package`). Nothing is compiled for it. ``replay``: runs
        of direct libdnnl kernels become one :class:`DirectReplay` call.
        ``keeps_nonfinite(node)``: the node must keep NaN and infinities
        (runtime/nonfinite.py); a segment holding one is generated, not handed to
        inductor or oneDNN Graph, whose fused kernels choose their own post-ops.
        ``target``: the CPU the session's kernels were chosen for. ``model`` (the
        session's path, bytes or ModelProto) and ``model_name`` (its graph's): what the
        packages ``inductor`` writes are described as having been compiled from (the
        model is hashed for that under ``inductor`` only, and not kept)."""
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
        self.model = (ModelLabel.of(model, model_name) if self.mode is CompileMode.INDUCTOR
                      else ModelLabel(model_name, "", ""))

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
                    compiled.append(OneDnnGraphSegment(pure, program.fn, self.report,
                                                       segment.index))
                else:
                    nodes = [step.node for step in steps]
                    compiled.append(AotInductorSegment(pure, program.fn, self.report, nodes,
                                                       cached_only=cached_only,
                                                       segment=segment.index,
                                                       model=self.model))
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

    runs = {} if pure or traceable or not replay else direct_runs(steps, live_out)
    library = target.native if replay and not (pure or traceable) else None
    native_starts = {} if library is None else native_runs(steps, template, produced, live_out)
    replays: list[DirectReplay] = []
    native_replays: list[NativeReplay] = []
    kernels = 0  # the kernel calls of the body outside replays (counted when it runs)
    skip_to = 0
    for index, step in enumerate(steps):
        if index < skip_to:
            continue
        node = step.node
        if index in native_starts or index in runs:
            end = native_starts.get(index) or runs[index]
            run = steps[index:end]
            skip_to = end
            body.append(f"_i = {index}")
            read_after = {slot for later in steps[end:] for slot in later.inputs} | live_out
            replay_fn: DirectReplay | NativeReplay
            if index in native_starts:
                assert library is not None
                replay_fn, reads, returns = native_replay(run, template, produced,
                                                                read_after, library)
                native_replays.append(replay_fn)
            else:
                replay_fn, reads, returns = direct_replay(run, inplace_input, read_after,
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
        consts = constants_of(step, template, produced)
        slot_inplace = inplace_input(step)
        body.append(f"_i = {index}")
        kernels += 1  # one kernel call below: a torch op, a view, or the bound kernel
        # A kernel that uploads host inputs first is called as it is.
        inline = (inline_form(node, None if traceable else slot_inplace, device, consts, traceable,
                          step.kernel, step.choice, target)
                  if not isinstance(step.kernel, UploadInputs) else None)
        split = inline_split(node, consts) if not isinstance(step.kernel, UploadInputs) \
            else None
        if split is not None:
            sizes, axis = split
            body.append(f"{''.join(f'v{slot}, ' for slot in step.outputs)}= "
                        f"{args[0]}.split({sizes}, {axis})")
        elif inline is not None:
            names = {key: em.bind(obj, "b") for key, obj in inline.bound.items()
                     if "{" + key + "}" in inline.expr}
            expr = inline.expr.format(**{f"in{i}": a for i, a in enumerate(args)}, **names)
            body.append(f"{''.join(f'v{slot}, ' for slot in step.outputs)}= {expr}"
                        if len(step.outputs) > 1 else f"v{step.outputs[0]} = {expr}")
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
