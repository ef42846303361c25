"""Convolutions called straight into oneDNN's C API (``libdnnl``, through ctypes).

Why: torch's ``mkldnn._convolution_pointwise`` rebuilds oneDNN's primitive
descriptor, memory descriptors and attributes on every call. That costs
45-95 us per convolution at batch 1 and 0.2-0.5 ms at batch 8, which was the
whole gap between segflow's default backend and onnxruntime on ResNet-50
(docs/benchmarking.md). Here a convolution builds its primitive once per input
layout, and then a call costs about 6 us: point the source, destination and
residual memories at the tensors, execute (ctypes releases the GIL).

The weight is read in place. The layout pass packs it with torch's oneDNN and
checks, byte for byte against this library's reorder, that the packing is the
format this library's convolution wants (trying torch's packing for another
size where the first differs); such a weight is then matched by descriptor at
run time. Where no torch packing is, the layout pass keeps this library's own
packing instead (``DirectConv(libdnnl_packed=True)``), matched the same way.
A primitive that wants yet another format (another input size, a post-op that
changes the choice) gets the convolution's own packed copy, for at most
``max_copies`` formats.

The library is the ``onednn-cpu-gomp`` wheel (oneDNN 3.x built on GNU OpenMP);
it must share torch's OpenMP runtime, or the two thread pools would fight for
the cores, so :meth:`Library.load` refuses a process with two ``libgomp``
copies. ``SEGFLOW_ONEDNN_DIRECT=0`` turns the path off; ``SEGFLOW_DNNL_LIBRARY``
names the library file when it is not in the environment's ``lib/``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import site
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from segflow.settings import ENV_DNNL_LIBRARY

if TYPE_CHECKING:
    from segflow.ops.native_stem import NativeStem
    from segflow.ops.winograd import Winograd

Tensor = torch.Tensor
# Where a direct kernel writes its output in a run: the storage planned for it, or None.
Destination = Callable[[], Tensor | None]
# A pooling window for one input size: kernel, strides, dilations, begin and end pads.
PoolWindow = tuple[list[int], list[int], list[int], list[int], list[int]]
_P = ctypes.c_void_p
_Dims = ctypes.c_int64 * 12           # dnnl_dims_t (DNNL_MAX_NDIMS)

# oneDNN 3.x C API constants (oneapi/dnnl/dnnl_types.h, dnnl_common_types.h).
_CPU_ENGINE = 1
_STREAM_IN_ORDER = 1
_F32 = 3
_FORMAT_ANY = 1
_TAG_A = 2                            # plain 1-D (bias)
_TAG_NCHW8C = 102                     # dnnl_aBcd8b: channels in blocks of 8 (nChw8c)
BLOCK = 8                             # channels per block of the blocked layout
_FORWARD_INFERENCE = 96
_CONVOLUTION_DIRECT = 1
# Pooling algorithms (dnnl_alg_kind_t).
POOL_MAX = 0x1FF
POOL_AVG_EXCLUDE_PADDING = 0x3FF
_QUERY_IMPL_INFO = 8
_QUERY_WEIGHTS_MD = 131
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS = 1, 17, 33, 41
_ARG_SRC_1 = 2
_POST_OP_ARG_BASE = 32768            # DNNL_ARG_ATTR_MULTIPLE_POST_OP(i) = base * (i + 1)
_BINARY_ADD = 0x1FFF0
_OMP_RUNTIME = 2                      # DNNL_RUNTIME_OMP

# Primitives an op builds (one per input layout) before the rest go to its fallback.
MAX_LAYOUTS = 32

# torch's oneDNN post-op names (ops/fused.py Activation.onednn) -> oneDNN eltwise
# (algorithm, alpha, beta) given the activation's scalars.
_ELTWISE: dict[str, Callable[[Sequence[float], str], tuple[int, float, float] | None]] = {
    "relu": lambda s, a: (32, 0.0, 0.0),
    "leaky_relu": lambda s, a: (32, float(s[0]), 0.0),
    "tanh": lambda s, a: (33, 0.0, 0.0),
    "hardsigmoid": lambda s, a: (40, 1.0 / 6.0, 0.5),
    "sigmoid": lambda s, a: (41, 0.0, 0.0),
    "hardtanh": lambda s, a: (47, float(s[0]), float(s[1])),     # clip_v2: lo <= x <= hi
    "hardswish": lambda s, a: (52, 1.0 / 6.0, 0.5),
    "gelu": lambda s, a: (43, 0.0, 0.0) if a == "tanh" else (49, 0.0, 0.0),
}


def onednn_eltwise(attr: str, scalars: Sequence[float], algorithm: str
                   ) -> tuple[int, float, float] | None:
    """oneDNN's eltwise ``(algorithm, alpha, beta)`` for torch's post-op name, if any."""
    make = _ELTWISE.get(attr)
    return None if make is None else make(scalars, algorithm)


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _P)]


class DnnlError(RuntimeError):
    """A oneDNN C call failed (status code in the message)."""


def _library_candidates() -> Iterator[str]:
    """Where to look: the named file, else the environment's ``lib/`` (where the wheel
    puts it), the user base, then the system's library path. Lazily: the last asks
    ``ctypes.util.find_library``, which runs ``ldconfig`` and a compiler (tens of
    milliseconds of a cold start), only when the wheel's file is not there."""
    named = os.environ.get(ENV_DNNL_LIBRARY, "").strip()
    if named:
        yield named
        return
    if not sys.platform.startswith("linux"):
        return
    for prefix in (sys.prefix, site.USER_BASE):
        if prefix:
            yield str(Path(prefix) / "lib" / "libdnnl.so.3")
    system = ctypes.util.find_library("dnnl")
    if system:
        yield system


def _libgomp_copies() -> int:
    return len(_libgomp_paths()) or 1


