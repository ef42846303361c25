"""Exporting the corpus's models to ONNX and keeping them in segflow's cache.

Each entry is one model exported by one exporter (``torchscript``: ``dynamo=False``;
``dynamo``: ``torch.export`` and onnxscript) at one opset, with a dynamic batch axis
(and sequence axis for text models). A file is kept in the ``corpus`` store of the
cache (``$SEGFLOW_CACHE_DIR/corpus/``, :class:`segflow.cache_store.ArtifactStore`):
its name carries a key over the package versions, the model's config, the exporter,
the opset and the inputs, and it is loaded only under the store's trust rules (the
cache and the file owned by this user, not group- or world-writable, its recorded
SHA-256), then checked with ``onnx.checker``. A cache that fails those rules is not
used: the models are built into a private temporary directory, and the manifest
says why. An export that fails is recorded in the manifest with a one-line reason
(and not retried until the key changes or ``rebuild`` is asked for).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import inspect
import io
import json
import os
import re
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from _corpus_models import MODELS, Built, CorpusModel

from segflow.cache_store import ArtifactStore

STORE = "corpus"
MANIFEST = "manifest"          # read back as manifest.json through the store's checks
FORMAT = 2                     # bump when what an export writes changes
OPSETS = (17, 18)
EXPORT_BATCH = 2               # torch.export specializes sizes 0 and 1


class Exporter(enum.Enum):
    TORCHSCRIPT = "torchscript"   # torch.onnx.export(dynamo=False)
    DYNAMO = "dynamo"             # torch.onnx.export(dynamo=True)


@dataclass(frozen=True)
class EntryId:
    model: str
    exporter: Exporter
    opset: int
    small: bool = False

    @property
    def label(self) -> str:
        size = "-small" if self.small else ""
        return f"{self.model}{size}/{self.exporter.value}/op{self.opset}"


@dataclass(frozen=True)
class Entry:
    """One manifest row: where the exported file is, or why there is none."""

    id: EntryId
    key: str
    path: str | None
    failure: str = ""
    nodes: int = 0
    bytes: int = 0
    build_s: float = 0.0
    cached: bool = False
    # The default-domain opset the file declares: the dynamo exporter translates at 18
    # and converts down, and keeps 18 where onnx's version converter has no adapter.
    file_opset: int = 0

    @property
    def note(self) -> str:
        if self.path is None or self.file_opset in (0, self.id.opset):
            return ""
        return f"the file is opset {self.file_opset} (not converted to {self.id.opset})"

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d["id"] = {**asdict(self.id), "exporter": self.id.exporter.value}
        d["label"] = self.id.label
        return d


def versions() -> dict[str, str]:
    import onnxscript
    import transformers

    return {"torch": torch.__version__, "onnx": onnx.__version__,
            "transformers": transformers.__version__, "onnxscript": onnxscript.__version__}


def entries(models: Iterable[str], exporters: Iterable[Exporter] = tuple(Exporter),
            opsets: Iterable[int] = OPSETS, small: bool = False) -> list[EntryId]:
    return [EntryId(m, e, o, small) for m in models for e in exporters for o in opsets]


def cache_key(entry: EntryId, built: Built) -> str:
    """SHA-256 over what decides the exported file's content."""
    model = MODELS[entry.model]
    what = {"format": FORMAT, "versions": versions(), "model": entry.model,
            "small": entry.small, "config": built.config, "exporter": entry.exporter.value,
            "opset": entry.opset, "inputs": [(s.name, dict(s.dynamic)) for s in built.inputs],
            "outputs": list(built.outputs), "export_seq": model.export_seq}
    text = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type, and the first telling line of the innermost
    cause's message (the exporters wrap the error in a banner of next steps)."""
    cause = exc
    while cause.__cause__ is not None and cause.__cause__ is not cause:
        cause = cause.__cause__
    text = _ANSI.sub("", str(cause))
    if "Status Message: " in text:   # onnxruntime: its source location and C++ signature
        head, message = text.rsplit("Status Message: ", 1)
        node = re.search(r"running (\w+) node\. Name:'([^']*)'", head)
        text = (f"{node[1]} {node[2]}: " if node else "") + _ORT_WHERE.sub("", message)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = next((ln for ln in lines if not ln.startswith(("[", "#", "=", "Exception from"))),
                 lines[0] if lines else "")
    kind = type(exc).__name__ if cause is exc else \
        f"{type(exc).__name__} <- {type(cause).__name__}"
    return f"{kind}: {first[:240]}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ORT_WHERE = re.compile(r"^\S+:\d+ .*?\)( const)? ")


def example_args(model: CorpusModel, built: Built) -> tuple[Any, ...]:
    feeds = model.feeds(built, EXPORT_BATCH, model.export_seq)
    return tuple(torch.from_numpy(feeds[s.name]) for s in built.inputs)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporters' progress lines and warnings: kept out of the table."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        yield


