"""The kernel of ``segflow.DenseChain`` (``ops/dense_chain.py``): a run of small dense
layers in one native call.

At one row a small layer is a fraction of a microsecond of arithmetic and several of
ATen dispatch, so a chain of such layers is all overhead when each is its own torch
call. :class:`DenseChain` runs the whole chain in one call into native code
(``kernels/native/dense_chain.c``, built by :mod:`segflow.kernels.native.build`) when

- the library is available (a C compiler, ``SEGFLOW_NATIVE`` not 0), and
- the call is small: every layer at most :data:`NATIVE_MAX_MACS` multiply-adds
  (rows x K x N). Above that, MKL's multithreaded GEMM wins,

and otherwise through torch, one ``addmm`` per layer (what ``FusedGemm`` does). Both
paths accumulate in float32; they differ from each other in the order of the sums
only (~1e-6 relative).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from segflow.ir.graph import Node
from segflow.kernels.choice import DENSE_CHAIN_ACTIVATIONS
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.report import NativeOrTorch, ReportFamily, short_label
from segflow.ops.dense_chain import ChainLayer, layers_of, run_chain
from segflow.ops.fused import Inline

if TYPE_CHECKING:
    from segflow.ops.registry import BindContext

Tensor = torch.Tensor
# Per layer and call: above this many multiply-adds (rows x K x N) the chain runs through
# torch. The threshold sits where the native kernel still beat MKL's addmm at every width
# measured (``benchmarks/dense_chain.py``; the figures are in docs/performance.md).
NATIVE_MAX_MACS = 1 << 18


class DenseChain(NativeOrTorch):
    """The op behind a DenseChain node: ``op(x) -> y`` (native or torch, per call).

    Counts its calls by path for ``explain()`` (the native count is not locked, so
    concurrent runs may undercount it); ``why_torch`` says why calls went through
    torch (no library, too large a call, an input that is not float32 on CPU).
    """

    kind = "dense chain"
    family = ReportFamily.DENSE_CHAIN

    def __init__(self, layers: Sequence[ChainLayer], library: NativeLibrary | None,
                 why: str = "") -> None:
        super().__init__(library, why)   # why: NativeLibrary.probe's phrase
        self.layers = list(layers)
        self.in_features = int(self.layers[0].weight.shape[0])
        self.out_features = int(self.layers[-1].weight.shape[1])
        self.max_macs_per_row = max(layer.macs_per_row for layer in self.layers)
        self._widest = max([int(layer.weight.shape[1]) for layer in self.layers[:-1]] or [0])
        self._fn = self._prepare_native(library) if library is not None else None

    def _prepare_native(self, library: NativeLibrary) -> Any:
        layers = self.layers
        for layer in layers:
            if not (layer.weight.is_contiguous() and layer.bias.is_contiguous()
                    and layer.weight.dtype == torch.float32 and layer.bias.dtype == torch.float32
                    and layer.weight.device.type == "cpu"):
                raise ValueError("DenseChain: weights must be contiguous float32 CPU tensors")
        count = len(layers)
        # Arrays the C function reads, built once; the op keeps them (and the tensors) alive.
        self._dims = (ctypes.c_long * (count + 1))(
            self.in_features, *[int(layer.weight.shape[1]) for layer in layers])
        self._weights = (ctypes.c_void_p * count)(*[layer.weight.data_ptr() for layer in layers])
        self._biases = (ctypes.c_void_p * count)(*[layer.bias.data_ptr() for layer in layers])
        self._acts = (ctypes.c_int * count)(
            *[DENSE_CHAIN_ACTIVATIONS.index(layer.activation.name) for layer in layers])
        self._p0 = (ctypes.c_float * count)(*[layer.params[0] for layer in layers])
        self._p1 = (ctypes.c_float * count)(*[layer.params[1] for layer in layers])
        fn = library.dll.segflow_dense_chain
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_long, *[ctypes.c_void_p] * 9]
        self._args = (count, ctypes.addressof(self._dims), ctypes.addressof(self._weights),
                      ctypes.addressof(self._biases), ctypes.addressof(self._acts),
                      ctypes.addressof(self._p0), ctypes.addressof(self._p1))
        return fn

    def __call__(self, x: Tensor, *_constants: Tensor | None) -> Tensor:
        """``x [..., K] -> [..., N]``. The weights and biases a caller passes after ``x``
        are the node's own constants; the op already holds them."""
        if x.shape[-1] != self.in_features or x.dim() < 2:
            raise ValueError(f"DenseChain expects [..., {self.in_features}], got "
                             f"{list(x.shape)}")
        rows = x.numel() // self.in_features
        why = self._why_torch(x, rows)
        if why:
            self.count_torch_call(why)
            return self.through_torch(x)
        self.native_calls += 1   # unlocked: the native path stays one C call
        return self.native(x)

    def native(self, x: Tensor) -> Tensor:
        """The chain in one native call (float32 CPU ``x``; the library must be loaded)."""
        if self._fn is None:
            raise RuntimeError(f"DenseChain: native kernels {self.why_native}")
        rows = x.numel() // self.in_features
        x2 = x.contiguous()
        y = torch.empty((*x.shape[:-1], self.out_features), dtype=torch.float32)
        scratch = torch.empty(2 * rows * self._widest, dtype=torch.float32)
        count, dims, weights, biases, acts, p0, p1 = self._args
        if self._fn(count, rows, dims, weights, biases, acts, p0, p1, x2.data_ptr(),
                    y.data_ptr(), scratch.data_ptr()):
            raise RuntimeError("DenseChain: the native kernel rejected its activations")
        return y

    def _why_torch(self, x: Tensor, rows: int) -> str:
        if self._fn is None:
            return "native kernels " + self.why_native
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return f"input is {x.dtype} on {x.device.type}"
        if rows * self.max_macs_per_row > NATIVE_MAX_MACS:
            return (f"{rows} rows: a layer is {rows * self.max_macs_per_row} multiply-adds, "
                    f"above {NATIVE_MAX_MACS} (MKL's GEMM is faster there)")
        return ""

    def through_torch(self, x: Tensor) -> Tensor:
        """The chain as one torch ``addmm`` (and activation) per layer (the reference)."""
        return run_chain(x, self.layers)

    def describe(self) -> str:
        widths = sorted({int(layer.weight.shape[1]) for layer in self.layers} |
                        {self.in_features})
        span = f"{widths[0]}" if len(widths) == 1 else f"{widths[0]}..{widths[-1]}"
        return f"{len(self.layers)} layers, widths {span}"

    @classmethod
    def describe_all(cls, ops: Sequence[tuple[str, DenseChain]], limit: int = 8
                     ) -> list[str]:
        """``explain()`` lines for a session's dense chains: how many, how their calls ran
        (native or torch) and why any went through torch."""
        if not ops:
            return []
        layers = sum(len(op.layers) for _, op in ops)
        library = ops[0][1].library
        where = (f"native ({ops[0][1].why_native}; {library.describe()})" if library is not None
                 else f"through torch: native kernels {ops[0][1].why_native}")
        native = sum(op.native_calls for _, op in ops)
        through_torch = sum(op.torch_calls for _, op in ops)
        lines = [f"dense chains: {len(ops)} chain{'s' if len(ops) > 1 else ''} of {layers} "
                 f"layers, {where}; {native} calls native, {through_torch} through torch"]
        if library is None:
            return lines
        slow = [(label, op, why, n) for label, op in ops for why, n in op.why_torch.items()]
        for label, op, why, n in slow[:limit]:
            lines.append(f"  through torch: {short_label(label)}, {op.describe()}, "
                         f"{n} calls: {why}")
        if len(slow) > limit:
            lines.append(f"  ... and {len(slow) - limit} more")
        return lines


class DenseChainKernel:
    """A DenseChain node's kernel: ``kernel(inputs) -> [op(x)]``. The op stays reachable,
    so generated code calls it directly and ``explain()`` can count its calls."""

    __slots__ = ("op",)

    def __init__(self, op: DenseChain) -> None:
        self.op = op

    def __call__(self, inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        return [self.op(x)]


def bind_dense_chain(node: Node, ctx: BindContext) -> DenseChainKernel:
    """The native chain (through torch per call where it declines, counted)."""
    library, why = ctx.target.native_for(ctx.device)
    return DenseChainKernel(DenseChain(layers_of(node), library, why))


def inline_chain(kernel: object) -> Inline | None:
    """Generated code calls the kernel's op with the chain's input only."""
    if isinstance(kernel, DenseChainKernel):
        return Inline("{fn}({in0})", {"fn": kernel.op})
    return None
