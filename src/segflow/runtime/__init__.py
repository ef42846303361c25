"""Runtime: plans bound to devices and engines, and the session API."""

from segflow.runtime.executor import Executor
from segflow.runtime.plan import Plan, make_plan
from segflow.runtime.session import InferenceSession, NodeArg
from segflow.runtime.stats import RunStats

__all__ = ["Executor", "InferenceSession", "NodeArg", "Plan", "RunStats", "make_plan"]
