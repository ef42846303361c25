"""The ``onednn`` segment backend: TorchScript, frozen, fused by oneDNN Graph (CPU).

A segment's pure, traceable generated function (:func:`segflow.runtime.compile.generate`
with ``pure=True, traceable=True``) is traced by ``torch.jit.trace`` on the first
input shapes it sees, frozen (its weights become graph constants), and run a few
times with torch's oneDNN Graph fuser enabled. oneDNN Graph then replaces runs of
convolution / linear / elementwise ops with compiled partitions that

- keep their primitives: the per-call primitive-descriptor setup that
  ``torch.ops.mkldnn._convolution_pointwise`` pays on every call (~20 us, measured)
  is paid once, and
- fuse a 1x1 convolution with the depthwise convolution after it into one
  primitive (oneDNN's depthwise post-op), which the per-node path cannot express.

Against torch's per-call oneDNN ops this pays most on depthwise convolution stacks;
on graphs without convolutions it is slower (benchmarks/cpu_targets.py;
docs/performance.md). It costs memory: oneDNN Graph caches packed weights beside the
dense ones the frozen graph references. So ``auto`` picks it only for graphs with
depthwise convolutions where libdnnl is not called directly
(:func:`segflow.passes.pipeline.choose_backend`).

Safety: a compiled shape is used only after its outputs matched the ``codegen``
function on the same inputs (:class:`segflow.runtime.verified_segment.VerifiedSegment`);
a trace that read input values into Python (a ``TracerWarning``) is rejected,
since it would bake in those values. Either way the segment falls back to
``codegen`` and the compile report says why.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from segflow import progress
from segflow.runtime.segment_module import SegmentModule
from segflow.runtime.verified_segment import MAX_SIGNATURES, VerifiedSegment

Tensor = torch.Tensor

__all__ = ["MAX_SIGNATURES", "OneDnnGraphSegment", "onednn_fusion"]

WARMUP_RUNS = 3          # the profiling executor fuses on its second run; one more to settle


@contextlib.contextmanager
def onednn_fusion() -> Iterator[None]:
    """Enable torch's oneDNN Graph fuser for the duration (it is process-wide)."""
    before = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        yield
    finally:
        torch.jit.enable_onednn_fusion(before)


class OneDnnGraphSegment(VerifiedSegment):
    """One segment run through TorchScript + oneDNN Graph, compiled per input signature."""

    cpu_only = True

    def _build(self, inputs: list[Tensor]) -> Callable[..., Any]:
        program = self.program
        assert program.pure_fn is not None
        module = SegmentModule(program.pure_fn, program.constants).eval()
        with progress.step(f"compiling {self.label} with oneDNN Graph"):
            return self._trace_and_freeze(module, inputs)

    def _trace_and_freeze(self, module: SegmentModule, inputs: list[Tensor]) -> Callable[..., Any]:
        # TorchScript warns that it is deprecated (torch >= 2.10); it is still the only way
        # to reach oneDNN Graph from torch, and this backend is optional.
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traced = torch.jit.trace(module, tuple(inputs), check_trace=False)
            frozen = torch.jit.freeze(traced)
        tracer = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
        if tracer:
            first = str(tracer[0].message).strip().splitlines()[0]
            raise ValueError(f"the trace depends on input values ({first})")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with onednn_fusion():
                for _ in range(WARMUP_RUNS):
                    frozen(*inputs)
        return frozen  # type: ignore[no-any-return]
