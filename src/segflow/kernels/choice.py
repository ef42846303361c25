"""Which kernel runs a node, decided once (``passes/select_kernels.py``) and read everywhere.

A :class:`KernelChoice` names the kernel (:class:`KernelKind`) and carries the typed
parameters the packing made for it (the input size a weight was packed for, whether
its bytes are libdnnl's format, the nChw8c region, Strassen's weight check, ...). The
Plan holds one :class:`KernelChoices` per graph; binding, codegen, the arena, prebuild
and explain read it instead of rediscovering the kernel from the node or the bound
object. A node without a choice runs its OpDef row's reference kernel.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from segflow.ir.graph import Node


class KernelKind(enum.Enum):
    """The kernels a node may be bound to."""

    REFERENCE = "reference"            # the OpDef row's own (torch) kernel
    ONEDNN_CONV = "onednn_conv"        # torch's oneDNN convolution over a prepacked weight
    DIRECT_CONV = "direct_conv"        # libdnnl's convolution, called directly
    WINOGRAD = "winograd"              # the direct convolution as Winograd F(4x4, 3x3)
    NATIVE_STEM = "native_stem"        # the direct convolution reading the NCHW image in place
    DIRECT_POOL = "direct_pool"        # libdnnl's pooling over a direct kernel's output
    DIRECT_BINARY = "direct_binary"    # libdnnl's binary: a per-channel scale of one
    ONEDNN_LINEAR = "onednn_linear"    # torch's oneDNN matmul over a prepacked weight
    DIRECT_LINEAR = "direct_linear"    # libdnnl's inner product
    NATIVE_LINEAR = "native_linear"    # segflow's packed-panel kernel (kernels/linear.py)
    NATIVE_ATTENTION = "native_attention"      # Attention's native kernel
    NATIVE_ADD_LAYER_NORM = "native_add_layer_norm"  # AddLayerNorm's native kernel
    NATIVE_DENSE_CHAIN = "native_dense_chain"  # DenseChain's one native call
    INT8_CONV = "int8_conv"            # QConv on libdnnl's int8 convolution
    NATIVE_DYNAMIC_QUANTIZE = "native_dynamic_quantize"  # DynamicQuantizeLinear's native kernel


# Kinds whose kernel calls libdnnl (it then writes where the run says: runtime/arena.py).
CALLS_LIBDNNL = frozenset({KernelKind.DIRECT_CONV, KernelKind.WINOGRAD, KernelKind.NATIVE_STEM,
                           KernelKind.DIRECT_POOL, KernelKind.DIRECT_BINARY})
# The direct convolution and its strategies (one DirectConv op each).
DIRECT_CONV_KINDS = frozenset({KernelKind.DIRECT_CONV, KernelKind.WINOGRAD,
                               KernelKind.NATIVE_STEM})
# Convolution kinds: the weight constant is packed (or transformed) for the kernel.
CONV_KINDS = frozenset({KernelKind.ONEDNN_CONV, KernelKind.DIRECT_CONV, KernelKind.WINOGRAD,
                        KernelKind.NATIVE_STEM})
# The poolings a DIRECT_POOL kernel runs (kernels/pool.py), reading a direct kernel's
# channels-last output in place.
DIRECT_POOL_OPS = frozenset({"MaxPool", "GlobalAveragePool", "GlobalMaxPool"})
# The activations the native dense chain runs: kernels/native/dense_chain.c's ACT_* codes,
# in order (the chaining pass joins only layers with one of these).
DENSE_CHAIN_ACTIVATIONS = ("", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid",
                           "HardSwish", "Gelu", "GeluTanh")
# segflow's own fused ops and the one native kernel each has on CPU (which falls back to
# the op's reference, counted, where a call does not fit it).
NATIVE_FUSED = {"Attention": KernelKind.NATIVE_ATTENTION,
                "AddLayerNorm": KernelKind.NATIVE_ADD_LAYER_NORM,
                "DenseChain": KernelKind.NATIVE_DENSE_CHAIN}
NATIVE_FUSED_KINDS = frozenset(NATIVE_FUSED.values())
# Standard ops with a native kernel on CPU (falling back to the op's row, counted).
NATIVE_STANDARD = {"DynamicQuantizeLinear": KernelKind.NATIVE_DYNAMIC_QUANTIZE}
LINEAR_KINDS = frozenset({KernelKind.ONEDNN_LINEAR, KernelKind.DIRECT_LINEAR,
                          KernelKind.NATIVE_LINEAR})


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """One node's kernel and the parameters its packed weight was made with."""

    kind: KernelKind = KernelKind.REFERENCE
    channels_last: bool = False                   # writes NHWC (a conv stack stays NHWC)
    blocked: bool = False                         # runs on nChw8c activations
    blocked_input: bool = False                   # ... and reads nChw8c ones
    packed_for: tuple[int, ...] | None = None     # input size the weight was packed for
    verified_for: tuple[int, ...] | None = None   # input size whose libdnnl format it holds
    libdnnl_packed: bool = False                  # the weight constant is libdnnl's packing
    strassen_wmax: float | None = None            # Strassen's weight check (None: classic)
    direct_rows: int | None = None                # rows an inner product's weight is packed for
    broadcast_input: int | None = None            # a binary's per-channel [N, C, 1, 1] operand

    @property
    def calls_libdnnl(self) -> bool:
        return self.kind in CALLS_LIBDNNL

    @property
    def reads_own_format(self) -> bool:
        """Whether the weight constant is a kernel's own format (libdnnl's packing, the
        Winograd transform, the native panels), not the weight's values in its shape."""
        return self.libdnnl_packed or self.kind in (
            KernelKind.WINOGRAD, KernelKind.DIRECT_LINEAR, KernelKind.NATIVE_LINEAR)

    @property
    def prepacked(self) -> bool:
        """Whether the weight constant was packed for oneDNN or a native kernel."""
        return self.kind in CONV_KINDS or self.kind in LINEAR_KINDS


REFERENCE = KernelChoice()


@dataclass(frozen=True, slots=True)
class KernelChoices:
    """Every node's :class:`KernelChoice` (nodes not held run the reference kernel)."""

    by_node: Mapping[Node, KernelChoice] = field(
        default_factory=lambda: MappingProxyType({}))

    @staticmethod
    def of_mapping(choices: Mapping[Node, KernelChoice]) -> KernelChoices:
        return KernelChoices(MappingProxyType(dict(choices)))

    def __getitem__(self, node: Node) -> KernelChoice:
        return self.by_node.get(node, REFERENCE)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.by_node)

    def __len__(self) -> int:
        return len(self.by_node)

    def kind(self, node: Node) -> KernelKind:
        return self[node].kind

    def counts(self) -> Counter[KernelKind]:
        """How many nodes each kind runs."""
        return Counter(choice.kind for choice in self.by_node.values())

    def calls_libdnnl(self, node: Node) -> bool:
        """Whether ``node``'s kernel calls libdnnl: it then writes its output where the
        run says (``runtime/arena.py``)."""
        return self[node].calls_libdnnl

    def converts_input(self, node: Node) -> bool:
        """A direct convolution over a graph input: its kernel first copies that (plain,
        NCHW) input to channels-last, since libdnnl has only reference kernels for plain
        input with channels-last output. A native stem reads it in place, but the run's
        storage for the copy stays planned for a call it declines (a large batch)."""
        if not self.calls_libdnnl(node) or node.op_type != "FusedConv":
            return False
        x = node.inputs[0] if node.inputs else None
        return x is not None and x.producer is None and x.const is None
