"""Image/spatial ops against onnxruntime: Resize (every mode and coordinate transform),
Upsample, Pad, DepthToSpace/SpaceToDepth, GridSample, AffineGrid, RoiAlign, MaxRoiPool,
MaxUnpool, LpPool, LpNormalization, MeanVarianceNormalization, CenterCropPad, Col2Im."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from onnx.reference import ReferenceEvaluator
from ort_compare import assert_matches_ort, make_model

import segflow
from segflow.errors import InvalidModel
from segflow.ops import _resize

RNG = np.random.default_rng(0)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return segflow.InferenceSession(model, engine="inline").run(None, feeds)


def _matches_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                       rtol: float = 1e-5, atol: float = 1e-6) -> None:
    expected = ReferenceEvaluator(model).run(None, feeds)
    for g, e in zip(_run(model, feeds), expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)


# -- Resize --------------------------------------------------------------------------------

# (mode, coordinate_transformation_mode, nearest_mode, scales or None, sizes or None)
RESIZE = [
    ("nearest", "asymmetric", "floor", [1, 1, 2, 2], None),
    ("nearest", "half_pixel", "round_prefer_floor", [1, 1, 0.6, 1.7], None),
    ("nearest", "half_pixel", "round_prefer_ceil", None, [1, 2, 7, 3]),
    ("nearest", "align_corners", "floor", None, [1, 2, 8, 9]),
    ("nearest", "asymmetric", "ceil", [1, 1, 1.5, 0.5], None),
    ("nearest", "tf_half_pixel_for_nn", "round_prefer_floor", [1, 1, 2, 3], None),
    ("linear", "half_pixel", "round_prefer_floor", [1, 1, 2, 2], None),
    ("linear", "half_pixel", "round_prefer_floor", [1, 1, 0.5, 0.75], None),
    ("linear", "pytorch_half_pixel", "round_prefer_floor", None, [1, 2, 1, 7]),
    ("linear", "align_corners", "round_prefer_floor", None, [1, 2, 9, 11]),
    ("linear", "align_corners", "round_prefer_floor", [1, 1, 0.6, 0.6], None),
    ("linear", "asymmetric", "round_prefer_floor", [1, 1, 1.5, 2.5], None),
    ("linear", "half_pixel_symmetric", "round_prefer_floor", [1, 1, 1.7, 0.6], None),
    ("cubic", "half_pixel", "round_prefer_floor", [1, 1, 2, 2], None),
    ("cubic", "half_pixel", "round_prefer_floor", [1, 1, 0.6, 0.8], None),
    ("cubic", "align_corners", "round_prefer_floor", None, [1, 2, 7, 9]),
    ("cubic", "asymmetric", "round_prefer_floor", [1, 1, 1.3, 2], None),
    ("cubic", "pytorch_half_pixel", "round_prefer_floor", None, [1, 2, 6, 4]),
]


@pytest.mark.parametrize(("mode", "ctm", "nearest", "scales", "sizes"), RESIZE)
def test_resize(mode: str, ctm: str, nearest: str, scales: list[float] | None,
                sizes: list[int] | None) -> None:
    feeds = {"x": RNG.standard_normal((1, 2, 5, 6)).astype(np.float32)}
    inits: dict[str, np.ndarray] = {}
    inputs = ["x", ""]
    if scales is not None:
        inits["scales"] = np.array(scales, dtype=np.float32)
        inputs.append("scales")
    else:
        inits["sizes"] = np.array(sizes, dtype=np.int64)
        inputs += ["", "sizes"]
    node = helper.make_node("Resize", inputs, ["y"], mode=mode,
                            coordinate_transformation_mode=ctm, nearest_mode=nearest)
    model = make_model([node], feeds, ["y"], 19, inits)
    if ctm == "align_corners" and scales is not None:
        # ONNX divides by (scale * size - 1) here; onnxruntime by (output size - 1).
        _matches_reference(model, feeds, rtol=1e-5, atol=1e-5)
    else:
        assert_matches_ort(model, feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("attrs", "scales"), [
    ({"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}, [1, 1, 0.8, 1.6]),
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.5, 0.6]),
    ({"mode": "cubic", "antialias": 1}, [1, 1, 0.4, 0.7]),
    ({"mode": "linear", "antialias": 1}, [1, 1, 1.5, 2.0]),
])
def test_resize_filters(attrs: dict[str, object], scales: list[float]) -> None:
    feeds = {"x": RNG.standard_normal((1, 1, 8, 10)).astype(np.float32)}
    inits = {"scales": np.array(scales, dtype=np.float32)}
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 18, inits), feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("axes", "sizes", "policy"), [
    ([2, 3], [7, 3], "stretch"), ([3, 2], [3, 7], "not_larger"), ([3, 2], [9, 4], "not_smaller")])
def test_resize_axes_and_aspect_policy(axes: list[int], sizes: list[int], policy: str) -> None:
    feeds = {"x": RNG.standard_normal((1, 2, 5, 6)).astype(np.float32)}
    inits = {"sizes": np.array(sizes, dtype=np.int64)}
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest", axes=axes,
                            keep_aspect_ratio_policy=policy)
    _matches_reference(make_model([node], feeds, ["y"], 19, inits), feeds)


@pytest.mark.parametrize("extrapolation", [0.0, 10.0])
def test_resize_tf_crop_and_resize(extrapolation: float) -> None:
    feeds = {"x": RNG.standard_normal((1, 1, 6, 6)).astype(np.float32)}
    inits = {"roi": np.array([0, 0, -0.2, 0.3, 1, 1, 0.8, 1.3], dtype=np.float32),
             "sizes": np.array([1, 1, 4, 5], dtype=np.int64)}
    node = helper.make_node("Resize", ["x", "roi", "", "sizes"], ["y"], mode="linear",
                            coordinate_transformation_mode="tf_crop_and_resize",
                            extrapolation_value=extrapolation)
    assert_matches_ort(make_model([node], feeds, ["y"], 13, inits), feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_opset10(mode: str) -> None:
    feeds = {"x": RNG.standard_normal((1, 1, 4, 4)).astype(np.float32)}
    inits = {"scales": np.array([1, 1, 2, 1.5], dtype=np.float32)}
    node = helper.make_node("Resize", ["x", "scales"], ["y"], mode=mode)
    assert_matches_ort(make_model([node], feeds, ["y"], 10, inits), feeds, rtol=1e-5, atol=1e-5)


def test_resize_uint8_linear_rounds() -> None:
    feeds = {"x": RNG.integers(0, 256, (1, 1, 4, 4)).astype(np.uint8)}
    inits = {"scales": np.array([1, 1, 1.5, 1.5], dtype=np.float32)}
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")
    model = make_model([node], feeds, ["y"], 13, inits)
    got = assert_matches_ort(model, feeds, rtol=0, atol=1)
    assert got[0].dtype == np.uint8


@pytest.mark.parametrize(("mode", "ctm", "scale"), [
    ("nearest", "asymmetric", 2.0), ("linear", "half_pixel", 1.5), ("linear", "half_pixel", 0.5),
    ("linear", "align_corners", 2.0), ("cubic", "half_pixel", 1.75)])
def test_resize_fast_path_matches_general_path(mode: str, ctm: str, scale: float) -> None:
    """The torch.interpolate fast path computes what the per-axis tables compute."""
    cfg = _resize.ResizeConfig(mode=_resize.Mode(mode), coord=_resize.Coord(ctm),
                               nearest=_resize.Nearest.FLOOR)
    x = torch.from_numpy(RNG.standard_normal((1, 2, 6, 7)).astype(np.float32))
    axes = [0, 1, 2, 3]
    out, factor = _resize.plan_sizes(cfg, x.shape, axes, [1, 1, scale, scale], None)
    fast = _resize._fast(x, cfg, axes, out, factor)
    assert fast is not None
    general = x
    for a in (2, 3):
        general = _resize.apply_axis(general, a, _resize.axis_table(cfg, x.shape[a], out[a],
                                                                   factor[a]), 0.0)
    torch.testing.assert_close(fast, general, rtol=1e-5, atol=1e-5)


def test_resize_errors() -> None:
    feeds = {"x": np.zeros((1, 1, 2, 2), np.float32)}
    inits = {"scales": np.array([1, 1, 2, 2], dtype=np.float32)}
    bad_mode = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="area")
    with pytest.raises(InvalidModel, match="mode 'area'"):
        segflow.InferenceSession(make_model([bad_mode], feeds, ["y"], 13, inits))
    aa_nearest = helper.make_node("Resize", ["x", "", "scales"], ["y"], antialias=1)
    with pytest.raises(InvalidModel, match="antialias"):
        segflow.InferenceSession(make_model([aa_nearest], feeds, ["y"], 18, inits))


@pytest.mark.parametrize(("opset", "mode"), [(7, "nearest"), (9, "nearest"), (9, "linear")])
def test_upsample(opset: int, mode: str) -> None:
    feeds = {"x": RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)}
    scales = [1.0, 1.0, 2.0, 3.0]
    if opset < 9:
        node = helper.make_node("Upsample", ["x"], ["y"], mode=mode, scales=scales)
        inits = {}
    else:
        node = helper.make_node("Upsample", ["x", "s"], ["y"], mode=mode)
        inits = {"s": np.array(scales, dtype=np.float32)}
    assert_matches_ort(make_model([node], feeds, ["y"], opset, inits), feeds)


# -- Pad -----------------------------------------------------------------------------------

PAD = [
    ("constant", [0, 1, 2, 0, 0, 2, 1, 3]),
    ("constant", [0, -1, 2, 0, 0, 1, -2, 1]),
    ("reflect", [0, 0, 2, 3, 0, 0, 1, 2]),
    ("edge", [0, 1, 3, 1, 0, 2, 0, 4]),
    ("wrap", [0, 0, 2, 5, 0, 0, 3, 1]),
]


@pytest.mark.parametrize(("mode", "pads"), PAD)
def test_pad(mode: str, pads: list[int]) -> None:
    feeds = {"x": RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)}
    inits = {"pads": np.array(pads, dtype=np.int64), "v": np.array(1.5, dtype=np.float32)}
    inputs = ["x", "pads", "v"] if mode == "constant" else ["x", "pads"]
    node = helper.make_node("Pad", inputs, ["y"], mode=mode)
    assert_matches_ort(make_model([node], feeds, ["y"], 19, inits), feeds)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_opset2_attributes(mode: str) -> None:
    feeds = {"x": RNG.standard_normal((3, 4)).astype(np.float32)}
    node = helper.make_node("Pad", ["x"], ["y"], mode=mode, pads=[1, 2, 2, 1], value=-3.0)
    assert_matches_ort(make_model([node], feeds, ["y"], 2), feeds)


def test_pad_axes_input() -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)}
    inits = {"pads": np.array([1, 2, 0, 1], dtype=np.int64),
             "axes": np.array([-1, 1], dtype=np.int64)}
    node = helper.make_node("Pad", ["x", "pads", "", "axes"], ["y"], mode="edge")
    assert_matches_ort(make_model([node], feeds, ["y"], 18, inits), feeds)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.uint8])
def test_pad_integer_types(dtype: type) -> None:
    feeds = {"x": RNG.integers(0, 2, (2, 3)).astype(dtype)}
    inits = {"pads": np.array([1, 0, 0, 2], dtype=np.int64)}
    node = helper.make_node("Pad", ["x", "pads"], ["y"])
    assert_matches_ort(make_model([node], feeds, ["y"], 13, inits), feeds)


def test_pad_wrong_pad_count_is_refused_at_load_naming_node() -> None:
    feeds = {"x": np.zeros((2, 3), np.float32)}
    inits = {"pads": np.array([1, 1], dtype=np.int64)}
    node = helper.make_node("Pad", ["x", "pads"], ["y"], name="the_pad")
    with pytest.raises(InvalidModel, match="the_pad"):
        _run(make_model([node], feeds, ["y"], 13, inits), feeds)


# -- rearrangements ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode: str) -> None:
    feeds = {"x": RNG.standard_normal((2, 8, 3, 2)).astype(np.float32)}
    node = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


def test_space_to_depth() -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 4, 6)).astype(np.float32)}
    node = helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds)


def test_depth_space_round_trip() -> None:
    feeds = {"x": RNG.standard_normal((1, 12, 2, 3)).astype(np.float32)}
    nodes = [helper.make_node("DepthToSpace", ["x"], ["s"], blocksize=2, mode="CRD"),
             helper.make_node("SpaceToDepth", ["s"], ["y"], blocksize=2)]
    got = _run(make_model(nodes, feeds, ["y"], 13), feeds)[0]
    assert got.shape == feeds["x"].shape


@pytest.mark.parametrize(("center", "shape", "axes"), [
    ([0, 0], [3, 7], None), ([0], [2], [-1]), (None, [5, 2], [0, 2])])
def test_center_crop_pad(center: object, shape: list[int], axes: list[int] | None) -> None:
    x = RNG.standard_normal((4, 5) if axes is None else (4, 3, 5)).astype(np.float32)
    feeds = {"x": x}
    inits = {"shape": np.array(shape, dtype=np.int64)}
    attrs = {"axes": axes} if axes is not None else {}
    node = helper.make_node("CenterCropPad", ["x", "shape"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 18, inits), feeds)


# -- sampling ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample(mode: str, padding: str, align: int) -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 5, 6)).astype(np.float32),
             "grid": RNG.uniform(-1.2, 1.2, (2, 4, 3, 2)).astype(np.float32)}
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode=mode, padding_mode=padding,
                            align_corners=align)
    assert_matches_ort(make_model([node], feeds, ["y"], 20), feeds, rtol=1e-4, atol=1e-5)


def test_grid_sample_opset16_names() -> None:
    feeds = {"x": RNG.standard_normal((1, 1, 4, 4)).astype(np.float32),
             "grid": RNG.uniform(-1, 1, (1, 3, 3, 2)).astype(np.float32)}
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode="bicubic")
    assert_matches_ort(make_model([node], feeds, ["y"], 16), feeds, rtol=1e-4, atol=1e-5)


def test_grid_sample_volumetric() -> None:
    feeds = {"x": RNG.standard_normal((1, 2, 3, 4, 5)).astype(np.float32),
             "grid": RNG.uniform(-1, 1, (1, 2, 3, 2, 3)).astype(np.float32)}
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode="linear")
    _matches_reference(make_model([node], feeds, ["y"], 20), feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("size", "align"), [([2, 3, 4, 5], 0), ([1, 2, 3, 4, 5], 1)])
def test_affine_grid(size: list[int], align: int) -> None:
    n = size[0]
    theta_shape = (n, 2, 3) if len(size) == 4 else (n, 3, 4)
    feeds = {"theta": RNG.standard_normal(theta_shape).astype(np.float32)}
    inits = {"size": np.array(size, dtype=np.int64)}
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align)
    assert_matches_ort(make_model([node], feeds, ["grid"], 20, inits), feeds, atol=1e-5)


ROIS = np.array([[0.5, 0.5, 6.3, 5.1], [2, 1, 3, 7.5], [0, 0, 9, 9], [-2, -1, 3, 3]],
                dtype=np.float32)


@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("ratio", [0, 2])
def test_roi_align(ctm: str, ratio: int) -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 8, 8)).astype(np.float32), "rois": ROIS,
             "b": np.array([0, 1, 1, 0], dtype=np.int64)}
    node = helper.make_node("RoiAlign", ["x", "rois", "b"], ["y"], output_height=3,
                            output_width=2, sampling_ratio=ratio, spatial_scale=0.9,
                            coordinate_transformation_mode=ctm)
    assert_matches_ort(make_model([node], feeds, ["y"], 16), feeds, rtol=1e-5, atol=1e-5)


def test_roi_align_max_mode() -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 8, 8)).astype(np.float32), "rois": ROIS,
             "b": np.array([0, 1, 1, 0], dtype=np.int64)}
    node = helper.make_node("RoiAlign", ["x", "rois", "b"], ["y"], mode="max", output_height=2,
                            output_width=2, sampling_ratio=2)
    _matches_reference(make_model([node], feeds, ["y"], 16), feeds, rtol=1e-5, atol=1e-5)


def test_max_roi_pool() -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 8, 8)).astype(np.float32),
             "rois": np.array([[0, 1, 1, 5, 6], [1, 0, 2, 7, 3], [0, 3, 3, 3, 3]], np.float32)}
    node = helper.make_node("MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=[2, 3],
                            spatial_scale=1.0)
    assert_matches_ort(make_model([node], feeds, ["y"], 1), feeds)


# -- pooling-like and normalizations -------------------------------------------------------

def test_max_unpool_round_trip() -> None:
    feeds = {"x": RNG.standard_normal((1, 2, 4, 4)).astype(np.float32)}
    nodes = [helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("MaxUnpool", ["p", "i"], ["y"], kernel_shape=[2, 2],
                              strides=[2, 2])]
    assert_matches_ort(make_model(nodes, feeds, ["y"], 11), feeds)


def test_max_unpool_output_shape() -> None:
    feeds = {"x": np.array([[[[5, 6], [7, 8]]]], np.float32),
             "i": np.array([[[[5, 7], [13, 15]]]], np.int64)}
    inits = {"shape": np.array([1, 1, 5, 5], dtype=np.int64)}
    node = helper.make_node("MaxUnpool", ["x", "i", "shape"], ["y"], kernel_shape=[2, 2],
                            strides=[2, 2])
    _matches_reference(make_model([node], feeds, ["y"], 11, inits), feeds)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2], "p": 2},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 2], "p": 1},
    {"kernel_shape": [2, 3], "auto_pad": "SAME_UPPER", "p": 3},
    {"kernel_shape": [2, 2], "dilations": [2, 1], "p": 2},
    {"kernel_shape": [3], "strides": [2], "p": 2},
])
def test_lp_pool(attrs: dict[str, object]) -> None:
    rank = len(attrs["kernel_shape"])  # type: ignore[arg-type]
    shape = (1, 2, 7, 6)[: 2 + rank]
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    node = helper.make_node("LpPool", ["x"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 18), feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("axis", "p"), [(-1, 2), (0, 1), (1, 2)])
def test_lp_normalization(axis: int, p: int) -> None:
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    x[1] = 0.0  # a zero row must normalize to zeros, not NaN
    feeds = {"x": x}
    node = helper.make_node("LpNormalization", ["x"], ["y"], axis=axis, p=p)
    got = assert_matches_ort(make_model([node], feeds, ["y"], 1), feeds, rtol=1e-5, atol=1e-6)
    assert not np.isnan(got[0]).any()


@pytest.mark.parametrize("axes", [None, [1], [0, 2, 3], [-1]])
def test_mean_variance_normalization(axes: list[int] | None) -> None:
    feeds = {"x": RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)}
    attrs = {"axes": axes} if axes is not None else {}
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 13), feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attrs", [{}, {"strides": [2, 1], "pads": [1, 0, 1, 1]},
                                   {"dilations": [1, 2]}])
def test_col2im(attrs: dict[str, list[int]]) -> None:
    block = [2, 3]
    image = [5, 6]
    strides, pads = attrs.get("strides", [1, 1]), attrs.get("pads", [0, 0, 0, 0])
    dil = attrs.get("dilations", [1, 1])
    counts = [(image[i] + pads[i] + pads[i + 2] - (dil[i] * (block[i] - 1) + 1)) // strides[i] + 1
              for i in range(2)]
    feeds = {"x": RNG.standard_normal((2, 2 * 6, counts[0] * counts[1])).astype(np.float32)}
    inits = {"image": np.array(image, np.int64), "block": np.array(block, np.int64)}
    node = helper.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs)
    assert_matches_ort(make_model([node], feeds, ["y"], 18, inits), feeds, rtol=1e-5, atol=1e-5)


def test_col2im_3d() -> None:
    feeds = {"x": RNG.standard_normal((1, 8, 27)).astype(np.float32)}
    inits = {"image": np.array([4, 4, 4], np.int64), "block": np.array([2, 2, 2], np.int64)}
    node = helper.make_node("Col2Im", ["x", "image", "block"], ["y"])
    _matches_reference(make_model([node], feeds, ["y"], 18, inits), feeds, rtol=1e-5, atol=1e-5)
