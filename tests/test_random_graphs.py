"""Random small graphs through the whole inference pipeline, against onnxruntime:
CNNs with a linear head, and attention patterns.

Each seed builds a graph from the patterns the passes rewrite, wired at random so
that the rules meet the cases they must leave alone: a convolution (plain,
depthwise, with BatchNormalization and Relu after it), residual Adds and Muls of
any two earlier values, Clip/Sigmoid, Transpose pairs, no-op Reshapes and
Identities, values that are also graph outputs in the middle of a pattern, and a
head of global pooling and linear layers (Gemm or MatMul+Add, with Relu, Tanh,
Sigmoid or the exporters' erf GELU). The batch is symbolic and each session runs
batch 1, then 3, then 1 again, so a layout, a packed weight or a replay recorded
for one batch must not serve another. segflow runs with its defaults (codegen,
libdnnl where it loads) and with ``compile="none"`` (per-node kernels). The
attention patterns (:func:`_attention_model`) vary what the attention rule
matches: where K is transposed, the scale, the mask's shape and side.
"""

from __future__ import annotations

import random

import numpy as np
import onnxruntime as ort
import pytest
from onnx import ModelProto, TensorProto, helper, numpy_helper

import segflow

SEEDS = range(40)
ATOL = RTOL = 1e-3


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []
        self.count = 0

    def name(self, prefix: str = "v") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, array: np.ndarray) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def floats(self, *shape: int, scale: float = 1.0) -> str:
        return self.const((self.np.standard_normal(shape) * scale).astype(np.float32))

    def node(self, op: str, inputs: list[str], **attrs: object) -> str:
        out = self.name()
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def batchnorm(self, x: str, c: int) -> str:
        positive = (self.np.random(c) + 0.5).astype(np.float32)
        return self.node("BatchNormalization", [
            x, self.const(positive), self.floats(c), self.floats(c, scale=0.1),
            self.const((self.np.random(c) + 0.5).astype(np.float32))])


