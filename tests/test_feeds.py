"""Tests for runtime/feeds.py: the feed validator inference and training share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import segflow
from segflow.errors import InvalidInput
from segflow.ir import DType, TensorSpec, Value
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