def _libgomp_paths() -> set[str]:
    """The libgomp files mapped into this process (empty: none, or no /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines()
            if "libgomp" in line.rsplit("/", 1)[-1]}


@functools.cache
def openmp_entry_points() -> tuple[int, int, int] | None:
    """``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads`` of the
    process's one libgomp, the thread pool torch and libdnnl share; None where there is
    not exactly one. Native kernels (``ops/native/winograd.c``) split their loops on it
    rather than start threads of their own that would compete for the cores."""
    paths = _libgomp_paths()
    if len(paths) != 1:
        return None
    try:
        dll = ctypes.CDLL(paths.pop())
        return tuple(ctypes.cast(getattr(dll, name), ctypes.c_void_p).value or 0
                     for name in ("GOMP_parallel", "omp_get_thread_num",
                                  "omp_get_num_threads"))  # type: ignore[return-value]
    except (OSError, AttributeError):
        return None


class Library:
    """The loaded ``libdnnl``: typed entry points and one CPU engine."""

    def __init__(self, dll: ctypes.CDLL, path: str) -> None:
        self.path = path
        dll.dnnl_version.restype = ctypes.POINTER(_Version)
        version = dll.dnnl_version().contents
        self.version = f"{version.major}.{version.minor}.{version.patch}"
        self.major = version.major
        self.cpu_runtime = version.cpu_runtime
        self._dll = dll
        dll.dnnl_primitive_desc_query_md.restype = _P
        dll.dnnl_primitive_desc_query_md.argtypes = [_P, ctypes.c_int, ctypes.c_int]
        dll.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        dll.dnnl_memory_desc_get_size.argtypes = [_P]
        dll.dnnl_memory_set_data_handle.argtypes = [_P, _P]
        dll.dnnl_primitive_execute.argtypes = [_P, _P, ctypes.c_int, _P]
        dll.dnnl_post_ops_append_eltwise.argtypes = [_P, ctypes.c_int, ctypes.c_float,
                                                     ctypes.c_float]
        dll.dnnl_post_ops_append_sum.argtypes = [_P, ctypes.c_float, ctypes.c_int32,
                                                 ctypes.c_int]
        dll.dnnl_post_ops_append_binary.argtypes = [_P, ctypes.c_int, _P]
        dll.dnnl_memory_desc_create_with_strides.argtypes = [ctypes.POINTER(_P), ctypes.c_int,
                                                             _Dims, ctypes.c_int, _Dims]
        dll.dnnl_memory_desc_create_with_tag.argtypes = [ctypes.POINTER(_P), ctypes.c_int,
                                                         _Dims, ctypes.c_int, ctypes.c_int]
        dll.dnnl_memory_create.argtypes = [ctypes.POINTER(_P), _P, _P, _P]
        dll.dnnl_primitive_desc_query.argtypes = [_P, ctypes.c_int, ctypes.c_int, _P]
        dll.dnnl_memory_desc_equal.argtypes = [_P, _P]
        self.set_handle = dll.dnnl_memory_set_data_handle
        self.execute = dll.dnnl_primitive_execute
        self.engine = self._make(dll.dnnl_engine_create, _CPU_ENGINE, ctypes.c_size_t(0))
        # preferred_desc's answers, kept for the process (a few hundred bytes each).
        self._preferred: dict[tuple[object, ...], _P] = {}

    @staticmethod
    def load() -> Library | None:
        """The process's libdnnl, or None when it is absent or unsafe to mix with torch."""
        return Library.probe()[0]

    @staticmethod
    @functools.cache
    def probe() -> tuple[Library | None, str]:
        """``(library, why)``: the library or None, and a phrase for explain/logs.

        Loaded once per process; whether a session uses it is the layout pass's
        ``onednn_direct`` option (``SEGFLOW_ONEDNN_DIRECT=0`` turns it off).
        """
        return Library.find()

    @staticmethod
    def find() -> tuple[Library | None, str]:
        """:meth:`probe` without the per-process cache."""
        for path in _library_candidates():
            if not path or ("/" in path and not Path(path).exists()):
                continue
            try:
                dll = ctypes.CDLL(path)
                lib = Library(dll, path)
            except (OSError, AttributeError, DnnlError) as exc:
                return None, f"is unusable ({path}: {exc})"
            if lib.major != 3:
                return None, f"is oneDNN {lib.version} at {path}; segflow needs 3.x"
            if not hasattr(torch.ops.mkldnn, "data_ptr"):
                return None, "is not used: this torch cannot expose its packed weights"
            if lib.cpu_runtime != _OMP_RUNTIME or _libgomp_copies() > 1:
                return None, (f"is not used: {path} does not share torch's OpenMP runtime "
                              "(two thread pools would compete for the cores)")
            return lib, f"oneDNN {lib.version} ({path})"
        return None, "is not installed (pip install onednn-cpu-gomp)"

    def destroy(self, owned: list[tuple[str, _P]]) -> None:
        """Free oneDNN objects: ``(kind, handle)``, kind naming the ``dnnl_<kind>_destroy``."""
        for kind, handle in owned:
            getattr(self._dll, f"dnnl_{kind}_destroy")(handle)
        owned.clear()

    def set_verbose(self, level: int) -> None:
        """oneDNN's verbose mode for this library (1: one line per primitive executed),
        the counterpart of ``torch.backends.mkldnn.verbose`` for torch's copy."""
        self.check(self._dll.dnnl_set_verbose(level), "set verbose")

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise DnnlError(f"{what}: oneDNN status {status}")

    def _make(self, fn: Callable[..., int], *args: object) -> _P:
        handle = _P()
        self.check(fn(ctypes.byref(handle), *args), fn.__name__)
        return handle

    def memory_desc(self, t: Tensor) -> _P:
        """A float32 memory descriptor with ``t``'s sizes and strides.

        A channels-last tensor gets the canonical channels-last strides: where a dim
        has size 1 torch's strides are arbitrary (a ``[N, C, 1, 1]`` tensor reads
        as NCHW), and oneDNN would then pick its reference kernels.
        """
        strides = list(t.stride())
        if t.dim() in (4, 5) and t.is_contiguous(memory_format=_channels_last(t.dim())):
            strides = channels_last_strides(list(t.shape))
        return self._make(self._dll.dnnl_memory_desc_create_with_strides, t.dim(),
                          _Dims(*t.shape), _F32, _Dims(*strides))

    def blocked_desc(self, sizes: Sequence[int]) -> _P:
        """A float32 ``nChw8c`` descriptor of a 4-D ``sizes``: channels in blocks of
        :data:`BLOCK`, the layout of the layout pass's blocked region."""
        return self._make(self._dll.dnnl_memory_desc_create_with_tag, 4, _Dims(*sizes), _F32,
                          _TAG_NCHW8C)

    def to_layout(self, t: Tensor, blocked: bool) -> Tensor:
        """``t`` (4-D, channels-last or plain) reordered into ``nChw8c`` (``blocked``), or
        blocked ``t`` reordered into a channels-last tensor; sizes are ``t``'s either way."""
        sizes = list(t.shape)
        out = torch.empty(sizes, memory_format=torch.channels_last)
        blk = self.blocked_desc(sizes)
        plain = self.memory_desc(t if blocked else out)
        try:
            if blocked:
                self.reorder(plain, t.data_ptr(), blk, out.data_ptr())
            else:
                self.reorder(blk, t.data_ptr(), plain, out.data_ptr())
        finally:
            self.destroy([("memory_desc", blk), ("memory_desc", plain)])
        return out

    def blocked_kernel(self, spec: ConvGeometry, input_size: Sequence[int],
                       plain_input: bool) -> str | None:
        """The kernel this library's convolution runs on ``nChw8c`` activations for this
        geometry and input size, or None where it has only a reference one;
        ``plain_input``: the source stays plain NCHW (a graph input), only the
        destination is blocked."""
        if len(input_size) != 4:
            return None
        owned: list[tuple[str, _P]] = []
        try:
            src, dst = self._activation_descs(spec, input_size, True, plain_input)
            any_weights = self.any_desc(spec.weight_dims)
            owned += [("memory_desc", d) for d in (src, dst, any_weights)]
            _, md, impl = self.convolution(src, any_weights, None, dst, spec.strides,
                                           spec.dilations, spec.pads, None, create=False)
            owned.append(("memory_desc", md))
        except DnnlError:
            return None
        finally:
            self.destroy(owned)
        return None if impl.startswith("ref") else impl

    def _activation_descs(self, spec: ConvGeometry, input_size: Sequence[int],
                          blocked: bool, plain_input: bool) -> tuple[_P, _P]:
        """A convolution's source and destination descriptors: channels-last, or
        ``nChw8c`` (``blocked``) with a plain NCHW source (``plain_input``) or not."""
        out_size = spec.output_size(input_size)
        if not blocked:
            layout = _channels_last(len(input_size))
            return (self.memory_desc(torch.empty(list(input_size), memory_format=layout)),
                    self.memory_desc(torch.empty(out_size, memory_format=layout)))
        src = (self.memory_desc(torch.empty(list(input_size))) if plain_input
               else self.blocked_desc(input_size))
        return src, self.blocked_desc(out_size)

    def vector_desc(self, n: int) -> _P:
        return self._make(self._dll.dnnl_memory_desc_create_with_tag, 1, _Dims(n), _F32, _TAG_A)

    def any_desc(self, sizes: Sequence[int]) -> _P:
        return self._make(self._dll.dnnl_memory_desc_create_with_tag, len(sizes),
                          _Dims(*sizes), _F32, _FORMAT_ANY)

    def memory(self, desc: _P, handle: int | None = None) -> _P:
        return self._make(self._dll.dnnl_memory_create, desc, self.engine, _P(handle))

    def stream(self) -> _P:
        return self._make(self._dll.dnnl_stream_create, self.engine,
                          ctypes.c_uint(_STREAM_IN_ORDER))

    def equal(self, a: _P, b: _P) -> bool:
        return bool(self._dll.dnnl_memory_desc_equal(a, b))

    def size(self, desc: _P) -> int:
        return int(self._dll.dnnl_memory_desc_get_size(desc))

    def reorder(self, src_desc: _P, src: int, dst_desc: _P, dst: int) -> None:
        """Copy ``src`` (laid out as ``src_desc``) to ``dst`` in ``dst_desc``'s format
        (a one-off: the primitive and its stream are made and freed here)."""
        dll = self._dll
        pd = self._make(dll.dnnl_reorder_primitive_desc_create, src_desc, self.engine,
                        dst_desc, self.engine, None)
        prim = self._make(dll.dnnl_primitive_create, pd)
        src_mem = self.memory(src_desc, src)
        dst_mem = self.memory(dst_desc, dst)
        stream = self.stream()
        args = (_ExecArg * 2)(_ExecArg(_ARG_SRC, src_mem), _ExecArg(_ARG_DST, dst_mem))
        try:
            self.check(self.execute(prim, stream, 2, args), "reorder")
            self.check(dll.dnnl_stream_wait(stream), "stream wait")
        finally:
            for mem in (src_mem, dst_mem):
                dll.dnnl_memory_destroy(mem)
            dll.dnnl_stream_destroy(stream)
            dll.dnnl_primitive_destroy(prim)
            dll.dnnl_primitive_desc_destroy(pd)

    def post_ops(self, residual: Tensor | None, inplace: bool,
                 eltwise: tuple[int, float, float] | None, blocked: bool = False
                 ) -> tuple[_P, _P | None]:
        """Attributes ``[sum | binary add] -> eltwise``; the residual's descriptor, if binary
        (``nChw8c`` when ``blocked``)."""
        dll = self._dll
        attr = self._make(dll.dnnl_primitive_attr_create)
        ops = self._make(dll.dnnl_post_ops_create)
        src1 = None
        if residual is not None and inplace:
            self.check(dll.dnnl_post_ops_append_sum(ops, 1.0, 0, 0), "append sum")
        elif residual is not None:
            src1 = self.blocked_desc(residual.shape) if blocked else self.memory_desc(residual)
            self.check(dll.dnnl_post_ops_append_binary(ops, _BINARY_ADD, src1), "append add")
        if eltwise is not None:
            self.check(dll.dnnl_post_ops_append_eltwise(ops, *eltwise), "append eltwise")
        self.check(dll.dnnl_primitive_attr_set_post_ops(attr, ops), "set post-ops")
        dll.dnnl_post_ops_destroy(ops)
        return attr, src1

    def convolution(self, src: _P, weights: _P, bias: _P | None, dst: _P,
                    strides: Sequence[int], dilations: Sequence[int], pads: Sequence[int],
                    attr: _P | None, *, create: bool = True) -> tuple[_P | None, _P, str]:
        """(primitive, its weights descriptor, implementation name) for a forward conv.

        ``create=False`` stops at the descriptor (no JIT code): primitive None.
        """
        dll = self._dll
        spatial = len(strides)
        pd = self._make(dll.dnnl_convolution_forward_primitive_desc_create, self.engine,
                        _FORWARD_INFERENCE, _CONVOLUTION_DIRECT, src, weights, bias, dst,
                        _Dims(*strides), _Dims(*[d - 1 for d in dilations]),
                        _Dims(*pads[:spatial]), _Dims(*pads[:spatial]), attr)
        return self._weighted(pd, create)

    def _weighted(self, pd: _P, create: bool) -> tuple[_P | None, _P, str]:
        """(primitive or None, a copy of its weights descriptor, implementation name) of a
        primitive descriptor, which it destroys."""
        dll = self._dll
        try:
            impl = ctypes.c_char_p()
            dll.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO, 0, ctypes.byref(impl))
            weights_md = _P()
            self.check(dll.dnnl_memory_desc_clone(ctypes.byref(weights_md),
                                                  _P(dll.dnnl_primitive_desc_query_md(
                                                      pd, _QUERY_WEIGHTS_MD, 0))), "clone md")
            prim = self._make(dll.dnnl_primitive_create, pd) if create else None
        finally:
            dll.dnnl_primitive_desc_destroy(pd)
        return prim, weights_md, (impl.value or b"?").decode()

    def inner_product(self, src: _P, weights: _P, bias: _P | None, dst: _P, attr: _P | None,
                      *, create: bool = True) -> tuple[_P | None, _P, str]:
        """(primitive, its weights descriptor, implementation name) for a forward inner
        product (a linear layer: ``dst[M, N] = src[M, K] @ weights[N, K]^T + bias``).

        ``create=False`` stops at the descriptor (no JIT code): primitive None.
        """
        dll = self._dll
        pd = self._make(dll.dnnl_inner_product_forward_primitive_desc_create, self.engine,
                        _FORWARD_INFERENCE, src, weights, bias, dst, attr)
        return self._weighted(pd, create)

    def matmul(self, src: _P, weights: _P, dst: _P) -> tuple[_P | None, _P, str]:
        """(primitive, its weights descriptor, implementation name) for a matmul
        (``dst[..., M, N] = src[..., M, K] @ weights[..., K, N]``, batched over the
        leading dims); ``weights`` may be :meth:`any_desc`."""
        pd = self._make(self._dll.dnnl_matmul_primitive_desc_create, self.engine, src,
                        weights, None, dst, None)
        return self._weighted(pd, True)

    def plain_desc(self, sizes: Sequence[int]) -> _P:
        """A float32 descriptor of a dense row-major tensor of ``sizes``."""
        strides = [1] * len(sizes)
        for dim in range(len(sizes) - 2, -1, -1):
            strides[dim] = strides[dim + 1] * int(sizes[dim + 1])
        return self._make(self._dll.dnnl_memory_desc_create_with_strides, len(sizes),
                          _Dims(*sizes), _F32, _Dims(*strides))

    def linear_desc(self, out_features: int, in_features: int, rows: int) -> tuple[_P, str]:
        """The weights descriptor this library's inner product wants for ``rows`` rows
        (no post-ops), and its implementation name; the caller destroys the descriptor."""
        src = self.memory_desc(torch.empty(rows, in_features))
        dst = self.memory_desc(torch.empty(rows, out_features))
        bias = self.vector_desc(out_features)
        any_weights = self.any_desc((out_features, in_features))
        try:
            _, weights_md, impl = self.inner_product(src, any_weights, bias, dst, None,
                                                     create=False)
        finally:
            self.destroy([("memory_desc", d) for d in (src, dst, bias, any_weights)])
        return weights_md, impl

    def pack_linear(self, dense: Tensor, rows: int) -> Tensor | None:
        """``dense`` ([N, K] float32) packed the way :meth:`linear_desc` says for ``rows``
        rows (bytes), or None where the library has only a reference kernel."""
        out_features, in_features = (int(d) for d in dense.shape)
        weights_md, impl = self.linear_desc(out_features, in_features, rows)
        try:
            if impl.startswith("ref"):
                return None
            return _reorder_weight(self, dense, weights_md, (out_features, in_features))
        finally:
            self.destroy([("memory_desc", weights_md)])

    def pooling(self, src: _P, dst: _P, algorithm: int, window: PoolWindow) -> tuple[_P, str]:
        """(primitive, implementation name) for a forward pooling (``POOL_*``)."""
        dll = self._dll
        kernel, strides, dilations, begin, end = window
        pd = self._make(dll.dnnl_pooling_forward_primitive_desc_create, self.engine,
                        _FORWARD_INFERENCE, algorithm, src, dst, _Dims(*strides),
                        _Dims(*kernel), _Dims(*[d - 1 for d in dilations]), _Dims(*begin),
                        _Dims(*end), None)
        try:
            impl = ctypes.c_char_p()
            dll.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO, 0, ctypes.byref(impl))
            prim = self._make(dll.dnnl_primitive_create, pd)
        finally:
            dll.dnnl_primitive_desc_destroy(pd)
        return prim, (impl.value or b"?").decode()

    def preferred_desc(self, spec: ConvGeometry, input_size: Sequence[int],
                       blocked: bool = False, plain_input: bool = False) -> _P:
        """The weights descriptor of this library's convolution over a channels-last
        (``blocked``: ``nChw8c``; with ``plain_input`` from plain NCHW) input of
        ``input_size`` (no post-ops); the caller destroys this copy of it.

        Asked at load (the layout pass packs weights in this format) and again at a
        convolution's first run (to read such a weight in place, or unpack it), and
        each answer is a primitive descriptor libdnnl searches its implementations
        for: ~0.9 ms for a ResNet-50 convolution, ~35 ms of its first run. So the
        first answer per geometry, input size and layout is kept for the process.
        That is also the right answer to give later: it describes the bytes already
        packed, where a fresh one could differ (libdnnl's kernels choose their
        blocking by the thread count, which a later session may set otherwise; a
        primitive that wants another format then gets its own copy)."""
        key = (spec, tuple(int(d) for d in input_size), blocked, plain_input)
        kept = self._preferred.get(key)
        if kept is None:
            src, dst = self._activation_descs(spec, input_size, blocked, plain_input)
            any_weights = self.any_desc(spec.weight_dims)
            try:
                _, kept, _ = self.convolution(src, any_weights, None, dst, spec.strides,
                                              spec.dilations, spec.pads, None, create=False)
            finally:
                self.destroy([("memory_desc", d) for d in (src, dst, any_weights)])
            if self._preferred.setdefault(key, kept) is not kept:   # another thread's
                self.destroy([("memory_desc", kept)])
                kept = self._preferred[key]
        copy = _P()
        self.check(self._dll.dnnl_memory_desc_clone(ctypes.byref(copy), kept), "clone md")
        return copy

    def unpack_weight(self, packed: Tensor, spec: ConvGeometry, input_size: Sequence[int],
                      blocked: bool = False, plain_input: bool = False) -> Tensor:
        """The dense float32 weight of ``packed``, the bytes :meth:`preferred_weight`
        wrote for ``input_size`` (and ``blocked``, ``plain_input``)."""
        weights_md = self.preferred_desc(spec, input_size, blocked, plain_input)
        dense = torch.empty(list(spec.weight_dims))
        dense_md = self.memory_desc(dense)
        try:
            if self.size(weights_md) != packed.numel() * packed.element_size():
                raise DnnlError("the packed weight's size is not its format's")
            self.reorder(weights_md, packed.data_ptr(), dense_md, dense.data_ptr())
        finally:
            self.destroy([("memory_desc", dense_md), ("memory_desc", weights_md)])
        return dense

    def preferred_weight(self, dense: Tensor, spec: ConvGeometry, input_size: Sequence[int],
                         blocked: bool = False, plain_input: bool = False) -> Tensor:
        """``dense`` packed the way :meth:`preferred_desc` says (bytes): the weight
        constant the layout pass gives a direct convolution."""
        weights_md = self.preferred_desc(spec, input_size, blocked, plain_input)
        try:
            return _reorder_weight(self, dense, weights_md, spec.weight_dims)
        finally:
            self.destroy([("memory_desc", weights_md)])


