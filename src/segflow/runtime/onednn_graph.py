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

Measured at batch 1 (benchmarks/cpu_targets.py, interleaved with ``codegen``):
MobileNetV2 ~35% faster, ResNet-50 0-9%; on BERT and the MLP chain (no
convolutions) it is slower. It costs memory: oneDNN Graph caches packed weights
beside the dense ones the frozen graph references. So ``auto`` picks it only for
graphs with depthwise convolutions (:func:`segflow.passes.pipeline.choose_backend`).

Safety: a compiled shape is used only after its outputs matched the ``codegen``
function on the same inputs (first call of that shape); a trace that read input
values into Python (a ``TracerWarning``) is rejected, since it would bake in those
values. Either way the segment falls back to ``codegen`` and the compile report
says why. Each distinct input signature is compiled separately, up to
``MAX_SIGNATURES``; further ones run ``codegen``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from segflow.runtime.segment_module import SegmentModule

if TYPE_CHECKING:
    from segflow.runtime.compile import CompileReport, Program, SegmentFn

Tensor = torch.Tensor
Signature = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]

MAX_SIGNATURES = 8
WARMUP_RUNS = 3          # the profiling executor fuses on its second run; one more to settle
RTOL, ATOL = 1e-3, 1e-4  # verification against codegen, atol scaled by the output's magnitude


@contextlib.contextmanager
def onednn_fusion() -> Iterator[None]:
    """Enable torch's oneDNN Graph fuser for the duration (it is process-wide)."""
    before = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        yield
    finally:
        torch.jit.enable_onednn_fusion(before)


class OneDnnGraphSegment:
    """One segment run through TorchScript + oneDNN Graph, compiled per input signature."""

    def __init__(self, program: Program, fallback: SegmentFn, report: CompileReport) -> None:
        assert program.pure_fn is not None
        self.program = program
        self.fallback = fallback
        self.report = report
        self._lock = threading.Lock()
        # signature -> the frozen TorchScript function, or None: run the fallback
        self._compiled: dict[Signature, Callable[..., Any] | None] = {}

    def __call__(self, env: list[Any]) -> None:
        program = self.program
        inputs = [env[s] for s in program.inputs]
        signature = _signature(inputs)
        fn = None if signature is None else self._compiled.get(signature, _MISSING)
        if signature is not None and fn is _MISSING:
            with self._lock:
                if signature not in self._compiled:
                    self._compiled[signature] = self._compile(env, inputs)
            fn = self._compiled[signature]
        if fn is None:
            self.fallback(env)
            return
        for slot in program.released:
            env[slot] = None
        with torch.no_grad():
            results = fn(*inputs)
        del inputs
        for slot, tensor in zip(program.outputs, results):
            env[slot] = tensor

    def _compile(self, env: list[Any], inputs: list[Tensor]) -> Callable[..., Any] | None:
        """Trace, freeze, fuse and verify for these inputs; None (and a report line) if not."""
        if len(self._compiled) >= MAX_SIGNATURES:
            self._fail(f"more than {MAX_SIGNATURES} input signatures")
            return None
        start = time.perf_counter()
        try:
            fn = self._build(inputs)
            problem = self._verify(fn, env, inputs)
        except Exception as exc:  # tracing and fusion fail in many ways: run codegen instead
            lines = str(exc).strip().splitlines()
            fn, problem = None, f"{type(exc).__name__}: {lines[0] if lines else ''}"
        self.report.first_run_compile_s += time.perf_counter() - start
        if problem is not None:
            self._fail(problem)
            return None
        return fn

    def _build(self, inputs: list[Tensor]) -> Callable[..., Any]:
        program = self.program
        assert program.pure_fn is not None
        module = SegmentModule(program.pure_fn, program.constants).eval()
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

    def _verify(self, fn: Callable[..., Any], env: list[Any], inputs: list[Tensor]
                ) -> str | None:
        """Compare with the codegen function on the same inputs; the problem, or None."""
        with torch.no_grad():
            got = fn(*inputs)  # first: codegen may write in place into inputs it releases
        scratch = list(env)
        self.fallback(scratch)
        for slot, tensor in zip(self.program.outputs, got):
            want = scratch[slot]
            if not isinstance(want, Tensor):
                return f"slot {slot}: codegen produced {type(want).__name__}"
            if want.shape != tensor.shape or want.dtype != tensor.dtype:
                return (f"slot {slot}: {tuple(tensor.shape)} {tensor.dtype}, codegen "
                        f"{tuple(want.shape)} {want.dtype}")
            if want.is_floating_point():
                scale = float(want.abs().max()) if want.numel() else 0.0
                ok = torch.allclose(tensor, want, rtol=RTOL, atol=ATOL * max(1.0, scale))
            else:
                ok = torch.equal(tensor, want)
            if not ok:
                return f"slot {slot}: outputs differ from codegen"
        return None

    def _fail(self, why: str) -> None:
        self.report.fallbacks.append(why)


_MISSING: Any = object()


def _signature(inputs: Sequence[object]) -> Signature | None:
    """Shapes, strides and dtypes of the inputs; None when one is not a CPU tensor."""
    parts = []
    for t in inputs:
        if not isinstance(t, Tensor) or t.device.type != "cpu" or t.is_mkldnn or t.requires_grad:
            return None
        parts.append((tuple(t.shape), tuple(t.stride()), t.dtype))
    return tuple(parts)
