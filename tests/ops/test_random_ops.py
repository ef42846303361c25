"""Random ops: Bernoulli's distribution, dtype and shape; Dropout's seeded training mask
(ONNX's reference draws it from numpy's Mersenne Twister, which segflow reproduces); and
how the conformance runner classifies cases whose expected outputs are a random stream."""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from ort_compare import make_model

import segflow
from segflow.conformance import Outcome, load_cases, run_case

RNG = np.random.default_rng(0)


def _session(model: onnx.ModelProto) -> segflow.InferenceSession:
    return segflow.InferenceSession(model, engine="inline")


# -- Bernoulli -----------------------------------------------------------------------------

@pytest.mark.parametrize("p_dtype", [np.float32, np.float64])
def test_bernoulli_mean_per_probability(p_dtype: type) -> None:
    probs = np.array([0.0, 0.05, 0.3, 0.5, 0.9, 1.0], p_dtype)
    draws = 20000
    feeds = {"p": np.tile(probs, (draws, 1))}
    node = helper.make_node("Bernoulli", ["p"], ["y"], seed=5.0)
    y = _session(make_model([node], feeds, ["y"], 15)).run(None, feeds)[0]
    assert y.dtype == p_dtype and y.shape == (draws, probs.size)
    assert set(np.unique(y)) <= {0.0, 1.0}
    # Each column's mean is within 5 standard errors of its p (sqrt(p (1 - p) / draws),
    # at most 0.0035 here); p = 0 and p = 1 are exact.
    bound = 5 * np.sqrt(probs * (1 - probs) / draws)
    np.testing.assert_array_less(np.abs(y.mean(axis=0) - probs), bound + 1e-12)


@pytest.mark.parametrize(("dtype", "np_dtype"), [(TensorProto.DOUBLE, np.float64),
                                                 (TensorProto.INT32, np.int32),
                                                 (TensorProto.BOOL, np.bool_)])
def test_bernoulli_dtype_attribute(dtype: int, np_dtype: type) -> None:
    feeds = {"p": np.full((3, 4, 5), 0.5, np.float32)}
    node = helper.make_node("Bernoulli", ["p"], ["y"], dtype=dtype)
    y = _session(make_model([node], feeds, ["y"], 15)).run(None, feeds)[0]
    assert y.dtype == np_dtype and y.shape == (3, 4, 5)
    assert set(np.unique(y.astype(np.float64))) <= {0.0, 1.0}


def test_bernoulli_seed_repeats_across_sessions_and_advances_within_one() -> None:
    feeds = {"p": np.full((64,), 0.5, np.float32)}
    model = make_model([helper.make_node("Bernoulli", ["p"], ["y"], seed=3.0)], feeds, ["y"], 15)
    first, second = _session(model), _session(model)
    a, b = first.run(None, feeds)[0], first.run(None, feeds)[0]
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(second.run(None, feeds)[0], a)


# -- Dropout -------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_seeded_training_dropout_matches_reference(ratio: float) -> None:
    feeds = {"x": RNG.standard_normal((4, 5, 6)).astype(np.float32),
             "r": np.array(ratio, np.float32), "t": np.array(True)}
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=11)
    model = make_model([node], feeds, ["y", "mask"], 13)
    expected = ReferenceEvaluator(model).run(None, feeds)
    y, mask = _session(model).run(None, feeds)
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, expected[1])
    np.testing.assert_allclose(y, expected[0], rtol=1e-6, atol=0)


def test_seeded_dropout_advances_run_to_run() -> None:
    feeds = {"x": np.ones((32, 32), np.float32), "r": np.array(0.5, np.float32),
             "t": np.array(True)}
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=0)
    sess = _session(make_model([node], feeds, ["y", "mask"], 13))
    first, second = sess.run(None, feeds)[1], sess.run(None, feeds)[1]
    assert not np.array_equal(first, second)
    assert 0.4 < first.mean() < 0.6


def test_unseeded_dropout_keeps_the_ratio() -> None:
    feeds = {"x": np.ones((200, 100), np.float32), "r": np.array(0.3, np.float32),
             "t": np.array(True)}
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"])
    y, mask = _session(make_model([node], feeds, ["y", "mask"], 13)).run(None, feeds)
    assert abs(mask.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y[mask], 1 / 0.7, rtol=1e-6)
    assert (y[~mask] == 0).all()


# -- conformance classification -------------------------------------------------------------

def test_conformance_bernoulli_cases_are_random_outputs() -> None:
    cases = load_cases("test_bernoulli")
    assert len(cases) == 6
    for case in cases:
        result = run_case(case)
        assert result.outcome is Outcome.RANDOM, f"{case.name}: {result.reason}"


def test_conformance_random_case_with_wrong_dtype_is_wrong() -> None:
    feeds = {"p": np.full((10,), 0.5, np.float32)}
    model = make_model([helper.make_node("Bernoulli", ["p"], ["y"])], feeds, ["y"], 15)
    case = types.SimpleNamespace(name="bernoulli_dtype", model=model, rtol=1e-3, atol=1e-7,
                                 data_sets=[([feeds["p"]], [np.zeros(10, np.float64)])])
    result = run_case(case)
    assert result.outcome is Outcome.WRONG and "float64" in result.reason
