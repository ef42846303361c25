"""The CPU a session runs on, as the kernel choices see it.

A :class:`CpuTarget` is built once per session (``runtime/session.py``) and passed
explicitly to the pass that chooses kernels (``passes/select_kernels.py``), to binding
and to codegen: the ISA torch's kernels were dispatched for, the native library
(``kernels/native/build.py``) and libdnnl (``kernels/onednn/library.py``) with the
reason either is absent, the intra-op thread count and the cache sizes. Every
heuristic that says where one kernel is preferred over another reads it here, in
terms of those facts (the measurements behind them: ``docs/performance.md``).

>>> target = CpuTarget.detect()                     # doctest: +SKIP
>>> target.winograd_preferred(tiles=196)            # doctest: +SKIP
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from segflow.kernels import linear as native_linear
from segflow.kernels import stem, winograd
from segflow.kernels.dense_chain import NATIVE_MAX_MACS as DENSE_CHAIN_MAX_MACS
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.geometry import ConvGeometry, geometry
from segflow.kernels.onednn.library import BLOCK, DnnlError, Library, onednn_eltwise
from segflow.kernels.stem import unfit as stem_unfit
from segflow.kernels.winograd import unfit as winograd_unfit

Tensor = torch.Tensor

# Tiles (4x4 outputs) one image must give a 3x3 convolution for Winograd to be the
# default where libdnnl's direct kernels are AVX-512: each call reads the whole
# transformed weight (36 C K floats) for its tiles, and with few tiles the transforms
# and that read cost more than they save (docs/performance.md, "Kernel selection").
WINOGRAD_MIN_TILES = 32


@dataclass(frozen=True, slots=True)
class CpuTarget:
    """ISA facts, kernel libraries and threads of the CPU a session runs on."""

    capability: str                 # torch's CPU dispatch: "AVX512", "AVX2", "DEFAULT", ...
    avx512: bool                    # torch's (and libdnnl's) kernels are AVX-512 ones
    avx2: bool
    fma: bool
    vnni: bool                      # AVX-512 VNNI (int8 dot products)
    bf16: bool                      # AVX-512 BF16
    vector_floats: int              # floats per vector of torch's kernels
    native: NativeLibrary | None    # segflow's own kernels (kernels/native/)
    native_why: str                 # what built it, or why there is none
    dnnl: Library | None            # libdnnl, called directly (kernels/onednn/)
    dnnl_why: str
    threads: int                    # torch's intra-op threads
    onednn_ops: bool                # torch ships the fused oneDNN CPU ops
    l1d_bytes: int = 0              # data cache sizes (0: not known)
    l2_bytes: int = 0
    l3_bytes: int = 0
    native_fma: bool = False        # the native build has its AVX2+FMA linear block
    native_panel_width: int = 0     # output columns per panel of the native linear packing
    native_vector_floats: int = 0   # floats per vector of the native build (the stem's)

    @staticmethod
    def detect() -> CpuTarget:
        """This process's CPU as a session sees it now (``SEGFLOW_NATIVE`` is read here,
        once, so that one process can hold sessions with and without native kernels)."""
        capability = cpu_capability()
        flags = _cpu_flags()
        native, native_why = NativeLibrary.for_session()
        dnnl, dnnl_why = Library.probe()
        avx512 = capability.startswith("AVX512")
        return CpuTarget(
            capability=capability, avx512=avx512,
            avx2=avx512 or capability.startswith("AVX2") or "avx2" in flags,
            fma="fma" in flags or avx512, vnni="avx512_vnni" in flags,
            bf16="avx512_bf16" in flags, vector_floats=16 if avx512 else 8,
            native=native, native_why=native_why, dnnl=dnnl, dnnl_why=dnnl_why,
            threads=torch.get_num_threads(), onednn_ops=onednn_ops_available(),
            l1d_bytes=_cache_bytes(1), l2_bytes=_cache_bytes(2), l3_bytes=_cache_bytes(3),
            native_fma=native_linear.native_linear_preferred(native),
            native_panel_width=native_linear.panel_width(native) if native is not None else 0,
            native_vector_floats=stem.vector_width(native) if native is not None else 0)

    def with_isa(self, *, avx512: bool) -> CpuTarget:
        """This target as a CPU with (or without) AVX-512 kernels: what tests use to see
        the other CPU's choices on this one (the kernels themselves run on either)."""
        return replace(self, avx512=avx512, vector_floats=16 if avx512 else 8)

    # -- where a kernel is preferred (the measurements: docs/performance.md) -----------
    def direct_linear_preferred(self) -> bool:
        """Whether large linears run libdnnl's inner product rather than torch's oneDNN
        matmul, where libdnnl loads: with AVX2 kernels, where libdnnl's inner product
        measured faster; with AVX-512 ones torch's matmul is the measured path."""
        return not self.avx512

    def blocked_layout_preferred(self) -> bool:
        """Whether a depthwise region may run on nChw8c activations: where 8 floats are
        the vector width (AVX2), as measured; AVX-512 CPUs keep NHWC."""
        return not self.avx512

    def native_stem_preferred(self) -> bool:
        """Whether a direct convolution over the NCHW image runs the native stem kernel
        (``kernels/stem.py``) unless told: where the native build's vectors hold 16
        floats (AVX-512); with 8-float vectors staging plus libdnnl measured as fast."""
        return self.native is not None and self.native_vector_floats == 16

    def winograd_preferred(self, tiles: int | None) -> bool:
        """Whether a 3x3 convolution runs as Winograd unless told, given the 4x4 tiles
        one image makes of its output (None: not known at load): always with AVX2
        kernels; with AVX-512 ones, whose direct kernels are twice as wide, only where an
        image makes at least :data:`WINOGRAD_MIN_TILES` tiles."""
        if not self.avx512:
            return True
        return tiles is not None and tiles >= WINOGRAD_MIN_TILES

    def native_for(self, device: torch.device) -> tuple[NativeLibrary | None, str]:
        """The native library for a kernel bound on ``device``, and what built it or why
        there is none (the native kernels run on the host only)."""
        if device.type != "cpu":
            return None, f"are CPU-only (the node runs on {device.type})"
        return self.native, self.native_why

    def native_linear_preferred(self) -> bool:
        """Whether large linears run the native packed-panel kernel (``kernels/linear.py``):
        the native library loads and was built with its AVX2+FMA (or AVX-512) block."""
        return self.native is not None and self.native_fma

    def strassen_preferred(self) -> bool:
        """Whether native linears run as one level of Strassen where their weight allows:
        with the AVX2 build's 24-column panels. An AVX-512 build's kernel reads its
        panel blocks from L1, and Strassen's sums cost what its products save."""
        return self.native is not None and self.native_panel_width == 24

    def fuses_transcendental_post_ops(self) -> bool:
        """Whether oneDNN's matmul should fuse a transcendental activation (sigmoid, tanh,
        GELU) as its post-op: on AVX-512 kernels. AVX2's brg_matmul evaluates it far
        slower than torch's in-place kernel run after the matmul."""
        return self.avx512

    # -- what kernel selection and weight packing ask of the kernels --------------------
    # (passes/ see kernels only through this class and kernels/choice.py)
    blocked_channels = BLOCK      # channels per block of libdnnl's nChw8c layout
    # multiply-adds a dense chain's layer may take in one call and still run native
    dense_chain_max_macs = DENSE_CHAIN_MAX_MACS

    @staticmethod
    def conv_geometry(shape: list[int], strides: tuple[int, ...], pads: tuple[int, ...],
                      dilations: tuple[int, ...], groups: int) -> ConvGeometry:
        """A convolution's geometry as libdnnl and the native kernels read it (``pads``:
        ONNX's ``[begin..., end...]``)."""
        return geometry(shape, strides, pads, dilations, groups)

    @staticmethod
    def eltwise(post: tuple[str, list[float], str] | None) -> tuple[int, float, float] | None:
        """libdnnl's eltwise ``(algorithm, alpha, beta)`` for a post-op from
        ``Activation.onednn`` (None: no activation, or one that runs after the kernel)."""
        return None if post is None or post[0] == "none" else onednn_eltwise(*post)

    @staticmethod
    def winograd_unfit(geo: ConvGeometry, in_channels: int,
                       eltwise: tuple[int, float, float] | None) -> str | None:
        """Why a convolution cannot run as Winograd (None: it can; ``kernels/winograd.py``)."""
        return winograd_unfit(geo, in_channels, eltwise)

    def stem_unfit(self, geo: ConvGeometry, in_channels: int,
                   eltwise: tuple[int, float, float] | None) -> str | None:
        """Why a convolution cannot run as the native stem (None: it can)."""
        return stem_unfit(geo, in_channels, self.native_vector_floats, eltwise)

    @staticmethod
    def winograd_weight(dense: Tensor) -> Tensor:
        """The Winograd transform ``U`` (``[36, C, K]``) of a 3x3 weight."""
        return winograd.transform_weight(dense)

    def libdnnl_conv_weight(self, dense: Tensor, geo: ConvGeometry, input_size: tuple[int, ...],
                            blocked: bool, plain_input: bool) -> Tensor | None:
        """libdnnl's own packing of a convolution weight for ``input_size`` (None: no
        libdnnl, or it describes none)."""
        if self.dnnl is None:
            return None
        try:
            return self.dnnl.preferred_weight(dense, geo, input_size, blocked, plain_input)
        except DnnlError:
            return None

    def libdnnl_linear_weight(self, dense: Tensor, rows: int) -> Tensor | None:
        """libdnnl's inner-product packing of a linear weight for ``rows`` rows (None: no
        libdnnl, or it describes none)."""
        if self.dnnl is None:
            return None
        try:
            return self.dnnl.pack_linear(dense, rows)
        except DnnlError:
            return None

    def native_linear_weight(self, dense: Tensor, top: Tensor | None) -> Tensor:
        """``dense`` packed into the native linear's panels (``top``: each output's
        largest ``|W|``, written while packing)."""
        assert self.native is not None
        return native_linear.pack(self.native, dense, top)

    def strassen_spread(self, top: Tensor, out_features: int, in_features: int
                        ) -> float | None:
        """Strassen's weight check from the packing's ``top`` (None: classic calls only)."""
        assert self.native is not None
        return native_linear.strassen_spread(self.native, top, out_features, in_features)


def cpu_capability() -> str:
    """torch's CPU dispatch level (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


def onednn_ops_available() -> bool:
    """Whether torch ships the oneDNN fused CPU ops the convolution and linear kernels use."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn,
                                                                  "_convolution_pointwise")


def onednn_graph_available() -> bool:
    """Whether this torch can fuse TorchScript graphs with oneDNN Graph (``compile="onednn"``)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.jit,
                                                                  "enable_onednn_fusion")


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _cache_bytes(level: int) -> int:
    """The size of the first CPU's level-``level`` data (or unified) cache: sysconf's
    answer, else sysfs's (0: not known)."""
    name = "SC_LEVEL1_DCACHE_SIZE" if level == 1 else f"SC_LEVEL{level}_CACHE_SIZE"
    try:
        size = int(os.sysconf(name))
    except (ValueError, OSError, AttributeError):
        size = 0
    if size > 0:
        return size
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if int((index / "level").read_text()) != level \
                    or (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        scale = units.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in units else text
        return int(digits) * scale if digits.isdigit() else 0
    return 0

