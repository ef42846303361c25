"""The feed validator both sessions use: a run's feeds checked against the graph inputs.

A feed must name an input, have its dtype and rank and its fixed dims, and bind
each symbolic dim (``batch``) to one size across all inputs; errors name the input
and what was expected. Numpy arrays become tensors over the same memory where
torch can share it.

>>> check = FeedValidator(graph.inputs)                       # doctest: +SKIP
>>> tensors, dims = check({"input": x})                       # doctest: +SKIP
>>> dims
{'batch': 8}
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from segflow.errors import InvalidInput
from segflow.ir import lowbit
from segflow.ir.graph import Value
from segflow.ir.types import Dim, DType, OptionalSpec, SequenceSpec, TensorSpec
from segflow.ops.strings import string_array

Tensor = torch.Tensor


class FeedValidator:
    """``validator(feeds) -> (tensors in input order, symbolic dims they bind)``.

    The common case (numpy feeds of the dtypes and shapes the last run accepted)
    skips the per-dim checks: those held for the same signature before.
    """

    __slots__ = ("inputs", "_by_name", "_accepted")

    def __init__(self, inputs: Sequence[Value]) -> None:
        self.inputs = tuple(inputs)
        # Looked up on every run: built once.
        self._by_name = {v.name: v for v in self.inputs}
        # The (dtype, shape) of each numpy feed, in input order, and the symbolic dims
        # they bound, as the last fully checked run accepted them.
        self._accepted: tuple[list[tuple[np.dtype, tuple[int, ...]]], dict[str, int]] | None = None

    def __call__(self, feeds: Mapping[str, Any]) -> tuple[list[Any], dict[str, int]]:
        if type(feeds) is not dict and not isinstance(feeds, Mapping):  # the ABC check is slow
            raise InvalidInput(f"feeds must be a dict of input name -> array, "
                               f"got {type(feeds).__name__}")
        expected = self._by_name
        for name in feeds:
            if name not in expected:
                raise InvalidInput(f"unknown input name {name!r}; the model's inputs are "
                                   f"{', '.join(expected) or '(none)'}")
        accepted = self._accepted
        if accepted is not None and len(feeds) == len(expected):
            arrays = [feeds.get(name) for name in expected]
            if _numpy_signature(arrays) == accepted[0]:
                return ([as_tensor(a, name) for a, name in
                         zip(cast("list[np.ndarray]", arrays), expected, strict=True)],
                        dict(accepted[1]))
        symbols: dict[str, tuple[int, str]] = {}
        tensors = []
        for value in self.inputs:
            if value.name not in feeds:
                raise InvalidInput(f"missing input {value.name!r} "
                                   f"(expected {value.describe()})")
            if value.container is not None:
                tensors.append(check_container_feed(value, feeds[value.name]))
            else:
                tensors.append(check_feed(value, feeds[value.name], symbols))
        dims = {name: size for name, (size, _) in symbols.items()}
        signature = _numpy_signature([feeds[name] for name in expected])
        self._accepted = (signature, dims) if signature is not None else None
        return tensors, dims


def check_feed(value: Value, data: Any, symbols: dict[str, tuple[int, str]]) -> Tensor:
    """``data`` as a tensor for the input ``value``; ``symbols``: the symbolic dims bound
    so far (name -> (size, the input that bound it)), extended by this feed."""
    spec = value.spec
    if isinstance(data, Tensor):
        tensor = data
        got = DType.from_container(data.dtype, spec.dtype)
    elif data is None:
        raise InvalidInput(f"input {value.name!r} is None; expected an array "
                           f"({spec.describe()})")
    elif isinstance(data, (list, tuple)) and any(isinstance(x, (np.ndarray, Tensor))
                                                 for x in data):
        raise InvalidInput(f"input {value.name!r} is a list of arrays (a sequence); "
                           f"expected one array ({spec.describe()})")
    else:
        array = np.asarray(data)
        try:
            got = DType.from_numpy(array.dtype)  # object, unicode, bytes: STRING
        except ValueError:
            raise InvalidInput(f"input {value.name!r} has numpy dtype {array.dtype}, which "
                               f"segflow does not read (expected {spec.describe()})"
                               ) from None
        tensor = None
    if spec.dtype is not None and got is not spec.dtype:
        raise InvalidInput(f"input {value.name!r} has dtype {got.onnx_name}, "
                           f"expected {spec.dtype.onnx_name} ({spec.describe()})")
    shape = tuple(tensor.shape) if tensor is not None else array.shape
    if spec.shape is not None:
        if len(shape) != len(spec.shape):
            raise InvalidInput(f"input {value.name!r} has rank {len(shape)} "
                               f"(shape {list(shape)}), expected rank {len(spec.shape)} "
                               f"({spec.describe()})")
        for axis, (want, have) in enumerate(zip(spec.shape, shape)):
            _check_dim(value.name, axis, want, have, spec, symbols)
    # The executor uploads feeds to the device (pinned memory, copy stream).
    return tensor if tensor is not None else as_tensor(array, value.name)


def check_container_feed(value: Value, data: Any) -> Any:
    """A feed for a sequence or optional input: a list of tensors for a sequence, None
    or the held value for an optional (as onnxruntime takes them). Each tensor is checked
    against the element spec (dtype, rank, fixed dims); the tensors of one sequence may
    differ in their symbolic dims, so those bind nothing."""
    container = value.container
    if isinstance(container, OptionalSpec):
        if data is None:
            return None
        return _check_held(value, container.elem, data, container.describe())
    assert isinstance(container, SequenceSpec)
    return _check_held(value, container, data, container.describe())


def _check_held(value: Value, spec: TensorSpec | SequenceSpec, data: Any,
                expected: str) -> Any:
    if isinstance(spec, SequenceSpec):
        if not isinstance(data, (list, tuple)):
            raise InvalidInput(f"input {value.name!r} is {_kind_of(data)}; expected a list "
                               f"of arrays ({expected})")
        item = Value(value.name, spec.elem)
        return [_check_element(item, x, i, expected) for i, x in enumerate(data)]
    if isinstance(data, (list, tuple)):
        raise InvalidInput(f"input {value.name!r} is a list; expected an array or None "
                           f"({expected})")
    return check_feed(Value(value.name, spec), data, {})


def _check_element(item: Value, data: Any, index: int, expected: str) -> Tensor:
    if data is None or isinstance(data, (list, tuple)):
        raise InvalidInput(f"input {item.name!r}: element {index} is {_kind_of(data)}; "
                           f"expected an array ({expected})")
    try:
        return check_feed(item, data, {})
    except InvalidInput as exc:
        raise InvalidInput(f"{exc} (element {index} of the sequence)") from None


def _kind_of(data: Any) -> str:
    """How an error names what a feed is."""
    if data is None:
        return "None"
    if isinstance(data, (list, tuple)):
        return f"a {type(data).__name__}"
    if isinstance(data, (np.ndarray, Tensor)):
        return "an array"
    return f"a {type(data).__name__}"


def feed_tensors(feeds: Iterable[Any]) -> Iterator[Tensor]:
    """The tensors of checked feeds: a sequence's one by one, an empty optional none."""
    for feed in feeds:
        if isinstance(feed, list):
            yield from feed
        elif feed is not None:
            yield feed


