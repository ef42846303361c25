"""onnxruntime's execution providers, as segflow devices.

A provider list picks the device a session runs on: ``CUDAExecutionProvider`` (its
``device_id`` option) is ``cuda:N``, ``CPUExecutionProvider`` is ``cpu``. The first
available provider in the list wins, as in onnxruntime; a provider segflow does not
know, or CUDA where torch sees no GPU, is dropped with the warning onnxruntime gives,
and a list left empty runs on the CPU. A session always reports the CPU provider
last: onnxruntime's fallback for nodes another provider does not take.

>>> resolve_providers(["CUDAExecutionProvider", "CPUExecutionProvider"]).device  # doctest: +SKIP
Device(kind=<DeviceKind.CUDA: 'cuda'>, index=0)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from segflow.errors import InvalidSetting
from segflow.ir.types import Device, DeviceKind

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
# The providers segflow runs (onnxruntime's order of preference: the GPU first).
PROVIDER_DEVICES = {CUDA_PROVIDER: DeviceKind.CUDA, CPU_PROVIDER: DeviceKind.CPU}

ProviderSpec = str | tuple[str, Mapping[str, Any]]


def get_available_providers() -> list[str]:
    """The providers this machine can run, most preferred first, as onnxruntime lists
    them: ``['CUDAExecutionProvider', 'CPUExecutionProvider']`` where torch sees a GPU."""
    import torch  # here, not at import: ``import segflow`` stays free of torch

    return [CUDA_PROVIDER, CPU_PROVIDER] if torch.cuda.is_available() else [CPU_PROVIDER]


def get_all_providers() -> list[str]:
    """Every provider segflow can map to a device (whether or not this machine has it)."""
    return list(PROVIDER_DEVICES)


def get_device() -> str:
    """``"GPU"`` where a GPU is available, else ``"CPU"`` (onnxruntime's build device)."""
    return "GPU" if CUDA_PROVIDER in get_available_providers() else "CPU"


@dataclass(frozen=True, slots=True)
class ProviderChoice:
    """The device a provider list chose, and what ``get_providers`` /
    ``get_provider_options`` report for it."""

    device: Device
    providers: tuple[str, ...]
    options: Mapping[str, Mapping[str, str]]


def resolve_providers(providers: Sequence[ProviderSpec] | None,
                      provider_options: Sequence[Mapping[str, Any]] | None = None, *,
                      available: Sequence[str] | None = None) -> ProviderChoice | None:
    """The device ``providers`` pick (None: no providers given, the caller decides)."""
    if providers is None:
        if provider_options is not None:
            raise InvalidSetting("provider_options given without providers")
        return None
    if isinstance(providers, str):
        raise InvalidSetting(f"providers={providers!r}: expected a list of provider names")
    named = _normalize(providers, provider_options)
    usable = get_available_providers() if available is None else list(available)
    for name, _ in named:
        if name not in usable:
            # onnxruntime's words, so that logs read the same under either runtime.
            warnings.warn(f"Specified provider '{name}' is not in available provider names."
                          f"Available providers: '{', '.join(usable)}'", stacklevel=3)
    chosen = [(name, options) for name, options in named if name in usable]
    if not chosen or PROVIDER_DEVICES[chosen[0][0]] is DeviceKind.CPU:
        return providers_for(Device(DeviceKind.CPU))
    name, options = chosen[0]
    index = _device_id(name, options)
    return ProviderChoice(Device(DeviceKind.CUDA, index), (name, CPU_PROVIDER),
                          {name: {**{k: str(v) for k, v in options.items()},
                                  "device_id": str(index)}, CPU_PROVIDER: {}})


def providers_for(device: Device) -> ProviderChoice:
    """What a session placed by ``device=`` reports as its providers."""
    if device.kind is DeviceKind.CUDA:
        return ProviderChoice(device, (CUDA_PROVIDER, CPU_PROVIDER),
                              {CUDA_PROVIDER: {"device_id": str(device.index)},
                               CPU_PROVIDER: {}})
    return ProviderChoice(device, (CPU_PROVIDER,), {CPU_PROVIDER: {}})


def _normalize(providers: Sequence[ProviderSpec],
               provider_options: Sequence[Mapping[str, Any]] | None
               ) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, options) pairs from names, ``(name, options)`` tuples and a parallel
    ``provider_options`` list (onnxruntime's three spellings)."""
    if provider_options is not None and len(provider_options) != len(providers):
        raise InvalidSetting(f"provider_options has {len(provider_options)} entries for "
                             f"{len(providers)} providers; give one dict per provider")
    named: list[tuple[str, Mapping[str, Any]]] = []
    for i, spec in enumerate(providers):
        if isinstance(spec, tuple):
            if len(spec) != 2 or not isinstance(spec[0], str) or not isinstance(spec[1], Mapping):
                raise InvalidSetting(f"providers[{i}]={spec!r}: expected a name or a "
                                     "(name, options dict) tuple")
            if provider_options is not None:
                raise InvalidSetting("providers holds (name, options) tuples and "
                                     "provider_options is given too; use one of the two")
            named.append((spec[0], spec[1]))
        elif isinstance(spec, str):
            named.append((spec, provider_options[i] if provider_options is not None else {}))
        else:
            raise InvalidSetting(f"providers[{i}]={spec!r}: expected a provider name")
    names = [name for name, _ in named]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidSetting(f"provider {duplicate!r} is listed more than once")
    return named


def _device_id(name: str, options: Mapping[str, Any]) -> int:
    value = options.get("device_id", 0)
    try:
        index = int(value)
    except (TypeError, ValueError):
        index = -1
    if index < 0:
        raise InvalidSetting(f"{name} option device_id={value!r}: expected a GPU index (0, 1, ...)")
    return index
