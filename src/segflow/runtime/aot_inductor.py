"""The ``inductor`` segment backend: AOTInductor packages, cached on disk.

A segment's pure, traceable generated function (:func:`segflow.runtime.compile.generate`
with ``pure=True, traceable=True``) is exported with ``torch.export`` for the
input signature it first sees, compiled by inductor ahead of time with
freezing (weights become constants it may fold and prepack for oneDNN), and
packaged as a ``.pt2`` file under :func:`segflow.settings.cache_dir`. A
package runs through inductor's C++ wrapper: no Python between kernels.

Why ahead of time rather than ``torch.compile``: with freezing on CPU, inductor
prepacks weights into oneDNN tensors, which its FX graph cache cannot pickle,
so every process would recompile (seconds before the first run even with a warm
kernel cache). A package is keyed by what determines it (the segment's
nodes and generated source, every constant's bytes, the input signature, the
segflow and torch versions, the device): a second process hashes and loads it
through the C++ loader without exporting, or even importing inductor. A cold
compile takes tens of seconds, a cached first run well under one (the figures:
docs/performance.md). The cost is memory (``benchmarks/cpu_targets.py --memory``):
a session holds the loaded package's weights twice, in the shared library's image
and unpacked, beside segflow's dense weights, which the ``codegen`` fallback needs,
and a cold compile adds torch's export/inductor modules.

How a segment is compiled depends on what it holds (:func:`inductor_options`):
convolutions get oneDNN-prepacked weights; linear layers over constant weights
get their GEMMs autotuned between inductor's C++ GEMM template and ATen. The
template matters for small layers: a prepacked oneDNN linear pays ~20 us of
setup per call and MKL's ``addmm`` ~2.5 us of dispatch, while the template's
generated micro-kernels are called straight from the package's C++
(benchmarks/cpu_targets.py). Autotuning about doubles a cold compile, once per
machine.

Exporting and compiling swap ``sys.stderr`` for the duration (a failed export
prints its whole graph there, autotuning its timing tables), so another
thread's stderr output in that window is lost.

Like the oneDNN Graph backend, a compiled signature is used only after its
outputs matched ``codegen`` on the same inputs (:class:`VerifiedSegment`).

Each package is written with its description (:class:`segflow.cache_descriptions.
PackageDescription`: the model, the segment, the input shapes), which ``segflow cache
--list`` shows. Under ``auto``, a package found in the cache changes what runs (and the
outputs in their last digits), so the compile report records it
(:attr:`CompileReport.cached_packages`, a line in ``explain()``) and it is announced as a
:mod:`segflow.progress` notice, which the command line prints once.

Packages are kept in an :class:`segflow.cache_store.ArtifactStore`: one is loaded
only if segflow compiled it (its recorded SHA-256) into directories only this user
can write; anything else, and a package that fails to load, is compiled again (or,
under ``auto``, not used) and the compile report says why. Of processes that need
one package at once, one compiles it and the others wait for it.

The cache is capped (``SEGFLOW_CACHE_MAX_MB``, default 2 GiB): writing a package
evicts the least recently used ones beyond the cap, by file mtime, which a cache
hit refreshes. The new package is kept even alone over the cap, and a build in
progress (another process may be writing it) is never evicted.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from segflow import progress
from segflow.cache_descriptions import ModelLabel, PackageDescription, input_signatures
from segflow.cache_store import MISSING, ArtifactStore, Cleared, mark_used
from segflow.ir.graph import Node
from segflow.ops.fused import FUSED_DOMAIN
from segflow.runtime.program import CachedPackage
from segflow.runtime.segment_module import SegmentModule
from segflow.runtime.verified_segment import VerifiedSegment
from segflow.settings import cache_dir, cache_max_bytes

if TYPE_CHECKING:
    from segflow.runtime.program import CompileReport, Program, SegmentFn

Tensor = torch.Tensor

FORMAT = "aoti-2"  # bump when what a package holds or how it is keyed changes
# A segment whose every op is at most this much work (multiply-adds, or elements) is
# compiled single-threaded: an OpenMP fork/join costs more than splitting such an op saves.
SERIAL_MAX_WORK = 1 << 16
# How long a process waits for another compiling the same package (then compiles its own).
LOCK_WAIT_S = 1800.0
_CONVOLUTIONS = {"Conv", "ConvTranspose", "FusedConv"}
_LINEARS = {"Gemm", "MatMul", "FusedGemm", "DenseChain"}


def inductor_options(nodes: Iterable[Node], device: torch.device) -> dict[str, Any]:
    """The inductor configuration a segment is compiled with (part of its package key).

    On CPU, a segment with linear layers over constant weights has its GEMMs
    autotuned between inductor's C++ GEMM template (micro-kernels generated
    for the exact shape, called without any dispatch) and ATen's kernels; a
    segment with convolutions gets its weights prepacked for oneDNN. Tiny
    linears (64x64) run ~5x faster through the template than
    through MKL's ``addmm`` or oneDNN's prepacked linear, which pays ~20 us of
    setup per call. The template needs prepacked weights, so either case sets
    ``cpp.weight_prepack``; a segment with neither leaves it off.
    """
    options: dict[str, Any] = {"freezing": True, "cpp.weight_prepack": False}
    if device.type != "cpu":
        return options
    for node in nodes:
        if node.domain not in ("", FUSED_DOMAIN):
            continue
        if node.op_type in _CONVOLUTIONS:
            options["cpp.weight_prepack"] = True
        elif node.op_type in _LINEARS and _constant_weight(node):
            options.update({"cpp.weight_prepack": True, "max_autotune": True,
                            "max_autotune_gemm_backends": "CPP,ATEN"})
    return options


def largest_op_work(graph: torch.fx.Graph) -> int:
    """The most work one op of an exported graph does: multiply-adds for a matrix
    product or convolution, the largest tensor it reads or writes otherwise."""
    largest = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        vals = [n.meta.get("val") for n in node.all_input_nodes]
        out = node.meta.get("val")
        vals += list(out) if isinstance(out, (list, tuple)) else [out]
        tensors = [t for t in vals if isinstance(t, Tensor)]
        if not tensors:
            continue
        work = max(int(t.numel()) for t in tensors)
        name = getattr(node.target, "__name__", "").split(".")[0]
        if name in _CONTRACTIONS and isinstance(out, Tensor) and len(tensors) >= 2:
            operand = tensors[_CONTRACTIONS[name]]
            if name.startswith("conv"):
                reduction = int(operand.numel()) // max(1, int(operand.shape[0]))
            else:
                reduction = int(operand.shape[-1]) if operand.dim() else 1
            work = max(work, int(out.numel()) * reduction)
        largest = max(largest, work)
    return largest


# op name -> which tensor operand gives the reduction length (a convolution: its weight)
_CONTRACTIONS = {"linear": 0, "mm": 0, "matmul": 0, "bmm": 0, "addmm": 1, "baddbmm": 1,
                 "conv1d": 1, "conv2d": 1, "conv3d": 1, "convolution": 1}


def _constant_weight(node: Node) -> bool:
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    return weight is not None and weight.const is not None


class AotInductorSegment(VerifiedSegment):
    """One segment as AOTInductor packages, one per input signature, cached on disk."""

    sets_grad_mode = True  # a package's C++ wrapper disables autograd for its run

    def __init__(self, program: Program, fallback: SegmentFn, report: CompileReport,
                 nodes: Sequence[Node], cached_only: bool = False, segment: int = -1,
                 model: ModelLabel | None = None) -> None:
        """``cached_only`` (``auto``): look in the disk cache on the first call and use
        the package found there; if there is none, run ``codegen`` from then on and
        compile nothing. ``segment``, ``model``: what a package written is described
        as (:mod:`segflow.cache_descriptions`)."""
        super().__init__(program, fallback, report, segment)
        self.nodes = tuple(nodes)
        self.cached_only = cached_only
        self.model = model or ModelLabel("", "", "")

    def _build(self, inputs: list[Tensor]) -> Callable[..., Sequence[Tensor]] | None:
        program = self.program
        assert program.pure_fn is not None
        device = inputs[0].device if inputs else torch.device("cpu")
        options = inductor_options(self.nodes, device)
        name = f"{package_key(self.nodes, program.source, inputs, options)}.pt2"
        store = ArtifactStore.open("aoti")
        if store.distrust:
            self._note(f"not loaded from the cache: {store.distrust} (packages built for this "
                       "process only)")
        problem = store.check(name)
        load_failed = False
        if not problem:
            try:
                runner = _load(store.path(name))
            except Exception as exc:  # segflow wrote it and it passed the checks: compile again
                lines = str(exc).strip().splitlines()
                problem = f"{type(exc).__name__}: {lines[0] if lines else ''}"
                load_failed = True
            else:
                self.report.cache_hits += 1
                mark_used(store.path(name))
                if self.cached_only:
                    self._announce(store, name)
                return runner
        if problem != MISSING:
            self._note(f"{name}: not loaded: {problem}")
        if self.cached_only:
            return None
        got = store.obtain(name, lambda out: self._compile_package(inputs, options, out),
                           wait_s=LOCK_WAIT_S, rebuild=load_failed,
                           description=self._description(inputs).to_json())
        assert got.path is not None   # a failed compile raised
        if got.built:
            self.report.evicted += store.evict(".pt2", cache_max_bytes(), keep=got.path).files
        return _load(got.path)

    def _announce(self, store: ArtifactStore, name: str) -> None:
        """Record a package ``auto`` runs instead of codegen, and say so (a notice whose
        text covers every such package of the session so far)."""
        described = PackageDescription.parse(store.description(name))
        self.report.cached_packages.append(
            CachedPackage(self.segment, name, described.created if described else 0.0))
        progress.notice(progress.Topic.CACHED_PACKAGES, self.report.cached_packages_note())

    def _description(self, inputs: list[Tensor]) -> PackageDescription:
        import segflow

        device = inputs[0].device if inputs else torch.device("cpu")
        first, last = self._span()
        return PackageDescription(
            self.model, self.segment, first, last, len(self.nodes),
            input_signatures([(t.shape, str(t.dtype)) for t in inputs]), str(device),
            torch.__version__, segflow.__version__)

    def _span(self) -> tuple[str, str]:
        """The segment's first and last node."""
        names = [node.name or node.op_type for node in self.nodes]
        return (names[0], names[-1]) if names else ("", "")

    def _note(self, text: str) -> None:
        if text not in self.report.cache_notes:
            self.report.cache_notes.append(text)

    def _compile_package(self, inputs: list[Tensor], options: dict[str, Any], out: Path) -> str:
        """Export the segment for these inputs and compile its package to ``out``."""
        first, last = self._span()
        span = first if first == last else f"{first} .. {last}"
        # Tens of seconds, a minute or more with autotuning: worth a spinner.
        with progress.step(f"compiling {self.label} with inductor ({span})"):
            self._export_and_compile(inputs, options, out)
        return ""

    def _export_and_compile(self, inputs: list[Tensor], options: dict[str, Any],
                            out: Path) -> None:
        program = self.program
        assert program.pure_fn is not None
        device = inputs[0].device if inputs else torch.device("cpu")
        module = SegmentModule(program.pure_fn, program.constants).eval()
        # A failed export prints the whole graph to stderr; the failure's first line goes
        # to the compile report instead (and the segment runs codegen).
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            exported = torch.export.export(module, tuple(inputs), strict=False)
        # Not in the key, and it need not be: it follows from the nodes and input shapes,
        # which are (a change to SERIAL_MAX_WORK bumps FORMAT).
        if device.type == "cpu" and largest_op_work(exported.graph) <= SERIAL_MAX_WORK:
            options = {**options, "cpp.threads": 1}
        import torch._inductor.config as inductor_config

        # Autotuning writes its timing tables to stderr; a compile error still raises.
        with inductor_config.patch(options), torch.no_grad(), \
                contextlib.redirect_stderr(io.StringIO()):
            torch._inductor.aoti_compile_and_package(exported, package_path=str(out))


