"""String tensors: how they are held and run, and the string ops.

A string value is a numpy object array of ``str`` on the host; it never becomes a torch
tensor. Every node that reads or writes one runs as a LOCAL host task over these arrays
(``OpRegistry.resolve`` picks these rows, and for the general ops those of
``ops/string_forms.py``); the numeric values such a node reads arrive as tensors and the
ones it writes leave as tensors on the node's device. onnx's reference implementation
(``onnx/reference/ops``) is the spec; where onnxruntime differs from it on what the node
suite leaves open (StringNormalizer's stopwords and accents, StringSplit of an empty
string), onnxruntime's behaviour is the one followed.
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


def host_ints(array: Host | None) -> list[int]:
    """A small integer array (a shape, axes, repeats) as a Python list."""
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


def host_row(name: str, bind: Callable[[Node], Callable[[list[Any]], list[Any]]],
             domain: str = "", since: int = 1, makes_nonfinite: bool = False) -> OpDef:
    """The LOCAL row of a host kernel over numpy arrays (see :func:`_hosted`);
    ``makes_nonfinite``: its results may hold NaN or an infinity its inputs do not."""
    return OpDef(name, _hosted(bind), domain=domain, since=since, exec_type=ExecType.LOCAL,
                 creates_nonfinite=(lambda node: True) if makes_nonfinite else None)


OPS = [
    host_row("StringNormalizer", _string_normalizer, since=10),
    host_row("StringConcat", _string_concat, since=20),
    host_row("StringSplit", _string_split, since=20),
    host_row("RegexFullMatch", _regex_full_match, since=20),
    host_row("LabelEncoder", _label_encoder, domain=ML_DOMAIN, makes_nonfinite=True),
]