@dataclass(frozen=True, slots=True)
class _Call:
    """A built primitive for one input layout: execute after pointing the memories."""

    primitive: _P
    src: _P
    dst: _P
    residual: _P | None              # a convolution's binary-add source, or None
    args: ctypes.Array[_ExecArg]
    in_format: torch.memory_format | None   # convert the input to this first (None: as is)
    out_shape: tuple[int, ...]
    out_format: torch.memory_format
    source: Tensor | None            # the weight constant a convolution was built for
    bias: Tensor | None
    impl: str
    # The addresses the src, dst and residual memories point at now (0: none yet):
    # a run's arena block keeps its addresses from run to run, so most calls need
    # no ctypes call to re-point them. Read and written under the op's lock, here or
    # by a native replay (ops/onednn_replay.py), hence a C array.
    handles: ctypes.Array[ctypes.c_size_t] = field(
        default_factory=lambda: (ctypes.c_size_t * 3)())
    # Where a native kernel stands for the primitive (``ops/winograd.py``,
    # ``ops/native_stem.py``): what executes ``primitive`` (dnnl_primitive_execute's
    # signature), the lock of the workspace it shares with other kernels, held while it
    # runs (None: it shares none), and what must outlive the call.
    run: Any = None
    lock: threading.Lock | None = None
    keep: object = None


