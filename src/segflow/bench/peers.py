"""Peers: other runtimes measured on the same model and inputs as segflow.

- ``onnxruntime``: the same ONNX model, CPU execution provider on CPU and the
  CUDA provider on CUDA devices (where the installed onnxruntime has it).
- ``torch``: PyTorch eager on the model's twin module (built-in models only:
  ``segflow.models.torch_module``), under ``torch.inference_mode``.

Peers are optional: a missing one raises :class:`PeerUnavailable` with the
reason, which the benchmark reports instead of crashing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from segflow.ir.types import Device, DeviceKind


class PeerUnavailable(Exception):
    """A peer cannot run here; the message says why."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What a peer needs: the ONNX model, and for built-in models their name and options."""

    model: onnx.ModelProto
    builtin: str | None = None
    options: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PeerRunner:
    """A prepared peer: ``run()`` makes one inference and returns numpy outputs."""

    name: str
    detail: str
    version: str
    run: Callable[[], list[np.ndarray]]
    # Its own CPU thread pool, which keeps spinning after a run: the runner pauses
    # between this peer's calls and the others' (BenchSettings.settle_s).
    own_pool: bool = False


def _onnxruntime(source: ModelSource, feeds: Mapping[str, np.ndarray],
                 device: Device) -> PeerRunner:
    try:
        import onnxruntime as ort
    except ImportError:
        raise PeerUnavailable("onnxruntime is not installed (pip install onnxruntime)") from None
    provider: str | tuple[str, dict[str, Any]] = "CPUExecutionProvider"
    if device.kind is DeviceKind.CUDA:
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise PeerUnavailable("this onnxruntime has no CUDAExecutionProvider "
                                  "(pip install onnxruntime-gpu)")
        provider = ("CUDAExecutionProvider", {"device_id": device.index})
    try:
        sess = ort.InferenceSession(source.model.SerializeToString(), providers=[provider])
    except Exception as exc:  # noqa: BLE001 - any failure makes the peer unavailable
        raise PeerUnavailable(f"onnxruntime cannot load the model: "
                              f"{type(exc).__name__}: {str(exc)[:200]}") from None
    inputs = dict(feeds)
    name = provider if isinstance(provider, str) else provider[0]

    def run() -> list[np.ndarray]:
        return list(sess.run(None, inputs))

    # onnxruntime's intra-op threads spin for ~40 ms after a run, and a run right after
    # one shares the cores with them (docs/benchmarking.md, "settle").
    return PeerRunner("onnxruntime", name, ort.__version__, run, own_pool=True)


def _torch_eager(source: ModelSource, feeds: Mapping[str, np.ndarray],
                 device: Device) -> PeerRunner:
    if source.builtin is None:
        raise PeerUnavailable("no PyTorch module for a model loaded from a file")
    if device.kind is DeviceKind.CUDA and not torch.cuda.is_available():
        raise PeerUnavailable("CUDA is not available to PyTorch")
    from segflow import models

    try:
        module = models.torch_module(source.builtin, **source.options)
    except (ValueError, NotImplementedError) as exc:
        raise PeerUnavailable(f"no PyTorch module for {source.builtin}: {exc}") from None
    target = device.torch
    module = module.eval().to(target)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(target) for k, v in feeds.items()}
    cuda = device.kind is DeviceKind.CUDA

    def run() -> list[np.ndarray]:
        with torch.inference_mode():
            out = module(**tensors)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if cuda:
            torch.cuda.synchronize(target)
        return [t.detach().cpu().numpy() for t in outs]

    return PeerRunner("torch", f"eager on {target}", torch.__version__, run)


PEERS: Mapping[str, Callable[[ModelSource, Mapping[str, np.ndarray], Device], PeerRunner]] = {
    "onnxruntime": _onnxruntime,
    "torch": _torch_eager,
}


def prepare_peer(name: str, source: ModelSource, feeds: Mapping[str, np.ndarray],
                 device: Device) -> PeerRunner:
    """Build peer ``name`` for a model; raises :class:`PeerUnavailable` when it cannot run."""
    factory = PEERS.get(name)
    if factory is None:
        raise ValueError(f"unknown peer {name!r}; available: {', '.join(PEERS)}")
    return factory(source, feeds, device)
