"""What a cached artifact is, for people: the JSON description kept beside it.

An artifact's file name is a digest of everything it depends on, which says nothing
to whoever lists the cache (``segflow cache --list``). So when segflow installs an
artifact it writes ``<name>.json`` beside it (:meth:`segflow.cache_store.ArtifactStore.obtain`):

- an inductor package (:class:`PackageDescription`): the model it was compiled from
  (its graph's name, the path it was loaded from, a digest of its ONNX bytes), the
  segment (index, first and last node), the input shapes and dtypes, the device and
  the torch and segflow versions;
- a native kernel build (:class:`NativeBuildDescription`): the compiler, its flags
  and the CPU.

The store adds ``created``, the time it installed the artifact.

A description is data, never code, and is read as untrusted: the store opens it only
under the same checks as the artifact (not a link, owned by this user, not writable by
group or others; :mod:`segflow.cache_store`) and reads at most
``cache_store.DESCRIPTION_MAX_BYTES``; :meth:`PackageDescription.parse` then takes
only fields of the expected types and lengths, with control characters removed (a
description is printed on a terminal). Anything else, and an artifact written before
descriptions were, lists as ``(no description)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1          # bump when a description's fields change meaning
MAX_TEXT = 200      # characters kept of any one string field
MAX_INPUTS = 64     # input signatures kept of a package
MAX_RANK = 16


@dataclass(frozen=True, slots=True)
class ModelLabel:
    """Which model a package was compiled from, as far as a person can tell."""

    name: str      # the ONNX graph's name
    source: str    # the path it was loaded from ('' for bytes or a ModelProto)
    digest: str    # the first 12 hex digits of its ONNX bytes' SHA-256 ('' when unknown)

    @classmethod
    def of(cls, model: object, name: str) -> ModelLabel:
        """The label of ``model`` (a path, ONNX bytes or a ModelProto) whose graph is
        ``name``. Hashes the whole model: made only where a package may be written
        (compile=inductor), where the compile costs far more."""
        source, digest = "", ""
        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            with contextlib.suppress(OSError), open(source, "rb") as f:
                hasher = hashlib.sha256()
                while chunk := f.read(1 << 20):
                    hasher.update(chunk)
                digest = hasher.hexdigest()[:12]
        elif isinstance(model, bytes):
            digest = hashlib.sha256(model).hexdigest()[:12]
        else:
            serialize = getattr(model, "SerializeToString", None)
            with contextlib.suppress(Exception):   # over protobuf's 2 GiB: no digest
                digest = hashlib.sha256(serialize()).hexdigest()[:12] if serialize else ""
        return cls(name, source, digest)

    def describe(self) -> str:
        """``mlp_chain (onnx 1a2b3c4d5e6f)``, ``main (model.onnx, onnx 1a2b3c4d5e6f)``."""
        facts = [f for f in (Path(self.source).name if self.source else "",
                             f"onnx {self.digest}" if self.digest else "") if f]
        return f"{self.name or '?'} ({', '.join(facts)})" if facts else self.name or "?"

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "source": self.source, "digest": self.digest}


@dataclass(frozen=True, slots=True)
class InputSignature:
    """One input a package was compiled for."""

    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class PackageDescription:
    """An inductor package's description (see the module docstring)."""

    model: ModelLabel
    segment: int                 # the segment's index in the plan (explain's ``#``)
    first: str                   # its first and last node
    last: str
    nodes: int
    inputs: tuple[InputSignature, ...]
    device: str
    torch: str
    segflow: str
    created: float = 0.0         # set by the store when it installs the package

    def to_json(self) -> dict[str, Any]:
        """The JSON object to write (without ``created``: the store adds it)."""
        return {"format": FORMAT, "kind": "aoti", "model": self.model.to_json(),
                "segment": {"index": self.segment, "first": self.first, "last": self.last,
                            "nodes": self.nodes},
                "inputs": [{"dtype": s.dtype, "shape": list(s.shape)} for s in self.inputs],
                "device": self.device, "torch": self.torch, "segflow": self.segflow}

    @classmethod
    def parse(cls, data: object) -> PackageDescription | None:
        """The description in ``data`` (a decoded JSON value), or None when it is not one."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT \
                or data.get("kind") != "aoti":
            return None
        model, segment, inputs = data.get("model"), data.get("segment"), data.get("inputs")
        if not isinstance(model, Mapping) or not isinstance(segment, Mapping) \
                or not isinstance(inputs, list) or len(inputs) > MAX_INPUTS:
            return None
        signatures = [_signature(item) for item in inputs]
        index, nodes = _count(segment.get("index")), _count(segment.get("nodes"))
        created = _time(data.get("created"))
        texts = [_text(v) for v in (model.get("name"), model.get("source"), model.get("digest"),
                                    segment.get("first"), segment.get("last"),
                                    data.get("device"), data.get("torch"), data.get("segflow"))]
        if None in signatures or index is None or nodes is None or created is None \
                or any(t is None for t in texts):
            return None
        name, source, digest, first, last, device, torch_version, segflow_version = \
            (t or "" for t in texts)
        return cls(ModelLabel(name, source, digest), index, first, last, nodes,
                   tuple(s for s in signatures if s is not None), device, torch_version,
                   segflow_version, created)

    def describe(self) -> str:
        """One line for ``segflow cache --list`` (without size and age)."""
        span = self.first if self.first == self.last else f"{self.first} .. {self.last}"
        count = f" ({self.nodes} nodes)" if self.nodes > 1 else ""
        inputs = ", ".join(s.describe() for s in self.inputs) or "no inputs"
        return (f"{self.model.describe()}  segment {self.segment}: {span}{count}  "
                f"inputs {inputs}  {self.device}, torch {self.torch}")


@dataclass(frozen=True, slots=True)
class NativeBuildDescription:
    """A native kernel build's description (see the module docstring)."""

    compiler: str      # the compiler's first ``--version`` line
    flags: str
    cpu: str
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "kind": "native", "compiler": self.compiler,
                "flags": self.flags, "cpu": self.cpu}

    @classmethod
    def parse(cls, data: object) -> NativeBuildDescription | None:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT \
                or data.get("kind") != "native":
            return None
        texts = [_text(data.get(k)) for k in ("compiler", "flags", "cpu")]
        created = _time(data.get("created"))
        if created is None or any(t is None for t in texts):
            return None
        compiler, flags, cpu = (t or "" for t in texts)
        return cls(compiler, flags, cpu, created)

    def describe(self) -> str:
        return f"{self.compiler}, {self.flags}  {self.cpu}"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8",
                                            errors="replace") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine()


