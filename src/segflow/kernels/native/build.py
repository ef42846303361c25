"""Native kernels: C sources shipped in ``kernels/native/``, built on first use, cached on disk.

Some work is too small for any library call to pay: a 64 x 64 dense layer at
batch 1 is ~4k multiply-adds, about 0.1 us of arithmetic, while one ATen call
costs 3-4 us of dispatch (``dense_chain.c``); and a loop over recorded libdnnl
executes costs 8-10 us a step in Python right after a kernel, well under one in C
(``replay.c``, ``kernels/onednn/replay.py``). And some work a library does, but not as
fast as it could on the CPUs we measure: a 3x3 convolution as Winograd where libdnnl
has none for AVX2 (``winograd.c``), a linear over a weight packed in panels
(``gemm.c``, ``kernels/linear.py``), a residual add and LayerNormalization or
RMSNormalization in one pass (``layer_norm.c``, ``kernels/layer_norm.py``), attention
reading its heads in place (``attention.c``, ``kernels/attention.py``), an NCHW image copied into
channels-last (``staging.c``, ``kernels/staging.py``). For such work segflow ships C source and
builds it with the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native``)
the first time a process needs it, into one library in ``<cache dir>/native/``
(see :func:`segflow.settings.cache_dir`), keyed by the sources, the compiler and
the CPU; later processes load the built library in about a millisecond. The cache
loads only a library segflow built, from directories only this user can write,
checked before ``dlopen`` runs any of its code (:mod:`segflow.cache_store`); of
processes starting together one builds it and the others wait for it.

Nothing here is required: without a compiler, or with ``SEGFLOW_NATIVE=0``,
:meth:`NativeLibrary.probe` returns None and a phrase saying why, and the
kernels that would use it run through torch (``explain()`` says so). Where the
library was wanted but could not be had, the process is told once, with a
:class:`~segflow.errors.NativeKernelsUnavailable` warning: a warning rather than a
log line because it is avoidable (a compiler, ``CC``, or ``SEGFLOW_NATIVE=0`` to
choose torch on purpose), and a warning class can be silenced, or made an error by a
deployment that must not run without the kernels (``-W error::...``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from segflow import progress
from segflow.cache_descriptions import NativeBuildDescription, cpu_name
from segflow.cache_store import ArtifactStore, Cleared
from segflow.errors import NativeKernelsUnavailable
from segflow.settings import ENV_NATIVE, c_compiler, environment, native_kernels

# Compiled together into one library; dense_chain.c defines segflow_native_abi().
SOURCES = tuple(Path(__file__).parent / name
                for name in ("attention.c", "dense_chain.c", "finite.c", "gemm.c",
                             "layer_norm.c", "quantize.c", "replay.c", "staging.c", "stem.c",
                             "strassen.c", "winograd.c"))
# Included by the sources (part of the build's key, not compiled on their own).
HEADERS = tuple(Path(__file__).parent / name for name in ("linear.h", "panel.h"))
ABI = 18         # segflow_native_abi() of the sources this module speaks to
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120
# How long a process waits for another that is building the same library (then builds its own).
LOCK_WAIT_S = BUILD_TIMEOUT_S + 30
# What falls back (to torch, or to libdnnl called from Python) without the library: the
# notice and explain() name it, so that a missing compiler's cost is visible where it is paid.
FALLBACKS = ("dense chains", "packed linears (and Strassen)", "add + LayerNorm/RMSNorm",
             "attention", "the convolution stem", "Winograd transforms", "image staging",
             "replayed runs", "dynamic quantization")
# What that costs, as measured (docs/performance.md, "Without a C compiler").
FALLBACK_COST = ("measured at 1.1x the time for ResNet-50 and BERT-tiny, 1.3x for ResNet-18, "
                 "10x for a chain of tiny layers")


@dataclass(frozen=True, slots=True)
class NativeLibrary:
    """A loaded build of ``kernels/native/*.c``: its functions, where it lives, how it got there."""

    dll: ctypes.CDLL
    path: Path
    compiler: str            # the compiler's first ``--version`` line
    build_s: float           # seconds spent compiling it in this process (0: loaded from cache)
    cache_note: str = ""     # what the cache's checks refused on the way (cache_store.py)

    @staticmethod
    def for_session() -> tuple[NativeLibrary | None, str]:
        """:meth:`probe`, unless ``SEGFLOW_NATIVE=0`` now: read when a session binds its
        kernels, so that one process can hold sessions with and without them."""
        if not native_kernels():
            return None, f"are off ({ENV_NATIVE}=0)"
        return NativeLibrary.probe()

    @staticmethod
    @functools.cache
    def probe() -> tuple[NativeLibrary | None, str]:
        """``(library, why)``: the library or None, and a phrase for explain/logs.

        Built or loaded once per process; where it was wanted and could not be had, the
        process is told so here, once (:func:`unavailable_notice`).
        """
        library, why = NativeLibrary.find()
        if library is None and native_kernels():
            warnings.warn(unavailable_notice(why), NativeKernelsUnavailable,
                          stacklevel=_caller_outside_segflow())
        return library, why

    @staticmethod
    def find(env: Mapping[str, str] | None = None) -> tuple[NativeLibrary | None, str]:
        """:meth:`probe` without the per-process cache (``env``: the variables to obey)."""
        env = environment(env)
        if not native_kernels(env):
            return None, f"are off ({ENV_NATIVE}=0)"
        compiler = c_compiler(env)
        exe = shutil.which(compiler, path=env.get("PATH"))
        if exe is None:
            return None, f"need a C compiler and found none ({compiler!r} is not on PATH; set CC)"
        try:
            version = _first_line(subprocess.run(
                [exe, "--version"], capture_output=True, text=True, timeout=30).stdout)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"need a working C compiler ({exe}: {exc})"
        try:
            sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
        except OSError as exc:
            return None, f"are missing their source ({exc})"
        key = hashlib.sha256(b"\0".join([*sources, version.encode(), " ".join(FLAGS).encode(),
                                         _cpu_identity().encode()])).hexdigest()[:20]
        name = f"segflow-native-{key}.so"
        build_s = [0.0]

        def build(out: Path) -> str:
            start = time.perf_counter()
            failure = _build(exe, out)
            build_s[0] = time.perf_counter() - start
            return failure

        described = NativeBuildDescription(version, " ".join(FLAGS[:2]), cpu_name()).to_json()
        try:
            store = ArtifactStore.open("native", env)
            got = store.obtain(name, build, wait_s=LOCK_WAIT_S, description=described)
            loaded = _open(got.path) if got.path is not None else "not built"
            refused = got.refused
            if isinstance(loaded, str) and got.path is not None and not got.built:
                # It passed the checks (segflow built it) yet does not load: once more.
                refused = f"it did not load ({loaded})"
                got = store.obtain(name, build, wait_s=LOCK_WAIT_S, rebuild=True,
                                   description=described)
                loaded = _open(got.path) if got.path is not None else "not built"
        except OSError as exc:
            return None, f"have no directory to be built in ({exc})"
        note = _cache_note(store, refused)
        if got.path is None:
            return None, f"could not be built: {got.failure}" + (f" ({note})" if note else "")
        if isinstance(loaded, str):
            return None, f"could not be loaded ({got.path}: {loaded})"
        dll, abi = loaded
        if abi != ABI:
            return None, f"are stale ({got.path} speaks ABI {abi}, segflow {ABI})"
        library = NativeLibrary(dll, got.path, version, build_s[0] if got.built else 0.0, note)
        return library, f"{version}, {' '.join(FLAGS[:2])}"

    def describe(self) -> str:
        """How this process got the library, for explain()."""
        text = (f"built in {self.build_s:.2f} s into {self.path}" if self.build_s
                else f"loaded from {self.path}")
        return f"{text} ({self.cache_note})" if self.cache_note else text


def describe_cache() -> list[str]:
    """``explain()``'s line for this process's library when the cache's checks refused
    something on the way to it (nothing when it was never looked for)."""
    if not native_kernels():
        return []
    calls = getattr(NativeLibrary.probe, "cache_info", None)   # absent where a test stands in
    if calls is not None and not calls().currsize:
        return []
    library, why = NativeLibrary.probe()
    if library is None:
        return [f"native kernels {why}; without them: {_listed(FALLBACKS)} fall back to torch"]
    return [f"native kernels: {library.describe()}"] if library.cache_note else []


def unavailable_notice(why: str) -> str:
    """The once-per-process notice for native kernels that were wanted and are absent:
    why, what falls back, what it costs and what to do."""
    fallbacks = _listed(FALLBACKS)
    return (f"segflow's native kernels {why}. {fallbacks[0].upper()}{fallbacks[1:]} fall back "
            f"to torch or to libdnnl called from Python ({FALLBACK_COST}; explain() lists "
            f"them). Install a C compiler or set CC; {ENV_NATIVE}=0 chooses the fallbacks "
            "without this notice.")


def _listed(items: tuple[str, ...]) -> str:
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items)


def cached_builds(env: Mapping[str, str] | None = None) -> list[Path]:
    """The built libraries in the cache (every source version and CPU that built one)."""
    return ArtifactStore.inspect("native", env).artifacts(".so")


def clear_builds(env: Mapping[str, str] | None = None) -> Cleared:
    """Delete the cached builds (and partial builds left by killed processes); links
    are left alone. The next process rebuilds."""
    return ArtifactStore.inspect("native", env).clear(".so")


def _caller_outside_segflow() -> int:
    """The ``stacklevel`` of the first frame outside segflow's package, so the notice
    names the line of the caller's code that opened the session."""
    package = str(Path(__file__).parents[2]) + os.sep
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _cache_note(store: ArtifactStore, refused: str) -> str:
    """Why the library is not the cache's own file, for describe() ('' when it is)."""
    if store.distrust:
        return f"for this process only; not loaded from the cache: {store.distrust}"
    return f"the file there before was not loaded: {refused}" if refused else ""


def _open(path: Path) -> tuple[ctypes.CDLL, int] | str:
    """The loaded library and its ABI, or why it did not load. Called only on a file
    :class:`ArtifactStore` verified: its constructors run here."""
    try:
        dll = ctypes.CDLL(str(path))
        return dll, int(dll.segflow_native_abi())
    except (OSError, AttributeError) as exc:
        return str(exc)


def _build(exe: str, out: Path) -> str:
    """Compile :data:`SOURCES` to ``out``, in its directory (a fresh ``.build-*`` one:
    :class:`ArtifactStore` moves the result into place). '' on success, else why not.
    Without ``-march=native`` if the compiler refuses it."""
    failure = ""
    # A few seconds on a small machine, once per cache: worth a spinner.
    with progress.step(f"building native kernels ({len(SOURCES)} C sources, {Path(exe).name})"):
        for flags in (FLAGS, tuple(f for f in FLAGS if not f.startswith("-march"))):
            failure = _compile_and_link(exe, flags, out.parent, out)
            if not failure:
                return ""
    return failure


def _compile_and_link(exe: str, flags: tuple[str, ...], work: Path, out: Path) -> str:
    """Every source compiled by its own compiler process, all at once, then one link: the
    first build takes about as long as the slowest source rather than their sum. '' on
    success, else why not."""
    compile_flags = [f for f in flags if f != "-shared"]
    objects = [work / f"{source.stem}.o" for source in SOURCES]
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    procs: list[subprocess.Popen[str]] = []
    try:
        for source, obj in zip(SOURCES, objects):
            procs.append(subprocess.Popen([exe, *compile_flags, "-c", str(source), "-o", str(obj)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
        failed = []
        for proc in procs:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if proc.returncode:
                failed.append((proc.returncode, err))
        if failed:
            return _compiler_failure(exe, *failed[0])
        done = subprocess.run([exe, "-shared", "-o", str(out), *map(str, objects), "-lm"],
                              capture_output=True, text=True,
                              timeout=max(0.1, deadline - time.monotonic()))
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{exe}: {exc}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return _compiler_failure(exe, done.returncode, done.stderr) if done.returncode else ""


def _compiler_failure(exe: str, returncode: int, stderr: str) -> str:
    # The first error, not the first line (often the "In function ..." before it).
    errors = [line for line in stderr.splitlines() if "error" in line]
    said = _first_line(errors[0] if errors else stderr)
    return f"{exe} exited with {returncode}" + (f": {said}" if said else " and said nothing")


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else ""


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the machine, and the first CPU's model and
    feature flags (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if not line.strip():
                    break        # the end of the first processor's block
                if line.split(":", 1)[0].strip() in ("model name", "flags", "Features",
                                                     "CPU part"):
                    parts.append(line.strip())
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)
