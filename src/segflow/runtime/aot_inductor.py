"""The ``inductor`` segment backend: AOTInductor packages, cached on disk.

A segment's pure, traceable generated function (:func:`segflow.runtime.compile.generate`
with ``pure=True, traceable=True``) is exported with ``torch.export`` for the
input signature it first sees, compiled by inductor ahead of time with
freezing (weights become constants it may fold and prepack for oneDNN), and
packaged as a ``.pt2`` file under :func:`segflow.settings.cache_dir`. A
package runs through inductor's C++ wrapper: no Python between kernels.

Why ahead of time rather than ``torch.compile``: with freezing on CPU, inductor
prepacks weights into oneDNN tensors, which its FX graph cache cannot pickle,
so every process recompiled (ResNet-50: ~8 s before the first run even with a
warm kernel cache). A package is keyed by what determines it (the exported
graph's code, every constant's bytes, the input signature, the torch version
and device), so a second process loads it in about 0.1 s after a ~1 s export.
Measured on the 2-core VM, ResNet-50 at batch 1: compile ~35 s cold, run
43-47 ms (codegen: 45-49 ms; ``torch.compile`` with freezing: 49-52 ms). The
cost is memory (``benchmarks/cpu_targets.py --memory``): ResNet-50 holds ~315 MiB
more after its first run, of which ~70 MiB are torch's export/inductor modules
and ~207 MiB the loaded package (its weights in the shared library's image and
unpacked), beside segflow's dense weights, which the ``codegen`` fallback needs.

Inductor's oneDNN weight prepacking (``cpp.weight_prepack``) pays off for
convolutions and large linears but costs ~20 us of oneDNN setup per call,
which swamps tiny layers: the 200-layer MLP chain runs 4.6 ms prepacked and
0.57 ms through MKL's addmm (codegen: 0.82 ms, benchmarks/cpu_targets.py).
:func:`wants_prepacked_weights` decides per segment by the layout pass's rule.

Exporting swaps ``sys.stderr`` for the duration (a failed export prints its
whole graph there), so another thread's stderr output in that window is lost.

Like the oneDNN Graph backend, a compiled signature is used only after its
outputs matched ``codegen`` on the same inputs (:class:`VerifiedSegment`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from segflow.ir.graph import Node
from segflow.ops.fused import FUSED_DOMAIN, LINEAR_PACK_MIN_WEIGHT
from segflow.runtime.segment_module import SegmentModule
from segflow.runtime.verified_segment import VerifiedSegment
from segflow.settings import cache_dir

if TYPE_CHECKING:
    from segflow.runtime.compile import CompileReport, Program, SegmentFn

Tensor = torch.Tensor

FORMAT = "aoti-1"  # bump when what a package holds or how it is keyed changes
_CONVOLUTIONS = {"Conv", "ConvTranspose", "FusedConv"}
_LINEARS = {"Gemm", "MatMul", "FusedGemm"}


def wants_prepacked_weights(nodes: Iterable[Node]) -> bool:
    """Whether inductor should prepack weights for oneDNN: any convolution, or a linear
    whose constant weight has at least ``LINEAR_PACK_MIN_WEIGHT`` elements."""
    for node in nodes:
        if node.domain not in ("", FUSED_DOMAIN):
            continue
        if node.op_type in _CONVOLUTIONS:
            return True
        if node.op_type in _LINEARS:
            weight = node.inputs[1] if len(node.inputs) > 1 else None
            if weight is not None and weight.const is not None \
                    and weight.const.numel() >= LINEAR_PACK_MIN_WEIGHT:
                return True
    return False


class AotInductorSegment(VerifiedSegment):
    """One segment as AOTInductor packages, one per input signature, cached on disk."""

    def __init__(self, program: Program, fallback: SegmentFn, report: CompileReport,
                 prepack: bool = True, directory: Path | None = None) -> None:
        super().__init__(program, fallback, report)
        self.prepack = prepack
        self.directory = directory

    def _build(self, inputs: list[Tensor]) -> Callable[..., Sequence[Tensor]]:
        program = self.program
        assert program.pure_fn is not None
        module = SegmentModule(program.pure_fn, program.constants).eval()
        # A failed export prints the whole graph to stderr; the failure's first line goes
        # to the compile report instead (and the segment runs codegen).
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            exported = torch.export.export(module, tuple(inputs), strict=False)
        directory = (self.directory or cache_dir()) / "aoti"
        path = directory / f"{package_key(exported, inputs, self.prepack)}.pt2"
        if path.exists():
            try:
                runner = _load(path)
            except Exception:  # a damaged or foreign file: compile it again
                pass
            else:
                self.report.cache_hits += 1
                return runner
        directory.mkdir(parents=True, exist_ok=True)
        # Written beside its final name and renamed: a concurrent process sees all or nothing.
        partial = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp.pt2")
        import torch._inductor.config as inductor_config

        try:
            options = {"freezing": True, "cpp.weight_prepack": self.prepack}
            with inductor_config.patch(options), torch.no_grad():
                torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return _load(path)


def package_key(exported: torch.export.ExportedProgram, inputs: Sequence[Tensor],
                prepack: bool = True) -> str:
    """A digest of everything a package depends on (graph, constants, inputs, options,
    toolchain)."""
    digest = hashlib.blake2b(digest_size=20)

    def text(*parts: object) -> None:
        digest.update(repr(parts).encode())

    device = inputs[0].device if inputs else torch.device("cpu")
    text(FORMAT, torch.__version__, str(device.type), prepack, exported.graph_module.code)
    for t in inputs:
        text(tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))
    named = {**exported.state_dict, **exported.constants}
    for name in sorted(named):
        value = named[name]
        if not isinstance(value, Tensor):
            text(name, repr(value))
            continue
        text(name, tuple(value.shape), tuple(value.stride()), str(value.dtype))
        data = value.detach().contiguous().cpu().reshape(-1)
        if data.numel():
            digest.update(data.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _load(path: Path) -> Callable[..., Sequence[Tensor]]:
    runner = torch._inductor.aoti_load_package(str(path))

    def run(*inputs: Tensor) -> Sequence[Tensor]:
        out: Any = runner(*inputs)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)
    return run
