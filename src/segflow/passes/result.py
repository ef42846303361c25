"""What every pass returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from segflow.ir.graph import Graph

if TYPE_CHECKING:
    from segflow.kernels.choice import KernelChoices


@dataclass(frozen=True, slots=True)
class PassResult:
    """The (possibly rewritten) graph, whether the pass changed anything, and its log.

    ``log`` holds the pass's report lines (the pipeline prints one line per pass,
    ``explain()`` shows them); a pass called on its own may leave it empty.

    >>> PassResult(graph, False).changed       # doctest: +SKIP
    False
    """

    graph: Graph
    changed: bool
    log: tuple[str, ...] = ()
    # The kernel selection's choices (passes/select_kernels.py; None: any other pass).
    choices: KernelChoices | None = None

    @property
    def modified(self) -> bool:
        """``changed``, by the name onnx-ir's pass contract uses."""
        return self.changed
