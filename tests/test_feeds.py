"""Tests for runtime/feeds.py: the feed validator inference and training share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import segflow
from segflow.errors import InvalidInput
from segflow.ir import DType, TensorSpec, Value
from segflow.ir.types import OptionalSpec, SequenceSpec
from segflow.runtime.feeds import FeedValidator


def _validator() -> FeedValidator:
    return FeedValidator([Value("x", TensorSpec(DType.FLOAT32, ("batch", 3))),
                          Value("y", TensorSpec(DType.INT64, ("batch",)))])


def test_feeds_become_tensors_in_input_order_with_their_dims():
    check = _validator()
    x = np.ones((2, 3), np.float32)
    tensors, dims = check({"y": np.zeros(2, np.int64), "x": x})
    assert dims == {"batch": 2} and [t.dtype for t in tensors] == [torch.float32, torch.int64]
    assert tensors[0].data_ptr() == x.ctypes.data          # numpy memory shared
    again, dims = check({"x": x, "y": np.zeros(2, np.int64)})   # the accepted signature
    assert dims == {"batch": 2} and again[0].data_ptr() == x.ctypes.data


@pytest.mark.parametrize("feeds,match", [
    ([1, 2], "feeds must be a dict"),
    ({"z": 1}, "unknown input name 'z'"),
    ({"x": np.ones((2, 3), np.float32)}, "missing input 'y'"),
    ({"x": np.ones((2, 3)), "y": np.zeros(2, np.int64)}, "has dtype double"),
    ({"x": np.ones(3, np.float32), "y": np.zeros(2, np.int64)}, "has rank 1"),
    ({"x": np.ones((2, 3), np.float32), "y": np.zeros(4, np.int64)}, "set 'batch' = 2"),
])
def test_errors_name_the_input_and_what_was_expected(feeds, match):
    with pytest.raises(InvalidInput, match=match):
        _validator()(feeds)


def test_both_sessions_use_it():
    from segflow.frontend.builder import GraphBuilder
    b = GraphBuilder("m")
    x = b.input("x", DType.FLOAT64, ["N", 4])
    b.output(b.op("Gemm", x, b.param("w", np.ones((2, 4))), transB=1), "logits")
    model = b.to_model()
    inference = segflow.InferenceSession(model)
    training = segflow.TrainingSession(model, loss=segflow.CrossEntropyLoss(labels="y"))
    assert isinstance(inference._check_feeds, FeedValidator)
    assert isinstance(training._check_feeds, FeedValidator)
    for run in (lambda f: inference.run(None, f), lambda f: training.step(f)):
        with pytest.raises(InvalidInput, match="unknown input name 'q'"):
            run({"q": np.ones(1)})


def _container_validator() -> FeedValidator:
    return FeedValidator([
        Value("s", container=SequenceSpec(TensorSpec(DType.FLOAT32, ("n", 2)))),
        Value("o", container=OptionalSpec(TensorSpec(DType.INT64, (3,)))),
        Value("x", TensorSpec(DType.FLOAT32, ("batch",)))])


def test_sequence_and_optional_feeds():
    """A sequence is a list of tensors, each checked against the element spec; its
    tensors may differ in a symbolic dim, which binds no graph-wide size."""
    check = _container_validator()
    a, b = np.ones((1, 2), np.float32), np.ones((4, 2), np.float32)
    feeds, dims = check({"s": [a, b], "o": None, "x": np.zeros(5, np.float32)})
    assert isinstance(feeds[0], list) and [t.shape for t in feeds[0]] == [(1, 2), (4, 2)]
    assert feeds[0][0].data_ptr() == a.ctypes.data and feeds[1] is None
    assert dims == {"batch": 5}
    feeds, _ = check({"s": (), "o": np.arange(3), "x": np.zeros(1, np.float32)})
    assert feeds[0] == [] and feeds[1].tolist() == [0, 1, 2]


@pytest.mark.parametrize("feeds,match", [
    ({"s": np.ones((1, 2), np.float32)}, r"'s' is an array; expected a list of arrays"),
    ({"s": [np.ones((1, 2), np.int64)]}, r"dtype int64.*element 0 of the sequence"),
    ({"s": [np.ones((1, 2, 1), np.float32)]}, r"rank 3.*element 0"),
    ({"o": [np.arange(3)]}, r"'o' is a list; expected an array or None"),
    ({"o": np.arange(4)}, r"dimension 4 at axis 0, expected 3"),
    ({"x": [np.zeros(1, np.float32)]}, r"'x' is a list of arrays \(a sequence\)"),
])
def test_wrong_kind_feeds_name_the_input(feeds, match):
    full = {"s": [np.ones((1, 2), np.float32)], "o": None, "x": np.zeros(1, np.float32),
            **feeds}
    with pytest.raises(InvalidInput, match=match):
        _container_validator()(full)