def has_packages() -> bool:
    """Whether the package cache holds any package at all (one directory listing)."""
    try:
        with os.scandir(cache_dir() / "aoti") as entries:
            return any(entry.name.endswith(".pt2") for entry in entries)
    except OSError:  # no cache directory yet, or not readable
        return False


def cached_packages() -> list[Path]:
    """The package files in the cache, least recently used first (links not followed)."""
    return ArtifactStore.inspect("aoti").artifacts(".pt2")


def evict_packages(max_bytes: int, keep: Path | None = None) -> Cleared:
    """Delete the least recently used packages until the cache holds at most ``max_bytes``.

    ``keep`` (the package just written) is never deleted, and neither is a build in
    progress: another process may be writing it (stale partial builds go).
    """
    return ArtifactStore.inspect("aoti").evict(".pt2", max_bytes, keep)


def clear_packages() -> Cleared:
    """Delete every cached package (and stale partial builds); links are left alone."""
    return ArtifactStore.inspect("aoti").clear(".pt2")


def package_key(nodes: Sequence[Node], source: str, inputs: Sequence[Tensor],
                options: dict[str, Any] | None = None) -> str:
    """A digest of everything a package depends on, computed without exporting.

    The segment's nodes (op, domain, opset, attributes, wiring by value name and
    spec), every constant's bytes, the generated source, the input signature, the
    inductor options and the toolchain (versions, device, and the CPU's vector ISA:
    a package holds machine code). A cache hit then costs hashing and loading only.
    """
    import segflow

    digest = hashlib.blake2b(digest_size=20)
    device = inputs[0].device if inputs else torch.device("cpu")
    _feed(digest, (FORMAT, segflow.__version__, torch.__version__, _target(device),
                   sorted((options or {}).items()), source))
    for t in inputs:
        _feed(digest, (tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device)))
    for node in nodes:
        _feed_node(digest, node)
    return digest.hexdigest()


