"""ImageDecoder: pixels of lossless files exactly, lossy ones as ONNX's reference decodes
them; bad bytes, a missing Pillow and an unknown pixel format are clear errors."""

from __future__ import annotations

import importlib
import io
from types import ModuleType

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from ort_compare import make_model

import segflow
from segflow.engine.base import ExecType
from segflow.errors import ExecutionError, InvalidModel, UnsupportedOp
from segflow.ops import image_decoder

Image = pytest.importorskip("PIL.Image")
RNG = np.random.default_rng(0)


def _encode(pixels: np.ndarray, fmt: str, mode: str = "RGB") -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buffer, format=fmt)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


def _model(encoded: np.ndarray, pixel_format: str = "RGB") -> onnx.ModelProto:
    node = helper.make_node("ImageDecoder", ["data"], ["pixels"], pixel_format=pixel_format)
    return make_model([node], {"data": encoded}, ["pixels"], 20)


def _decode(encoded: np.ndarray, pixel_format: str = "RGB") -> np.ndarray:
    sess = segflow.InferenceSession(_model(encoded, pixel_format), engine="inline")
    return sess.run(None, {"data": encoded})[0]


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "PPM"])
def test_lossless_formats_give_the_pixels(fmt: str) -> None:
    pixels = RNG.integers(0, 256, (7, 11, 3), dtype=np.uint8)
    encoded = _encode(pixels, fmt)
    rgb = _decode(encoded)
    assert rgb.dtype == np.uint8 and rgb.shape == (7, 11, 3)
    np.testing.assert_array_equal(rgb, pixels)
    np.testing.assert_array_equal(_decode(encoded, "BGR"), pixels[:, :, ::-1])


def test_grayscale_uses_pillows_luma() -> None:
    pixels = RNG.integers(0, 256, (5, 6, 3), dtype=np.uint8)
    gray = _decode(_encode(pixels, "PNG"), "Grayscale")
    assert gray.shape == (5, 6, 1)
    expected = np.asarray(Image.fromarray(pixels).convert("L"))
    np.testing.assert_array_equal(gray[:, :, 0], expected)


@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
def test_jpeg_matches_reference(pixel_format: str) -> None:
    pixels = RNG.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    encoded = _encode(pixels, "JPEG")
    expected = ReferenceEvaluator(_model(encoded, pixel_format)).run(None, {"data": encoded})[0]
    np.testing.assert_array_equal(_decode(encoded, pixel_format), expected)


def test_rgba_png_decodes_to_three_channels() -> None:
    pixels = RNG.integers(0, 256, (4, 4, 4), dtype=np.uint8)
    rgb = _decode(_encode(pixels, "PNG", mode="RGBA"))
    np.testing.assert_array_equal(rgb, pixels[:, :, :3])


def test_node_runs_on_the_host() -> None:
    assert image_decoder.OPS[0].exec_type is ExecType.LOCAL


def test_bytes_that_are_no_image_are_a_clear_error() -> None:
    encoded = np.frombuffer(b"certainly not an image", dtype=np.uint8)
    with pytest.raises(ExecutionError, match="ImageDecoder.*InvalidInput: the input is not "
                                             "an image Pillow can decode"):
        _decode(encoded)


def test_unknown_pixel_format_is_invalid() -> None:
    encoded = _encode(np.zeros((2, 2, 3), np.uint8), "PNG")
    with pytest.raises(InvalidModel, match="pixel_format"):
        segflow.InferenceSession(_model(encoded, "CMYK"), engine="inline")


def test_without_pillow_the_model_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_pillow(name: str, package: str | None = None) -> ModuleType:
        if name.startswith("PIL"):
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(image_decoder.importlib, "import_module", no_pillow)
    encoded = _encode(np.zeros((2, 2, 3), np.uint8), "PNG")
    with pytest.raises(UnsupportedOp, match="Pillow"):
        segflow.InferenceSession(_model(encoded), engine="inline")
