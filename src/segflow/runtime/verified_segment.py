"""A segment compiled per input signature and trusted only once it matches ``codegen``.

The graph compilers segflow hands whole segments to (oneDNN Graph through
TorchScript, AOTInductor) specialize on input shapes and can fail, or
miscompile, in ways segflow cannot rule out ahead of time. So a backend here
only says how to build a callable for one input signature
(:meth:`VerifiedSegment._build`); this class does the rest:

- compiles each distinct signature (shapes, strides, dtypes) on its first
  call, up to ``MAX_SIGNATURES`` (further ones run ``codegen``);
- compares that first call's outputs with the ``codegen`` function on the
  same inputs and uses the compiled callable only if they agree;
- on any failure or mismatch runs ``codegen`` for that signature and adds the
  reason to the compile report, so ``explain()`` and ``segflow run`` show it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from segflow.runtime.program import CompileReport, Program, SegmentFn

Tensor = torch.Tensor
Signature = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]

MAX_SIGNATURES = 8
RTOL, ATOL = 1e-3, 1e-4  # verification against codegen, atol scaled by the output's magnitude


class VerifiedSegment:
    """Base class: one segment, compiled per input signature by :meth:`_build`."""

    cpu_only = False  # inputs on another device run codegen
    sets_grad_mode = False  # the compiled callable turns autograd off itself (else: no_grad)

    def __init__(self, program: Program, fallback: SegmentFn, report: CompileReport,
                 segment: int = -1) -> None:
        """``segment``: the segment's index in the plan, for what the compile announces
        (:mod:`segflow.progress`) and records."""
        assert program.pure_fn is not None
        self.program = program
        self.fallback = fallback
        self.report = report
        self.segment = segment
        self._lock = threading.Lock()
        # signature -> the compiled function, or None: run the fallback
        self._compiled: dict[Signature, Callable[..., Any] | None] = {}
        self.codegen_only = False  # _build said there is nothing to compile: skip the lookup

    @property
    def label(self) -> str:
        return f"segment {self.segment}" if self.segment >= 0 else "a segment"

    def _build(self, inputs: list[Tensor]) -> Callable[..., Sequence[Tensor]] | None:
        """A callable ``fn(*inputs) -> outputs`` specialized for these inputs, or None:
        nothing to compile here, and ``codegen`` runs these inputs (not a failure to
        report); when no earlier signature was compiled, every later call too."""
        raise NotImplementedError

    def __call__(self, env: list[Any]) -> None:
        if self.codegen_only:
            self.fallback(env)
            return
        program = self.program
        inputs = [env[s] for s in program.inputs]
        signature = _signature(inputs, self.cpu_only)
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
        if self.sets_grad_mode:
            results = fn(*inputs)
        else:
            with torch.no_grad():
                results = fn(*inputs)
        del inputs
        for slot, tensor in zip(program.outputs, results):
            env[slot] = tensor

    def _compile(self, env: list[Any], inputs: list[Tensor]) -> Callable[..., Any] | None:
        """Build and verify for these inputs; None (and a report line) if not usable."""
        if len(self._compiled) >= MAX_SIGNATURES:
            self._fail(f"more than {MAX_SIGNATURES} input signatures")
            return None
        start = time.perf_counter()
        try:
            fn = self._build(inputs)
            if fn is None:  # codegen for this signature; for every later one too unless
                # an earlier signature is compiled (its runs still need the lookup)
                self.codegen_only = not any(self._compiled.values())
                return None
            problem = self._verify(fn, env, inputs)
        except Exception as exc:  # compilers fail in many ways: run codegen instead
            lines = str(exc).strip().splitlines()
            fn, problem = None, f"{type(exc).__name__}: {lines[0] if lines else ''}"
        self.report.first_run_compile_s += time.perf_counter() - start
        if problem is not None:
            self._fail(problem)
            return None
        return fn

    def _verify(self, fn: Callable[..., Any], env: list[Any], inputs: list[Tensor]
                ) -> str | None:
        """Compare with the codegen function on the same inputs; the problem, or None."""
        with torch.no_grad():
            got = list(fn(*inputs))  # first: codegen may write in place into inputs it releases
        scratch = list(env)
        self.fallback(scratch)
        if len(got) != len(self.program.outputs):
            return f"{len(got)} outputs, codegen {len(self.program.outputs)}"
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


def _signature(inputs: Sequence[object], cpu_only: bool) -> Signature | None:
    """Shapes, strides and dtypes of the inputs; None when one cannot be compiled for."""
    parts = []
    for t in inputs:
        if not isinstance(t, Tensor) or t.is_mkldnn or t.requires_grad:
            return None
        if cpu_only and not t.is_cpu:
            return None
        parts.append((tuple(t.shape), tuple(t.stride()), t.dtype))
    return tuple(parts)