def _target(device: torch.device) -> tuple[object, ...]:
    """What a package's machine code is built for. Inductor compiles CPU kernels with
    ``-march=native`` and bakes in the intra-op thread count, so a package must not load
    on another CPU model or in a process with another thread count; GPU code is built for
    one compute capability."""
    if device.type == "cuda":
        return ("cuda", torch.cuda.get_device_capability(device))
    if device.type != "cpu":
        return (device.type,)
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        lines = [line for line in f if line.startswith(("model name", "flags"))]
        cpu = "".join(sorted(set(lines)))
    return ("cpu", torch.backends.cpu.get_cpu_capability(), cpu, torch.get_num_threads())


def _feed_node(digest: Any, node: Node) -> None:
    _feed(digest, (node.domain, node.op_type, node.opset, [v.name for v in node.outputs]))
    for name in sorted(node.attrs):
        _feed(digest, name)
        _feed(digest, node.attrs[name])
    for value in node.inputs:
        if value is None:
            _feed(digest, None)
            continue
        spec = value.spec
        _feed(digest, (value.name, str(spec.dtype), spec.shape))
        if value.const is not None:
            _feed(digest, value.const)
    for name in sorted(node.subgraphs):
        _feed(digest, name)
        for inner in node.subgraphs[name].nodes:
            _feed_node(digest, inner)


