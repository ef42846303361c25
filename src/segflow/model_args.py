"""The command line's shared arguments: the parser, number checks, models and their inputs.

``segflow`` (:mod:`segflow.cli`), its ``bench``/``profile`` commands
(:mod:`segflow.bench.cli`) and ``train-demo`` parse with :class:`CliParser`, whose
errors are one line. A model is an ONNX path or ``builtin:NAME``; its inputs are
``--input NAME=VALUE`` (see :func:`parse_input_arg`) and ``--dim NAME=SIZE``. Building
these arguments imports neither torch nor onnx.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from segflow.errors import InvalidInput, SegflowError

if TYPE_CHECKING:
    import onnx

    from segflow.ir.graph import Value
    from segflow.runtime.session import InferenceSession

DEFAULT_MODEL = "builtin:resnet50"

# A symbolic dim no argument sets is guessed from its name (lower case): image sides
# and sequence lengths at the sizes models are commonly exported for (a 1x1 image is
# too small for most convolution stacks), the batch (a batch name, or the first axis)
# at the batch size, anything else at 1.
SIZE_GUESSES: Mapping[str, int] = {
    **dict.fromkeys(("h", "w", "height", "width", "image_height", "image_width"), 224),
    **dict.fromkeys(("seq", "seq_len", "seqlen", "seq_length", "sequence",
                     "sequence_length", "tokens", "num_tokens"), 128),
}
BATCH_NAMES = frozenset({"n", "b", "bs", "batch", "batch_size", "batchsize"})

INPUT_HELP = ("NAME=VALUE, repeatable. VALUE: FILE.npy; rand:1x3x224x224 (random data of "
              "that shape); a number such as 16000 or 0.5 (the input filled with it, in its "
              "dtype: a scalar for a scalar input); a list such as [1,2,3] (quote it). "
              "Inputs not given get random data")
DIM_HELP = ("set a symbolic input dim by name, e.g. --dim N=4 --dim H=224 (repeatable); "
            "dims no --input or --dim sets are guessed (H/W/height/width 224, seq names "
            "128, the batch 1, others 1) and the guess is noted on stderr")


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``segflow: error: ...``, exit 2
    (sub-parsers are made of the same class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"segflow: error: {message}\n")


def _bounded(convert: Callable[[str], Any], what: str,
             accept: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type`` that converts and checks a number, naming what it expected."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


positive_int = _bounded(int, "a positive integer", lambda v: v >= 1)
non_negative_int = _bounded(int, "an integer >= 0", lambda v: v >= 0)
positive_float = _bounded(float, "a number > 0", lambda v: math.isfinite(v) and v > 0)
non_negative_float = _bounded(float, "a number >= 0", lambda v: math.isfinite(v) and v >= 0)


def check_device(text: str) -> str:
    """``text`` if it names a device this torch has, else a one-line SegflowError."""
    from segflow.ir.types import Device, DeviceKind

    try:
        device = Device.parse(text)
    except ValueError as exc:
        raise SegflowError(f"--device: {exc}") from None
    if device.kind is DeviceKind.CUDA:
        import torch

        if not torch.cuda.is_available():
            why = "built without it" if torch.version.cuda is None else "no device found"
            raise SegflowError(f"--device {text}: this torch ({torch.__version__}) has no "
                               f"CUDA ({why}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index >= count:
            raise SegflowError(f"--device {text}: torch sees only {count} CUDA device"
                               f"{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})")
    return text


# -- models -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelArg:
    """A model argument resolved: its label, the model, and what onnxruntime can load."""

    label: str
    proto: onnx.ModelProto
    builtin: str | None = None
    path: str | None = None

    @property
    def reference_source(self) -> str | bytes:
        """The file (read by onnxruntime itself), or a built-in model's bytes."""
        return self.path if self.path is not None else self.proto.SerializeToString()


def resolve_model(model: str | None) -> ModelArg:
    """A path, or ``builtin:NAME`` / a bare built-in name, loaded (one-line errors for a
    missing file, a directory or a file that is not ONNX)."""
    from segflow import models
    from segflow.frontend.onnx_import import load_model

    spec = model or DEFAULT_MODEL
    name = spec.removeprefix("builtin:")
    if spec.startswith("builtin:") or (name in models.available() and not Path(spec).exists()):
        if name not in models.available():
            raise SegflowError(f"unknown built-in model {name!r}; available: "
                               f"{', '.join(models.available())}")
        return ModelArg(f"builtin:{name}", models.build(name), builtin=name)
    return ModelArg(spec, load_model(spec), path=spec)


