"""segflow: run neural-network graphs in bulk segments through a dependency engine.

>>> import segflow
>>> sess = segflow.InferenceSession("model.onnx", device="cpu")   # doctest: +SKIP
>>> outs = sess.run(None, {"input": x})                           # doctest: +SKIP
>>> sess.last_run_stats                                           # doctest: +SKIP
>>> print(sess.explain())                                         # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from segflow.errors import (
    CommunicationError,
    ExecutionError,
    InvalidInput,
    InvalidModel,
    InvalidSetting,
    NativeKernelsUnavailable,
    SegflowError,
    SegflowWarning,
    UnsupportedOp,
)

if TYPE_CHECKING:
    from segflow.frontend.model_info import ModelMetadata
    from segflow.profiler import profile
    from segflow.runtime.io_binding import IOBinding, OrtValue
    from segflow.runtime.ort_api import (
        ExecutionMode,
        ExecutionOrder,
        GraphOptimizationLevel,
        RunOptions,
        SessionOptions,
    )
    from segflow.runtime.providers import get_all_providers, get_available_providers, get_device
    from segflow.runtime.session import InferenceSession, NodeArg, PendingRun
    from segflow.runtime.stats import RunStats
    from segflow.runtime.training import (
        CrossEntropyLoss,
        GradReq,
        StepResult,
        TrainingSession,
    )

# The public names that need torch and onnx load on first use (PEP 562), so that
# ``import segflow.errors`` and ``segflow --help`` do not pay their ~3 s import.
_LAZY = {
    "profile": "segflow.profiler",
    "InferenceSession": "segflow.runtime.session",
    "NodeArg": "segflow.runtime.session",
    "PendingRun": "segflow.runtime.session",
    "RunStats": "segflow.runtime.stats",
    "CrossEntropyLoss": "segflow.runtime.training",
    "GradReq": "segflow.runtime.training",
    "StepResult": "segflow.runtime.training",
    "TrainingSession": "segflow.runtime.training",
    # onnxruntime's names, so that ``import segflow as ort`` runs onnxruntime scripts.
    "SessionOptions": "segflow.runtime.ort_api",
    "RunOptions": "segflow.runtime.ort_api",
    "GraphOptimizationLevel": "segflow.runtime.ort_api",
    "ExecutionMode": "segflow.runtime.ort_api",
    "ExecutionOrder": "segflow.runtime.ort_api",
    "ModelMetadata": "segflow.frontend.model_info",
    "OrtValue": "segflow.runtime.io_binding",
    "IOBinding": "segflow.runtime.io_binding",
    "get_all_providers": "segflow.runtime.providers",
    "get_available_providers": "segflow.runtime.providers",
    "get_device": "segflow.runtime.providers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'segflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "CommunicationError",
    "CrossEntropyLoss",
    "ExecutionError",
    "ExecutionMode",
    "ExecutionOrder",
    "GradReq",
    "GraphOptimizationLevel",
    "IOBinding",
    "InferenceSession",
    "InvalidInput",
    "InvalidModel",
    "InvalidSetting",
    "ModelMetadata",
    "NativeKernelsUnavailable",
    "NodeArg",
    "OrtValue",
    "PendingRun",
    "RunOptions",
    "RunStats",
    "SegflowError",
    "SegflowWarning",
    "SessionOptions",
    "StepResult",
    "TrainingSession",
    "UnsupportedOp",
    "__version__",
    "get_all_providers",
    "get_available_providers",
    "get_device",
    "profile",
]
