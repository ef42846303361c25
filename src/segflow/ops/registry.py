"""The operator table: one :class:`OpDef` row per operator.

An OpDef binds together everything segflow knows about an op: its name and
domain, the opset range it implements, its :class:`ExecType`, the kernel
factory, and optionally a gradient rule. Kernels are *bound* once per node at
plan time: ``bind(node, ctx)`` parses attributes and returns a closure that
maps input tensors to output tensors, so nothing is parsed per run.

Adding an op is one row in one family module (see CONTRIBUTING.md)::

    OpDef("Relu", bind=unary(torch.relu))
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from segflow.engine.base import ExecType
from segflow.errors import UnsupportedOp
from segflow.ir.types import DType

if TYPE_CHECKING:
    from segflow.ir.graph import Graph, Node, Value
    from segflow.kernels.choice import KernelChoice
    from segflow.kernels.target import CpuTarget
    from segflow.kernels.workspace import Workspace

Tensor = torch.Tensor
Kernel = Callable[[Sequence[Tensor | None]], Sequence[Tensor]]
"""A bound kernel: input tensors (None for omitted optionals) -> output tensors."""


class SubgraphRunner(Protocol):
    """Runs one bound subgraph: its own inputs, plus the outer values it captures."""

    def __call__(self, inputs: Sequence[Tensor | None],
                 outer: Mapping[Value, Tensor | None]) -> list[Tensor]:
        ...


class BindContext(Protocol):
    """What a kernel factory may ask of the runtime while binding a node."""

    @property
    def device(self) -> torch.device:
        ...

    @property
    def target(self) -> CpuTarget:
        """The CPU this session's kernels run on (``kernels/target.py``)."""
        ...

    def choice(self, node: Node) -> KernelChoice:
        """The kernel the plan chose for ``node`` (``kernels/choice.py``)."""
        ...

    def reference(self, node: Node) -> Kernel:
        """``node``'s OpDef row kernel, whatever its choice (a chosen kernel's fallback)."""
        ...

    def captured(self, node: Node) -> list[Value]:
        """Outer values read by the node's subgraphs; passed after the explicit inputs."""
        ...

    def subgraph(self, graph: Graph) -> SubgraphRunner:
        """Bind ``graph`` once; the runner takes its inputs and ``{captured value: tensor}``.

        A control-flow kernel receives the captured tensors after its explicit
        inputs, in ``captured(node)`` order, and zips them into that mapping.
        """
        ...

    def destination(self, value: Value) -> Callable[[], Tensor | None] | None:
        """Storage the run plans for ``value``, for a kernel that can write into given
        storage: call it in the kernel (None: allocate). None: never planned."""
        ...

    def staging(self, node: Node) -> Callable[[], Tensor | None] | None:
        """Storage the run plans for a copy of ``node``'s first input that its kernel
        makes (a plain input in the layout the kernel reads), like :meth:`destination`."""
        ...

    def workspace(self) -> Workspace:
        """Scratch memory the kernels of this binding share, one kernel at a time
        (``kernels/workspace.py``)."""
        ...

    def allow_inexact(self, node: Node, reason: str) -> bool:
        """Whether ``node`` may run a kernel whose NaN and infinity results differ from
        onnxruntime's (``reason`` says how, e.g. "oneDNN's ReLU post-op turns NaN into 0").
        False where a NaN can reach the node, or for a session's exact runs; a True
        answer is recorded, so runs with non-finite feeds know to take the exact path
        (``runtime/nonfinite.py``)."""
        ...


Bind = Callable[["Node", BindContext], Kernel]

NEWEST_ONNX_OPSET = 28
"""The newest ai.onnx opset whose operator versions the rows follow; a model importing a
newer one is refused at load (its ops may have changed meaning)."""
GradRule = Callable[..., Any]
HostRead = Callable[["Node"], tuple[int, ...]]
"""A node -> the indices of the inputs whose values its kernel reads on the host."""


def reads_on_host(*indices: int, since: int = 1) -> HostRead:
    """:attr:`OpDef.host_reads` for an op that reads ``indices`` on the host from opset
    ``since`` on (``Reshape``'s shape became an input in opset 5)."""
    return lambda node: indices if node.opset >= since else ()


class ViewOfInput(enum.Enum):
    """How an op's first output relates to its first input's storage."""

    NONE = "none"          # new storage
    MAY_ALIAS = "alias"    # possibly a view of input 0, or input 0 itself (Slice, Cast)
    RESHAPE = "reshape"    # input 0's elements in order under a new shape: a view where
                           # input 0 is contiguous, input 0 itself where the shape holds


