"""Convolutions called straight into oneDNN's C API (``libdnnl``, through ctypes).

Why: torch's ``mkldnn._convolution_pointwise`` rebuilds oneDNN's primitive
descriptor, memory descriptors and attributes on every call, tens of microseconds
per convolution at batch 1 (figures in docs/performance.md). Here a convolution
builds its primitive once per input layout, and then a call only points the
source, destination and residual memories at the tensors and executes (ctypes
releases the GIL).

The weight is read in place. The packing pass (``passes/pack_weights.py``) packs it
with torch's oneDNN and checks, byte for byte against this library's reorder, that the
packing is the format this library's convolution wants (trying torch's packing for
another size where the first differs); such a weight is then matched by descriptor at
run time. Where no torch packing is, the packing keeps this library's own
packing instead (``DirectConv(libdnnl_packed=True)``), matched the same way.
A primitive that wants yet another format (another input size, a post-op that
changes the choice) gets the convolution's own packed copy, for at most
``max_copies`` formats.

The library is the ``onednn-cpu-gomp`` wheel (oneDNN 3.x built on GNU OpenMP);
it must share torch's OpenMP runtime, or the two thread pools would fight for
the cores, so :meth:`Library.load` refuses a process with two ``libgomp``
copies. ``SEGFLOW_ONEDNN_DIRECT=0`` turns the path off; ``SEGFLOW_DNNL_LIBRARY``
names the library file when it is not in the environment's ``lib/``.

This module is the whole ctypes surface of libdnnl that segflow calls (the constants,
the C signatures, :class:`Library`'s wrappers), so that no other module declares a C
signature of it; the kernels that build on it are ``conv``, ``pool``, ``linear`` and
``op`` beside it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import site
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from segflow.kernels.onednn.geometry import (
    ConvGeometry,
    channels_last_format,
    channels_last_strides,
)
from segflow.settings import dnnl_library

Tensor = torch.Tensor
# Where a direct kernel writes its output in a run: the storage planned for it, or None.
Destination = Callable[[], Tensor | None]
# A pooling window for one input size: kernel, strides, dilations, begin and end pads.
PoolWindow = tuple[list[int], list[int], list[int], list[int], list[int]]
Pointer = ctypes.c_void_p
Dims = ctypes.c_int64 * 12           # dnnl_dims_t (DNNL_MAX_NDIMS)

# oneDNN 3.x C API constants (oneapi/dnnl/dnnl_types.h, dnnl_common_types.h).
CPU_ENGINE = 1
STREAM_IN_ORDER = 1
F32 = 3
FORMAT_ANY = 1
TAG_A = 2                            # plain 1-D (bias)
TAG_NCHW8C = 102                     # dnnl_aBcd8b: channels in blocks of 8 (nChw8c)
BLOCK = 8                             # channels per block of the blocked layout
FORWARD_INFERENCE = 96
CONVOLUTION_DIRECT = 1
# Pooling algorithms (dnnl_alg_kind_t).
POOL_MAX = 0x1FF
POOL_AVG_EXCLUDE_PADDING = 0x3FF
QUERY_IMPL_INFO = 8
QUERY_WEIGHTS_MD = 131
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 17, 33, 41
ARG_SRC_1 = 2
POST_OP_ARG_BASE = 32768            # DNNL_ARG_ATTR_MULTIPLE_POST_OP(i) = base * (i + 1)
BINARY_ADD = 0x1FFF0
OMP_RUNTIME = 2                      # DNNL_RUNTIME_OMP

# Primitives an op builds (one per input layout) before the rest go to its fallback.
MAX_LAYOUTS = 32

# torch's oneDNN post-op names (ops/fused.py Activation.onednn) -> oneDNN eltwise
# (algorithm, alpha, beta) given the activation's scalars.
ELTWISE: dict[str, Callable[[Sequence[float], str], tuple[int, float, float] | None]] = {
    "relu": lambda s, a: (32, 0.0, 0.0),
    "leaky_relu": lambda s, a: (32, float(s[0]), 0.0),
    "tanh": lambda s, a: (33, 0.0, 0.0),
    "hardsigmoid": lambda s, a: (40, 1.0 / 6.0, 0.5),
    "sigmoid": lambda s, a: (41, 0.0, 0.0),
    "swish": lambda s, a: (44, 1.0, 0.0),                        # x * logistic(alpha x)
    "hardtanh": lambda s, a: (47, float(s[0]), float(s[1])),     # clip_v2: lo <= x <= hi
    "hardswish": lambda s, a: (52, 1.0 / 6.0, 0.5),
    "gelu": lambda s, a: (43, 0.0, 0.0) if a == "tanh" else (49, 0.0, 0.0),
}


def onednn_eltwise(attr: str, scalars: Sequence[float], algorithm: str
                   ) -> tuple[int, float, float] | None:
    """oneDNN's eltwise ``(algorithm, alpha, beta)`` for torch's post-op name, if any."""
    make = ELTWISE.get(attr)
    return None if make is None else make(scalars, algorithm)


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


class ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", Pointer)]


class DnnlError(RuntimeError):
    """A oneDNN C call failed (status code in the message)."""


def _library_candidates() -> Iterator[str]:
    """Where to look: the named file, else the environment's ``lib/`` (where the wheel
    puts it), the user base, then the system's library path. Lazily: the last asks
    ``ctypes.util.find_library``, which runs ``ldconfig`` and a compiler (tens of
    milliseconds of a cold start), only when the wheel's file is not there."""
    named = dnnl_library()
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
    """The libgomp files mapped into this process that a library linked against
    ``libgomp.so.1`` can bind to (empty: none, or no /proc). A copy vendored under a
    hashed name (``libgomp-e985bcbb.so.1.0.0``, as auditwheel renames scikit-learn's)
    serves only the package that ships it: it is not the runtime torch and libdnnl share,
    and its presence must not turn libdnnl off."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines()
            if line.rsplit("/", 1)[-1].startswith("libgomp.so")}


@functools.cache
def openmp_entry_points() -> tuple[int, int, int] | None:
    """``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads`` of the
    process's one libgomp, the thread pool torch and libdnnl share; None where there is
    not exactly one. Native kernels (``kernels/native/winograd.c``) split their loops on it
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
        dll.dnnl_primitive_desc_query_md.restype = Pointer
        dll.dnnl_primitive_desc_query_md.argtypes = [Pointer, ctypes.c_int, ctypes.c_int]
        dll.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        dll.dnnl_memory_desc_get_size.argtypes = [Pointer]
        dll.dnnl_memory_set_data_handle.argtypes = [Pointer, Pointer]
        dll.dnnl_primitive_execute.argtypes = [Pointer, Pointer, ctypes.c_int, Pointer]
        dll.dnnl_post_ops_append_eltwise.argtypes = [Pointer, ctypes.c_int, ctypes.c_float,
                                                     ctypes.c_float]
        dll.dnnl_post_ops_append_sum.argtypes = [Pointer, ctypes.c_float, ctypes.c_int32,
                                                 ctypes.c_int]
        dll.dnnl_post_ops_append_binary.argtypes = [Pointer, ctypes.c_int, Pointer]
        dll.dnnl_memory_desc_create_with_strides.argtypes = [ctypes.POINTER(Pointer), ctypes.c_int,
                                                             Dims, ctypes.c_int, Dims]
        dll.dnnl_memory_desc_create_with_tag.argtypes = [ctypes.POINTER(Pointer), ctypes.c_int,
                                                         Dims, ctypes.c_int, ctypes.c_int]
        dll.dnnl_memory_create.argtypes = [ctypes.POINTER(Pointer), Pointer, Pointer, Pointer]
        dll.dnnl_primitive_desc_query.argtypes = [Pointer, ctypes.c_int, ctypes.c_int, Pointer]
        dll.dnnl_memory_desc_equal.argtypes = [Pointer, Pointer]
        self.set_handle = dll.dnnl_memory_set_data_handle
        self.execute = dll.dnnl_primitive_execute
        self.engine = self._make(dll.dnnl_engine_create, CPU_ENGINE, ctypes.c_size_t(0))
        # preferred_desc's answers, kept for the process (a few hundred bytes each).
        self._preferred: dict[tuple[object, ...], Pointer] = {}

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
            if lib.cpu_runtime != OMP_RUNTIME or _libgomp_copies() > 1:
                return None, (f"is not used: {path} does not share torch's OpenMP runtime "
                              "(two thread pools would compete for the cores)")
            return lib, f"oneDNN {lib.version} ({path})"
        return None, "is not installed (pip install onednn-cpu-gomp)"

    def destroy(self, owned: list[tuple[str, Pointer]]) -> None:
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

    def _primitive(self, pd: Pointer) -> tuple[Pointer, str]:
        """(primitive, implementation name) of primitive descriptor ``pd``, which it
        destroys."""
        dll = self._dll
        try:
            impl = ctypes.c_char_p()
            dll.dnnl_primitive_desc_query(pd, QUERY_IMPL_INFO, 0, ctypes.byref(impl))
            prim = self._make(dll.dnnl_primitive_create, pd)
        finally:
            dll.dnnl_primitive_desc_destroy(pd)
        return prim, (impl.value or b"?").decode()

    def _make(self, fn: Callable[..., int], *args: object) -> Pointer:
        handle = Pointer()
        self.check(fn(ctypes.byref(handle), *args), fn.__name__)
        return handle

    def memory_desc(self, t: Tensor) -> Pointer:
        """A float32 memory descriptor with ``t``'s sizes and strides.

        A channels-last tensor gets the canonical channels-last strides: where a dim
        has size 1 torch's strides are arbitrary (a ``[N, C, 1, 1]`` tensor reads
        as NCHW), and oneDNN would then pick its reference kernels.
        """
        strides = list(t.stride())
        if t.dim() in (4, 5) and t.is_contiguous(memory_format=channels_last_format(t.dim())):
            strides = channels_last_strides(list(t.shape))
        return self._make(self._dll.dnnl_memory_desc_create_with_strides, t.dim(),
                          Dims(*t.shape), F32, Dims(*strides))

    def blocked_desc(self, sizes: Sequence[int]) -> Pointer:
        """A float32 ``nChw8c`` descriptor of a 4-D ``sizes``: channels in blocks of
        :data:`BLOCK`, the layout of the layout pass's blocked region."""
        return self._make(self._dll.dnnl_memory_desc_create_with_tag, 4, Dims(*sizes), F32,
                          TAG_NCHW8C)

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
        owned: list[tuple[str, Pointer]] = []
        try:
            src, dst = self._activation_descs(spec, input_size, True, plain_input)
            any_weights = self.any_desc(spec.weight_dims)
            owned += [("memory_desc", d) for d in (src, dst, any_weights)]
            _, md, impl = self.convolution(src, any_weights, None, dst, spec, None,
                                           create=False)
            owned.append(("memory_desc", md))
        except DnnlError:
            return None
        finally:
            self.destroy(owned)
        return None if impl.startswith("ref") else impl

    def _activation_descs(self, spec: ConvGeometry, input_size: Sequence[int],
                          blocked: bool, plain_input: bool) -> tuple[Pointer, Pointer]:
        """A convolution's source and destination descriptors: channels-last, or
        ``nChw8c`` (``blocked``) with a plain NCHW source (``plain_input``) or not."""
        out_size = spec.output_size(input_size)
        if not blocked:
            layout = channels_last_format(len(input_size))
            return (self.memory_desc(torch.empty(list(input_size), memory_format=layout)),
                    self.memory_desc(torch.empty(out_size, memory_format=layout)))
        src = (self.memory_desc(torch.empty(list(input_size))) if plain_input
               else self.blocked_desc(input_size))
        return src, self.blocked_desc(out_size)

    def vector_desc(self, n: int) -> Pointer:
        return self._make(self._dll.dnnl_memory_desc_create_with_tag, 1, Dims(n), F32, TAG_A)

    def any_desc(self, sizes: Sequence[int]) -> Pointer:
        return self._make(self._dll.dnnl_memory_desc_create_with_tag, len(sizes),
                          Dims(*sizes), F32, FORMAT_ANY)

    def memory(self, desc: Pointer, handle: int | None = None) -> Pointer:
        return self._make(self._dll.dnnl_memory_create, desc, self.engine, Pointer(handle))

    def stream(self) -> Pointer:
        return self._make(self._dll.dnnl_stream_create, self.engine,
                          ctypes.c_uint(STREAM_IN_ORDER))

    def equal(self, a: Pointer, b: Pointer) -> bool:
        return bool(self._dll.dnnl_memory_desc_equal(a, b))

    def size(self, desc: Pointer) -> int:
        return int(self._dll.dnnl_memory_desc_get_size(desc))

    def reorder(self, src_desc: Pointer, src: int, dst_desc: Pointer, dst: int) -> None:
        """Copy ``src`` (laid out as ``src_desc``) to ``dst`` in ``dst_desc``'s format
        (a one-off: the primitive and its stream are made and freed here)."""
        dll = self._dll
        pd = self._make(dll.dnnl_reorder_primitive_desc_create, src_desc, self.engine,
                        dst_desc, self.engine, None)
        prim = self._make(dll.dnnl_primitive_create, pd)
        src_mem = self.memory(src_desc, src)
        dst_mem = self.memory(dst_desc, dst)
        stream = self.stream()
        args = (ExecArg * 2)(ExecArg(ARG_SRC, src_mem), ExecArg(ARG_DST, dst_mem))
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
                 ) -> tuple[Pointer, Pointer | None]:
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
            self.check(dll.dnnl_post_ops_append_binary(ops, BINARY_ADD, src1), "append add")
        if eltwise is not None:
            self.check(dll.dnnl_post_ops_append_eltwise(ops, *eltwise), "append eltwise")
        self.check(dll.dnnl_primitive_attr_set_post_ops(attr, ops), "set post-ops")
        dll.dnnl_post_ops_destroy(ops)
        return attr, src1

    def convolution(self, src: Pointer, weights: Pointer, bias: Pointer | None, dst: Pointer,
                    spec: ConvGeometry, attr: Pointer | None, *, create: bool = True
                    ) -> tuple[Pointer | None, Pointer, str]:
        """(primitive, its weights descriptor, implementation name) for a forward conv
        of ``spec``'s strides, dilations and padding (libdnnl takes the begin and the end
        pads apart, so an asymmetric padding is its own primitive, no padded copy).

        ``create=False`` stops at the descriptor (no JIT code): primitive None.
        """
        dll = self._dll
        pd = self._make(dll.dnnl_convolution_forward_primitive_desc_create, self.engine,
                        FORWARD_INFERENCE, CONVOLUTION_DIRECT, src, weights, bias, dst,
                        Dims(*spec.strides), Dims(*[d - 1 for d in spec.dilations]),
                        Dims(*spec.pads_begin), Dims(*spec.pads_end), attr)
        return self._weighted(pd, create)

    def _weighted(self, pd: Pointer, create: bool) -> tuple[Pointer | None, Pointer, str]:
        """(primitive or None, a copy of its weights descriptor, implementation name) of a
        primitive descriptor, which it destroys."""
        dll = self._dll
        try:
            impl = ctypes.c_char_p()
            dll.dnnl_primitive_desc_query(pd, QUERY_IMPL_INFO, 0, ctypes.byref(impl))
            weights_md = Pointer()
            self.check(dll.dnnl_memory_desc_clone(ctypes.byref(weights_md),
                                                  Pointer(dll.dnnl_primitive_desc_query_md(
                                                      pd, QUERY_WEIGHTS_MD, 0))), "clone md")
            prim = self._make(dll.dnnl_primitive_create, pd) if create else None
        finally:
            dll.dnnl_primitive_desc_destroy(pd)
        return prim, weights_md, (impl.value or b"?").decode()

    def inner_product(self, src: Pointer, weights: Pointer, bias: Pointer | None, dst: Pointer,
                      attr: Pointer | None,
                      *, create: bool = True) -> tuple[Pointer | None, Pointer, str]:
        """(primitive, its weights descriptor, implementation name) for a forward inner
        product (a linear layer: ``dst[M, N] = src[M, K] @ weights[N, K]^T + bias``).

        ``create=False`` stops at the descriptor (no JIT code): primitive None.
        """
        dll = self._dll
        pd = self._make(dll.dnnl_inner_product_forward_primitive_desc_create, self.engine,
                        FORWARD_INFERENCE, src, weights, bias, dst, attr)
        return self._weighted(pd, create)

    def matmul(self, src: Pointer, weights: Pointer, dst: Pointer
               ) -> tuple[Pointer | None, Pointer, str]:
        """(primitive, its weights descriptor, implementation name) for a matmul
        (``dst[..., M, N] = src[..., M, K] @ weights[..., K, N]``, batched over the
        leading dims); ``weights`` may be :meth:`any_desc`."""
        pd = self._make(self._dll.dnnl_matmul_primitive_desc_create, self.engine, src,
                        weights, None, dst, None)
        return self._weighted(pd, True)

    def plain_desc(self, sizes: Sequence[int]) -> Pointer:
        """A float32 descriptor of a dense row-major tensor of ``sizes``."""
        strides = [1] * len(sizes)
        for dim in range(len(sizes) - 2, -1, -1):
            strides[dim] = strides[dim + 1] * int(sizes[dim + 1])
        return self._make(self._dll.dnnl_memory_desc_create_with_strides, len(sizes),
                          Dims(*sizes), F32, Dims(*strides))

    def linear_desc(self, out_features: int, in_features: int, rows: int) -> tuple[Pointer, str]:
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
            return reorder_weight(self, dense, weights_md, (out_features, in_features))
        finally:
            self.destroy([("memory_desc", weights_md)])

    def pooling(self, src: Pointer, dst: Pointer, algorithm: int, window: PoolWindow
                ) -> tuple[Pointer, str]:
        """(primitive, implementation name) for a forward pooling (``POOL_*``)."""
        dll = self._dll
        kernel, strides, dilations, begin, end = window
        pd = self._make(dll.dnnl_pooling_forward_primitive_desc_create, self.engine,
                        FORWARD_INFERENCE, algorithm, src, dst, Dims(*strides),
                        Dims(*kernel), Dims(*[d - 1 for d in dilations]), Dims(*begin),
                        Dims(*end), None)
        return self._primitive(pd)

    def preferred_desc(self, spec: ConvGeometry, input_size: Sequence[int],
                       blocked: bool = False, plain_input: bool = False) -> Pointer:
        """The weights descriptor of this library's convolution over a channels-last
        (``blocked``: ``nChw8c``; with ``plain_input`` from plain NCHW) input of
        ``input_size`` (no post-ops); the caller destroys this copy of it.

        Asked at load (the layout pass packs weights in this format) and again at a
        convolution's first run (to read such a weight in place, or unpack it), and
        each answer is a primitive descriptor libdnnl searches its implementations
        for (about a millisecond for a large convolution). So the first answer per
        geometry, input size and layout is kept for the process.
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
                _, kept, _ = self.convolution(src, any_weights, None, dst, spec, None,
                                              create=False)
            finally:
                self.destroy([("memory_desc", d) for d in (src, dst, any_weights)])
            if self._preferred.setdefault(key, kept) is not kept:   # another thread's
                self.destroy([("memory_desc", kept)])
                kept = self._preferred[key]
        copy = Pointer()
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
            return reorder_weight(self, dense, weights_md, spec.weight_dims)
        finally:
            self.destroy([("memory_desc", weights_md)])

    def binary(self, src0: Pointer, src1: Pointer, dst: Pointer, algorithm: int
               ) -> tuple[Pointer, str]:
        """(primitive, implementation name) for an elementwise binary (``BINARY_*``):
        ``dst = src0 op src1``, ``src1`` broadcast along its dims of size 1."""
        dll = self._dll
        pd = self._make(dll.dnnl_binary_primitive_desc_create, self.engine, algorithm,
                        src0, src1, dst, None)
        return self._primitive(pd)


# -- int8: quantized convolutions (u8/s8 activations, s8 weights, scales, zero points) ----
U8, S8, S32 = 6, 5, 4                # dnnl_data_type_t
ARG_ATTR_SCALES = 4096               # DNNL_ARG_ATTR_SCALES | arg: an f32 scale memory
ARG_ATTR_ZERO_POINTS = 8192          # DNNL_ARG_ATTR_ZERO_POINTS | arg: an s32 zero point
ELTWISE_RELU, ELTWISE_LINEAR, ELTWISE_CLIP_V2, ELTWISE_ROUND = 32, 38, 47, 50
_TORCH_TO_DNNL = {torch.uint8: U8, torch.int8: S8, torch.int32: S32, torch.float32: F32}
# A post-op of an int8 primitive: ("eltwise", algorithm, alpha, beta) or
# ("add", descriptor of the tensor added).
PostOp = tuple[str, int, float, float] | tuple[str, Pointer]


def typed_desc(lib: Library, sizes: Sequence[int], strides: Sequence[int],
               dtype: torch.dtype) -> Pointer:
    """A descriptor of ``sizes`` and ``strides`` in ``dtype`` (u8, s8, s32 or f32)."""
    return lib._make(lib._dll.dnnl_memory_desc_create_with_strides, len(sizes), Dims(*sizes),
                     _TORCH_TO_DNNL[dtype], Dims(*strides))


def typed_any_desc(lib: Library, sizes: Sequence[int], dtype: torch.dtype) -> Pointer:
    """A descriptor of ``sizes`` in ``dtype`` whose format the primitive chooses."""
    return lib._make(lib._dll.dnnl_memory_desc_create_with_tag, len(sizes), Dims(*sizes),
                     _TORCH_TO_DNNL[dtype], FORMAT_ANY)


def int8_attr(lib: Library, weight_mask: int, src_zero_point: bool, dst_zero_point: bool,
              post_ops: Sequence[PostOp]) -> Pointer:
    """Attributes of a quantized primitive: runtime scales of the source (one), the
    weights (``weight_mask``: 0 one, else per output channel) and the destination (one),
    the zero points asked for (runtime, one each), and ``post_ops`` in order (eltwise, or
    ``("add" | "mul", src1 descriptor)`` binary ones). libdnnl applies post-ops in float
    to the scaled accumulator (plus bias), then divides by the destination's scale, adds
    its zero point, rounds and saturates."""
    dll = lib._dll
    attr = lib._make(dll.dnnl_primitive_attr_create)
    for arg, mask in ((ARG_SRC, 0), (ARG_WEIGHTS, weight_mask), (ARG_DST, 0)):
        lib.check(dll.dnnl_primitive_attr_set_scales_mask(attr, arg, mask), "set scales")
    for arg, wanted in ((ARG_SRC, src_zero_point), (ARG_DST, dst_zero_point)):
        if wanted:
            lib.check(dll.dnnl_primitive_attr_set_zero_points_mask(attr, arg, 0),
                      "set zero points")
    ops = lib._make(dll.dnnl_post_ops_create)
    for op in post_ops:
        if op[0] == "eltwise":
            _, algorithm, alpha, beta = op  # type: ignore[misc]
            lib.check(dll.dnnl_post_ops_append_eltwise(ops, algorithm, alpha, beta),
                      "append eltwise")
        else:
            algorithm = BINARY_MUL if op[0] == "mul" else BINARY_ADD
            lib.check(dll.dnnl_post_ops_append_binary(ops, algorithm, op[1]),
                      f"append {op[0]}")
    lib.check(dll.dnnl_primitive_attr_set_post_ops(attr, ops), "set post-ops")
    dll.dnnl_post_ops_destroy(ops)
    return attr


def reorder_weight(lib: Library, weight: Tensor, weights_md: Pointer,
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


# Binary primitives (Library.binary; kernels/onednn/binary.py): dnnl_alg_kind_t.
BINARY_MUL = 0x1FFF1