class DirectOp:
    """What the direct convolution and pooling share: one primitive per input layout
    (``calls``, at most ``max_shapes``; None where the fallback serves it, ``why_not``
    says why), a lock and a stream per op, and the oneDNN objects it owns."""

    kind = "primitive"
    max_copies = 0        # own repacked copies of a weight an op may keep (ops with weights)

    def __init__(self, lib: Library, fallback: Callable[..., Tensor], max_shapes: int,
                 destination: Destination | None) -> None:
        self.lib = lib
        self.fallback = fallback
        self.max_shapes = max_shapes
        # Storage the run planned for the output (runtime/arena.py); None: allocate it.
        self.destination = destination
        self.calls: dict[tuple[object, ...], _Call | None] = {}
        self.why_not: dict[tuple[object, ...], str] = {}
        # Of the calls, how many were built while the session loaded (runtime/prebuild.py).
        self.built_at_load = 0
        self.lock = threading.Lock()
        self._stream: _P | None = None
        # oneDNN objects this op created, destroyed with it (JIT code included).
        self._owned: list[tuple[str, _P]] = []
        weakref.finalize(self, lib.destroy, self._owned)

    @property
    def direct_layouts(self) -> int:
        """How many input layouts run through libdnnl (the rest fall back)."""
        return sum(1 for call in self.calls.values() if call is not None)

    def _output(self, call: _Call) -> Tensor:
        """The planned storage when the run has it at this size, else a new tensor."""
        given = self.destination() if self.destination is not None else None
        if given is not None and given.shape == call.out_shape:
            return given
        return torch.empty(call.out_shape, memory_format=call.out_format)

    def _run(self, call: _Call, x: Tensor, y: Tensor, z: Tensor | None = None) -> None:
        res = 0 if call.residual is None else z.data_ptr()  # type: ignore[union-attr]
        self.execute_at(call, x.data_ptr(), y.data_ptr(), res)

    def execute_at(self, call: _Call, src: int, dst: int, res: int) -> None:
        """Execute ``call`` with its source, destination and residual memories at these
        addresses (``res`` 0: no residual); what a call does once it has its tensors.
        ``ops/onednn_replay.py`` calls it with addresses it recorded."""
        lib = self.lib
        with self.lock:
            handles = call.handles
            if handles[0] != src:
                lib.set_handle(call.src, src)
                handles[0] = src
            if handles[1] != dst:
                lib.set_handle(call.dst, dst)
                handles[1] = dst
            if res and handles[2] != res:
                lib.set_handle(call.residual, res)
                handles[2] = res
            run = call.run
            if run is None:
                status = lib.execute(call.primitive, self._stream, len(call.args), call.args)
            elif call.lock is None:
                status = run(call.primitive, self._stream, len(call.args), call.args)
            else:
                with call.lock:
                    status = run(call.primitive, self._stream, len(call.args), call.args)
        if status != 0:
            raise DnnlError(f"{self.kind} ({call.impl}): oneDNN status {status}")

    def stream(self) -> _P:
        """The op's oneDNN stream (made at its first primitive)."""
        if self._stream is None:
            self._stream = self.lib.stream()
            self._owned.append(("stream", self._stream))
        return self._stream

    def _build(self, key: tuple[object, ...], make: Callable[[], tuple[_Call | None, str]]
               ) -> _Call | None:
        call: _Call | None = None
        why = f"more than {self.max_shapes} input layouts"
        if len(self.calls) < self.max_shapes:
            try:
                call, why = make()
            except DnnlError as exc:
                why = str(exc)
        if call is None:
            self.why_not[key] = why
        self.calls[key] = call
        return call

    def _prebuilt(self, key: tuple[object, ...], make: Callable[[], tuple[_Call | None, str]]
                  ) -> _Call | None:
        """The call for ``key``, built now (counted in ``built_at_load``) if no run has."""
        if key in self.calls:
            return self.calls[key]
        call = self._build(key, make)
        if call is not None:
            self.built_at_load += 1
        return call

    def _weight(self, w: Tensor, weights_md: _P) -> int | None:
        """The address of ``w``'s values in the format ``weights_md`` (None: over the
        op's cap on own copies). Ops with weights define it."""
        raise NotImplementedError

    def _weight_args(self, prim: _P, impl: str, w: Tensor, weights_md: _P, b: Tensor | None,
                     bias_md: _P | None) -> tuple[list[tuple[int, _P]] | None, str]:
        """The weights (and bias) arguments of a built primitive; or None and why not,
        the primitive then destroyed (a reference kernel, or no copy of the weight left)."""
        lib = self.lib
        if impl.startswith("ref"):
            lib.destroy([("primitive", prim)])
            return None, f"only a reference implementation ({impl})"
        weight_ptr = self._weight(w, weights_md)
        if weight_ptr is None:
            lib.destroy([("primitive", prim)])
            return None, f"a weight format beyond {self.max_copies} own copies ({impl})"
        weights = lib.memory(weights_md, weight_ptr)
        self._owned.append(("memory", weights))
        extra = [(_ARG_WEIGHTS, weights)]
        if b is not None and bias_md is not None:
            bias = lib.memory(bias_md, b.data_ptr())
            self._owned.append(("memory", bias))
            extra.append((_ARG_BIAS, bias))
        return extra, ""

    def _finish(self, prim: _P, src_md: _P, dst_md: _P, extra: Sequence[tuple[int, _P]],
                **fields: Any) -> _Call:
        """Own ``prim`` and memories for src/dst (set per call) and ``extra`` args."""
        lib, owned = self.lib, self._owned
        owned.append(("primitive", prim))
        self.stream()
        src = lib.memory(src_md)
        dst = lib.memory(dst_md)
        owned.extend(("memory", m) for m in (src, dst))
        args = [_ExecArg(_ARG_SRC, src), _ExecArg(_ARG_DST, dst),
                *(_ExecArg(arg, memory) for arg, memory in extra)]
        return _Call(prim, src, dst, args=(_ExecArg * len(args))(*args), **fields)


