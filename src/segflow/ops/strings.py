"""String tensors: the string ops, and the string forms of the general ops.

A string value is a numpy object array of ``str`` on the host; it never becomes a torch
tensor. Every node that reads or writes one runs as a LOCAL host task over these arrays
(``OpRegistry.resolve`` picks the rows of :data:`STRING_FORMS` for the general ops); the
numeric values such a node reads arrive as tensors and the ones it writes leave as tensors
on the node's device. onnx's reference implementation (``onnx/reference/ops``) is the
spec; where onnxruntime differs from it on what the node suite leaves open (Cast's number
formatting, StringNormalizer's stopwords and accents, StringSplit of an empty string),
onnxruntime's behaviour is the one followed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from segflow.engine.base import ExecType
from segflow.errors import InvalidInput, InvalidModel, UnsupportedOp
from segflow.ir.graph import Node
from segflow.ir.types import DType
from segflow.ops._common import normalize_axis
from segflow.ops.registry import BindContext, Kernel, OpDef

Host = np.ndarray
ML_DOMAIN = "ai.onnx.ml"
_BFLOAT16 = DType.BFLOAT16.numpy


def string_array(data: Any) -> Host:
    """``data`` (str/bytes/object array-like) as an object array of ``str``.

    >>> string_array(np.array([b"a", "b"], dtype=object)).tolist()
    ['a', 'b']
    """
    array = np.asarray(data)
    if array.dtype.kind == "U" or array.dtype == object and all(
            type(s) is str for s in array.flat):
        return array.astype(object)
    out = np.empty(array.shape, dtype=object)
    for index, item in np.ndenumerate(array):
        out[index] = item.decode("utf-8") if isinstance(item, bytes) else str(item)
    return out


def _host(value: Any) -> Host:
    """An input as a numpy array: string arrays as they are, tensors copied to the host."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:  # numpy reads no torch bfloat16
            return value.detach().cpu().view(torch.uint16).numpy().view(_BFLOAT16)
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _tensor(array: Host, device: torch.device) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    if array.dtype == _BFLOAT16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


def _hosted(bind: Callable[[Node], Callable[[list[Any]], list[Any]]]) -> Callable[
        [Node, BindContext], Kernel]:
    """An OpDef ``bind`` from a host kernel: inputs as numpy arrays (None kept), numeric
    outputs back as tensors on the node's device, string outputs as object arrays."""
    def bind_node(node: Node, ctx: BindContext) -> Kernel:
        kernel = bind(node)
        device = ctx.device

        def run(inputs: Sequence[Any]) -> list[Any]:
            arrays = [None if x is None else _host(x) for x in inputs]
            outputs = kernel(arrays)
            return [out if out.dtype == object else _tensor(out, device) for out in outputs]
        return run
    return bind_node


def _ints(array: Host | None) -> list[int]:
    return [] if array is None else [int(v) for v in array.reshape(-1)]


# -- string ops ------------------------------------------------------------------------------
def _simple_upper(c: str) -> str:
    # Python maps by Unicode's full case mapping ("ß" -> "SS"); onnxruntime's towupper
    # by the simple one, which for these few characters is their titlecase where that is
    # one character ("ᾳ" -> "ᾼ") and none otherwise ("ß" stays).
    full = c.upper()
    if len(full) == 1:
        return full
    title = c.title()
    return title if len(title) == 1 else c


def _simple_lower(c: str) -> str:
    full = c.lower()
    return full if len(full) == 1 else full[0]   # "İ" -> "i̇": the simple mapping is "i"


def _upper(text: str) -> str:
    return "".join(map(_simple_upper, text))


def _lower(text: str) -> str:
    return "".join(map(_simple_lower, text))


