"""The general ops over string tensors: the host rows a node of Identity, Reshape, Gather,
Concat, Slice, Unique, Equal, Cast ... runs where it reads or writes a string value
(``OpRegistry.resolve``). They follow the general rows' ONNX semantics over numpy object
arrays; Cast to and from strings follows onnxruntime (strtod/strtoll parsing, "NaN",
"INF" and "-INF", numbers written with 8 significant digits).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from segflow.errors import InvalidInput, InvalidModel, UnsupportedOp
from segflow.ir.graph import Node
from segflow.ir.types import DType, shape_window
from segflow.ops._common import normalize_axis
from segflow.ops.strings import Host, host_ints, host_row


def _identity(node: Node) -> Callable[[list[Any]], list[Any]]:
    return lambda inputs: [inputs[0]]


def _reshape(node: Node) -> Callable[[list[Any]], list[Any]]:
    allowzero = bool(int(node.attrs.get("allowzero", 0)))

    def kernel(inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        shape = host_ints(inputs[1]) if node.opset >= 5 else [int(d) for d in node.attrs["shape"]]
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
        return host_ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
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
            starts, ends = host_ints(inputs[1]), host_ints(inputs[2])
            axes = host_ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None \
                else list(range(len(starts)))
            steps = host_ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None \
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
        x, shape = inputs[0], host_ints(inputs[1])
        try:
            target = np.broadcast_shapes(x.shape, tuple(shape))
        except ValueError:
            raise InvalidInput(f"{node.label}: cannot expand {list(x.shape)} to "
                               f"{shape}") from None
        return [np.array(np.broadcast_to(x, target))]
    return kernel


def _tile(node: Node) -> Callable[[list[Any]], list[Any]]:
    return lambda inputs: [np.tile(inputs[0], host_ints(inputs[1]))]


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


STRING_FORMS = [
    host_row("Identity", _identity),
    host_row("Reshape", _reshape),
    host_row("Flatten", _flatten),
    host_row("Squeeze", _squeeze),
    host_row("Unsqueeze", _unsqueeze),
    host_row("Transpose", _transpose),
    host_row("Gather", _gather),
    host_row("Concat", _concat),
    host_row("Slice", _slice),
    host_row("Expand", _expand),
    host_row("Tile", _tile),
    host_row("Unique", _unique),
    host_row("Equal", _equal),
    host_row("Where", _where),
    host_row("Shape", _shape),
    host_row("Size", _size),
    # "NaN" and "INF" become NaN and infinity: no kernel that loses them may read the result.
    host_row("Cast", _cast, makes_nonfinite=True),
    host_row("CastLike", _cast, makes_nonfinite=True),
]
"""The rows a node of these general ops resolves to where it reads or writes strings; the
opset range is the general row's (checked first), so these cover every opset."""