class DirectConv(DirectOp):
    """``fn(x, w, b, z?) -> y``: a FusedConv over libdnnl, one primitive per input layout.

    ``w`` is the layout pass's packed weight. The primitive reads it in place
    when its bytes are the format this library wants for the shape; otherwise
    the convolution keeps its own packed copy, for at most ``max_copies``
    formats. ``fallback`` (torch's oneDNN op, same signature) serves what this
    path cannot take: a residual that broadcasts, a primitive the library
    cannot build or only has a reference implementation for, more formats than
    ``max_copies`` or more layouts than ``max_shapes``. ``why_not`` records why.
    ``destination()`` returns the storage the run planned for the output, if any
    (a channels-last tensor of the output's size), and ``staging()`` the storage
    for a plain (NCHW) input's channels-last copy (``runtime/arena.py``).

    With ``libdnnl_packed``, ``w`` is instead this library's own packing for a
    channels-last input of size ``verified_for`` (bytes; the layout pass keeps
    that where torch's packing is not this library's format), and ``fallback``
    must take it as it is. With ``blocked``, the output (and a residual) is
    ``nChw8c`` bytes under its logical shape, and so is the input with
    ``blocked_input`` (else it is plain NCHW, the blocked region's entry); the
    weight is then packed for that layout, and the fallback runs between
    reorders (``passes/layout.py``, ``_blocked_region``). With ``winograd``, ``w`` is
    the Winograd transform of the weight, and each layout is built as Winograd F(4x4,
    3x3) (``ops/winograd.py``: a call whose ``run`` is the native kernel); one it
    declines (``winograd_not``) runs the fallback, over the plain weight recovered from
    ``w``. With ``stem``, a plain NCHW input is read in place by segflow's stem kernel
    (``ops/native_stem.py``: a call whose ``run`` is the kernel); an input it declines
    (``stem_not``) is staged for libdnnl.
    """

    kind = "convolution"

    def __init__(self, lib: Library, spec: ConvGeometry, eltwise: tuple[int, float, float] | None,
                 after: Callable[[Tensor], Tensor] | None,
                 fallback: Callable[..., Tensor], max_shapes: int, max_copies: int,
                 verified_for: Sequence[int] | None = None,
                 destination: Destination | None = None,
                 staging: Destination | None = None,
                 fallback_inplace: Callable[..., Tensor] | None = None,
                 libdnnl_packed: bool = False, blocked: bool = False,
                 blocked_input: bool = False, winograd: Winograd | None = None,
                 stage: Callable[[Tensor, Tensor], Tensor] | None = None,
                 stem: NativeStem | None = None) -> None:
        super().__init__(lib, fallback, max_shapes, destination)
        if libdnnl_packed and not verified_for:
            raise ValueError("a weight in libdnnl's packing needs the input size it is for")
        if blocked_input and not blocked:
            raise ValueError("a convolution reading nChw8c must write nChw8c")
        self.libdnnl_packed = libdnnl_packed
        # nChw8c activations (the layout pass's blocked region): the output, and the
        # input unless it is the region's plain NCHW entry; a residual is blocked too.
        self.blocked = blocked
        self.blocked_input = blocked_input
        self.staging = staging
        # What copies an input into the staging storage (``stage(x, out) -> out``; None:
        # ``out.copy_(x)``): ops/native_staging.py's native copy where the library loads.
        self.stage = stage
        self.fallback_inplace = fallback_inplace or fallback
        # The layout pass checked that ``w``'s bytes are this library's format for a
        # channels-last input of this size: a primitive whose weights descriptor equals
        # that one reads ``w`` without comparing bytes again (no dense temporaries).
        self.verified_for = tuple(verified_for) if verified_for else None
        self._verified_md: _P | None = None
        self.spec = spec
        self.eltwise = eltwise
        self.after = after
        self.max_copies = max_copies
        self.copies: list[tuple[_P, Tensor]] = []    # (weights descriptor, own packed copy)
        # Builds this convolution's calls as Winograd where they qualify (ops/winograd.py).
        self.winograd = winograd
        self.winograd_not: dict[tuple[object, ...], str] = {}   # layouts it declined, why
        # Builds a plain NCHW input's call as segflow's stem kernel, the input read in
        # place (ops/native_stem.py); None: such an input is staged for libdnnl.
        self.stem = stem
        self.stem_not: dict[tuple[object, ...], str] = {}       # inputs it declined, why

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None,
                 z: Tensor | None = None) -> Tensor:
        return self._conv(x, w, b, z, False)

    def inplace_call(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor) -> Tensor:
        """Like calling it, but the output overwrites the residual ``z`` (where the
        memory plan allows: ``z`` dies here)."""
        return self._conv(x, w, b, z, True)

    def call_for(self, x: Tensor, z: Tensor | None, inplace: bool) -> _Call | None:
        """The primitive built for this input layout (None: none, or it falls back)."""
        return self.calls.get(self._key(x, z, inplace))

    def prebuild(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor | None,
                 inplace: bool) -> tuple[int, ...] | None:
        """Build the primitive a run calling with these tensors would build, without
        running it: ``x`` and ``z`` need only the run's sizes, strides and dtype (their
        values are not read), ``w`` and ``b`` must be the tensors runs pass. The output's
        sizes, or None where that call would fall back (runtime/prebuild.py)."""
        call = self._prebuilt(self._key(x, z, inplace),
                              lambda: self._make_call(x, w, b, z, inplace))
        if call is None or w is not call.source or b is not call.bias:
            return None
        return call.out_shape

    @staticmethod
    def _key(x: Tensor, z: Tensor | None, inplace: bool) -> tuple[object, ...]:
        return (x.shape, x.stride(), x.dtype) if z is None else (x.shape, x.stride(), x.dtype,
                                                                    z.stride(), z.shape, inplace)

    def _conv(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor | None,
              inplace: bool) -> Tensor:
        key = self._key(x, z, inplace)
        try:
            call = self.calls[key]
        except KeyError:
            call = self._build(key, lambda: self._make_call(x, w, b, z, inplace))
        if call is None or w is not call.source or b is not call.bias:
            if self.blocked:
                return self._fallback_blocked(x, w, b, z, inplace)
            if z is None:
                return self.fallback(x, w, b)
            return (self.fallback_inplace if inplace else self.fallback)(x, w, b, z)
        if call.in_format is not None:
            x = self._staged(x, call.in_format)
        y = z if z is not None and inplace else self._output(call)
        self._run(call, x, y, z)
        return y if self.after is None else self.after(y)

    def _fallback_blocked(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor | None,
                          inplace: bool) -> Tensor:
        """The fallback between nChw8c tensors: reorder in, run it, reorder back."""
        lib = self.lib
        if self.blocked_input:
            x = lib.to_layout(x, blocked=False)
        if z is None:
            y = self.fallback(x, w, b)
        else:
            y = self.fallback(x, w, b, lib.to_layout(z, blocked=False))
        y = lib.to_layout(y.contiguous(memory_format=torch.channels_last), blocked=True)
        if z is not None and inplace:
            return z.copy_(y)
        return y

    def _staged(self, x: Tensor, layout: torch.memory_format) -> Tensor:
        """``x`` in channels-last: into the run's staging storage when it has some."""
        staged = self.staging() if self.staging is not None else None
        if staged is not None and staged.shape == x.shape:
            return self.stage(x, staged) if self.stage is not None else staged.copy_(x)
        return x.contiguous(memory_format=layout)

    def _make_call(self, x: Tensor, w: Tensor, b: Tensor | None, z: Tensor | None,
                   inplace: bool) -> tuple[_Call | None, str]:
        lib, spec = self.lib, self.spec
        if self.winograd is not None:
            # Its weight is the Winograd transform: a layout it declines is the fallback's.
            call, why = self.winograd.make_call(self, x, w, b, z, inplace)
            if call is None:
                self.winograd_not[self._key(x, z, inplace)] = why
            return call, why
        if self.stem is not None and not self.blocked and self.stem.takes(x, z):
            call, why = self.stem.make_call(self, x, w, b)
            if call is not None:
                return call, ""
            self.stem_not[self._key(x, z, inplace)] = why   # staged for libdnnl, as before
        packed = w.dtype == torch.uint8 if self.libdnnl_packed else w.is_mkldnn
        if x.dtype != torch.float32 or not packed or x.dim() not in (4, 5):
            return None, "not a packed float32 2-D/3-D convolution"
        # oneDNN has only reference kernels for plain NCHW input with channels-last output.
        want = _channels_last(x.dim())
        in_format = None
        if not self.blocked and not x.is_contiguous(memory_format=want):
            in_format = want
            x = x.contiguous(memory_format=want)
        if self.blocked and (x.dim() != 4 or (not self.blocked_input and not x.is_contiguous())):
            return None, "not a 2-D convolution over a plain or nChw8c input"
        out_shape = spec.output_size(x.shape)
        if z is not None and (tuple(z.shape) != out_shape or z.dtype != torch.float32):
            return None, "residual shape differs from the output's"
        example = z if z is not None and inplace else torch.empty(out_shape, memory_format=want)
        attr, src1 = lib.post_ops(z, inplace, self.eltwise, self.blocked)
        if self.blocked:
            src_md = lib.blocked_desc(x.shape) if self.blocked_input else lib.memory_desc(x)
            dst_md = lib.blocked_desc(out_shape)
            if lib.size(dst_md) != example.numel() * 4:
                lib.destroy([("memory_desc", md) for md in (src_md, dst_md, src1)
                             if md is not None] + [("primitive_attr", attr)])
                return None, f"channels not a multiple of {BLOCK}"
        else:
            src_md = lib.memory_desc(x)
            dst_md = lib.memory_desc(example)
        bias_md = lib.vector_desc(spec.out_channels) if b is not None else None
        any_weights = lib.any_desc(spec.weight_dims)
        try:
            made, weights_md, impl = lib.convolution(
                src_md, any_weights, bias_md, dst_md, spec.strides, spec.dilations, spec.pads,
                attr)
        finally:
            lib.destroy([("memory_desc", any_weights), ("primitive_attr", attr)])
        assert made is not None
        prim = made
        owned = self._owned
        owned.extend(("memory_desc", md) for md in (src_md, dst_md, bias_md, src1, weights_md)
                     if md is not None)
        extra, why = self._weight_args(prim, impl, w, weights_md, b, bias_md)
        if extra is None:
            return None, why
        residual = None
        if src1 is not None:
            residual = lib.memory(src1)
            owned.append(("memory", residual))
            extra.append((_POST_OP_ARG_BASE | _ARG_SRC_1, residual))
        return self._finish(prim, src_md, dst_md, extra, residual=residual, in_format=in_format,
                            out_shape=out_shape, out_format=want, source=w, bias=b,
                            impl=impl), ""

    def dense_weight(self, w: Tensor) -> Tensor:
        """The float32 ``[K, C, *kernel]`` weight whose packing ``w`` is (a copy)."""
        spec = self.spec
        if self.libdnnl_packed:
            assert self.verified_for is not None
            dense = self.lib.unpack_weight(w, spec, self.verified_for, self.blocked,
                                           self.blocked and not self.blocked_input)
        else:
            dense = w.to_dense() if w.is_mkldnn else w.clone()
        return dense.reshape(spec.out_channels, -1, *spec.kernel)

    def _weight(self, w: Tensor, weights_md: _P) -> int | None:
        """The address of ``w``'s values in the format ``weights_md`` (None: over the cap)."""
        lib = self.lib
        for desc, copy in self.copies:
            if lib.equal(desc, weights_md):
                return int(copy.data_ptr())
        if self.verified_for is not None:
            if self._verified_md is None:
                self._verified_md = lib.preferred_desc(
                    self.spec, self.verified_for, self.blocked,
                    self.blocked and not self.blocked_input)
                self._owned.append(("memory_desc", self._verified_md))
            if lib.equal(self._verified_md, weights_md):
                return int(w.data_ptr() if self.libdnnl_packed else torch.ops.mkldnn.data_ptr(w))
        if self.libdnnl_packed:
            mine = _reorder_weight(lib, self.dense_weight(w), weights_md, self.spec.weight_dims)
        else:
            mine = _reorder_weight(lib, w, weights_md, self.spec.weight_dims)
            if same_bytes(w, mine):
                return int(torch.ops.mkldnn.data_ptr(w))
        if len(self.copies) >= self.max_copies:
            return None
        self.copies.append((weights_md, mine))
        return int(mine.data_ptr())


