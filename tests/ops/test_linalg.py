"""Einsum and Det against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from ort_compare import assert_matches_ort, make_model

RNG = np.random.default_rng(0)

EINSUM = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij, bjk -> bik", [(2, 3, 4), (2, 4, 5)]),
    ("ii->i", [(4, 4)]),
    ("...ii->...i", [(2, 3, 3)]),
    ("i,i", [(5,), (5,)]),
    ("ij->", [(3, 4)]),
    ("ij", [(3, 4)]),
    ("ba", [(3, 4)]),
    ("...j,jk->...k", [(2, 3, 4), (4, 2)]),
    ("i,j->ij", [(3,), (4,)]),
]


@pytest.mark.parametrize(("equation", "shapes"), EINSUM, ids=[e for e, _ in EINSUM])
def test_einsum(equation: str, shapes: list[tuple[int, ...]]) -> None:
    feeds = {f"x{i}": RNG.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    node = helper.make_node("Einsum", list(feeds), ["y"], equation=equation)
    assert_matches_ort(make_model([node], feeds, ["y"], 12), feeds, rtol=1e-5, atol=1e-5)


def test_einsum_integer() -> None:
    feeds = {"a": RNG.integers(-5, 5, (3, 4)).astype(np.int32),
             "b": RNG.integers(-5, 5, (4, 2)).astype(np.int32)}
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik")
    assert_matches_ort(make_model([node], feeds, ["y"], 12), feeds, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 1, 2, 2)])
def test_det(shape: tuple[int, ...]) -> None:
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    node = helper.make_node("Det", ["x"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 11), feeds, rtol=1e-4, atol=1e-5)
