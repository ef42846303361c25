"""ops/elementwise.py: Clip's defaults for a bound left out, against onnxruntime.

ONNX's default bounds are the dtype's lowest and highest values, so a Clip without
one still maps -Inf / +Inf to the largest finite floats (onnxruntime does): a
kernel that treats a missing bound as no clamp returns an infinity where
onnxruntime returns 3.4e38, and a later MatMul turns that into NaN or Inf.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from ort_compare import make_model, run_both

X = np.array([[-np.inf, -1.5, 0.0, 2.5, np.inf, np.nan]], np.float32)


@pytest.mark.parametrize("bounds", [[], ["lo"], ["", "hi"], ["lo", "hi"]])
def test_clip_without_a_bound_clamps_to_the_float_range(bounds):
    inits = {k: np.array(v, np.float32) for k, v in (("lo", -1.0), ("hi", 1.0)) if k in bounds}
    model = make_model([helper.make_node("Clip", ["x", *bounds], ["y"])], {"x": X}, ["y"], 13,
                       inits)
    (want,), (got,) = run_both(model, {"x": X})
    np.testing.assert_array_equal(got, want)      # NaN stays NaN, infinities clamped


def test_clip_attributes_default_to_the_float_range():
    model = make_model([helper.make_node("Clip", ["x"], ["y"], min=-1.0)], {"x": X}, ["y"], 6)
    (want,), (got,) = run_both(model, {"x": X})
    np.testing.assert_array_equal(got, want)
    assert got[0, 4] == np.finfo(np.float32).max