# -- inputs -------------------------------------------------------------------------------
class InputKind(enum.Enum):
    FILE = "file"
    RANDOM = "rand"
    NUMBER = "number"
    LIST = "list"


@dataclass(frozen=True, slots=True)
class InputArg:
    """One ``--input NAME=VALUE``, its syntax checked (the model checks the rest)."""

    text: str
    name: str
    kind: InputKind
    value: Any      # FILE: the path; RANDOM: the shape; NUMBER: the number; LIST: the lists


def parse_input_arg(text: str) -> InputArg:
    """``NAME=FILE.npy``, ``NAME=rand:1x3x224x224``, ``NAME=16000`` / ``NAME=0.5`` or
    ``NAME=[1,2,3]``. A value that reads as a number is one (write ``./16000`` for a
    file named so)."""
    name, sep, source = text.partition("=")
    if not sep or not name or not source:
        raise SegflowError(f"--input {text!r}: expected NAME=VALUE, VALUE one of FILE.npy, "
                           "rand:DIMS, a number or a [list]")
    if source.startswith("rand:"):
        dims = source.removeprefix("rand:")
        try:
            shape = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            shape = (-1,)
        if any(d < 0 for d in shape):
            raise SegflowError(f"--input {text!r}: bad dims {dims!r}, expected sizes "
                               "joined by x, e.g. 1x3x224x224")
        return InputArg(text, name, InputKind.RANDOM, shape)
    if source.startswith("["):
        try:   # json gives nested lists; numpy refuses ragged ones
            values = json.loads(source)
            array = np.array(values) if isinstance(values, list) else None
        except ValueError:
            array = None
        if array is None or array.dtype.kind not in "biuf":
            raise SegflowError(f"--input {text!r}: expected a list of numbers such as "
                               "[1,2,3] or [[1,2],[3,4]] (same length rows)")
        return InputArg(text, name, InputKind.LIST, values)
    number = _number(source)
    if number is not None:
        return InputArg(text, name, InputKind.NUMBER, number)
    return InputArg(text, name, InputKind.FILE, source)


def _number(text: str) -> int | float | bool | None:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for convert in (int, float):
        try:
            return convert(text)  # type: ignore[no-any-return]
        except ValueError:
            pass
    return None


def parse_dim_arg(text: str) -> tuple[str, int]:
    """``--dim NAME=SIZE`` -> (NAME, SIZE)."""
    name, sep, size = text.partition("=")
    if not sep or not name or not size.strip().isdigit():
        raise SegflowError(f"--dim {text!r}: expected NAME=SIZE with SIZE an integer >= 0, "
                           "e.g. --dim H=224")
    return name, int(size)


@dataclass(frozen=True, slots=True)
class Feeds:
    """A model's feeds, the symbolic dims they bind, and those that were guessed."""

    arrays: dict[str, np.ndarray]
    dims: dict[str, int]
    guessed: dict[str, int]

    def note(self) -> str | None:
        """The line saying which dims were guessed and how to set them (None: none were)."""
        if not self.guessed:
            return None
        # The example --dim names a dim guessed above 1 where there is one (not the batch).
        named = sorted((name for name in self.guessed if name in self.dims),
                       key=lambda name: self.guessed[name] == 1)
        example = next((f"--input {name}=rand:{'x'.join(map(str, a.shape))}"
                        for name, a in self.arrays.items() if a.ndim), "--input NAME=rand:DIMS")
        how = f"{example} or --dim {named[0]}={self.guessed[named[0]]}" if named else example
        guessed = ", ".join(f"{k}={v}" for k, v in self.guessed.items())
        return f"note: symbolic dims guessed: {guessed} (set them with {how})"

    def describe(self) -> str:
        return ", ".join(f"{name} {a.dtype}{list(a.shape)}" for name, a in self.arrays.items())