class DirectPool(DirectOp):
    """``fn(x) -> y``: a pooling over libdnnl for a channels-last float32 input, one
    primitive per input layout, writing into the run's planned storage.

    ``window(x)`` gives (kernel, strides, dilations, begin pads, end pads) for
    ``x``'s size (``auto_pad`` and global pooling depend on it); ``algorithm``
    is one of ``POOL_*``. ``fallback`` (torch's pooling, same signature) serves
    a plain-layout or non-float32 input, ``ceil_mode``, what has only a
    reference kernel (dilated windows), and with ``keeps_nan`` every max pooling.
    Why bother: torch's CPU max pool also
    allocates the int64 argmax it then drops (1.6 MiB a run at ResNet-50's
    stem) and is 3-4x slower at batch 1, and the first call of torch's mean
    faults in ~1.7 MiB of its reduction code.
    """

    kind = "pooling"

    def __init__(self, lib: Library, algorithm: int, window: Callable[[Tensor], PoolWindow],
                 ceil_mode: bool, fallback: Callable[[Tensor], Tensor], max_shapes: int,
                 destination: Destination | None = None, blocked_input: bool = False,
                 keeps_nan: bool = False) -> None:
        super().__init__(lib, fallback, max_shapes, destination)
        self.algorithm = algorithm
        # A max pooling that must return NaN for a window holding one runs the fallback.
        self.keeps_nan = keeps_nan and algorithm == POOL_MAX
        self.window = window
        self.ceil_mode = ceil_mode
        # The input is nChw8c (the end of the layout pass's blocked region); the output
        # of a global pooling, [N, C, 1, 1], is then the same bytes in any layout.
        self.blocked_input = blocked_input

    def call_for(self, x: Tensor) -> _Call | None:
        """The primitive built for this input layout (None: none, or it falls back)."""
        return self.calls.get(self._key(x))

    def prebuild(self, x: Tensor) -> tuple[int, ...] | None:
        """Like :meth:`DirectConv.prebuild`: the primitive for ``x``'s layout, built now."""
        call = self._prebuilt(self._key(x), lambda: self._make_call(x))
        return None if call is None else call.out_shape

    @staticmethod
    def _key(x: Tensor) -> tuple[object, ...]:
        return (x.shape, x.stride(), x.dtype)

    def __call__(self, x: Tensor) -> Tensor:
        key = self._key(x)
        try:
            call = self.calls[key]
        except KeyError:
            call = self._build(key, lambda: self._make_call(x))
        if call is None:
            if self.blocked_input:
                return self.fallback(self.lib.to_layout(x, blocked=False))
            return self.fallback(x)
        y = self._output(call)
        self._run(call, x, y)
        return y

    def _make_call(self, x: Tensor) -> tuple[_Call | None, str]:
        if self.keeps_nan:
            return None, "a NaN can reach it (libdnnl's max pooling skips NaN)"
        if self.ceil_mode:
            return None, "ceil_mode"
        if x.dtype != torch.float32 or x.dim() not in (4, 5) or not (
                self.blocked_input or x.is_contiguous(memory_format=_channels_last(x.dim()))):
            return None, "not a channels-last float32 input"
        window = self.window(x)
        kernel, strides, dilations, begin, end = window
        out_shape = (int(x.shape[0]), int(x.shape[1]), *(
            (size + b + e - d * (k - 1) - 1) // s + 1 for size, b, e, d, k, s in
            zip(x.shape[2:], begin, end, dilations, kernel, strides, strict=True)))
        if min(out_shape) < 1:
            return None, "an empty output"
        lib = self.lib
        layout = _channels_last(x.dim())
        if self.blocked_input:
            if x.dim() != 4 or out_shape[2:] != (1, 1):
                return None, "an nChw8c input to a pooling that is not global"
            src_md, dst_md = lib.blocked_desc(x.shape), lib.blocked_desc(out_shape)
        else:
            src_md = lib.memory_desc(x)
            dst_md = lib.memory_desc(torch.empty(out_shape, memory_format=layout))
        self._owned.extend(("memory_desc", md) for md in (src_md, dst_md))
        prim, impl = lib.pooling(src_md, dst_md, self.algorithm, window)
        if impl.startswith("ref"):
            lib.destroy([("primitive", prim)])
            return None, f"only a reference implementation ({impl})"
        return self._finish(prim, src_md, dst_md, (), residual=None, in_format=None,
                            out_shape=out_shape, out_format=layout, source=None, bias=None,
                            impl=impl), ""


