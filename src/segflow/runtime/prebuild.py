"""Direct kernels built while a session loads, not by its first run.

A convolution or pooling whose choice calls libdnnl (``kernels/onednn/``)
builds a primitive, JIT code included, for each input layout it meets, the first
time it meets it. Left to the first run, that makes the first run several times
a steady one (``benchmarks/cold_start.py``; docs/performance.md), and it faults in
libdnnl's own code pages that the memory benchmark then charges to runs.

:func:`prebuild` builds them while the session loads, for the layouts a run at the
memory plan's dims (a symbolic batch at 1) brings: a graph input arrives contiguous,
and a direct kernel writes its output channels-last, into the run's arena or a
tensor of its own alike. The stand-ins it passes are ``meta`` tensors: a layout's
key is its sizes, strides and dtype, and building reads no values. A kernel that
reads anything else (a torch op's output, a graph input with a symbolic dim other
than its first) is left to its first run, as is any layout a later run brings
(batch 8): a layout built here that no run brings costs its build time and its
code, nothing else. ``SEGFLOW_PREBUILD=0`` leaves every one to its first run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from segflow.ir.graph import Value
from segflow.ir.types import DType
from segflow.kernels.choice import DIRECT_CONV_KINDS, KernelKind
from segflow.kernels.onednn.binary import DirectBinary
from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.geometry import channels_last_strides
from segflow.kernels.onednn.op import DirectKernel, ResidualInPlaceKernel
from segflow.kernels.onednn.pool import DirectPool
from segflow.passes.plan_memory import static_sizes
from segflow.runtime.binding import Step

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class PrebuildReport:
    """What :func:`prebuild` did, for explain()."""

    built: int          # primitives built while loading
    left: int           # direct kernels not built here (layout unknown, or a fallback)
    seconds: float
    failure: str = ""   # the first build that raised (its kernel then left to its run)

    def describe(self) -> str:
        text = (f"prebuilt: {self.built} input layout{'s' if self.built != 1 else ''} "
                f"built while loading ({self.seconds * 1e3:.0f} ms)")
        if self.left:
            text += f"; {self.left} kernels left to their first run"
        if self.failure:
            text += f" (a build failed: {self.failure})"
        return text


def prebuild(steps: Sequence[Step], graph_inputs: Sequence[Value],
             template: Sequence[Tensor | None], dims: Mapping[str, int]) -> PrebuildReport:
    """Build the primitives of ``steps``' direct kernels (steps in the order a run
    takes them; ``template``: the constants runs pass, by slot) for a run at ``dims``."""
    start = time.perf_counter()
    known: dict[int, Tensor] = {}        # id(Value) -> a stand-in with the run's layout
    for value in graph_inputs:
        shape = value.spec.shape
        if shape is None or any(isinstance(d, str) for d in shape[1:]):
            continue
        sizes = static_sizes(value, dims)
        # A negative declared dim is the importer's to refuse; a speculation skips it.
        # A string input is a host array no direct kernel reads.
        if sizes is not None and value.spec.dtype not in (None, DType.STRING) \
                and min(sizes, default=0) >= 0:
            known[id(value)] = torch.empty(sizes, dtype=value.spec.dtype.torch, device="meta")
    built = left = 0
    failure = ""
    for step in steps:
        kernel = step.kernel
        if not step.choice.calls_libdnnl or not isinstance(kernel, DirectKernel):
            continue      # the choice names the direct kernels (bound to libdnnl if it loads)
        op, node = kernel.op, step.node
        x = known.get(id(node.inputs[0])) if node.inputs and node.inputs[0] is not None \
            else None
        out: tuple[int, ...] | None = None
        before = op.built_at_load
        try:   # a build that raises here leaves the kernel to its run, which builds anew
            if x is not None and step.choice.kind in DIRECT_CONV_KINDS:
                assert isinstance(op, DirectConv)
                z_value = node.inputs[3] if len(node.inputs) > 3 else None
                z = known.get(id(z_value)) if z_value is not None else None
                w = template[step.inputs[1]]
                b = template[step.inputs[2]] \
                    if len(step.inputs) > 2 and node.inputs[2] is not None else None
                if w is not None and (z_value is None or z is not None):
                    out = op.prebuild(x, w, b, z, isinstance(kernel, ResidualInPlaceKernel))
            elif x is not None and step.choice.kind is KernelKind.DIRECT_POOL:
                assert isinstance(op, DirectPool)
                out = op.prebuild(x)
            elif step.choice.kind is KernelKind.DIRECT_BINARY:
                assert isinstance(op, DirectBinary)
                a, b = (known.get(id(v)) if v is not None else None for v in node.inputs)
                if a is not None and b is not None:
                    out = op.prebuild(*op.operands(a, b))
        except Exception as exc:  # noqa: BLE001 - loading must not fail on a speculation
            failure = failure or f"{node.label}: {type(exc).__name__}: {exc}"
        built += op.built_at_load - before
        if out is None:
            left += 1
            continue
        known[id(node.outputs[0])] = torch.empty_strided(
            out, channels_last_strides(out), dtype=torch.float32, device="meta")
    return PrebuildReport(built, left, time.perf_counter() - start, failure)
