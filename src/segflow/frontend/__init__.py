"""Frontends turn model formats into segflow graphs."""

from segflow.frontend.onnx_import import import_model, load_model

__all__ = ["import_model", "load_model"]
