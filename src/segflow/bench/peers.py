"""Peers: other runtimes measured on the same model and inputs as segflow.

- ``onnxruntime``: the same ONNX model, CPU execution provider on CPU and the
  CUDA provider on CUDA devices (where the installed onnxruntime has it).
- ``torch``: PyTorch eager on the model's twin module (built-in models only:
  ``segflow.models.torch_module``), under ``torch.inference_mode``.
- ``openvino``: OpenVINO's CPU plugin on the same ONNX model, compiled in float32
  (``INFERENCE_PRECISION_HINT`` f32: its default on CPUs with AVX512_BF16 or AMX is
  bfloat16), with the latency hint and segflow's thread count, at the feeds' static
  shapes. ``openvino-default`` compiles it in OpenVINO's own default precision, to
  measure what bfloat16 costs in accuracy and buys in time; it is not a peer at the
  same precision.

Each peer records the precision it computes in (``PeerRunner.precision``).

Peers are optional: a missing one raises :class:`PeerUnavailable` with the
reason, which the benchmark reports instead of crashing.
"""

from __future__ import annotations

import functools
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
    """A prepared peer: ``run()`` makes one inference and returns numpy outputs.

    ``precision`` is the floating-point precision it computes in ("f32", "bf16"; None
    where the peer does not say, as on CUDA); ``settings`` what else it was set to.
    """

    name: str
    detail: str
    version: str
    run: Callable[[], list[np.ndarray]]
    precision: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)


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

    # A float32 model runs in float32 on the CPU provider; the CUDA provider's TF32
    # default is not reported.
    precision = "f32" if device.kind is DeviceKind.CPU else None
    return PeerRunner("onnxruntime", name, ort.__version__, run, precision)


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

    # On the CPU, float32 matmuls run in float32 unless torch was told otherwise
    # (torch.set_float32_matmul_precision); CUDA's TF32 switches are not reported.
    precision = None
    if not cuda:
        matmul = torch.get_float32_matmul_precision()
        precision = "f32" if matmul == "highest" else f"f32, matmul precision {matmul}"
    return PeerRunner("torch", f"eager on {target}", torch.__version__, run, precision)


def _openvino(source: ModelSource, feeds: Mapping[str, np.ndarray], device: Device, *,
              precision: str | None) -> PeerRunner:
    """OpenVINO's CPU plugin; ``precision`` None leaves its default inference precision."""
    name = "openvino" if precision else "openvino-default"
    if device.kind is not DeviceKind.CPU:
        raise PeerUnavailable(f"{name} runs on the CPU only")
    try:
        import openvino as ov
        import openvino.properties as props
        import openvino.properties.hint as hint
    except ImportError:
        raise PeerUnavailable("openvino is not installed (pip install openvino)") from None
    threads = torch.get_num_threads()   # what segflow's kernels run on
    config: dict[Any, Any] = {hint.performance_mode: hint.PerformanceMode.LATENCY,
                              props.inference_num_threads: threads}
    if precision is not None:
        config[hint.inference_precision] = getattr(ov.Type, precision)
    try:
        core = ov.Core()
        model = core.read_model(source.model.SerializeToString(), b"")
        # Static shapes at the feeds' sizes, as segflow's sessions plan at them (dims=):
        # a dynamic dim would compile OpenVINO's shape-agnostic path instead.
        model.reshape({port.get_any_name():
                       ov.PartialShape(list(feeds[port.get_any_name()].shape))
                       for port in model.inputs})
        compiled = core.compile_model(model, "CPU", config)
    except Exception as exc:  # noqa: BLE001 - any failure makes the peer unavailable
        raise PeerUnavailable(f"openvino cannot load the model: "
                              f"{type(exc).__name__}: {str(exc)[:200]}") from None
    used = compiled.get_property(hint.inference_precision).get_type_name()
    request = compiled.create_infer_request()
    inputs = dict(feeds)
    outputs = list(compiled.outputs)

    def run() -> list[np.ndarray]:
        # share_inputs: the feeds are read in place; the outputs come back as copies,
        # as onnxruntime's do.
        result = request.infer(inputs, share_inputs=True)
        return [result[port] for port in outputs]

    settings = {"performance_hint": "LATENCY", "threads": threads,
                "shapes": "static (reshaped to the feeds)",
                "feed": "InferRequest.infer(share_inputs=True)"}
    return PeerRunner(name, f"CPU plugin, {used}", ov.__version__, run, used, settings)


Factory = Callable[[ModelSource, Mapping[str, np.ndarray], Device], PeerRunner]

PEERS: Mapping[str, Factory] = {
    "onnxruntime": _onnxruntime,
    "openvino": functools.partial(_openvino, precision="f32"),
    "openvino-default": functools.partial(_openvino, precision=None),
    "torch": _torch_eager,
}


def prepare_peer(name: str, source: ModelSource, feeds: Mapping[str, np.ndarray],
                 device: Device) -> PeerRunner:
    """Build peer ``name`` for a model; raises :class:`PeerUnavailable` when it cannot run."""
    factory = PEERS.get(name)
    if factory is None:
        raise ValueError(f"unknown peer {name!r}; available: {', '.join(PEERS)}")
    return factory(source, feeds, device)
