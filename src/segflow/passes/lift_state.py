"""Training: initializers become graph inputs, fed each step from the session's state."""

from __future__ import annotations

from collections.abc import Sequence

from segflow.ir.graph import Graph
from segflow.passes.result import PassResult


def lift_state(graph: Graph, names: Sequence[str]) -> PassResult:
    """Turn the initializers ``names`` into graph inputs (the session's mutable state:
    parameters and running statistics, updated in place between steps).

    >>> lift_state(graph, ["fc.weight"]).changed              # doctest: +SKIP
    True
    """
    lifted = 0
    for name in names:
        value = graph.initializers.pop(name, None)
        if value is None:
            continue
        value.const = None
        graph.add_input(value)
        lifted += 1
    return PassResult(graph, lifted > 0,
                      (f"lift_state: {lifted} initializers fed as state",))