def _string_normalizer(node: Node) -> Callable[[list[Any]], list[Any]]:
    """onnxruntime's StringNormalizer: stopwords are whole elements (compared case-folded
    unless ``is_case_sensitive``), removed before the case change; case maps by Unicode
    whatever the ``locale`` (onnxruntime's in any UTF-8 locale), accents kept."""
    action = str(node.attrs.get("case_change_action", "NONE"))
    if action not in ("NONE", "LOWER", "UPPER"):
        raise InvalidModel(f"{node.label}: case_change_action must be NONE, LOWER or UPPER, "
                           f"got {action!r}")
    sensitive = bool(int(node.attrs.get("is_case_sensitive", 0)))
    change: Callable[[str], str] = {"NONE": lambda s: s, "LOWER": _lower,
                                    "UPPER": _upper}[action]
    fold: Callable[[str], str] = (lambda s: s) if sensitive else _lower
    stops = {fold(str(w)) for w in node.attrs.get("stopwords", [])}

    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        if x.ndim not in (1, 2) or x.ndim == 2 and x.shape[0] != 1:
            raise InvalidInput(f"{node.label}: StringNormalizer takes [C] or [1, C] strings, "
                               f"got shape {list(x.shape)}")
        kept = [change(s) for s in x.reshape(-1) if fold(s) not in stops]
        out = np.array(kept or [""], dtype=object)
        return [out.reshape(1, -1) if x.ndim == 2 else out]
    return kernel


