"""A small helper that emits ONNX nodes and seeded weights for the model builders.

Every builder draws its weights through one `GraphBuilder`, in emission order, from
`numpy.random.default_rng(seed)`. The builder keeps two views of the weights: the ONNX
initializers and `state_dict`, the same arrays keyed and laid out the way the matching
PyTorch module expects them, so `torch_module` and `build` share weights by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17
IR_VERSION = 8
PRODUCER = "segflow.models"

Dim = int | str


class GraphBuilder:
    """Accumulates nodes, initializers and graph inputs/outputs for one ONNX graph."""

    def __init__(self, graph_name: str, seed: int) -> None:
        self.graph_name = graph_name
        self.rng = np.random.default_rng(seed)
        self.state_dict: dict[str, np.ndarray] = {}
        self._initializers: dict[str, np.ndarray] = {}
        self._nodes: list[onnx.NodeProto] = []
        self._node_names: set[str] = set()
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[onnx.ValueInfoProto] = []

    # -- weights and constants ---------------------------------------------------------

    def normal(self, shape: Sequence[int], std: float, mean: float = 0.0) -> np.ndarray:
        """Draw a float32 array from N(mean, std^2)."""
        draw = self.rng.standard_normal(tuple(shape), dtype=np.float32)
        draw *= np.float32(std)
        draw += np.float32(mean)
        return draw

    def uniform(self, shape: Sequence[int], low: float, high: float) -> np.ndarray:
        """Draw a float32 array from U(low, high)."""
        return self.rng.uniform(low, high, size=tuple(shape)).astype(np.float32)

    def param(self, name: str, array: np.ndarray) -> str:
        """Register a weight both as an initializer and in `state_dict`; returns its name."""
        self.state_dict[name] = array
        return self.initializer(name, array)

    def initializer(self, name: str, array: np.ndarray) -> str:
        """Register an initializer (constants and re-laid-out weights); returns its name."""
        if name in self._initializers:
            raise ValueError(f"duplicate initializer name {name!r}")
        # ascontiguousarray would turn a 0-d constant into shape (1,)
        self._initializers[name] = array if array.flags.c_contiguous else array.copy(order="C")
        return name

    def const(self, name: str, value: float | int | Sequence[int] | np.ndarray) -> str:
        """A shared constant initializer; the same name may be requested many times."""
        array = np.asarray(value)
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        if name in self._initializers:
            if not np.array_equal(self._initializers[name], array):
                raise ValueError(f"constant {name!r} redefined with a different value")
            return name
        return self.initializer(name, array)

    # -- nodes -------------------------------------------------------------------------

    def node(
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        *,
        output: str | None = None,
        **attrs: Any,
    ) -> str:
        """Emit a single-output node named `name`; its output value is `output` or `name`."""
        out = output if output is not None else name
        self.multi_node(op_type, inputs, name, [out], **attrs)
        return out

    def multi_node(
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        outputs: Sequence[str],
        **attrs: Any,
    ) -> list[str]:
        """Emit a node with explicit output names."""
        if name in self._node_names:
            raise ValueError(f"duplicate node name {name!r}")
        self._node_names.add(name)
        self._nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name, **attrs))
        return list(outputs)

    # -- graph interface ---------------------------------------------------------------

    def add_input(self, name: str, elem_type: int, shape: Sequence[Dim]) -> str:
        """Declare a graph input (`shape` entries may be symbolic names)."""
        self._inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def add_output(self, name: str, elem_type: int, shape: Sequence[Dim]) -> str:
        """Declare a graph output; `name` must be produced by an emitted node."""
        self._outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def to_model(self) -> onnx.ModelProto:
        """Assemble the ModelProto (default-domain opset 17, IR version 8)."""
        graph = helper.make_graph(self._nodes, self.graph_name, self._inputs, self._outputs)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=PRODUCER
        )
        model.ir_version = IR_VERSION
        # Filled in place: passing them to make_graph/make_model copies every weight twice,
        # which is a second or more for bert_base.
        for name, array in self._initializers.items():
            tensor = model.graph.initializer.add()
            tensor.name = name
            tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
            tensor.dims.extend(array.shape)
            tensor.raw_data = array.tobytes()
        return model

    # -- layers shared by several families ---------------------------------------------

    def conv(
        self,
        x: str,
        prefix: str,
        cin: int,
        cout: int,
        kernel: int,
        *,
        stride: int = 1,
        group: int = 1,
    ) -> str:
        """Bias-free Conv with He-normal weights and 'same'-style padding kernel // 2."""
        fan_in = cin // group * kernel * kernel
        weight = self.normal((cout, cin // group, kernel, kernel), std=float(np.sqrt(2.0 / fan_in)))
        w = self.param(f"{prefix}.weight", weight)
        pad = kernel // 2
        return self.node(
            "Conv",
            [x, w],
            prefix,
            dilations=[1, 1],
            group=group,
            kernel_shape=[kernel, kernel],
            pads=[pad, pad, pad, pad],
            strides=[stride, stride],
        )

    def batch_norm(self, x: str, prefix: str, channels: int, gamma: tuple[float, float]) -> str:
        """Inference BatchNormalization with random affine and running statistics."""
        scale = self.param(f"{prefix}.weight", self.uniform((channels,), *gamma))
        bias = self.param(f"{prefix}.bias", self.normal((channels,), std=0.1))
        mean = self.param(f"{prefix}.running_mean", self.normal((channels,), std=0.1))
        var = self.param(f"{prefix}.running_var", self.uniform((channels,), 0.5, 1.5))
        return self.node(
            "BatchNormalization", [x, scale, bias, mean, var], prefix, epsilon=1e-5, momentum=0.9
        )

    def gemm(
        self,
        x: str,
        prefix: str,
        fin: int,
        fout: int,
        *,
        std: float | None = None,
        output: str | None = None,
    ) -> str:
        """Linear layer as the exporter emits it for 2-D input: Gemm(transB=1).

        Weights default to N(0, 1/fin) (LeCun); biases use a tenth of the weight std.
        """
        std = float(np.sqrt(1.0 / fin)) if std is None else std
        w = self.param(f"{prefix}.weight", self.normal((fout, fin), std=std))
        b = self.param(f"{prefix}.bias", self.normal((fout,), std=0.1 * std))
        return self.node("Gemm", [x, w, b], prefix, output=output, alpha=1.0, beta=1.0, transB=1)

    def matmul_add(self, x: str, prefix: str, fin: int, fout: int, *, std: float) -> str:
        """Linear layer as MatMul + Add, for inputs of any rank.

        `state_dict` holds the torch layout [fout, fin]; the ONNX initializer
        `{prefix}.weight_t` holds its transpose [fin, fout], as the exporter stores it.
        """
        weight_t = self.normal((fin, fout), std=std)
        self.state_dict[f"{prefix}.weight"] = weight_t.T
        w = self.initializer(f"{prefix}.weight_t", weight_t)
        b = self.param(f"{prefix}.bias", self.normal((fout,), std=std))
        y = self.node("MatMul", [x, w], f"{prefix}.matmul")
        return self.node("Add", [y, b], f"{prefix}.add")


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
