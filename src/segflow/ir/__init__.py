"""segflow's intermediate representation."""

from segflow.ir.graph import Graph, IRError, Node, Value
from segflow.ir.types import Device, DeviceKind, Dim, DType, TensorSpec

__all__ = ["DType", "Device", "DeviceKind", "Dim", "Graph", "IRError", "Node", "TensorSpec",
           "Value"]
