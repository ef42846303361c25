"""ImageDecoder (opset 20): an encoded image (a 1-D uint8 tensor holding a JPEG, PNG, BMP,
TIFF, WebP, JPEG 2000 or PNM file) -> uint8 pixels [H, W, C] in RGB, BGR or Grayscale.

Decoding is Pillow's, the library ONNX's reference uses, so pixels agree with it exactly;
Pillow is optional (``pip install segflow[image]``) and a model with the op fails at load
without it. The output's shape comes from the file, so the node runs LOCAL, on the host.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from segflow.engine.base import ExecType
from segflow.errors import InvalidInput, InvalidModel, UnsupportedOp
from segflow.ir.graph import Node
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
# Pillow's mode for each ONNX pixel format; BGR decodes as RGB and reverses the channels.
_MODES = {"RGB": "RGB", "BGR": "RGB", "Grayscale": "L"}


def _pillow_image(label: str) -> ModuleType:
    try:
        return importlib.import_module("PIL.Image")
    except ImportError:
        raise UnsupportedOp(f"{label}: ImageDecoder needs the Pillow package "
                            "(pip install 'segflow[image]')") from None


def _image_decoder(node: Node, ctx: BindContext) -> Kernel:
    label = node.label
    pixel_format = str(node.attrs.get("pixel_format", "RGB"))
    if pixel_format not in _MODES:
        raise InvalidModel(f"{label}: pixel_format must be RGB, BGR or Grayscale, "
                           f"got {pixel_format!r}")
    image_module = _pillow_image(label)
    mode = _MODES[pixel_format]

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        encoded = inputs[0]
        assert encoded is not None
        if encoded.dtype != torch.uint8 or encoded.dim() != 1:
            raise InvalidInput("the encoded image must be a 1-D uint8 tensor, got "
                               f"{encoded.dtype} of shape {list(encoded.shape)}")
        data = encoded.cpu().numpy().tobytes()
        try:
            with image_module.open(io.BytesIO(data)) as image:
                pixels = np.array(image.convert(mode))
        except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad files
            raise InvalidInput("the input is not an image Pillow can decode "
                               f"({type(exc).__name__})") from None
        if pixel_format == "BGR":
            pixels = pixels[:, :, ::-1]
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        return [torch.from_numpy(np.ascontiguousarray(pixels)).to(encoded.device)]
    return kernel


OPS: list[OpDef] = [
    OpDef("ImageDecoder", _image_decoder, since=20, exec_type=ExecType.LOCAL,
          doc="host-side decoding with Pillow"),
]
