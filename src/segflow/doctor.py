"""``segflow doctor``: what this installation runs with, one short line per fact.

What a bug report needs and what explains a slow run: segflow's version and where it
is installed, Python, torch (its CUDA build and devices), onnx, numpy, the optional
peers, the CPU as the kernel choices see it (:class:`~segflow.kernels.target.CpuTarget`)
and the choices it makes there, the C compiler and whether the native kernels load,
libdnnl, and the cache directory: whether it is trusted and what it holds.

>>> from segflow.doctor import report
>>> print("\\n".join(report()))                      # doctest: +SKIP
segflow 0.1.0 at /venv/lib/python3.11/site-packages/segflow

Nothing raises: a fact that cannot be read is a line saying so and why, so that the
report is most useful exactly where an installation is broken.
"""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

# (what, required_by): a module reported when installed; the second part says who needs it.
OPTIONAL_MODULES = (("onnxruntime", "segflow check, bench peers and the tests"),
                    ("openvino", "another runtime, for comparisons"))


def report() -> list[str]:
    """The report's lines, section by section (:data:`SECTIONS`); a section that fails
    is one line naming it and the error."""
    lines: list[str] = []
    for name, section in SECTIONS:
        try:
            lines += section()
        except Exception as exc:   # the report must survive any broken piece
            lines.append(f"{name}: could not be read ({type(exc).__name__}: {_first(exc)})")
    return lines


# -- sections ---------------------------------------------------------------------------
def _segflow() -> list[str]:
    import segflow

    where = Path(segflow.__file__).resolve().parent
    site = any(part in ("site-packages", "dist-packages") for part in where.parts)
    how = "installed" if site else "a source tree: editable install or PYTHONPATH"
    return [f"segflow {segflow.__version__} at {where} ({how})"]


def _python() -> list[str]:
    return [f"python {platform.python_version()} ({sys.executable}), "
            f"{platform.system()} {platform.machine()}"]


def _torch() -> list[str]:
    import torch

    cuda = torch.version.cuda
    line = f"torch {torch.__version__} ({f'CUDA {cuda} build' if cuda else 'CPU build'})"
    if not cuda:
        return [line]
    if not torch.cuda.is_available():
        return [f"{line}; CUDA not available (no driver or no device)"]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"{line}; {len(names)} CUDA devices: {', '.join(names)}"]


def _libraries() -> list[str]:
    lines = [f"{name} {_version(name) or 'NOT INSTALLED (required)'}"
             for name in ("onnx", "numpy")]
    for name, used_by in OPTIONAL_MODULES:
        version = _version(name)
        lines.append(f"{name} {version}" if version else
                     f"{name}: not installed (optional: {used_by})")
    return lines


def _cpu() -> list[str]:
    from segflow.errors import NativeKernelsUnavailable
    from segflow.kernels.target import CpuTarget

    # The native line below says why they are absent; the notice would say it twice.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NativeKernelsUnavailable)
        target = CpuTarget.detect()
    isa = [name for name, has in (("avx2", target.avx2), ("fma", target.fma),
                                  ("avx512", target.avx512), ("vnni", target.vnni),
                                  ("bf16", target.bf16)) if has]
    caches = ", ".join(f"L{level} {size >> 10} KiB" for level, size in
                       ((1, target.l1d_bytes), (2, target.l2_bytes), (3, target.l3_bytes))
                       if size)
    choices = [name for name, chosen in (
        ("direct linears (libdnnl inner product)", target.direct_linear_preferred()),
        ("blocked nChw8c layout", target.blocked_layout_preferred()),
        ("native stem", target.native_stem_preferred()),
        ("native packed linears", target.native_linear_preferred()),
        ("Strassen", target.strassen_preferred()),
        ("transcendental post-ops in oneDNN", target.fuses_transcendental_post_ops()),
    ) if chosen]
    winograd = ("every 3x3 convolution" if target.winograd_preferred(None)
                else f"3x3 convolutions with >= {_min_tiles()} tiles an image")
    native = (f"{target.native.describe()} ({target.native_why})"
              if target.native is not None else target.native_why)
    return [
        f"cpu: {_cpu_model()}; torch dispatch {target.capability}; "
        f"{' '.join(isa) or 'no AVX2'}; {target.threads} threads"
        + (f"; {caches}" if caches else ""),
        f"kernel choices: {', '.join(choices) or 'none of the optional ones'}; "
        f"Winograd for {winograd}",
        f"native kernels: {native}",
        f"libdnnl: {target.dnnl_why}",
    ]


def _compiler() -> list[str]:
    from segflow.settings import c_compiler

    compiler = c_compiler()
    exe = shutil.which(compiler)
    if exe is None:
        return [f"C compiler: {compiler!r} is not on PATH (set CC)"]
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return [f"C compiler: {exe} does not run ({_first(exc)})"]
    said = done.stdout.strip().splitlines()
    version = said[0] if said else f"no version (exit status {done.returncode})"
    return [f"C compiler: {exe}: {version}"]


def _cache() -> list[str]:
    from segflow.cache_store import ArtifactStore
    from segflow.kernels.native.build import cached_builds
    from segflow.runtime.aot_inductor import cached_packages
    from segflow.settings import ENV_CACHE_DIR, cache_dir, environment

    chosen = (f"from ${ENV_CACHE_DIR}" if environment().get(ENV_CACHE_DIR, "").strip()
              else f"the default; ${ENV_CACHE_DIR} moves it")
    lines = [f"cache: {cache_dir()} ({chosen})"]
    for kind, what, listed in (("aoti", "inductor packages", cached_packages),
                               ("native", "native builds", cached_builds)):
        store = ArtifactStore.inspect(kind)
        files = listed()
        size = sum(path.stat().st_size for path in files) / (1 << 20)
        trust = f"NOT TRUSTED: {store.distrust}" if store.distrust else "trusted"
        lines.append(f"  {what}: {len(files)}, {size:.1f} MiB; {trust}")
    return lines


SECTIONS: tuple[tuple[str, Callable[[], list[str]]], ...] = (
    ("segflow", _segflow),
    ("python", _python),
    ("torch", _torch),
    ("libraries", _libraries),
    ("C compiler", _compiler),
    ("cpu", _cpu),
    ("cache", _cache),
)


# -- helpers ----------------------------------------------------------------------------
def _version(module: str) -> str:
    """The module's version, '' when it does not import (any error: a broken install
    of an optional peer is reported as absent, not raised)."""
    try:
        return str(getattr(importlib.import_module(module), "__version__", "(no version)"))
    except Exception:
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown model"


def _min_tiles() -> int:
    from segflow.kernels.target import WINOGRAD_MIN_TILES
    return WINOGRAD_MIN_TILES


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
