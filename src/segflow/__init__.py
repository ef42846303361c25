"""segflow: run neural-network graphs in bulk segments through a dependency engine.

>>> import segflow
>>> sess = segflow.InferenceSession("model.onnx", device="cpu")   # doctest: +SKIP
>>> outs = sess.run(None, {"input": x})                           # doctest: +SKIP
>>> sess.last_run_stats                                           # doctest: +SKIP
>>> print(sess.explain())                                         # doctest: +SKIP
"""

from segflow.errors import (
    ExecutionError,
    InvalidInput,
    InvalidModel,
    InvalidSetting,
    SegflowError,
    UnsupportedOp,
)
from segflow.profiler import profile
from segflow.runtime.session import InferenceSession, NodeArg, PendingRun
from segflow.runtime.stats import RunStats
from segflow.runtime.training import CrossEntropyLoss, GradReq, StepResult, TrainingSession

__version__ = "0.1.0"

__all__ = [
    "CrossEntropyLoss",
    "ExecutionError",
    "GradReq",
    "InferenceSession",
    "InvalidInput",
    "InvalidModel",
    "InvalidSetting",
    "NodeArg",
    "PendingRun",
    "RunStats",
    "SegflowError",
    "StepResult",
    "TrainingSession",
    "UnsupportedOp",
    "__version__",
    "profile",
]