class DirectLinear(DirectOp):
    """``fn(x, w, b) -> act(x @ W^T + b)``: a FusedGemm over libdnnl's inner product,
    one primitive per input layout (the row count ``x.numel() / K`` varies with batch
    and sequence length).

    ``w`` is the layout pass's packing of ``W`` ([N, K]) in this library's format for
    ``packed_rows`` rows (:meth:`Library.pack_linear`): bytes, the model's only copy
    of the weight. A primitive reads it in place when its weights format is that one,
    which is what the library picks for any row count so far; otherwise the op keeps
    its own repacked copy, for at most ``max_copies`` formats. ``eltwise`` is the
    post-op fused into the primitive and ``after`` an activation run after it.

    Nothing falls back to torch's packed op (there is no torch packing to read):
    input that is not float32, more layouts than ``max_shapes``, or a primitive with
    only a reference kernel run ``F.linear`` over a dense copy of the weight, which
    is unpacked at the first such call and kept. Why bother: on a Zen 3 CPU (AVX2)
    this library's inner product (brgemm:avx2) ran BERT-base's 128-row linears at
    82-85 GMAC/s against 65-69 for torch's oneDNN matmul (brg_matmul:avx2).
    """

    kind = "linear"

    def __init__(self, lib: Library, in_features: int, out_features: int, packed_rows: int,
                 eltwise: tuple[int, float, float] | None,
                 after: Callable[[Tensor], Tensor] | None, act: Callable[[Tensor], Tensor],
                 max_shapes: int, max_copies: int) -> None:
        super().__init__(lib, self._fallback, max_shapes, None)
        self.in_features = in_features
        self.out_features = out_features
        self.eltwise = eltwise
        self.after = after
        self.act = act
        self.max_copies = max_copies
        self.copies: list[tuple[_P, Tensor]] = []
        self.packed_md, _ = lib.linear_desc(out_features, in_features, packed_rows)
        self._owned.append(("memory_desc", self.packed_md))
        self._dense: Tensor | None = None

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        key = (x.shape, x.stride(), x.dtype)
        try:
            call = self.calls[key]
        except KeyError:
            call = self._build(key, lambda: self._make_call(x, w, b))
        if call is None or w is not call.source or b is not call.bias:
            return self._fallback(x, w, b)
        y = torch.empty(call.out_shape)
        self._run(call, x, y)
        return y if self.after is None else self.after(y)

    def dense_weight(self, w: Tensor) -> Tensor:
        """``W`` ([N, K] float32) unpacked from ``w`` (kept for later fallbacks)."""
        if self._dense is None:
            dense = torch.empty(self.out_features, self.in_features)
            plain = self.lib.memory_desc(dense)
            try:
                self.lib.reorder(self.packed_md, w.data_ptr(), plain, dense.data_ptr())
            finally:
                self.lib.destroy([("memory_desc", plain)])
            self._dense = dense
        return self._dense

    def _fallback(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        dense = self.dense_weight(w)
        if x.dtype != dense.dtype:
            dense = dense.to(x.dtype)
            b = None if b is None else b.to(x.dtype)
        return self.act(torch.nn.functional.linear(x, dense, b))

    def _make_call(self, x: Tensor, w: Tensor, b: Tensor | None) -> tuple[_Call | None, str]:
        lib = self.lib
        k, n = self.in_features, self.out_features
        if x.dtype != torch.float32 or w.dtype != torch.uint8 or x.dim() < 1 \
                or int(x.shape[-1]) != k or not x.is_contiguous():
            return None, "not a contiguous float32 input of the weight's width"
        rows = x.numel() // k
        if rows < 1:
            return None, "an empty input"
        attr, _ = lib.post_ops(None, False, self.eltwise)
        src_md = lib.memory_desc(torch.empty(rows, k))
        dst_md = lib.memory_desc(torch.empty(rows, n))
        bias_md = lib.vector_desc(n) if b is not None else None
        try:
            # The packed format first: read ``w`` in place when the library takes it.
            made, weights_md, impl = lib.inner_product(src_md, self.packed_md, bias_md, dst_md,
                                                       attr)
            if impl.startswith("ref"):
                lib.destroy([("primitive", made), ("memory_desc", weights_md)])  # type: ignore[list-item]
                any_weights = lib.any_desc((n, k))
                try:
                    made, weights_md, impl = lib.inner_product(src_md, any_weights, bias_md,
                                                               dst_md, attr)
                finally:
                    lib.destroy([("memory_desc", any_weights)])
        finally:
            lib.destroy([("primitive_attr", attr)])
        assert made is not None
        prim = made
        self._owned.extend(("memory_desc", md) for md in (src_md, dst_md, bias_md, weights_md)
                           if md is not None)
        extra, why = self._weight_args(prim, impl, w, weights_md, b, bias_md)
        if extra is None:
            return None, why
        return self._finish(prim, src_md, dst_md, extra, residual=None, in_format=None,
                            out_shape=(*x.shape[:-1], n), out_format=torch.contiguous_format,
                            source=w, bias=b, impl=impl), ""

    def _weight(self, w: Tensor, weights_md: _P) -> int | None:
        """The address of the weight in the format ``weights_md`` (None: over the cap)."""
        lib = self.lib
        if lib.equal(self.packed_md, weights_md):
            return int(w.data_ptr())
        for desc, copy in self.copies:
            if lib.equal(desc, weights_md):
                return int(copy.data_ptr())
        if len(self.copies) >= self.max_copies:
            return None
        mine = _reorder_weight(lib, self.dense_weight(w), weights_md,
                               (self.out_features, self.in_features))
        self.copies.append((weights_md, mine))
        return int(mine.data_ptr())


class DirectKernel:
    """A node's kernel over a direct op: ``kernel(inputs) -> [op(*inputs)]``. The op
    stays reachable, so generated code calls the same op (one set of primitives per
    node) and ``explain()`` can say which layouts fell back and why."""

    __slots__ = ("op",)

    def __init__(self, op: DirectOp) -> None:
        self.op = op

    def __call__(self, inputs: Sequence[Tensor | None]) -> list[Tensor]:
        return [self.op(*inputs)]  # type: ignore[operator]


class ResidualInPlaceKernel(DirectKernel):
    """A residual convolution's kernel where the memory plan lets its output overwrite
    the residual (input 3, which dies here): ``[op.inplace_call(x, w, b, z)]``, oneDNN's
    in-place sum post-op, as generated code calls it. The interpreter and profiled
    runs then run the kernel the default backend runs. (ResNet-50 at batch 8, layer1's
    last 1x1 convolution alone: 6.5 ms in place against 9.7 with a binary-add post-op on
    an AVX-512 VM; a whole compile="none" run on an AVX2 one: 404 against 415 ms.)"""

    __slots__ = ()

    def __call__(self, inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, w, b, z = inputs
        assert x is not None and w is not None and z is not None
        return [self.op.inplace_call(x, w, b, z)]  # type: ignore[attr-defined]


def describe_direct(ops: Sequence[tuple[str, DirectOp]], limit: int = 8) -> list[str]:
    """``explain()`` lines for a session's direct ops (``(node label, op)``): how many,
    the input layouts built through libdnnl, and each fallback with its reason."""
    if not ops:
        return []
    kinds: dict[str, int] = {}
    for _, op in ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    what = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in kinds.items())
    built = sum(op.direct_layouts for _, op in ops)
    fallbacks = [(label, key, why) for label, op in ops for key, why in op.why_not.items()]
    if not built and not fallbacks:
        return [f"direct kernels (libdnnl): {what}; no input layout built yet (each is built "
                "at its first run)", *_describe_winograd(ops, limit), *_describe_stems(ops, limit)]
    lines = [f"direct kernels (libdnnl): {what}; {built} input layout{'s' if built != 1 else ''}"
             f" built, {len(fallbacks)} fell back to torch"]
    for label, key, why in fallbacks[:limit]:
        shape, dtype = key[0], key[2]   # the input's sizes and dtype (the layout key)
        lines.append(f"  fallback: {label} at {list(shape)} {dtype}: {why}")  # type: ignore[call-overload]
    if len(fallbacks) > limit:
        lines.append(f"  ... and {len(fallbacks) - limit} more")
    lines.extend(_describe_winograd(ops, limit))
    lines.extend(_describe_stems(ops, limit))
    return lines


def _describe_stems(ops: Sequence[tuple[str, DirectOp]], limit: int) -> list[str]:
    """The convolutions marked to run the native stem kernel: the input layouts it runs,
    and those it declined (staged for libdnnl instead), with why."""
    marked = [(label, op) for label, op in ops
              if isinstance(op, DirectConv) and op.stem is not None]
    if not marked:
        return []
    layouts = sum(1 for _, op in marked for call in op.calls.values()
                  if call is not None and call.impl.startswith("native stem"))
    return [f"  native stem (NCHW image read in place): {len(marked)} convolution"
            f"{'s' if len(marked) != 1 else ''}, {layouts} input "
            f"layout{'s' if layouts != 1 else ''} built",
            *_declined("the native stem", [(label, op.stem_not) for label, op in marked],
                       limit)]


def _declined(what: str, reasons: Sequence[tuple[str, dict[tuple[object, ...], str]]],
              limit: int) -> list[str]:
    """A line per input layout a native kernel declined (``reasons``: per op, its node
    label and why it declined each layout key), ``limit`` at most."""
    declined = [(label, key, why) for label, of in reasons for key, why in of.items()]
    return [f"  not {what}: {label} at {list(key[0])}: {why}"  # type: ignore[call-overload]
            for label, key, why in declined[:limit]]


def _describe_winograd(ops: Sequence[tuple[str, DirectOp]], limit: int) -> list[str]:
    """The convolutions marked for Winograd: what runs so, what it holds, what declined."""
    marked = [(label, op) for label, op in ops
              if isinstance(op, DirectConv) and op.winograd is not None]
    if not marked:
        return []
    layouts = sum(1 for _, op in marked for call in op.calls.values()
                  if call is not None and call.run is not None)
    builders = [op.winograd for _, op in marked if op.winograd is not None]
    weights = sum(w.weight_bytes for w in builders)
    spaces = {id(w.workspace): w.workspace.nbytes for w in builders}
    return [f"  winograd F(4x4,3x3): {len(marked)} convolutions, {layouts} input "
            f"layout{'s' if layouts != 1 else ''} built; transformed weights "
            f"{weights / 2**20:.1f} MiB (the weights themselves), workspace "
            f"{sum(spaces.values()) / 2**20:.1f} MiB",
            *_declined("winograd", [(label, op.winograd_not) for label, op in marked], limit)]


@dataclass(frozen=True, slots=True)
class ConvGeometry:
    """What the primitive depends on besides the input layout."""

    out_channels: int
    weight_dims: tuple[int, ...]     # oneDNN's: (g, oc/g, ic/g, k...) when grouped
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]
    dilations: tuple[int, ...]

    def output_size(self, input_size: Sequence[int]) -> tuple[int, ...]:
        spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in
                   zip(input_size[2:], self.pads, self.dilations, self.kernel, self.strides,
                       strict=True)]
        return (int(input_size[0]), self.out_channels, *spatial)


