"""Training on a real GPU (skipped without CUDA): the same steps as on the CPU.

The training executor goes through the same completion strategy as inference
(streams, events, one wait for the step's outputs), so a CUDA step must give
the CPU step's loss and parameters.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cuda_trace import requires_cuda

import segflow
from segflow import models
from segflow.optim import SGD, Adam

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not requires_cuda, reason="needs a CUDA device")]

IMAGE = {"image_size": 32, "num_classes": 10}


def _batches(count: int, batch: int, seed: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input": rng.standard_normal((batch, 3, 32, 32), dtype=np.float32),
             "y": rng.integers(0, IMAGE["num_classes"], batch)} for _ in range(count)]


@pytest.mark.parametrize("engine", ["inline", "threaded"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.05, momentum=0.9), Adam(lr=0.001)],
                         ids=["sgd", "adam"])
def test_resnet18_steps_match_the_cpu(engine, optimizer):
    model = models.build("resnet18", **IMAGE)
    loss = segflow.CrossEntropyLoss(labels="y")
    cpu = segflow.TrainingSession(model, loss=loss, optimizer=optimizer, engine=engine)
    gpu = segflow.TrainingSession(model, loss=loss, optimizer=optimizer, engine=engine,
                                  device="cuda:0")
    for feeds in _batches(3, 4):
        want = cpu.step(feeds).loss
        got = gpu.step(feeds).loss
        assert got == pytest.approx(want, rel=2e-3, abs=1e-4)
    ref = cpu.parameters()
    for name, tensor in gpu.parameters().items():
        torch.testing.assert_close(tensor.cpu(), ref[name].cpu(), rtol=2e-3, atol=2e-4)
