"""Loading builder weights into the matching PyTorch eager modules."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn


def load_state(factory: Callable[[], nn.Module], state_dict: Mapping[str, np.ndarray]) -> nn.Module:
    """Construct a module and give it `state_dict`'s weights; returns it in eval mode.

    The module is built on the meta device so its own random initialization (a second
    for bert_base) is skipped. Names and shapes must match exactly; only BatchNorm's
    `num_batches_tracked` counters may be absent from `state_dict`.
    """
    with torch.device("meta"):
        module = factory()
    tensors = {
        name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in state_dict.items()
    }
    for name in module.state_dict():
        if name.endswith("num_batches_tracked") and name not in tensors:
            tensors[name] = torch.zeros((), dtype=torch.long)
    module.load_state_dict(tensors, strict=True, assign=True)
    return module.eval()