def export(entry: EntryId, built: Built, out: Path) -> str:
    """Write the ONNX file to ``out``; '' or why the export failed (one line)."""
    model = MODELS[entry.model]
    args = example_args(model, built)
    names = [s.name for s in built.inputs]
    dynamic = {s.name: dict(s.dynamic) for s in built.inputs}
    dynamic.update({k: dict(v) for k, v in built.output_dynamic.items()})
    try:
        with _quiet():
            if entry.exporter is Exporter.TORCHSCRIPT:
                torch.onnx.export(built.module, args, str(out), dynamo=False,
                                  opset_version=entry.opset, input_names=names,
                                  output_names=list(built.outputs), dynamic_axes=dynamic)
            else:
                program = torch.onnx.export(built.module, args, dynamo=True,
                                            opset_version=entry.opset, input_names=names,
                                            output_names=list(built.outputs),
                                            **_dynamo_dynamic(built, dynamic))
                if program is None:
                    return "the dynamo exporter returned no program"
                program.save(str(out), external_data=False)
    except Exception as exc:  # noqa: BLE001 - an exporter's failure is a row, not a crash
        if os.environ.get("CORPUS_TRACEBACK"):
            traceback.print_exc()
        return one_line(exc)
    return ""


def _dynamo_dynamic(built: Built, dynamic: dict[str, dict[int, str]]) -> dict[str, Any]:
    """The dynamo exporter's dynamic axes: ``dynamic_axes`` (named, as for TorchScript)
    where it can convert them; for a ``forward(*past)`` it cannot (it fails with "Failed
    to convert 'dynamic_axes' to 'dynamic_shapes'"), ``dynamic_shapes`` in the
    signature's structure, each axis ``Dim.AUTO`` (which also finds that the mask is one
    longer than the past)."""
    params = list(inspect.signature(built.module.forward).parameters.values())
    if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return {"dynamic_axes": dynamic}
    specs = [{axis: torch.export.Dim.AUTO for axis in s.dynamic} for s in built.inputs]
    shapes: list[Any] = []
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            shapes.append(tuple(specs[len(shapes):]))
            break
        shapes.append(specs[len(shapes)])
    return {"dynamic_shapes": tuple(shapes)}


def _check(path: Path) -> str:
    try:
        onnx.checker.check_model(str(path))
    except Exception as exc:  # noqa: BLE001
        return f"onnx.checker: {one_line(exc)}"
    return ""


class Corpus:
    """The corpus's store and manifest.

    >>> corpus = Corpus.open()                                             # doctest: +SKIP
    >>> entry = corpus.obtain(EntryId("bert_base", Exporter.DYNAMO, 18))   # doctest: +SKIP
    >>> entry.path, entry.failure                                          # doctest: +SKIP
    """

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store
        self.manifest = self._read_manifest()
        self._built: dict[tuple[str, bool], Built] = {}

    @classmethod
    def open(cls) -> Corpus:
        return cls(ArtifactStore.open(STORE))

    @property
    def distrust(self) -> str:
        """Why the cache's directory is not used ('' when it is)."""
        return self.store.distrust

    def built(self, name: str, small: bool) -> Built:
        """The torch module (built once per process: the bench's eager peer runs it)."""
        if (name, small) not in self._built:
            self._built[(name, small)] = MODELS[name].build(small)
        return self._built[(name, small)]

    def release(self, name: str, small: bool) -> None:
        """Drop a model's torch module (the full corpus would not fit in memory at once)."""
        self._built.pop((name, small), None)

    def obtain(self, entry: EntryId, rebuild: bool = False) -> Entry:
        built = self.built(entry.model, entry.small)
        key = cache_key(entry, built)
        name = f"{entry.model}{'-small' if entry.small else ''}-{entry.exporter.value}" \
               f"-op{entry.opset}-{key[:16]}.onnx"
        known = self.manifest.get(entry.label)
        if not rebuild and known and known.get("key") == key and known.get("failure"):
            return self._remember(Entry(entry, key, None, known["failure"], cached=True))
        start = time.perf_counter()
        got = self.store.obtain(name, lambda out: export(entry, built, out), wait_s=1800,
                                rebuild=rebuild, description={"entry": entry.label, "key": key})
        if got.path is not None:
            problem = _check(got.path)
            if problem and not got.built:   # a cached file that fails the checker: rebuild once
                got = self.store.obtain(name, lambda out: export(entry, built, out),
                                        wait_s=1800, rebuild=True)
                problem = _check(got.path) if got.path is not None else got.failure
            if got.path is not None and not problem:
                proto = onnx.load(str(got.path), load_external_data=False)
                opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
                             0)
                return self._remember(Entry(entry, key, str(got.path), nodes=len(proto.graph.node),
                                            bytes=got.path.stat().st_size,
                                            build_s=time.perf_counter() - start if got.built
                                            else 0.0, cached=not got.built, file_opset=opset))
            failure = problem or got.failure
        else:
            failure = got.failure
        return self._remember(Entry(entry, key, None, failure,
                                    build_s=time.perf_counter() - start))

    # -- the manifest --------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, dict[str, Any]]:
        data = self.store.description(MANIFEST)   # the store's checks, JSON, size-capped
        entries = data.get("entries") if isinstance(data, dict) else None
        return {k: v for k, v in entries.items() if isinstance(v, dict)} \
            if isinstance(entries, dict) else {}

    def _remember(self, entry: Entry) -> Entry:
        self.manifest[entry.id.label] = entry.record()
        self._write_manifest()
        return entry

    def _write_manifest(self) -> None:
        text = json.dumps({"format": FORMAT, "versions": versions(),
                           "store": str(self.store.directory), "distrust": self.distrust,
                           "entries": self.manifest}, sort_keys=True)
        target = self.store.path(MANIFEST + ".json")
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=self.store.directory)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
