"""Graph passes, one per module. Each returns a :class:`PassResult`."""

from segflow.passes.result import PassResult

__all__ = ["PassResult"]
