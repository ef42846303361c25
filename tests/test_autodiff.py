"""Gradients of every covered op, ResNet-18 and mlp_chain against torch.autograd.

Each op case builds ``loss = ReduceSum(op(params...) * R)`` for a random R,
trains nothing (optimizer None), and compares every parameter's gradient with
torch.autograd on the same float64 data.

Tolerances: float64 everywhere, ``rtol=1e-7, atol=1e-9`` for single ops and
``rtol=1e-6, atol=1e-8`` for the whole networks (different reduction orders).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper

import segflow
from segflow import models
from segflow.frontend.builder import GraphBuilder, Sym
from segflow.ir import DType
from segflow.ops import default_registry
from segflow.passes.autodiff import differentiate

OP_RTOL, OP_ATOL = 1e-7, 1e-9
NET_RTOL, NET_ATOL = 1e-6, 1e-8

Build = Callable[[GraphBuilder, dict[str, Sym]], Sym]
TorchFn = Callable[..., torch.Tensor]


def _rand(rng: np.random.Generator, *shape: int, positive: bool = False) -> np.ndarray:
    data = rng.standard_normal(shape)
    return np.abs(data) + 0.5 if positive else data


def check_grads(params: dict[str, np.ndarray], build: Build, reference: TorchFn,
                consts: dict[str, np.ndarray] | None = None) -> segflow.TrainingSession:
    """Gradients of sum(op(...) * R) from segflow and from torch.autograd must agree."""
    consts = consts or {}
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    expected = reference(**leaves, **{n: torch.tensor(a) for n, a in consts.items()})
    weights = np.random.default_rng(7).standard_normal(tuple(expected.shape))
    (expected * torch.tensor(weights)).sum().backward()

    b = GraphBuilder("case")
    syms = {n: b.param(n, a) for n, a in params.items()}
    syms.update({n: b.const(a, name=n) for n, a in consts.items()})
    y = build(b, syms)
    loss = b.op("ReduceSum", b.op("Mul", y, b.const(weights)), keepdims=0)
    b.output(loss, "loss")
    sess = segflow.TrainingSession(b.to_model(), loss="loss", params=list(params),
                                   engine="inline")
    sess.step({})
    grads = sess.gradients()
    for name, leaf in leaves.items():
        assert leaf.grad is not None
        torch.testing.assert_close(grads[name], leaf.grad, rtol=OP_RTOL, atol=OP_ATOL,
                                   msg=lambda m, n=name: f"d/d{n}: {m}")
    return sess


def _op(op: str, *names: str, outputs: int = 1, **attrs: object) -> Build:
    def build(b: GraphBuilder, s: dict[str, Sym]) -> Sym:
        out = b.op(op, *(s[n] if n else None for n in names), outputs=outputs, **attrs)
        return out[0] if outputs > 1 else out
    return build


RNG = np.random.default_rng(0)

ELEMENTWISE = [
    ("Add", {"a": _rand(RNG, 3, 4), "b": _rand(RNG, 4)}, lambda a, b: a + b),
    ("Add", {"a": _rand(RNG, 3, 4), "b": _rand(RNG, 3, 4)}, lambda a, b: a + b),
    ("Sub", {"a": _rand(RNG, 2, 3, 4), "b": _rand(RNG, 3, 1)}, lambda a, b: a - b),
    ("Mul", {"a": _rand(RNG, 3, 4), "b": _rand(RNG, 3, 1)}, lambda a, b: a * b),
    ("Div", {"a": _rand(RNG, 3, 4), "b": _rand(RNG, 4, positive=True)}, lambda a, b: a / b),
    ("Pow", {"a": _rand(RNG, 3, 4, positive=True), "b": _rand(RNG, 4)}, lambda a, b: a**b),
]
UNARY = [
    ("Neg", {}, torch.neg, False),
    ("Sqrt", {}, torch.sqrt, True),
    ("Exp", {}, torch.exp, False),
    ("Log", {}, torch.log, True),
    ("Reciprocal", {}, torch.reciprocal, True),
    ("Abs", {}, torch.abs, False),
    ("Relu", {}, torch.relu, False),
    ("Sigmoid", {}, torch.sigmoid, False),
    ("Tanh", {}, torch.tanh, False),
    ("Gelu", {}, lambda x: F.gelu(x), False),
    ("Gelu", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh"), False),
    ("LeakyRelu", {"alpha": 0.2}, lambda x: F.leaky_relu(x, 0.2), False),
    ("Softplus", {}, lambda x: F.softplus(x), False),
    ("Erf", {}, torch.erf, False),
    ("Sin", {}, torch.sin, False),
    ("Cos", {}, torch.cos, False),
]


@pytest.mark.parametrize(("op", "params", "reference"), ELEMENTWISE,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(ELEMENTWISE)])
def test_binary_broadcasting(op: str, params: dict[str, np.ndarray], reference: TorchFn) -> None:
    check_grads(params, _op(op, "a", "b"), reference)


@pytest.mark.parametrize(("op", "attrs", "reference", "positive"), UNARY,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(UNARY)])
def test_unary(op: str, attrs: dict[str, object], reference: TorchFn, positive: bool) -> None:
    x = _rand(np.random.default_rng(1), 3, 5, positive=positive)
    check_grads({"x": x}, _op(op, "x", **attrs), lambda x: reference(x))


def test_clip() -> None:
    x = _rand(np.random.default_rng(2), 4, 5)
    check_grads({"x": x}, lambda b, s: b.op("Clip", s["x"], b.const(np.array(-0.5)),
                                            b.const(np.array(0.7))),
                lambda x: torch.clamp(x, -0.5, 0.7))


@pytest.mark.parametrize("op", ["Sum", "Mean"])
def test_variadic(op: str) -> None:
    rng = np.random.default_rng(3)
    params = {"a": _rand(rng, 2, 3), "b": _rand(rng, 3), "c": _rand(rng, 2, 1)}
    scale = 1.0 if op == "Sum" else 1.0 / 3
    check_grads(params, _op(op, "a", "b", "c"), lambda a, b, c: (a + b + c) * scale)


def test_shared_value_gradients_accumulate() -> None:
    x = _rand(np.random.default_rng(4), 3, 3)
    check_grads({"x": x}, lambda b, s: b.op("Mul", b.op("Tanh", s["x"]), s["x"]) + s["x"],
                lambda x: torch.tanh(x) * x + x)


CONV = [
    ({"pads": [1, 1, 1, 1]}, 1, {"padding": 1}),
    ({"pads": [1, 1, 1, 1], "strides": [2, 2]}, 1, {"padding": 1, "stride": 2}),
    ({"group": 2, "dilations": [2, 2], "pads": [2, 2, 2, 2]}, 2,
     {"groups": 2, "dilation": 2, "padding": 2}),
    ({"pads": [0, 1, 2, 1]}, 1, "asym"),
]


@pytest.mark.parametrize(("attrs", "groups", "torch_kw"), CONV)
@pytest.mark.parametrize("bias", [False, True])
def test_conv(attrs: dict[str, object], groups: int, torch_kw: object, bias: bool) -> None:
    rng = np.random.default_rng(5)
    params = {"x": _rand(rng, 2, 4, 7, 6), "w": _rand(rng, 6, 4 // groups, 3, 3)}
    if bias:
        params["b"] = _rand(rng, 6)

    def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                  ) -> torch.Tensor:
        if torch_kw == "asym":
            return F.conv2d(F.pad(x, [1, 1, 0, 2]), w, b)
        assert isinstance(torch_kw, dict)
        return F.conv2d(x, w, b, **torch_kw)

    names = ("x", "w", "b") if bias else ("x", "w")
    check_grads(params, _op("Conv", *names, **attrs), reference)


@pytest.mark.parametrize(("ta", "tb"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm(ta: int, tb: int) -> None:
    rng = np.random.default_rng(6)
    a = _rand(rng, 3, 4) if not ta else _rand(rng, 4, 3)
    bm = _rand(rng, 4, 5) if not tb else _rand(rng, 5, 4)
    params = {"a": a, "b": bm, "c": _rand(rng, 5)}

    def reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return 0.7 * ((a.t() if ta else a) @ (b.t() if tb else b)) + 1.3 * c

    check_grads(params, _op("Gemm", "a", "b", "c", transA=ta, transB=tb, alpha=0.7, beta=1.3),
                reference)


@pytest.mark.parametrize(("sa", "sb"), [((2, 3, 4), (4, 5)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)),
                                        ((1, 3, 4), (2, 4, 2))])
def test_matmul(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    check_grads({"a": _rand(rng, *sa), "b": _rand(rng, *sb)}, _op("MatMul", "a", "b"),
                lambda a, b: a @ b)


def test_batchnorm_training_and_running_statistics() -> None:
    rng = np.random.default_rng(8)
    params = {"x": _rand(rng, 4, 3, 5, 5), "s": _rand(rng, 3), "b": _rand(rng, 3)}
    mean, var = _rand(rng, 3), _rand(rng, 3, positive=True)
    sess = check_grads(params, lambda b, s: b.op("BatchNormalization", s["x"], s["s"], s["b"],
                                                 b.param("rm", mean), b.param("rv", var),
                                                 momentum=0.75, epsilon=1e-3),
                       lambda x, s, b: F.batch_norm(x, None, None, s, b, True, 0.0, 1e-3))
    state = sess.state_dict()
    x = params["x"]
    np.testing.assert_allclose(state["rm"], 0.75 * mean + 0.25 * x.mean(axis=(0, 2, 3)),
                               rtol=1e-12)
    np.testing.assert_allclose(state["rv"], 0.75 * var + 0.25 * x.var(axis=(0, 2, 3)), rtol=1e-10)
    assert "BatchNormTraining" in {n.op_type for n in sess.graph.nodes}


def test_batchnorm_inference_mode_gradient() -> None:
    """With train_mode=False BatchNorm keeps using its (constant) running statistics."""
    rng = np.random.default_rng(9)
    params = {"x": _rand(rng, 2, 3, 4, 4), "s": _rand(rng, 3), "b": _rand(rng, 3)}
    mean, var = _rand(rng, 3), _rand(rng, 3, positive=True)
    b = GraphBuilder()
    s = {n: b.param(n, a) for n, a in params.items()}
    y = b.op("BatchNormalization", s["x"], s["s"], s["b"], b.const(mean), b.const(var))
    loss = b.op("ReduceSum", b.op("Mul", y, y), keepdims=0)
    b.output(loss, "loss")
    sess = segflow.TrainingSession(b.to_model(), loss="loss", params=list(params),
                                   engine="inline", train_mode=False)
    sess.step({})
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    ty = F.batch_norm(leaves["x"], torch.tensor(mean), torch.tensor(var), leaves["s"],
                      leaves["b"], False, 0.0, 1e-5)
    (ty * ty).sum().backward()
    for name, leaf in leaves.items():
        torch.testing.assert_close(sess.grad(name), leaf.grad, rtol=OP_RTOL, atol=OP_ATOL)


POOLS = [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
     lambda x: F.max_pool2d(x, 3, 2, 1)),
    ("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
     lambda x: F.max_pool2d(x, 2, 2, ceil_mode=True)),
    ("MaxPool", {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]},
     lambda x: F.max_pool2d(F.pad(x, [0, 1, 0, 1], value=-np.inf), 2, 1)),
    ("MaxPool", {"kernel_shape": [3], "strides": [2]},
     lambda x: F.max_pool1d(x.flatten(2), 3, 2)),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
     lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)),
    ("AveragePool", {"kernel_shape": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
     lambda x: F.avg_pool2d(x, 2, 1, 1, count_include_pad=True)),
    ("GlobalAveragePool", {}, lambda x: x.mean(dim=(2, 3), keepdim=True)),
]


@pytest.mark.parametrize(("op", "attrs", "reference"), POOLS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(POOLS)])
def test_pooling(op: str, attrs: dict[str, object], reference: TorchFn) -> None:
    x = _rand(np.random.default_rng(10), 2, 3, 7, 6)
    if len(attrs.get("kernel_shape", [0, 0])) == 1:  # type: ignore[arg-type]
        x = x.reshape(2, 3, 42)
        check_grads({"x": x}, _op(op, "x", **attrs), lambda x: reference(x.unsqueeze(2)))
        return
    check_grads({"x": x}, _op(op, "x", **attrs), reference)


SHAPES = [
    ("Reshape", lambda b, s: b.op("Reshape", s["x"], b.const(np.array([4, -1]))),
     lambda x: x.reshape(4, -1)),
    ("Flatten", lambda b, s: b.op("Flatten", s["x"], axis=2), lambda x: x.reshape(6, -1)),
    ("Transpose", lambda b, s: b.op("Transpose", s["x"], perm=[2, 0, 1]),
     lambda x: x.permute(2, 0, 1)),
    ("Squeeze", lambda b, s: b.op("Squeeze", b.op("Unsqueeze", s["x"], b.const(np.array([1]))),
                                  b.const(np.array([1]))), lambda x: x),
    ("Expand", lambda b, s: b.op("Expand", s["x"], b.const(np.array([2, 2, 3, 4]))),
     lambda x: x.expand(2, 2, 3, 4)),
    ("Slice", lambda b, s: b.op("Slice", s["x"], b.const(np.array([0, 1])),
                                b.const(np.array([2, 4])), b.const(np.array([0, 2])),
                                b.const(np.array([1, 2]))), lambda x: x[0:2, :, 1:4:2]),
    ("Slice-negative", lambda b, s: b.op("Slice", s["x"], b.const(np.array([-1])),
                                         b.const(np.array([-5])), b.const(np.array([2])),
                                         b.const(np.array([-2]))),
     lambda x: x[:, :, [3, 1]]),
    ("Identity", lambda b, s: b.op("Identity", s["x"]), lambda x: x),
    ("Softmax", lambda b, s: b.op("Softmax", s["x"], axis=1), lambda x: torch.softmax(x, 1)),
    ("LogSoftmax", lambda b, s: b.op("LogSoftmax", s["x"]), lambda x: torch.log_softmax(x, -1)),
    ("ReduceSum", lambda b, s: b.op("ReduceSum", s["x"], b.const(np.array([0, 2])), keepdims=0),
     lambda x: x.sum(dim=(0, 2))),
    ("ReduceMean", lambda b, s: b.op("ReduceMean", s["x"], axes=[1]),
     lambda x: x.mean(dim=1, keepdim=True)),
]


@pytest.mark.parametrize(("name", "build", "reference"), SHAPES, ids=[c[0] for c in SHAPES])
def test_shape_ops_softmax_reductions(name: str, build: Build, reference: TorchFn) -> None:
    x = _rand(np.random.default_rng(11), 2, 3, 4)
    check_grads({"x": x}, build, reference)


def test_concat() -> None:
    rng = np.random.default_rng(12)
    params = {"a": _rand(rng, 2, 1, 3), "b": _rand(rng, 2, 4, 3), "c": _rand(rng, 2, 2, 3)}
    check_grads(params, _op("Concat", "a", "b", "c", axis=1),
                lambda a, b, c: torch.cat([a, b, c], 1))


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm(axis: int) -> None:
    rng = np.random.default_rng(13)
    shape = (3, 4) if axis == -1 else (3, 4)
    params = {"x": _rand(rng, 2, 3, 4), "s": _rand(rng, *shape[axis:] if axis == -1 else shape),
              "b": _rand(rng, *(shape[axis:] if axis == -1 else shape))}
    params["s"] = params["s"].reshape(-1)[:4] if axis == -1 else params["s"]
    params["b"] = params["b"].reshape(-1)[:4] if axis == -1 else params["b"]
    norm = (4,) if axis == -1 else (3, 4)
    check_grads(params, _op("LayerNormalization", "x", "s", "b", axis=axis, epsilon=1e-4),
                lambda x, s, b: F.layer_norm(x, norm, s, b, 1e-4))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_softmax_cross_entropy(reduction: str, weighted: bool) -> None:
    rng = np.random.default_rng(14)
    labels = np.array([1, 4, 0, 2, 4, 3])
    params = {"x": _rand(rng, 6, 5)}
    consts = {"labels": labels}
    if weighted:
        consts["weights"] = _rand(rng, 5, positive=True)

    def build(b: GraphBuilder, s: dict[str, Sym]) -> Sym:
        return b.op("SoftmaxCrossEntropyLoss", s["x"], s["labels"],
                    s["weights"] if weighted else None, reduction=reduction, ignore_index=2)

    def reference(x: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
                  ) -> torch.Tensor:
        return F.cross_entropy(x, labels, weight=weights, reduction=reduction, ignore_index=2)

    check_grads(params, build, reference, consts)


def test_softmax_cross_entropy_spatial() -> None:
    rng = np.random.default_rng(15)
    labels = rng.integers(0, 3, (2, 4))
    check_grads({"x": _rand(rng, 2, 3, 4)},
                lambda b, s: b.op("SoftmaxCrossEntropyLoss", s["x"], s["labels"]),
                lambda x, labels: F.cross_entropy(x, labels), {"labels": labels})


def test_dropout_uses_the_forward_mask() -> None:
    x = _rand(np.random.default_rng(16), 50, 40)
    b = GraphBuilder()
    xs = b.param("x", x)
    y, mask = b.op("Dropout", xs, b.const(np.array(0.25)), outputs=2)
    loss = b.op("ReduceSum", b.op("Mul", y, b.const(np.full((50, 40), 3.0))), keepdims=0)
    b.output(loss, "loss")
    b.output(mask, "mask")
    sess = segflow.TrainingSession(b.to_model(), loss="loss", params=["x"], engine="inline")
    result = sess.step({})
    kept = result.outputs["mask"]
    assert 0.6 < kept.mean() < 0.9  # training mode really drops
    np.testing.assert_allclose(sess.grad("x").numpy(), 3.0 * kept / 0.75, rtol=1e-12)


def test_cast_roundtrip_gradient() -> None:
    x = _rand(np.random.default_rng(17), 3, 4)
    build = lambda b, s: b.op("Cast", b.op("Cast", s["x"], to=1), to=11)  # noqa: E731
    leaves = {"x": torch.tensor(x, requires_grad=True)}
    b = GraphBuilder()
    y = build(b, {"x": b.param("x", x)})
    b.output(b.op("ReduceSum", y, keepdims=0), "loss")
    sess = segflow.TrainingSession(b.to_model(), loss="loss", engine="inline")
    sess.step({})
    leaves["x"].to(torch.float32).to(torch.float64).sum().backward()
    torch.testing.assert_close(sess.grad("x"), leaves["x"].grad)


def test_ops_off_the_gradient_path_need_no_rule() -> None:
    b = GraphBuilder()
    x = b.input("x", DType.FLOAT64, [2, 3])
    w = b.param("w", np.ones((2, 3)))
    shift = b.op("Floor", x)  # no rule, but no parameter flows through it
    b.output(b.op("ReduceSum", b.op("Mul", b.op("Add", x, shift), w), keepdims=0), "loss")
    sess = segflow.TrainingSession(b.to_model(), loss="loss", engine="inline")
    data = np.array([[0.5, 1.5, 2.5], [3.5, -1.5, 0.25]])
    sess.step({"x": data})
    np.testing.assert_allclose(sess.grad("w").numpy(), data + np.floor(data))


def test_differentiate_reports_unreachable_and_keeps_graph_valid() -> None:
    b = GraphBuilder()
    x = b.param("x", np.ones(3))
    unused = b.param("unused", np.ones(3))
    b.output(b.op("ReduceSum", b.op("Exp", x), keepdims=0), "loss")
    b.output(unused + 1.0, "other")
    graph = b.to_graph()
    wrt = [graph.initializers["x"], graph.initializers["unused"]]
    result = differentiate(graph, graph.outputs[0], wrt, default_registry())
    graph.validate()
    assert result.modified
    assert [v.name for v in result.unreachable] == ["unused"]
    assert set(result.gradients) == {graph.initializers["x"]}
    assert all(n.domain == "segflow.train" or n.domain == "" for n in result.backward_nodes)


# -- whole networks -----------------------------------------------------------------------
def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model computing in float64 (initializers and declared types converted)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, tensor in enumerate(out.graph.initializer):
        if tensor.data_type == onnx.TensorProto.FLOAT:
            array = numpy_helper.to_array(tensor).astype(np.float64)
            out.graph.initializer[i].CopyFrom(numpy_helper.from_array(array, tensor.name))
    for info in [*out.graph.input, *out.graph.output, *out.graph.value_info]:
        if info.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            info.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    return out


@pytest.mark.parametrize(("name", "options", "batch"), [
    ("resnet18", {"num_classes": 10, "image_size": 32}, 2),
    ("mlp_chain", {"layers": 6, "width": 16}, 4),
])
def test_network_gradients_match_torch(name: str, options: dict[str, int], batch: int) -> None:
    model = to_float64(models.build(name, **options))
    feeds = models.example_inputs(name, batch_size=batch, **options)
    (input_name, data), = feeds.items()
    data = data.astype(np.float64)
    classes = options.get("num_classes", options.get("width"))
    assert classes is not None
    labels = np.random.default_rng(0).integers(0, classes, batch)
    sess = segflow.TrainingSession(model, loss=segflow.CrossEntropyLoss(labels="labels"),
                                   engine="threaded")
    result = sess.step({input_name: data, "labels": labels})

    module = models.torch_module(name, **options).double().train()
    for layer in module.modules():
        if isinstance(layer, torch.nn.BatchNorm2d):
            # What the float32 ONNX attributes hold (momentum 0.9 is torch's 0.1).
            layer.eps = float(np.float32(layer.eps))
            layer.momentum = 1.0 - float(np.float32(0.9))
    out = module(**{input_name: torch.tensor(data)})
    loss = F.cross_entropy(out, torch.tensor(labels))
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    grads = sess.gradients()
    params = dict(module.named_parameters())
    assert set(grads) == set(params)
    for pname, param in params.items():
        assert param.grad is not None
        torch.testing.assert_close(grads[pname], param.grad, rtol=NET_RTOL, atol=NET_ATOL,
                                   msg=lambda m, n=pname: f"d/d{n}: {m}")
    if name == "resnet18":
        # Running means follow ONNX's update rule (torch's running_var is unbiased).
        state = sess.state_dict()
        for bname, buf in module.named_buffers():
            if bname.endswith("running_mean"):
                np.testing.assert_allclose(state[bname], buf.numpy(), rtol=1e-9, atol=1e-12)