def geometry(weight_shape: Sequence[int], strides: Sequence[int], pads: Sequence[int],
             dilations: Sequence[int], group: int) -> ConvGeometry:
    oc, icg, *kernel = (int(d) for d in weight_shape)
    dims = (oc, icg, *kernel) if group == 1 else (group, oc // group, icg, *kernel)
    return ConvGeometry(oc, dims, tuple(kernel), tuple(int(s) for s in strides),
                        tuple(int(p) for p in pads), tuple(int(d) for d in dilations))


def _channels_last(rank: int) -> torch.memory_format:
    return torch.channels_last if rank == 4 else torch.channels_last_3d


def channels_last_strides(sizes: Sequence[int]) -> list[int]:
    """Element strides of a dense ``[N, C, *spatial]`` tensor stored channels-last."""
    n, c, *spatial = sizes
    strides = [0] * len(sizes)
    strides[1] = 1
    step = c
    for dim in range(len(sizes) - 1, 1, -1):
        strides[dim] = step
        step *= sizes[dim]
    strides[0] = step
    return strides


def same_bytes(packed: Tensor, mine: Tensor) -> bool:
    """Whether torch's packed (``mkldnn``) tensor holds exactly the bytes of ``mine``."""
    size = mine.numel()
    if torch.ops.mkldnn._nbytes(packed) != size:
        return False
    theirs = (ctypes.c_uint8 * size).from_address(torch.ops.mkldnn.data_ptr(packed))
    # Compared 8 bytes at a time where the size allows: torch.equal on uint8 runs at ~1
    # GB/s, ~6x slower (a tenth of a second of loading ResNet-50).
    wide = torch.int64 if size % 8 == 0 else torch.int32 if size % 4 == 0 else torch.uint8
    return bool(torch.equal(mine.view(wide), torch.frombuffer(theirs, dtype=wide)))


def _reorder_weight(lib: Library, weight: Tensor, weights_md: _P,
                    dims: Sequence[int]) -> Tensor:
    """``weight``'s values (packed or dense) shaped ``dims`` and written by this library
    in the format ``weights_md`` (bytes)."""
    dense = (weight.to_dense() if weight.is_mkldnn else weight).reshape(
        list(dims)).contiguous()
    mine = torch.empty(lib.size(weights_md), dtype=torch.uint8)
    dense_md = lib.memory_desc(dense)
    try:
        lib.reorder(dense_md, dense.data_ptr(), weights_md, mine.data_ptr())
    finally:
        lib.destroy([("memory_desc", dense_md)])
    return mine
