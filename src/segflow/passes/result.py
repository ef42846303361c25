"""What every pass returns."""

from __future__ import annotations

from dataclasses import dataclass

from segflow.ir.graph import Graph


@dataclass(frozen=True, slots=True)
class PassResult:
    """The (possibly rewritten) graph and whether the pass changed anything."""

    graph: Graph
    modified: bool
