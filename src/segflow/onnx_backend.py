"""An ``onnx.backend.base.Backend`` over segflow, for ONNX's conformance tests.

>>> from segflow.onnx_backend import SegflowBackend
>>> rep = SegflowBackend.prepare(model)              # doctest: +SKIP
>>> outputs = rep.run([x])                           # doctest: +SKIP

Models run through ``InferenceSession(model, engine="inline")``; an unsupported
op raises :class:`segflow.UnsupportedOp` from :meth:`SegflowBackend.prepare`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import onnx
import onnx.backend.base as onnx_backend
import torch

from segflow.errors import InvalidInput
from segflow.ir import lowbit
from segflow.ir.types import DType
from segflow.runtime.session import InferenceSession

Tensor = torch.Tensor


def _device_name(device: str) -> str:
    """ONNX backend device strings ("CPU", "CUDA:1") -> segflow's ("cpu", "cuda:1")."""
    kind, _, index = device.partition(":")
    kind = kind.strip().lower()
    return f"{kind}:{index or 0}" if kind == "cuda" else "cpu"


def _to_tensor(array: Any) -> Any:
    """A feed as a torch tensor; bfloat16 arrays (ml_dtypes) are reinterpreted bitwise.
    A sequence (a list) becomes a list of tensors, an empty optional (None) stays None."""
    if isinstance(array, Tensor) or array is None:
        return array
    if isinstance(array, onnx.TensorProto):
        array = onnx.numpy_helper.to_array(array)
    if isinstance(array, (list, tuple)):
        return [_to_tensor(x) for x in array]
    arr = np.asarray(array)
    if arr.dtype in lowbit.NUMPY_DTYPES:
        return lowbit.to_tensor(arr)   # float8, int4 ...: their torch form
    if arr.dtype.name == "bfloat16":
        bits = np.array(arr, copy=True, order="C").view(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16)  # same bits, torch's bfloat16
    if arr.dtype == object or arr.dtype.kind in ("U", "S"):
        return cast(Tensor, arr)  # a string feed: the session checks and converts it
    return torch.from_numpy(np.array(arr, copy=True, order="C"))  # keeps 0-d arrays 0-d


def _to_numpy(tensor: Any, dtype: DType | None) -> Any:
    """An output as numpy: a sequence (a list) as a list of arrays, None as None; ``dtype``,
    the graph's type of it, tells a sub-byte type from the ordinary type of its container."""
    if tensor is None:
        return None
    if isinstance(tensor, list):
        return [_to_numpy(t, dtype) for t in tensor]
    if isinstance(tensor, np.ndarray):  # a string output
        return tensor
    t = tensor.detach().cpu()
    if dtype is not None and dtype.is_lowbit:
        return np.array(lowbit.to_numpy(t, dtype), copy=True)
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # onnx depends on it; only needed for bfloat16 outputs

        return t.contiguous().view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return np.array(t.numpy(), copy=True)


class SegflowRep(onnx_backend.BackendRep):
    """A prepared model: one InferenceSession, run with positional or named feeds."""

    def __init__(self, session: InferenceSession) -> None:
        self.session = session
        self.input_names = [arg.name for arg in session.get_inputs()]
        self.output_names = [arg.name for arg in session.get_outputs()]
        self.output_dtypes = [v.spec.dtype for v in session.graph.outputs]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, Mapping):
            feeds = {name: _to_tensor(value) for name, value in inputs.items()}
        else:
            if isinstance(inputs, (np.ndarray, Tensor)):
                inputs = [inputs]
            values = list(inputs)
            if len(values) != len(self.input_names):
                raise InvalidInput(f"expected {len(self.input_names)} inputs "
                                   f"({', '.join(self.input_names)}), got {len(values)}")
            feeds = {name: _to_tensor(v) for name, v in zip(self.input_names, values)}
        outputs = self.session.run_tensors(feeds)
        arrays = [_to_numpy(t, dtype) for t, dtype in zip(outputs, self.output_dtypes)]
        return onnx_backend.namedtupledict("Outputs", self.output_names)(*arrays)


class SegflowBackend(onnx_backend.Backend):
    """ONNX backend API: ``prepare``, ``run_model``, ``run_node``, ``supports_device``."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU",
                **kwargs: Any) -> SegflowRep:
        # engine="inline": deterministic, no worker threads to leak across thousands of cases.
        session = InferenceSession(model, device=_device_name(device), engine="inline")
        return SegflowRep(session)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        """Wrap ``node`` in a one-node model whose inputs are typed from ``inputs``."""
        arrays = [None if x is None else np.asarray(x) for x in inputs]
        graph_inputs = []
        feeds = []
        for name, array in zip(node.input, arrays):
            if not name or array is None:
                continue
            graph_inputs.append(onnx.helper.make_tensor_value_info(
                name, DType.from_numpy(array.dtype).value, array.shape))
            feeds.append(array)
        graph_outputs = []
        for i, name in enumerate(node.output):
            if not name:
                continue
            if outputs_info is not None and i < len(outputs_info):
                dtype, shape = outputs_info[i]
                info = onnx.helper.make_tensor_value_info(
                    name, DType.from_numpy(dtype).value, shape)
            else:
                info = onnx.helper.make_empty_tensor_value_info(name)
            graph_outputs.append(info)
        opset = int(kwargs.get("opset_version", onnx.defs.onnx_opset_version()))
        graph = onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        model = onnx.helper.make_model(
            graph, opset_imports=[onnx.helper.make_opsetid(node.domain or "", opset)])
        return cls.run_model(model, feeds, device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        kind = device.partition(":")[0].strip().upper()
        if kind == "CPU":
            return True
        return kind == "CUDA" and torch.cuda.is_available()


prepare = SegflowBackend.prepare
run_model = SegflowBackend.run_model
run_node = SegflowBackend.run_node
supports_device = SegflowBackend.supports_device
