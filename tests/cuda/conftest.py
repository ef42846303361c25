"""Shared fixtures for the GPU tests (collected everywhere, skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def exact_fp32():
    """Compare in true fp32: TF32 matmuls/convs would exceed the tolerances."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