@dataclass(frozen=True, slots=True, eq=False)
class InlineOp:
    """How generated code calls an op directly, with its kernel's semantics.

    ``expr`` is a Python expression over ``{in0}``, ``{in1}`` ... and the names of
    ``bound`` (closure constants); ``inplace`` maps an input index to the expression that
    overwrites that input instead. Used by codegen (``runtime/compile.py``).
    """

    expr: str
    inplace: Mapping[int, str]
    float_only: bool               # integer types go through the kernel (ONNX int semantics)
    bound: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class OpDef:
    """Declaration of one operator (for one opset range)."""

    name: str
    bind: Bind
    domain: str = ""
    since: int = 1
    until: int | None = None
    exec_type: ExecType = ExecType.SYNC
    # When set, decides the exec type per node (e.g. TopK is LOCAL only with a computed k).
    classify: Callable[[Node], ExecType] | None = None
    grad: GradRule | None = None
    doc: str = ""
    # Whether the node may compute NaN or an infinity from finite inputs (a division by
    # zero, the log of a negative number, an exponential past float range): where its
    # results flow, no kernel that loses a NaN is chosen (runtime/nonfinite.py). Plain
    # arithmetic overflowing float range is not counted.
    creates_nonfinite: Callable[[Node], bool] | None = None
    # Whether the gradient rule reads the op's output instead of its input (Relu's
    # gradient is a function of y): autodiff then keeps y alive for the backward pass.
    grad_reads_output: bool = False
    # The inputs whose values the kernel reads on the host (Reshape's shape, Slice's
    # starts): a CUDA graph bakes them in, so it captures the node only where they are
    # constants or fixed by the input shapes (runtime/cudagraph.py).
    host_reads: HostRead | None = None
    # Whether output 0 may share input 0's storage: a training session's state aliases
    # follow it (runtime/training.py), and the no-op rule drops a RESHAPE that keeps the
    # shape (passes/fuse/noops.py).
    view_of_input: ViewOfInput = ViewOfInput.NONE
    # The direct call codegen emits in place of the kernel, for core ops that have one.
    inline: InlineOp | None = None

    def exec_type_of(self, node: Node) -> ExecType:
        # Sequences and optionals are host-side lists and Nones, which no bulk segment,
        # generated program or device stream carries: any node moving one (an Identity
        # of a sequence, say) runs as a LOCAL task.
        if node.touches_containers:
            return ExecType.LOCAL
        return self.classify(node) if self.classify else self.exec_type

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset <= self.until)

    def host_read_inputs(self, node: Node) -> tuple[int, ...]:
        """Indices of the inputs whose values ``node``'s kernel reads on the host."""
        return self.host_reads(node) if self.host_reads is not None else ()


_DOMAIN_ALIASES = {"ai.onnx": ""}


def touches_strings(node: Node) -> bool:
    """Whether ``node`` reads or writes a string value: it then runs its string row, on
    the host (:meth:`OpRegistry.resolve`), and no pass hands its values to torch."""
    return any(v is not None and v.spec.dtype is DType.STRING
               for v in (*node.inputs, *node.outputs))


@dataclass(slots=True)
class OpRegistry:
    """Lookup of OpDefs by (domain, op type, opset)."""

    rows: dict[tuple[str, str], list[OpDef]] = field(default_factory=dict)
    # The host rows a node resolves to where it reads or writes string values, by
    # (domain, op type): the string ops' own rows and the general ops' string forms
    # (ops/strings.py).
    string_forms: dict[tuple[str, str], OpDef] = field(default_factory=dict)

    def register(self, opdef: OpDef) -> None:
        key = (_DOMAIN_ALIASES.get(opdef.domain, opdef.domain), opdef.name)
        self.rows.setdefault(key, []).append(opdef)

    def extend(self, opdefs: Iterable[OpDef]) -> OpRegistry:
        for opdef in opdefs:
            self.register(opdef)
        return self

    def lookup(self, domain: str, op_type: str, opset: int, node_name: str = "") -> OpDef:
        domain = _DOMAIN_ALIASES.get(domain, domain)
        where = f" (node {node_name!r})" if node_name else ""
        shown = domain or "ai.onnx"
        rows = self.rows.get((domain, op_type))
        if not rows:
            known = {d or "ai.onnx" for d, _ in self.rows}
            if domain and (shown not in known):
                raise UnsupportedOp(f"unsupported op domain {shown!r}: op {op_type}, "
                                    f"opset {opset}{where}")
            raise UnsupportedOp(f"unsupported op {op_type} (domain {shown}, opset {opset}){where}")
        for row in rows:
            if row.covers(opset):
                return row
        ranges = ", ".join(f"{r.since}..{r.until or 'latest'}" for r in rows)
        raise UnsupportedOp(f"unsupported opset {opset} for op {op_type} (domain {shown}; "
                            f"implemented for opsets {ranges}){where}")

    def register_string_form(self, opdef: OpDef) -> None:
        """``opdef`` runs the nodes of its op that read or write strings."""
        self.string_forms[(_DOMAIN_ALIASES.get(opdef.domain, opdef.domain), opdef.name)] = opdef

    def resolve(self, node: Node) -> OpDef:
        """The row that runs ``node``: :meth:`lookup`'s, or its string form where the node
        reads or writes a string value (a node of another op over strings is refused)."""
        row = self.lookup(node.domain, node.op_type, node.opset, node.name)
        if not touches_strings(node):
            return row
        form = self.string_forms.get((_DOMAIN_ALIASES.get(node.domain, node.domain),
                                      node.op_type))
        if form is None:
            if node.domain == "segflow" and node.op_type == "Copy" and node.inputs[0]:
                raise UnsupportedOp(f"string value {node.inputs[0].name!r} would have to go "
                                    f"to {node.attrs.get('to')}: string tensors stay on the "
                                    "host (place the nodes that read it on the CPU)")
            raise UnsupportedOp(f"{node.op_type} over string tensors is not supported "
                                f"(node {node.name!r})")
        return form

    def contains(self, domain: str, op_type: str) -> bool:
        return (_DOMAIN_ALIASES.get(domain, domain), op_type) in self.rows

    def names(self) -> list[str]:
        return sorted(f"{d + '.' if d else ''}{n}" for d, n in self.rows)