def _check_dim(name: str, axis: int, want: Dim, have: int, spec: TensorSpec,
               symbols: dict[str, tuple[int, str]]) -> None:
    if isinstance(want, int) and want != have:
        raise InvalidInput(f"input {name!r} has dimension {have} at axis {axis}, "
                           f"expected {want} ({spec.describe()})")
    if isinstance(want, str):
        seen = symbols.get(want)
        if seen is None:
            symbols[want] = (have, name)
        elif seen[0] != have:
            raise InvalidInput(f"input {name!r} has dimension {have} at axis {axis} "
                               f"('{want}'), but input {seen[1]!r} set '{want}' = {seen[0]}")


def _numpy_signature(feeds: Sequence[Any]) -> list[tuple[np.dtype, tuple[int, ...]]] | None:
    """Each feed's (dtype, shape) where every one is a plain numpy array, else None."""
    if not all(type(a) is np.ndarray for a in feeds):
        return None
    return [(a.dtype, a.shape) for a in feeds]


def as_tensor(array: np.ndarray, name: str = "") -> Tensor:
    """A feed array as a tensor over the same memory where torch can share it.

    A byte-swapped array (``>f4`` on a little-endian host) is converted to native
    order; an ``ml_dtypes.bfloat16`` one, which torch cannot read, is shared as its
    16-bit patterns viewed as bfloat16; the other ml_dtypes types (float8, int4, ...)
    are copied into their torch form (``ir/lowbit.py``). A string feed (``str``,
    ``bytes`` or an object array of them) stays an array: an object array of ``str``
    (``ops/strings.py``).
    """
    dtype = array.dtype
    if dtype.kind in "OUS":
        return cast(Tensor, _strings(array, name))
    if dtype in lowbit.NUMPY_DTYPES:
        return lowbit.to_tensor(array)
    if not dtype.isnative:
        array = array.astype(dtype.newbyteorder("="))
    flags = array.flags
    if not flags.writeable or not flags.c_contiguous:
        # torch.from_numpy needs a writeable array without negative strides.
        array = np.array(array, order="C")
    if dtype == _BFLOAT16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _strings(array: np.ndarray, name: str) -> np.ndarray:
    if array.dtype == object:
        for item in array.flat:
            if not isinstance(item, (str, bytes)):
                raise InvalidInput(f"input {name!r} is a string tensor; an element is "
                                   f"{type(item).__name__} {item!r}, not str")
    return string_array(array)


_BFLOAT16 = DType.BFLOAT16.numpy