def make_feeds(inputs: Sequence[Value], given: Sequence[InputArg],
               dims: Mapping[str, int] | None = None, *, seed: int = 0,
               batch_size: int | None = None,
               examples: Mapping[str, np.ndarray] | None = None) -> Feeds:
    """Feeds for the model ``inputs`` (declared specs): the ``--input`` values, then random
    data for the rest, at the symbolic dims ``dims`` set, those the given feeds bind, and
    guesses for the others (:data:`SIZE_GUESSES`; a built-in model's ``examples`` size its
    dims instead). ``batch_size`` sets the batch dims (a batch name, or the first axis);
    None guesses them at 1. A built-in model given neither inputs nor dims runs on
    ``examples``.
    Every mismatch with the model is a one-line :class:`SegflowError`."""
    from segflow.runtime.feeds import check_feed

    for value in inputs:
        if value.container is not None:
            raise SegflowError(f"input {value.name!r} is {value.describe()}: the command "
                               "line makes tensor inputs only (feed it from Python: "
                               "InferenceSession.run takes a list or None)")
    dims = dict(dims or {})
    by_name = {v.name: v for v in inputs}
    symbols: dict[str, tuple[int, str]] = {}
    defaults: dict[str, tuple[int, str]] = {}   # the dims a built-in model's examples bind
    if examples is not None:
        for value in inputs:
            check_feed(value, examples[value.name], defaults)
        if not given and not dims:
            return Feeds({v.name: examples[v.name] for v in inputs},
                         {k: size for k, (size, _) in defaults.items()}, {})
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    numbers: dict[str, InputArg] = {}
    for arg in given:
        target = by_name.get(arg.name)
        if target is None:
            raise SegflowError(f"--input {arg.text!r}: the model has no input {arg.name!r} "
                               f"(inputs: {', '.join(by_name) or 'none'})")
        if arg.name in arrays or arg.name in numbers:
            raise SegflowError(f"--input {arg.text!r}: input {arg.name!r} is given twice")
        if arg.kind is InputKind.NUMBER:
            numbers[arg.name] = arg
            continue
        array = _given_array(arg, target, rng)
        try:
            check_feed(target, array, symbols)
        except InvalidInput as exc:
            raise SegflowError(f"--input {arg.text!r}: {exc}") from None
        arrays[arg.name] = array
    symbolic = list(dict.fromkeys(d for v in inputs for d in (v.spec.shape or ())
                                  if isinstance(d, str)))
    for name, size in dims.items():
        if name not in symbolic:
            raise SegflowError(f"--dim {name}={size}: the model's inputs have no symbolic dim "
                               f"{name!r} (symbolic dims: {', '.join(symbolic) or 'none'})")
        bound = symbols.get(name)
        if bound is not None and bound[0] != size:
            raise SegflowError(f"--dim {name}={size}: --input {bound[1]} has {name}={bound[0]}")
    sizes = {**{k: size for k, (size, _) in symbols.items()}, **dims}
    guessed: dict[str, int] = {}
    for value in inputs:
        if value.name in arrays:
            continue
        shape = []
        for axis, dim in enumerate(value.spec.shape or ()):
            if isinstance(dim, int):
                shape.append(dim)
            elif isinstance(dim, str):
                if dim in defaults and dim not in sizes:   # a built-in model's own size
                    sizes[dim] = defaults[dim][0]
                elif dim not in sizes:
                    sizes[dim] = _guess(dim, axis, batch_size or 1)
                    if batch_size is None or not _is_batch(dim, axis):
                        guessed[dim] = sizes[dim]
                shape.append(sizes[dim])
            else:   # an unnamed dim: only --input sets it
                size = _guess("", axis, batch_size or 1)
                guessed[f"{value.name}[{axis}]"] = size
                shape.append(size)
        number = numbers.get(value.name)
        arrays[value.name] = (_filled(number, value, shape) if number is not None
                              else _random(value, shape, rng))
    return Feeds({v.name: arrays[v.name] for v in inputs}, sizes, guessed)


def _is_batch(name: str, axis: int) -> bool:
    return name.lower() not in SIZE_GUESSES and (name.lower() in BATCH_NAMES or axis == 0)


def _guess(name: str, axis: int, batch_size: int) -> int:
    if name.lower() in SIZE_GUESSES:
        return SIZE_GUESSES[name.lower()]
    return batch_size if _is_batch(name, axis) else 1


def _dtype(value: Value) -> np.dtype[Any]:
    dtype = value.spec.dtype
    return dtype.numpy if dtype is not None else np.dtype(np.float32)


