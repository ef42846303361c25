"""A generated segment as a ``torch.nn.Module``, for backends that freeze weights.

Both graph compilers segflow hands segments to (inductor's freezing and
TorchScript's ``torch.jit.freeze`` for oneDNN Graph) treat module buffers as
constants they may fold, fuse or prepack. The segment's pure function takes
its constants as leading arguments; this module holds them as buffers and
passes them in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Tensor = torch.Tensor


class SegmentModule(torch.nn.Module):
    """``fn(*constants, *inputs)`` with the constants as (non-persistent) buffers."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], constants: Sequence[Tensor]
                 ) -> None:
        super().__init__()
        self.fn = fn
        self.count = len(constants)
        for i, tensor in enumerate(constants):
            self.register_buffer(f"c{i}", tensor, persistent=False)

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        constants = [getattr(self, f"c{i}") for i in range(self.count)]
        return self.fn(*constants, *inputs)
