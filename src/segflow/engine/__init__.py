"""Dependency engines: run pushed tasks in an order that respects their Vars."""

from segflow.engine.base import Engine, ExecType, Var
from segflow.engine.inline import InlineEngine
from segflow.engine.threaded import ThreadedEngine


def make_engine(name: str) -> Engine:
    """``"inline"`` or ``"threaded"`` (see :func:`segflow.settings.resolve_engine`)."""
    if name == "inline":
        return InlineEngine()
    if name == "threaded":
        return ThreadedEngine()
    raise ValueError(f"unknown engine {name!r}; expected 'inline' or 'threaded'")


__all__ = ["Engine", "ExecType", "InlineEngine", "ThreadedEngine", "Var", "make_engine"]