def _given_array(arg: InputArg, value: Value, rng: np.random.Generator) -> np.ndarray:
    if arg.kind is InputKind.RANDOM:
        return _random(value, list(arg.value), rng)
    if arg.kind is InputKind.LIST:
        return _cast(np.array(arg.value), value, arg)
    path = Path(arg.value)
    if not path.is_file():
        raise SegflowError(f"--input {arg.text!r}: file not found: {path}"
                           if not path.exists() else f"--input {arg.text!r}: not a file: {path}")
    try:
        return np.load(path, allow_pickle=False)  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - any reason numpy cannot read it is reported
        raise SegflowError(f"--input {arg.text!r}: cannot read {path} as .npy: "
                           f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                           ) from None


def _cast(array: np.ndarray, value: Value, arg: InputArg) -> np.ndarray:
    """``array`` in the input's dtype, refusing what that dtype cannot hold exactly."""
    dtype = _dtype(value)
    if dtype.kind in "iub" and array.dtype.kind == "f" and not np.all(np.mod(array, 1) == 0):
        raise SegflowError(f"--input {arg.text!r}: input {value.name!r} is {dtype}, "
                           "which holds no fractions")
    if dtype.kind == "b" and not np.all((array == 0) | (array == 1)):
        raise SegflowError(f"--input {arg.text!r}: input {value.name!r} is bool: "
                           "expected 0, 1, true or false")
    if dtype.kind == "u" and np.any(array < 0):
        raise SegflowError(f"--input {arg.text!r}: input {value.name!r} is {dtype}, "
                           "which holds no negative numbers")
    return array.astype(dtype)


def _filled(arg: InputArg, value: Value, shape: list[int]) -> np.ndarray:
    return np.full(shape, _cast(np.array(arg.value), value, arg), dtype=_dtype(value))


def _random(value: Value, dims: list[int], rng: np.random.Generator) -> np.ndarray:
    dtype = _dtype(value)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(dims).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, dims).astype(bool)
    if value.name.endswith("mask"):
        return np.ones(dims, dtype=dtype)
    return rng.integers(0, 100, dims).astype(dtype)


def checksum(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:12]


# -- sessions -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OpenedModel:
    """A model argument loaded into a session, with the feeds its arguments give."""

    model: ModelArg
    session: InferenceSession
    feeds: Feeds

    @property
    def label(self) -> str:
        return self.model.label


def model_feeds(model: ModelArg, given: Sequence[InputArg], dims: Mapping[str, int], *,
                seed: int = 0) -> Feeds:
    """The feeds the parsed ``--input``/``--dim`` give ``model`` (random data for the rest)."""
    from segflow import models
    from segflow.frontend.onnx_import import declared_inputs

    examples = (models.example_inputs(model.builtin, seed=seed)
                if model.builtin is not None else None)
    return make_feeds(declared_inputs(model.proto), given, dims, seed=seed, examples=examples)


def open_model(args: argparse.Namespace) -> OpenedModel:
    """Check the device, load the model, make its feeds (noting guessed dims on stderr)
    and open a session that plans memory at the feeds' dims."""
    import segflow

    device = check_device(args.device)
    # Parsed before the model loads: bad syntax fails before a large model is read.
    given = [parse_input_arg(text) for text in args.input]
    dims = dict(parse_dim_arg(text) for text in args.dim)
    model = resolve_model(args.model)
    feeds = model_feeds(model, given, dims, seed=args.seed)
    note = feeds.note()
    if note is not None:
        print(note, file=sys.stderr)
    bulk = None if getattr(args, "bulk", None) is None else args.bulk == "on"
    sess = segflow.InferenceSession(model.proto, device=device, bulk=bulk,
                                    engine=getattr(args, "engine", None),
                                    compile=getattr(args, "compile", None),
                                    intra_op_threads=getattr(args, "threads", None),
                                    host_memory=getattr(args, "host_memory", None),
                                    dims=feeds.dims)
    return OpenedModel(model, sess, feeds)


def add_input_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    """``--input`` and ``--dim`` (and ``--seed``)."""
    p.add_argument("--input", action="append", default=[], metavar="NAME=VALUE",
                   help=INPUT_HELP + " (a built-in model given none runs on its example "
                        "inputs: a transformer's at sequence 128)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE", help=DIM_HELP)
    if seed:
        p.add_argument("--seed", type=non_negative_int, default=0,
                       help="seed for random or example inputs (0)")


def add_model_args(p: argparse.ArgumentParser) -> None:
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
    add_input_args(p)
