"""Training on a real GPU (skipped without CUDA): the CPU's gradients and updates.

The training executor goes through the same completion strategy as inference
(streams, events, one wait for the step's outputs), so a CUDA step must give
the CPU step's loss, gradients and parameters. cuDNN and oneDNN sum in
different orders: tolerances are relative to each tensor's norm (TF32 is off,
see conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cuda_trace import requires_cuda

import segflow
from segflow import models
from segflow.optim import SGD

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not requires_cuda, reason="needs a CUDA device")]

IMAGE = {"image_size": 32, "num_classes": 10}


def _batches(count: int, batch: int, seed: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input": rng.standard_normal((batch, 3, 32, 32), dtype=np.float32),
             "y": rng.integers(0, IMAGE["num_classes"], batch)} for _ in range(count)]


def _close_in_norm(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                   tol: float) -> None:
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        ref = want[name].detach().cpu().double()
        err = float((tensor.detach().cpu().double() - ref).norm() / max(ref.norm(), 1e-12))
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("engine", ["inline", "threaded"])
def test_resnet18_gradients_and_updates_match_the_cpu(engine):
    model = models.build("resnet18", **IMAGE)
    loss = segflow.CrossEntropyLoss(labels="y")
    kwargs = {"loss": loss, "optimizer": SGD(lr=0.01, momentum=0.9), "engine": engine}
    cpu = segflow.TrainingSession(model, **kwargs)
    gpu = segflow.TrainingSession(model, device="cuda:0", **kwargs)
    first, *rest = _batches(4, 8)
    assert gpu.step(first, update=False).loss == pytest.approx(
        cpu.step(first, update=False).loss, rel=1e-4)
    _close_in_norm(gpu.gradients(), cpu.gradients(), 1e-3)
    for feeds in rest:
        assert gpu.step(feeds).loss == pytest.approx(cpu.step(feeds).loss, rel=1e-3)
    assert all(t.is_cuda for t in gpu.parameters().values())
    _close_in_norm(gpu.parameters(), cpu.parameters(), 1e-4)