def _string_concat(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        x, y = np.broadcast_arrays(inputs[0], inputs[1])
        out = np.empty(x.shape, dtype=object)
        for index in np.ndindex(x.shape):
            out[index] = x[index] + y[index]
        return [out]
    return kernel


def _string_split(node: Node) -> Callable[[list[Any]], list[Any]]:
    delimiter = node.attrs.get("delimiter") or None  # "" splits on runs of whitespace
    maxsplit = node.attrs.get("maxsplit")
    limit = -1 if maxsplit is None else int(maxsplit)

    def split_one(text: str) -> list[str]:
        # onnxruntime's: an empty string has no pieces, and on whitespace the rest left
        # after maxsplit pieces loses its trailing whitespace too.
        if not text:
            return []
        parts = text.split(delimiter, limit)
        if delimiter is None and 0 <= limit < len(parts):
            parts[-1] = parts[-1].rstrip()
        return parts

    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        parts = [split_one(s) for s in x.reshape(-1)]
        width = max((len(p) for p in parts), default=0)
        out = np.full((len(parts), width), "", dtype=object)
        for row, pieces in enumerate(parts):
            out[row, :len(pieces)] = pieces
        counts = np.array([len(p) for p in parts], dtype=np.int64)
        return [out.reshape(*x.shape, width), counts.reshape(x.shape)]
    return kernel


# RE2 constructs Python's re reads differently or not at all, and Python-only ones RE2
# refuses: a pattern holding any of them is refused rather than matched another way.
_NOT_RE2 = (
    (re.compile(r"\(\?(?:=|!|<=|<!)"), "lookaround assertions"),
    (re.compile(r"\(\?P=|\\[1-9]|\\g<"), "backreferences"),
    (re.compile(r"\(\?>|\(\?\("), "atomic groups and conditionals"),
    (re.compile(r"(?:[*+?}])\+"), "possessive quantifiers"),
    (re.compile(r"\\[pPCQEz]"), "\\p, \\C, \\Q...\\E and \\z escapes"),
    (re.compile(r"\[\[:"), "POSIX character classes"),
)


def re2_subset(pattern: str, where: str) -> re.Pattern[str]:
    """``pattern`` compiled by Python's re, where it lies in the syntax RE2 and re share.

    >>> re2_subset(r"[a-z]+@\\w+\\.com", "node").fullmatch("ab@cd.com") is not None
    True
    """
    plain = re.sub(r"\\\\", "", pattern)  # an escaped backslash starts no construct
    for construct, what in _NOT_RE2:
        if construct.search(plain):
            raise UnsupportedOp(f"{where}: pattern {pattern!r} uses {what}, outside the RE2 "
                                "syntax segflow runs with Python's re")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InvalidModel(f"{where}: invalid pattern {pattern!r}: {exc}") from None


def _regex_full_match(node: Node) -> Callable[[list[Any]], list[Any]]:
    regex = re2_subset(str(node.attrs.get("pattern", "")), node.label)

    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        matched = [regex.fullmatch(s) is not None for s in x.reshape(-1)]
        return [np.array(matched, dtype=np.bool_).reshape(x.shape)]
    return kernel


def _label_encoder(node: Node) -> Callable[[list[Any]], list[Any]]:
    attrs = node.attrs
    keys = _first_present(attrs, "keys_strings", "keys_int64s", "keys_floats", "keys_tensor")
    values = _first_present(attrs, "values_strings", "values_int64s", "values_floats",
                            "values_tensor")
    if keys is None or values is None or len(keys) != len(values):
        raise InvalidModel(f"{node.label}: LabelEncoder needs as many values as keys")
    out_dtype = node.outputs[0].spec.dtype
    default: Any
    if "default_tensor" in attrs:
        default = _listed(attrs["default_tensor"])[0]
    elif "values_strings" in attrs:
        default = str(attrs.get("default_string", "_Unused"))
    elif "values_int64s" in attrs:
        default = int(attrs.get("default_int64", -1))
    elif "values_floats" in attrs:
        default = float(attrs.get("default_float", -0.0))
    else:  # values_tensor without default_tensor: the schema's default for its type
        kind = "O" if out_dtype in (None, DType.STRING) else out_dtype.numpy.kind
        default = "_Unused" if kind == "O" else -1 if kind in "iu" else -0.0
    np_dtype = np.dtype(object) if out_dtype in (None, DType.STRING) else out_dtype.numpy
    # NaN keys match NaN inputs, as in onnxruntime.
    table = {_key(k): v for k, v in zip(keys, values, strict=True)}

    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        looked = [table.get(_key(k), default) for k in x.reshape(-1).tolist()]
        out = np.empty(len(looked), dtype=np_dtype)
        out[:] = looked
        return [out.reshape(x.shape)]
    return kernel


def _first_present(attrs: dict[str, Any], *names: str) -> list[Any] | None:
    for name in names:
        if name in attrs:
            return _listed(attrs[name])
    return None


def _listed(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    if isinstance(value, np.ndarray):
        return value.reshape(-1).tolist()
    return list(value)


def _key(item: Any) -> Any:
    return "nan" if isinstance(item, float) and math.isnan(item) else item


# -- the general ops over strings ------------------------------------------------------------
def _identity(node: Node) -> Callable[[list[Any]], list[Any]]:
    return lambda inputs: [inputs[0]]


def _reshape(node: Node) -> Callable[[list[Any]], list[Any]]:
    allowzero = bool(int(node.attrs.get("allowzero", 0)))

    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        shape = _ints(inputs[1]) if node.opset >= 5 else [int(d) for d in node.attrs["shape"]]
        if not allowzero:
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        try:
            return [x.reshape(shape)]
        except ValueError:
            raise InvalidInput(f"{node.label}: cannot reshape {list(x.shape)} to "
                               f"{shape}") from None
    return kernel


def _flatten(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        axis = normalize_axis(int(node.attrs.get("axis", 1)), x.ndim)
        rows = math.prod(x.shape[:axis])
        return [x.reshape(rows, math.prod(x.shape[axis:]))]
    return kernel


def _axes(node: Node, inputs: list[Any]) -> list[int] | None:
    if node.opset >= 13:
        return _ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
    axes = node.attrs.get("axes")
    return None if axes is None else [int(a) for a in axes]


def _squeeze(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        axes = _axes(node, inputs)
        if axes is None:
            return [x.reshape([d for d in x.shape if d != 1])]
        return [np.squeeze(x, tuple(normalize_axis(a, x.ndim) for a in axes))]
    return kernel


def _unsqueeze(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        axes = _axes(node, inputs) or []
        rank = x.ndim + len(axes)
        return [np.expand_dims(x, tuple(normalize_axis(a, rank) for a in axes))]
    return kernel


def _transpose(node: Node) -> Callable[[list[Any]], list[Any]]:
    perm = node.attrs.get("perm")
    return lambda inputs: [np.transpose(inputs[0], None if perm is None else list(perm))]


def _gather(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        x, indices = inputs[0], inputs[1].astype(np.int64)
        axis = normalize_axis(int(node.attrs.get("axis", 0)), x.ndim)
        size = x.shape[axis]
        if indices.size and (indices.min() < -size or indices.max() >= size):
            raise InvalidInput(f"{node.label}: an index is outside [-{size}, {size - 1}]")
        return [np.take(x, np.where(indices < 0, indices + size, indices), axis=axis)]
    return kernel


def _concat(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        parts = [x for x in inputs if x is not None]
        axis = normalize_axis(int(node.attrs["axis"]), parts[0].ndim)
        return [np.concatenate(parts, axis=axis)]
    return kernel


def _slice(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        if node.opset >= 10:
            starts, ends = _ints(inputs[1]), _ints(inputs[2])
            axes = _ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None \
                else list(range(len(starts)))
            steps = _ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None \
                else [1] * len(starts)
        else:
            starts, ends = list(node.attrs["starts"]), list(node.attrs["ends"])
            axes = list(node.attrs.get("axes", range(len(starts))))
            steps = [1] * len(starts)
        window = [slice(None)] * x.ndim
        for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
            axis = normalize_axis(axis, x.ndim)
            window[axis] = _onnx_slice(start, end, step, x.shape[axis], node.label)
        return [x[tuple(window)]]
    return kernel


def _onnx_slice(start: int, end: int, step: int, size: int, where: str) -> slice:
    """ONNX's clamped start/end/step along an axis of ``size`` as a Python slice."""
    if step == 0:
        raise InvalidInput(f"{where}: a Slice step is 0")
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), size), min(max(end, 0), size), step)
    start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
    return slice(start, None if end < 0 else end, step)


def _expand(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        x, shape = inputs[0], _ints(inputs[1])
        try:
            target = np.broadcast_shapes(x.shape, tuple(shape))
        except ValueError:
            raise InvalidInput(f"{node.label}: cannot expand {list(x.shape)} to "
                               f"{shape}") from None
        return [np.array(np.broadcast_to(x, target))]
    return kernel


def _tile(node: Node) -> Callable[[list[Any]], list[Any]]:
    return lambda inputs: [np.tile(inputs[0], _ints(inputs[1]))]


def _unique(node: Node) -> Callable[[list[Any]], list[Any]]:
    if node.attrs.get("axis") is not None:
        raise UnsupportedOp(f"{node.label}: Unique over strings along an axis is not "
                            "supported (only over all elements)")
    keep_sorted = bool(int(node.attrs.get("sorted", 1)))

    def kernel(inputs: list[Any]) -> list[Any]:
        flat = inputs[0].reshape(-1)
        first: dict[str, int] = {}
        for position, item in enumerate(flat):
            first.setdefault(item, position)
        order = sorted(first) if keep_sorted else list(first)
        rank = {item: i for i, item in enumerate(order)}
        inverse = np.array([rank[item] for item in flat], dtype=np.int64)
        counts = np.bincount(inverse, minlength=len(order)).astype(np.int64)
        return [np.array(order, dtype=object).reshape(-1),
                np.array([first[item] for item in order], dtype=np.int64),
                inverse, counts]
    return kernel


def _equal(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        return [np.asarray(np.equal(inputs[0], inputs[1]), dtype=np.bool_)]
    return kernel


def _where(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        return [np.where(inputs[0].astype(np.bool_), inputs[1], inputs[2]).astype(object)]
    return kernel


def _shape(node: Node) -> Callable[[list[Any]], list[Any]]:
    start, end = node.attrs.get("start"), node.attrs.get("end")

    def kernel(inputs: list[Any]) -> list[Any]:
        from segflow.ir.types import shape_window
        dims = inputs[0].shape
        return [np.array(dims[shape_window(start, end, len(dims))], dtype=np.int64)]
    return kernel


def _size(node: Node) -> Callable[[list[Any]], list[Any]]:
    return lambda inputs: [np.array(inputs[0].size, dtype=np.int64)]


# -- Cast ------------------------------------------------------------------------------------
# The numbers strtod/strtoll read from the start of a string (onnxruntime's parsers).
_FLOAT_PREFIX = re.compile(r"\s*[+-]?(?:0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)"
                           r"(?:[pP][+-]?\d+)?|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
                           r"|inf(?:inity)?|nan)", re.IGNORECASE)
_INT_PREFIX = re.compile(r"\s*[+-]?\d+")


def _parse_float(text: str, where: str) -> float:
    found = _FLOAT_PREFIX.match(text)
    if found is None:
        raise InvalidInput(f"{where}: cannot cast {text!r} to a number")
    number = found.group().strip()
    if "x" in number.lower():
        return float.fromhex(number)
    return float(number)


def _parse_int(text: str, where: str, signed: bool) -> int:
    """The integer strtoll (``signed``) or strtoull reads from the start of ``text``; the
    caller wraps it to the target's width, as a C cast does."""
    found = _INT_PREFIX.match(text)
    if found is None:
        raise InvalidInput(f"{where}: cannot cast {text!r} to an integer")
    number = int(found.group())
    if signed and not -(1 << 63) <= number < 1 << 63 or not signed and abs(number) >= 1 << 64:
        raise InvalidInput(f"{where}: {text!r} is out of the 64-bit integer range")
    return number if signed else number % (1 << 64)


def _format_number(item: Any, is_float: bool) -> str:
    if isinstance(item, (bool, np.bool_)):
        return "1" if item else "0"
    if not is_float:
        return str(int(item))
    value = float(item)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "INF" if value > 0 else "-INF"
    return f"{value:.8g}"


def _from_strings(x: Host, to: DType, where: str) -> Host:
    flat = x.reshape(-1)
    if to.is_float:
        numbers = np.array([_parse_float(s, where) for s in flat], dtype=np.float64)
        with np.errstate(over="ignore"):
            return numbers.astype(to.numpy).reshape(x.shape)
    if to is DType.BOOL:
        truths = [_parse_int(s, where, False) != 0 for s in flat]
        return np.array(truths, dtype=np.bool_).reshape(x.shape)
    if to.numpy.kind in "iu":
        signed = to.numpy.kind == "i"
        parsed = [_parse_int(s, where, signed) for s in flat]
        wrapped = np.array(parsed, dtype=np.uint64 if not signed else np.int64)
        return wrapped.astype(to.numpy).reshape(x.shape)
    raise UnsupportedOp(f"{where}: Cast from string to {to.onnx_name} is not supported")


def _cast(node: Node) -> Callable[[list[Any]], list[Any]]:
    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        to = node.outputs[0].spec.dtype
        if to is None:
            raise InvalidModel(f"{node.label}: Cast's target type is unknown")
        if to is DType.STRING:
            if x.dtype == object:
                return [x]
            is_float = x.dtype.kind in "fc" or x.dtype == DType.BFLOAT16.numpy
            out = np.empty(x.shape, dtype=object)
            for index, item in np.ndenumerate(x):
                out[index] = _format_number(item, is_float)
            return [out]
        return [_from_strings(x, to, node.label)]
    return kernel


def _row(name: str, bind: Callable[[Node], Callable[[list[Any]], list[Any]]],
         domain: str = "", since: int = 1, makes_nonfinite: bool = False) -> OpDef:
    return OpDef(name, _hosted(bind), domain=domain, since=since, exec_type=ExecType.LOCAL,
                 creates_nonfinite=(lambda node: True) if makes_nonfinite else None)


OPS = [
    _row("StringNormalizer", _string_normalizer, since=10),
    _row("StringConcat", _string_concat, since=20),
    _row("StringSplit", _string_split, since=20),
    _row("RegexFullMatch", _regex_full_match, since=20),
    _row("LabelEncoder", _label_encoder, domain=ML_DOMAIN, makes_nonfinite=True),
]

STRING_FORMS = [
    _row("Identity", _identity),
    _row("Reshape", _reshape),
    _row("Flatten", _flatten),
    _row("Squeeze", _squeeze),
    _row("Unsqueeze", _unsqueeze),
    _row("Transpose", _transpose),
    _row("Gather", _gather),
    _row("Concat", _concat),
    _row("Slice", _slice),
    _row("Expand", _expand),
    _row("Tile", _tile),
    _row("Unique", _unique),
    _row("Equal", _equal),
    _row("Where", _where),
    _row("Shape", _shape),
    _row("Size", _size),
    # "NaN" and "INF" become NaN and infinity: no kernel that loses them may read the result.
    _row("Cast", _cast, makes_nonfinite=True),
    _row("CastLike", _cast, makes_nonfinite=True),
]
"""The rows a node of these general ops resolves to where it reads or writes strings; the
opset range is the general row's (checked first), so these cover every opset."""