def _model(seed: int) -> tuple[ModelProto, int, int]:
    b = _Builder(seed)
    rng = b.rng
    c, size = rng.choice([8, 16]), rng.choice([5, 8])
    images = ["x"]
    outputs: set[str] = set()
    for _ in range(rng.randint(3, 12)):
        x = rng.choice(images)
        kind = rng.choice(["conv", "conv", "depthwise", "conv_bn_relu", "bn", "relu", "clip",
                           "sigmoid", "add", "mul", "add_const", "transposes", "identity",
                           "reshape", "output"])
        if kind in ("conv", "depthwise", "conv_bn_relu"):
            group = c if kind == "depthwise" else 1
            inputs = [x, b.floats(c, c // group, 3, 3, scale=0.2)]
            if rng.random() < 0.5:
                inputs.append(b.floats(c, scale=0.1))
            y = b.node("Conv", inputs, pads=[1, 1, 1, 1], group=group)
            if kind == "conv_bn_relu":
                y = b.node("Relu", [b.batchnorm(y, c)])
        elif kind == "bn":
            y = b.batchnorm(x, c)
        elif kind in ("relu", "sigmoid"):
            y = b.node(kind.capitalize(), [x])
        elif kind == "clip":
            y = b.node("Clip", [x, b.const(np.array(0.0, np.float32)),
                                b.const(np.array(6.0, np.float32))])
        elif kind in ("add", "mul"):
            pair = [x, rng.choice(images)]
            rng.shuffle(pair)
            y = b.node(kind.capitalize(), pair)
        elif kind == "add_const":
            y = b.node("Add", [x, b.floats(1, c, 1, 1)])
        elif kind == "transposes":
            inner = b.node("Transpose", [x], perm=[0, 2, 3, 1])
            if rng.random() < 0.3:
                outputs.add(inner)           # the pair's middle is read from outside
            y = b.node("Transpose", [inner], perm=[0, 3, 1, 2])
        elif kind == "identity":
            y = b.node("Identity", [x])
        elif kind == "reshape":
            y = b.node("Reshape", [x, b.const(np.array([-1, c, size, size], np.int64))])
        else:
            outputs.add(x)
            continue
        images.append(y)
        if rng.random() < 0.15:
            outputs.add(y)
    if rng.random() < 0.6:
        outputs.add(_head(b, images[-1], c))
    else:
        outputs.add(images[-1])
    graph = helper.make_graph(
        b.nodes, f"random{seed}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, size, size])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in sorted(outputs)],
        b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, c, size


def _head(b: _Builder, x: str, width: int) -> str:
    """Global pooling, then 1-4 linear layers with an activation or none."""
    rng = b.rng
    y = b.node("Flatten", [b.node(rng.choice(["GlobalAveragePool", "GlobalMaxPool"]), [x])])
    for _ in range(rng.randint(1, 4)):
        n = rng.choice([4, 8, 16, 32])
        if rng.random() < 0.5:
            y = b.node("Gemm", [y, b.floats(n, width, scale=0.3), b.floats(n)], transB=1)
        else:
            y = b.node("Add", [b.node("MatMul", [y, b.floats(width, n, scale=0.3)]),
                               b.floats(n)])
        act = rng.choice(["Relu", "Tanh", "Sigmoid", "Gelu", None])
        if act == "Gelu":
            erf = b.node("Erf", [b.node("Div", [y, b.const(np.array(2 ** 0.5, np.float32))])])
            one = b.node("Add", [erf, b.const(np.array(1.0, np.float32))])
            y = b.node("Mul", [b.node("Mul", [y, one]), b.const(np.array(0.5, np.float32))])
        elif act is not None:
            y = b.node(act, [y])
        width = n
    return y


@pytest.mark.parametrize("seed", SEEDS)
def test_random_graph_matches_onnxruntime_at_several_batches(seed):
    model, c, size = _model(seed)
    data = np.random.default_rng(1000 + seed).standard_normal((3, c, size, size))
    reference = ort.InferenceSession(model.SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    sessions = [segflow.InferenceSession(model), segflow.InferenceSession(model, compile="none")]
    for batch in (1, 3, 1):
        feeds = {"x": data[:batch].astype(np.float32)}
        want = reference.run(None, feeds)
        for sess in sessions:
            for got, expected in zip(sess.run(None, feeds), want):
                np.testing.assert_allclose(got, expected, atol=ATOL, rtol=RTOL)


def test_the_random_graphs_exercise_every_fuse_rule_but_attention():
    """The generator must keep reaching what it is for: across the seeds, the fuse
    pass fires each rule it has a pattern for (attention has none here)."""
    fired: set[str] = set()
    for seed in SEEDS:
        log = segflow.InferenceSession(_model(seed)[0]).plan.pass_log
        fuse_line = next(line for line in log if line.startswith("fuse:"))
        fired |= {rule for rule in ("noops", "batchnorm", "linear", "gelu", "conv",
                                    "activation") if f"{rule} " in fuse_line}
    assert fired == {"noops", "batchnorm", "linear", "gelu", "conv", "activation"}


ATTENTION_SEEDS = range(40)


def _attention_model(seed: int) -> tuple[ModelProto, dict[str, np.ndarray]]:
    """``softmax(Q @ Kt * s + M) @ V`` with what varies in exported models: K given
    transposed or transposed in the graph, the scale a Div, a Mul or absent, the mask
    absent, a constant, or an input of shape [b,1,1,T], [1,1,S,T], [S,T] or
    [b,H,S,T] on either side of the Add, the softmax axis -1 or 3, keys longer than
    queries, and the probabilities sometimes a graph output too."""
    rng, data = random.Random(seed), np.random.default_rng(seed)
    batch, heads, s, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([3, 8, 17]), \
        rng.choice([4, 8, 16])
    t = rng.choice([s, s + 2])
    nodes, inits = [], []

    def const(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(array, np.float32), name))
        return name

    kt_given = rng.random() < 0.5
    shapes = {"q": ["b", heads, s, d], "k": ["b", heads, d, t] if kt_given else ["b", heads, t, d],
              "v": ["b", heads, t, d]}
    kt = "k"
    if not kt_given:
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
        kt = "kt"
    nodes.append(helper.make_node("MatMul", ["q", kt], ["scores"]))
    last = "scores"
    scale = rng.choice(["div", "mul", None])
    if scale is not None:
        op, factor = ("Div", d ** 0.5) if scale == "div" else ("Mul", d ** -0.5)
        nodes.append(helper.make_node(op, [last, const("scale", factor)], ["scaled"]))
        last = "scaled"
    mask = rng.choice([None, "const", "b11t", "11st", "st", "bhst"])
    if mask == "const":
        operand = const("mask", data.standard_normal((1, 1, s, t)) * 2)
    elif mask is not None:
        shapes["m"] = {"b11t": ["b", 1, 1, t], "11st": [1, 1, s, t], "st": [s, t],
                       "bhst": ["b", heads, s, t]}[mask]
        operand = "m"
    if mask is not None:
        pair = [last, operand]
        rng.shuffle(pair)
        nodes.append(helper.make_node("Add", pair, ["masked"]))
        last = "masked"
    nodes.append(helper.make_node("Softmax", [last], ["p"], axis=rng.choice([-1, 3])))
    nodes.append(helper.make_node("MatMul", ["p", "v"], ["out"]))
    outputs = ["out"] + (["p"] if rng.random() < 0.2 else [])
    graph = helper.make_graph(
        nodes, f"attention{seed}",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in shapes.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {n: (data.standard_normal([batch if dim == "b" else dim for dim in shape])
                 * (2 if n == "m" else 1)).astype(np.float32) for n, shape in shapes.items()}
    return model, feeds


@pytest.mark.parametrize("seed", ATTENTION_SEEDS)
def test_random_attention_pattern_matches_onnxruntime(seed):
    model, feeds = _attention_model(seed)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    for sess in (segflow.InferenceSession(model), segflow.InferenceSession(model, compile="none")):
        for _ in range(2):
            for got, expected in zip(sess.run(None, feeds), want):
                np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-3)


def test_the_random_attention_patterns_mostly_fuse():
    """Most seeds must become one Attention node (36 of 40 when written; the rest are
    shapes the rule leaves alone on purpose), or the test above would only exercise
    the plain ops."""
    fused = sum(any(n.op_type == "Attention" for n in
                    segflow.InferenceSession(_attention_model(seed)[0]).graph.nodes)
                for seed in ATTENTION_SEEDS)
    assert fused >= 3 * len(ATTENTION_SEEDS) // 4, fused
