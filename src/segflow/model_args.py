"""The command line's model and input arguments, shared by every subcommand that runs a model.

``segflow`` (:mod:`segflow.cli`) and its ``bench``/``profile`` commands
(:mod:`segflow.bench.cli`) both name a model as an ONNX path or ``builtin:NAME`` and its
inputs as ``NAME=FILE.npy`` / ``NAME=rand:DIMS``; building these arguments imports neither
torch nor onnx.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from segflow.errors import SegflowError

DEFAULT_MODEL = "builtin:resnet50"


def load_model_arg(model: str | None):  # type: ignore[no-untyped-def]
    """A path, or ``builtin:NAME`` / a bare built-in name -> (ModelProto or path, label)."""
    from segflow import models

    spec = model or DEFAULT_MODEL
    name = spec.removeprefix("builtin:")
    if spec.startswith("builtin:") or (name in models.available() and not Path(spec).exists()):
        if name not in models.available():
            raise SegflowError(f"unknown built-in model {name!r}; available: "
                               f"{', '.join(models.available())}")
        return models.build(name), f"builtin:{name}"
    return spec, spec


def parse_inputs(specs: Sequence[str], sess, seed: int = 0,  # type: ignore[no-untyped-def]
                 label: str | None = None) -> dict[str, np.ndarray]:
    """``NAME=FILE.npy`` or ``NAME=rand:1x3x224x224``; unnamed inputs get random data.

    A built-in model (``label`` ``builtin:NAME``) given no ``--input`` runs on its own
    example inputs (``segflow.models.example_inputs``: a transformer's at sequence 128), not on
    random data with every symbolic dimension 1.
    """
    if not specs and label is not None and label.startswith("builtin:"):
        from segflow import models

        return models.example_inputs(label.removeprefix("builtin:"), batch_size=1, seed=seed)
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    inputs = {arg.name: arg for arg in sess.get_inputs()}
    for item in specs:
        name, sep, source = item.partition("=")
        if not sep:
            raise SegflowError(f"--input {item!r}: expected NAME=FILE.npy or NAME=rand:DIMS")
        if name not in inputs:
            raise SegflowError(f"--input {item!r}: the model has no input {name!r} "
                               f"(inputs: {', '.join(inputs)})")
        if source.startswith("rand:"):
            try:
                dims = [int(d) for d in source[5:].split("x")]
            except ValueError:
                raise SegflowError(f"--input {item!r}: bad dims {source[5:]!r}, "
                                   "expected e.g. 1x3x224x224") from None
            feeds[name] = _random(inputs[name], dims, rng)
        else:
            path = Path(source)
            if not path.exists():
                raise SegflowError(f"--input {item!r}: file not found: {path}")
            try:
                feeds[name] = np.load(path, allow_pickle=False)
            except Exception as exc:
                raise SegflowError(f"--input {item!r}: cannot read {path}: {exc}") from None
    for name, arg in inputs.items():
        if name not in feeds:
            dims = [d if isinstance(d, int) else 1 for d in arg.shape]
            feeds[name] = _random(arg, dims, rng)
    return feeds


def _random(arg, dims: list[int], rng: np.random.Generator) -> np.ndarray:  # type: ignore[no-untyped-def]
    dtype = arg.dtype.numpy if arg.dtype is not None else np.dtype(np.float32)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(dims).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, dims).astype(bool)
    if arg.name.endswith("mask"):
        return np.ones(dims, dtype=dtype)
    return rng.integers(0, 100, dims).astype(dtype)


def checksum(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:12]


def open_session(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import segflow

    model, label = load_model_arg(args.model)
    bulk = None if getattr(args, "bulk", None) is None else args.bulk == "on"
    sess = segflow.InferenceSession(model, device=args.device, bulk=bulk,
                                    engine=getattr(args, "engine", None),
                                    compile=getattr(args, "compile", None),
                                    intra_op_threads=getattr(args, "threads", None),
                                    host_memory=getattr(args, "host_memory", None))
    return sess, label


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_model_args(p: argparse.ArgumentParser, with_inputs: bool = True) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="ONNX file, or builtin:NAME (default: builtin:resnet50)")
    p.add_argument("--device", default="cpu", help="cpu, cpu:N or cuda:N (default: cpu)")
    p.add_argument("--engine", choices=["auto", "inline", "threaded"], default=None,
                   help="dependency engine (default: $SEGFLOW_ENGINE or auto: threaded "
                        "when the plan spans devices, inline otherwise)")
    p.add_argument("--bulk", choices=["on", "off"], default=None,
                   help="bulk segments (default: $SEGFLOW_BULK_INFERENCE or on)")
    p.add_argument("--compile", choices=["auto", "codegen", "onednn", "inductor", "none"],
                   default=None,
                   help="segment backend (default: $SEGFLOW_COMPILE or auto: codegen, with "
                        "convolutions called straight into libdnnl on CPU (onednn for "
                        "depthwise graphs where libdnnl is missing), and a small segment's "
                        "inductor package when one is cached)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch intra-op threads (default: $SEGFLOW_INTRA_OP_THREADS, "
                        "else $OMP_NUM_THREADS or the core count)")
    p.add_argument("--host-memory", choices=["retain", "system"], default=None,
                   help="on CPU, keep a run's freed activation memory for the next run "
                        "(retain) or leave malloc's policy alone (system); default: "
                        "$SEGFLOW_HOST_MEMORY or retain")
    p.add_argument("--no-progress", action="store_true",
                   help="draw no progress display for long steps (inductor compiles, the "
                        "native kernels' build) on stderr; it is drawn only on a terminal")
    if with_inputs:
        p.add_argument("--input", action="append", default=[], metavar="NAME=SRC",
                       help="NAME=FILE.npy or NAME=rand:1x3x224x224 (repeatable); "
                            "inputs not given get random data (symbolic dimensions 1), "
                            "and a built-in model given none runs on its example inputs "
                            "(a transformer's at sequence 128)")
        p.add_argument("--seed", type=int, default=0,
                       help="seed for random or example inputs")