def input_signatures(shapes: Sequence[tuple[Sequence[int], str]]) -> tuple[InputSignature, ...]:
    """``(shape, dtype)`` pairs as signatures (dtypes without torch's ``torch.`` prefix)."""
    return tuple(InputSignature(dtype.removeprefix("torch."), tuple(int(d) for d in shape))
                 for shape, dtype in shapes)


def age(seconds: float) -> str:
    """How long ago, for a person: ``just now``, ``5 min ago``, ``3 h ago``, ``2 days ago``."""
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def date(timestamp: float) -> str:
    """A local date and time for a person: ``2026-05-09 14:03``."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


# -- validation ---------------------------------------------------------------------------
def _text(value: object) -> str | None:
    """A string field, shortened and without control characters; None if not a string."""
    if not isinstance(value, str):
        return None
    return "".join(c if c.isprintable() else "?" for c in value[:MAX_TEXT])


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def _time(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e11
    return float(value) if ok else None   # type: ignore[arg-type]


def _signature(item: object) -> InputSignature | None:
    if not isinstance(item, Mapping):
        return None
    dtype, shape = _text(item.get("dtype")), item.get("shape")
    if dtype is None or not isinstance(shape, list) or len(shape) > MAX_RANK:
        return None
    dims = [_count(d) for d in shape]
    if any(d is None for d in dims):
        return None
    return InputSignature(dtype, tuple(d for d in dims if d is not None))