def _feed(digest: Any, obj: object) -> None:
    """Add ``obj`` to the digest: tensors and arrays by their bytes, the rest by repr."""
    if isinstance(obj, Tensor):
        digest.update(repr(("tensor", tuple(obj.shape), str(obj.dtype))).encode())
        data = (obj.to_dense() if obj.is_mkldnn else obj).detach().contiguous().cpu().reshape(-1)
        if data.numel():
            digest.update(data.view(torch.uint8).numpy().data)
    elif isinstance(obj, np.ndarray):
        digest.update(repr(("array", obj.shape, str(obj.dtype))).encode())
        digest.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, (list, tuple)):
        digest.update(f"{type(obj).__name__}[{len(obj)}](".encode())
        for item in obj:
            _feed(digest, item)
        digest.update(b")")
    else:
        digest.update(repr(obj).encode())


def _load(path: Path) -> Callable[..., Sequence[Tensor]]:
    """The package's runner. Segment inputs and outputs are flat tensor lists, so the
    C++ loader is called directly: ``aoti_load_package`` would first import
    ``torch._inductor`` (about 1.5 s) only to flatten and unflatten them."""
    loader_type = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    loader: Any = None
    if loader_type is not None:
        for args in ((str(path), "model", False, 1, -1), (str(path), "model", False, 1)):
            try:
                loader = loader_type(*args)
                break
            except TypeError:  # another torch's constructor signature
                continue
    if loader is None:
        runner = torch._inductor.aoti_load_package(str(path))

        def run_any(*inputs: Tensor) -> Sequence[Tensor]:
            out: Any = runner(*inputs)
            return tuple(out) if isinstance(out, (list, tuple)) else (out,)
        return run_any

    def run(*inputs: Tensor) -> Sequence[Tensor]:
        return loader.run(list(inputs))  # type: ignore[no-any-return]
    return run
