"""onnxruntime's OrtValue and IOBinding over torch tensors.

An :class:`OrtValue` holds one tensor on a device (CPU arrays are shared, not copied,
as onnxruntime shares them). An :class:`IOBinding` names a run's inputs and outputs
ahead of it: inputs as arrays, OrtValues, torch tensors or raw buffers, outputs as
devices to leave them on or preallocated buffers to write them into; the session's
``run_with_iobinding`` runs it without the numpy round trip of ``run``.

>>> binding = sess.io_binding()                                # doctest: +SKIP
>>> binding.bind_cpu_input("x", x)                             # doctest: +SKIP
>>> binding.bind_output("y")                                   # doctest: +SKIP
>>> sess.run_with_iobinding(binding)                           # doctest: +SKIP
>>> y = binding.copy_outputs_to_cpu()[0]                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from segflow.errors import InvalidInput
from segflow.ir.types import DType

Tensor = torch.Tensor


def _device(device_type: str, device_id: int) -> torch.device:
    kind = str(device_type).strip().lower()
    if kind == "gpu":
        kind = "cuda"
    if kind not in ("cpu", "cuda"):
        raise InvalidInput(f"device_type={device_type!r}: expected 'cpu' or 'cuda'")
    return torch.device("cpu") if kind == "cpu" else torch.device("cuda", int(device_id))


def _dtype(element_type: Any) -> DType:
    try:
        if isinstance(element_type, torch.dtype):
            return DType.from_torch(element_type)
        if isinstance(element_type, int) and not isinstance(element_type, bool):
            return DType.from_onnx(element_type)
        return DType.from_numpy(element_type)
    except (TypeError, ValueError):
        raise InvalidInput(f"element_type={element_type!r}: expected a numpy dtype "
                           "(np.float32, ...)") from None


class _Buffer:
    """A raw buffer seen through numpy's or CUDA's array interface, so that numpy and
    torch can view it without a copy."""

    def __init__(self, pointer: int, shape: Sequence[int], dtype: np.dtype, cuda: bool) -> None:
        described = {"shape": tuple(int(d) for d in shape), "typestr": dtype.str,
                     "data": (int(pointer), False), "version": 3}
        if cuda:
            self.__cuda_array_interface__ = described
        else:
            self.__array_interface__ = described


def tensor_at(pointer: int, shape: Sequence[int], element_type: Any,
              device: torch.device) -> Tensor:
    """A tensor over the memory at ``pointer`` (shared, not copied)."""
    if not pointer:
        raise InvalidInput("buffer_ptr is null")
    dtype = _dtype(element_type)
    view = _Buffer(pointer, shape, dtype.numpy, device.type == "cuda")
    if device.type == "cuda":
        return torch.as_tensor(view, device=device)
    return torch.from_numpy(np.asarray(view))


class OrtValue:
    """A tensor on a device, as onnxruntime's ``OrtValue`` (segflow holds a torch tensor:
    :attr:`tensor`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise InvalidInput(f"OrtValue holds a tensor, got {type(tensor).__name__}")
        self.tensor = tensor

    @staticmethod
    def ortvalue_from_numpy(array: Any, device_type: str = "cpu",
                            device_id: int = 0) -> OrtValue:
        """``array`` (numpy, or a torch tensor) on the device; on the CPU it is shared."""
        device = _device(device_type, device_id)
        if isinstance(array, Tensor):
            return OrtValue(array.to(device))
        if not isinstance(array, np.ndarray):
            raise InvalidInput(f"ortvalue_from_numpy: expected a numpy array, got "
                               f"{type(array).__name__}")
        if array.dtype.kind in "OUS":
            raise InvalidInput("ortvalue_from_numpy: string arrays are not bound as OrtValues "
                               "(a string tensor is fed to run() as a numpy array)")
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return OrtValue(tensor if device.type == "cpu" else tensor.to(device))

    @staticmethod
    def ortvalue_from_shape_and_type(shape: Sequence[int], element_type: Any = np.float32,
                                     device_type: str = "cpu", device_id: int = 0) -> OrtValue:
        """An uninitialized tensor of ``shape`` and ``element_type`` on the device."""
        dtype = _dtype(element_type)
        return OrtValue(torch.empty(tuple(int(d) for d in shape), dtype=dtype.torch,
                                    device=_device(device_type, device_id)))

    def numpy(self) -> np.ndarray:
        """The tensor as a numpy array (a copy for device tensors, shared on the CPU)."""
        t = self.tensor.detach()
        return t.cpu().numpy() if not t.is_cpu else t.numpy()

    def shape(self) -> list[int]:
        return list(self.tensor.shape)

    def data_type(self) -> str:
        return f"tensor({DType.from_torch(self.tensor.dtype).onnx_name})"

    def element_type(self) -> int:
        """The ONNX element type code (1 for float)."""
        return DType.from_torch(self.tensor.dtype).value

    def device_name(self) -> str:
        return self.tensor.device.type

    def data_ptr(self) -> int:
        return int(self.tensor.data_ptr())

    def tensor_size_in_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def is_tensor(self) -> bool:
        return True

    def has_value(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"OrtValue({self.data_type()}, shape={self.shape()}, device={self.device_name()})"


RunTensors = Callable[[dict[str, Tensor]], list[Tensor]]


class IOBinding:
    """A run's inputs and outputs, bound ahead of ``run_with_iobinding`` (onnxruntime's
    ``IOBinding``). Made by ``InferenceSession.io_binding()``."""

    def __init__(self, output_names: Sequence[str], device: torch.device) -> None:
        self._output_names = list(output_names)
        self._device = device
        self._inputs: dict[str, Tensor] = {}
        # Bound outputs in bind order: name -> (the device to leave it on, a buffer to
        # write it into or None).
        self._outputs: dict[str, tuple[torch.device, Tensor | None]] = {}
        self._results: list[OrtValue] = []

    # -- inputs --------------------------------------------------------------------------
    def bind_cpu_input(self, name: str, array: np.ndarray) -> None:
        self._inputs[name] = OrtValue.ortvalue_from_numpy(array).tensor

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any,
                   shape: Sequence[int], buffer_ptr: int) -> None:
        """Bind the memory at ``buffer_ptr`` (``shape`` elements of ``element_type``)."""
        self._inputs[name] = tensor_at(buffer_ptr, shape, element_type,
                                       _device(device_type, device_id))

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue | Tensor) -> None:
        self._inputs[name] = _tensor_of(ortvalue, name)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def synchronize_inputs(self) -> None:
        """Nothing to wait for: inputs are read when the run starts."""

    # -- outputs -------------------------------------------------------------------------
    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type: Any = None, shape: Sequence[int] | None = None,
                    buffer_ptr: int | None = None) -> None:
        """Leave output ``name`` on the device, or with ``buffer_ptr`` (and its element
        type and shape) write it into that memory."""
        self._check_output(name)
        device = _device(device_type, device_id)
        buffer = None
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise InvalidInput(f"bind_output({name!r}): a buffer_ptr needs its "
                                   "element_type and shape")
            buffer = tensor_at(buffer_ptr, shape, element_type, device)
        self._outputs[name] = (device, buffer)

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue | Tensor) -> None:
        """Write output ``name`` into ``ortvalue`` (preallocated, of the output's shape)."""
        self._check_output(name)
        tensor = _tensor_of(ortvalue, name)
        self._outputs[name] = (tensor.device, tensor)

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    def synchronize_outputs(self) -> None:
        """Wait for the device to finish writing the outputs (on the CPU,
        ``run_with_iobinding`` returns with them ready)."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def get_outputs(self) -> list[OrtValue]:
        """The last run's outputs, in bind order."""
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        """The last run's outputs as numpy arrays (copies: later runs do not change them)."""
        return [np.array(v.numpy(), copy=True) for v in self._results]

    # -- running -------------------------------------------------------------------------
    def execute(self, run_tensors: RunTensors) -> None:
        """Run with the bound inputs; keep the bound outputs (``run_with_iobinding``)."""
        if not self._outputs:
            raise InvalidInput("no outputs are bound; call bind_output first")
        outputs = run_tensors(dict(self._inputs))
        results = []
        for name, (device, buffer) in self._outputs.items():
            tensor = outputs[self._output_names.index(name)]
            if buffer is None:
                results.append(OrtValue(tensor.to(device)))
                continue
            if tuple(buffer.shape) != tuple(tensor.shape) or buffer.dtype != tensor.dtype:
                raise InvalidInput(
                    f"output {name!r} is {DType.from_torch(tensor.dtype).onnx_name} "
                    f"{list(tensor.shape)}, but its bound buffer is "
                    f"{DType.from_torch(buffer.dtype).onnx_name} {list(buffer.shape)}")
            buffer.copy_(tensor)
            results.append(OrtValue(buffer))
        self._results = results

    def _check_output(self, name: str) -> None:
        if name not in self._output_names:
            raise InvalidInput(f"unknown output name {name!r}; the model's outputs are "
                               f"{', '.join(self._output_names)}")


def _tensor_of(value: OrtValue | Tensor, name: str) -> Tensor:
    if isinstance(value, OrtValue):
        return value.tensor
    if isinstance(value, Tensor):
        return value
    raise InvalidInput(f"{name!r}: expected an OrtValue or a torch tensor, "
                       f"got {type(value).__name__}")
