"""Tests for passes/fuse/: each rule's changed and unchanged case, its switch, numerics vs
onnxruntime."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models
from segflow.frontend.onnx_import import import_model
from segflow.kernels import conv as conv_kernels
from segflow.kernels.choice import KernelKind
from segflow.kernels.target import CpuTarget
from segflow.ops import fused
from segflow.passes.fuse import RULE_NAMES, RULES, fuse, run_rules
from targets import as_cpu

ATOL, RTOL = 1e-4, 1e-3
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits=None, opset=17):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _check(model, feeds, expect_ops=None, **session):
    """Run on onnxruntime and on segflow (optimized); compare; return the session."""
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = segflow.InferenceSession(model, engine="inline", **session)
    got = sess.run(None, feeds)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, atol=ATOL, rtol=RTOL)
    if expect_ops is not None:
        assert Counter(n.op_type for n in sess.graph.nodes) == Counter(expect_ops)
    return sess


def _fused(model, rules=None):
    graph = import_model(model)
    result = fuse(graph, rules)
    graph.validate()
    return graph, result


def _bn_inits(c, prefix="bn"):
    return {f"{prefix}.s": _rand(c, scale=0.5) + 1, f"{prefix}.b": _rand(c),
            f"{prefix}.m": _rand(c), f"{prefix}.v": np.abs(_rand(c)) + 0.5}


def _bn(x, y, prefix="bn", **attrs):
    return helper.make_node("BatchNormalization", [x, f"{prefix}.s", f"{prefix}.b",
                                                   f"{prefix}.m", f"{prefix}.v"], [y], **attrs)


# -- unchanged graphs ---------------------------------------------------------------------
def test_nothing_to_fuse_leaves_the_graph_alone():
    model = _model([helper.make_node("Add", ["x", "y"], ["z"]),
                    helper.make_node("Sigmoid", ["z"], ["out"])],
                   {"x": [2, 3], "y": [2, 3]}, ["out"])
    graph, result = _fused(model)
    assert not result.modified
    assert [n.op_type for n in graph.nodes] == ["Add", "Sigmoid"]


def test_every_rule_is_named_and_selectable():
    names = [name for name, _ in RULES]
    assert names == ["noops", "global_pool", "pad", "batchnorm", "linear", "integer_linear",
                     "gelu", "gelu_tanh", "silu", "conv", "activation", "attention", "rmsnorm",
                     "layernorm", "siblings", "views"]
    with pytest.raises(ValueError, match="unknown fuse rules"):
        run_rules(import_model(_model([helper.make_node("Relu", ["x"], ["y"])],
                                      {"x": [2]}, ["y"])), ["nope"])


def _noop_model():
    nodes = [helper.make_node("Identity", ["x"], ["a"]),
             helper.make_node("Conv", ["a", "w"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["b"], ["out"])]
    return _model(nodes, {"x": [1, 2, 5, 5]}, ["out"], {"w": _rand(3, 2, 3, 3)}), \
        {"x": _rand(1, 2, 5, 5)}


def _pad_conv(pads=(0, 0, 0, 0, 0, 0, 1, 1), value=None, mode="constant", stride=2,
              auto_pad=None):
    """A "same"-padded stride-2 convolution as transformers' ports export it: Pad, Conv
    (the Conv's ``auto_pad`` where given: the torchscript exporter writes VALID)."""
    inputs = ["x", "p"] + (["v"] if value is not None else [])
    inits = {"w": _rand(4, 3, 3, 3), "p": np.array(pads, np.int64)}
    if value is not None:
        inits["v"] = np.array(value, np.float32)
    nodes = [helper.make_node("Pad", inputs, ["xp"], mode=mode),
             helper.make_node("Conv", ["xp", "w"], ["out"], strides=[stride, stride],
                              **({"auto_pad": auto_pad} if auto_pad else {}))]
    return _model(nodes, {"x": [2, 3, 9, 8]}, ["out"], inits), {"x": _rand(2, 3, 9, 8)}


def _resnet():
    build = {"num_classes": 10, "image_size": 32}
    feeds = models.example_inputs("resnet18", batch_size=2, **build)
    return models.build("resnet18", **build), feeds


def _bert():
    return models.build("bert_tiny"), models.example_inputs("bert_tiny", batch_size=2, seq_len=16)


def _residual_layer_norm():
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["out"], epsilon=1e-6)]
    model = _model(nodes, {"x": ["batch", 8, 32], "r": ["batch", 8, 32]}, ["out"],
                   {"g": _rand(32), "b": _rand(32)})
    return model, {"x": _rand(2, 8, 32), "r": _rand(2, 8, 32)}


def _rms_norm():
    """T5's RMS norm as torch writes it: Pow, ReduceMean, Add eps, Sqrt, Div(1, .), Mul x,
    Mul weight."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["p"]),
             helper.make_node("ReduceMean", ["p", "axes"], ["m"], keepdims=1),
             helper.make_node("Add", ["m", "eps"], ["v"]),
             helper.make_node("Sqrt", ["v"], ["root"]),
             helper.make_node("Div", ["one", "root"], ["inv"]),
             helper.make_node("Mul", ["x", "inv"], ["n"]),
             helper.make_node("Mul", ["w", "n"], ["out"])]
    inits = {"two": np.float32(2), "axes": np.array([-1], np.int64), "eps": np.float32(1e-6),
             "one": np.float32(1), "w": _rand(32)}
    return _model(nodes, {"x": ["batch", 8, 32]}, ["out"], inits, opset=18), \
        {"x": _rand(2, 8, 32)}


def _sibling_linears(acts=("Relu", "Relu"), bias=(True, True), graph_output=False):
    """Two MatMul (+ bias Add) + activation over one input, summed."""
    nodes, inits = [], {}
    for i, (act, has_bias) in enumerate(zip(acts, bias)):
        inits[f"w{i}"] = _rand(16, 8 + 4 * i, scale=0.3)
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]))
        last = f"m{i}"
        if has_bias:
            inits[f"b{i}"] = _rand(8 + 4 * i)
            nodes.append(helper.make_node("Add", [last, f"b{i}"], [f"a{i}"]))
            last = f"a{i}"
        nodes.append(helper.make_node(act, [last], [f"y{i}"]))
    nodes += [helper.make_node("ReduceSum", [f"y{i}", "axes"], [f"s{i}"], keepdims=1)
              for i in range(len(acts))]
    nodes.append(helper.make_node("Add", ["s0", "s1"], ["out"]))
    inits["axes"] = np.array([-1], np.int64)
    outputs = ["out", "y0"] if graph_output else ["out"]
    model = _model(nodes, {"x": ["batch", 5, 16]}, outputs, inits)
    return model, {"x": _rand(3, 5, 16)}


def _tanh_gelu_after_linear(tail="half_x_first", cube="pow", swap=False, rank=3):
    """A MatMul + bias (reshaped back to 3-D around a 2-D Gemm where ``rank`` is 2, as
    GPT-2's exports do), then the tanh GELU in one of the exporters' associations.

    ``tail``: ``half_x_first`` ``(x * 0.5) * (1 + t)`` (both torch exporters),
    ``x_first`` ``(x * (1 + t)) * 0.5``, ``half_last`` ``x * (0.5 * (1 + t))``;
    ``cube``: ``pow`` or ``mul`` (``x * x * x``); ``swap``: constants first."""
    k, n = 8, 12
    inits = {"w": _rand(k, n, scale=0.5), "b": _rand(n), "three": np.array(3.0, np.float32),
             "kappa": np.array(0.044715, np.float32),
             "beta": np.array(math.sqrt(2 / math.pi), np.float32),
             "one": np.array(1.0, np.float32), "half": np.array(0.5, np.float32)}

    def mul(a, b, out):
        return helper.make_node("Mul", [b, a] if swap else [a, b], [out])

    if rank == 2:
        inits.update({"flat": np.array([-1, k], np.int64), "back": np.array([2, 5, n], np.int64)})
        nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]),
                 helper.make_node("Gemm", ["x2", "w", "b"], ["g"]),
                 helper.make_node("Reshape", ["g", "back"], ["y"])]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
                 helper.make_node("Add", ["m", "b"], ["y"])]
    if cube == "pow":
        nodes.append(helper.make_node("Pow", ["y", "three"], ["c"]))
    else:
        nodes += [helper.make_node("Mul", ["y", "y"], ["sq"]), mul("sq", "y", "c")]
    nodes += [mul("c", "kappa", "ck"),
              helper.make_node("Add", ["ck", "y"] if swap else ["y", "ck"], ["i"]),
              mul("i", "beta", "ib"), helper.make_node("Tanh", ["ib"], ["t"]),
              helper.make_node("Add", ["one", "t"] if swap else ["t", "one"], ["t1"])]
    if tail == "half_x_first":
        nodes += [mul("y", "half", "h"), mul("h", "t1", "out")]
    elif tail == "x_first":
        nodes += [mul("y", "t1", "p"), mul("p", "half", "out")]
    else:
        nodes += [mul("half", "t1", "h"), mul("y", "h", "out")]
    model = _model(nodes, {"x": [2, 5, k]}, ["out"], inits)
    return model, {"x": _rand(2, 5, k, scale=2.0)}


def _silu_after_conv(swap=False, alpha=None):
    """Conv, then ``x * sigmoid(x)`` (``x * sigmoid(alpha * x)`` where ``alpha``)."""
    inits = {"w": _rand(8, 4, 3, 3, scale=0.3), "b": _rand(8)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])]
    arg = "c"
    if alpha is not None:
        inits["alpha"] = np.array(alpha, np.float32)
        nodes.append(helper.make_node("Mul", ["alpha", "c"] if swap else ["c", "alpha"], ["ca"]))
        arg = "ca"
    nodes += [helper.make_node("Sigmoid", [arg], ["s"]),
              helper.make_node("Mul", ["s", "c"] if swap else ["c", "s"], ["out"])]
    model = _model(nodes, {"x": ["batch", 4, 6, 6]}, ["out"], inits)
    return model, {"x": _rand(2, 4, 6, 6, scale=2.0)}


def _head_split(seq=1, shared=False, batch=1):
    """A linear's output split into heads as exporters write it: flatten, reshape to
    heads, transpose the heads ahead of the sequence (a copy unless ``seq`` is 1)."""
    inits = {"w": _rand(8, 8), "flat": np.array([-1, 8], np.int64),
             "heads": np.array([-1, seq, 2, 4], np.int64)}
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["f"]),
             helper.make_node("MatMul", ["f", "w"], ["m"]),
             helper.make_node("Reshape", ["m", "heads"], ["h"]),
             helper.make_node("Transpose", ["h"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Relu", ["t"], ["out"])]
    outputs = ["out"]
    if shared:
        nodes.append(helper.make_node("Neg", ["h"], ["other"]))
        outputs.append("other")
    model = _model(nodes, {"x": [batch, seq, 8]}, outputs, inits)
    return model, {"x": _rand(1, seq, 8)}


def _spatial_mean_after_conv(axes=(2, 3), keepdims=1):
    """Conv, then ReduceMean over ``axes`` (opset 18: axes an input)."""
    inits = {"w": _rand(8, 4, 3, 3, scale=0.3), "b": _rand(8),
             "axes": np.array(list(axes), np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["c", "axes"], ["out"], keepdims=keepdims)]
    model = _model(nodes, {"x": ["batch", 4, 6, 6]}, ["out"], inits, opset=18)
    return model, {"x": _rand(2, 4, 6, 6, scale=2.0)}


def _dynamic_linear(scale: str = "tensor", bias: bool = True, cast_to: int = TensorProto.FLOAT,
                    extra_reader: bool = False):
    """One linear as onnxruntime's ``quantize_dynamic`` writes it: DynamicQuantizeLinear ->
    MatMulInteger (constant int8 weight) -> Cast -> Mul by ``xs * ws`` (``scale``
    "tensor"; "column": one weight scale per output column) [-> Add of a bias]."""
    k, n = 16, 6
    inits = {"w": RNG.integers(-128, 128, (k, n)).astype(np.int8),
             "ws": (np.array(0.02, np.float32) if scale == "tensor"
                    else (RNG.uniform(0.01, 0.03, n)).astype(np.float32)),
             "b": _rand(n)}
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xzp"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=cast_to),
             helper.make_node("Mul", ["xs", "ws"], ["s"])]
    if cast_to != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", ["accf"], ["accf32"], to=TensorProto.FLOAT))
    product = "accf" if cast_to == TensorProto.FLOAT else "accf32"
    nodes.append(helper.make_node("Mul", [product, "s"], ["y" if not bias else "ys"]))
    outputs = ["y"]
    if bias:
        nodes.append(helper.make_node("Add", ["b", "ys"], ["y"]))
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["accf"], ["r"]))
        outputs.append("r")
    model = _model(nodes, {"x": [3, 4, k]}, outputs, inits, opset=13)
    return model, {"x": _rand(3, 4, k)}


# rule -> (model and feeds, the op the rule rewrites away: gone with the rule on, kept off;
# "+Op": an op the rule adds, there with the rule on, not off)
_RULE_CASES = {
    "noops": (_noop_model, "Identity"),
    "global_pool": (_spatial_mean_after_conv, "ReduceMean"),
    "pad": (_pad_conv, "Pad"),
    "batchnorm": (_resnet, "BatchNormalization"),
    "linear": (_bert, "MatMul"),
    "integer_linear": (_dynamic_linear, "MatMulInteger"),
    "gelu": (_bert, "Erf"),
    "gelu_tanh": (lambda: _tanh_gelu_after_linear(), "Tanh"),
    "silu": (lambda: _silu_after_conv(), "Sigmoid"),
    "conv": (_resnet, "Conv"),
    "activation": (_resnet, "Relu"),
    "attention": (_bert, "Softmax"),
    "rmsnorm": (_rms_norm, "ReduceMean"),
    "layernorm": (_residual_layer_norm, "LayerNormalization"),
    "siblings": (_sibling_linears, "+Split"),
    "views": (_head_split, "Transpose"),
}


def test_every_rule_has_a_switch_case():
    assert sorted(_RULE_CASES) == sorted(RULE_NAMES)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_each_rule_switched_off_leaves_its_pattern_and_the_results(rule):
    make, op_type = _RULE_CASES[rule]
    model, feeds = make()
    on = _check(model, feeds)
    off = _check(model, feeds, optimize={f"fuse.{rule}": False})
    without, present = (off, on) if op_type.startswith("+") else (on, off)
    assert not any(n.op_type == op_type.lstrip("+") for n in without.graph.nodes)
    assert any(n.op_type == op_type.lstrip("+") for n in present.graph.nodes)
    assert f"rules off: {rule}" in off.explain()
    assert "rules off" not in on.explain()


# -- integer_linear ----------------------------------------------------------------------
@pytest.mark.parametrize("scale", ["tensor", "column"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_dynamically_quantized_linear_becomes_matmul_integer_to_float(scale, bias):
    model, feeds = _dynamic_linear(scale, bias)
    sess = _check(model, feeds, ["DynamicQuantizeLinear", "MatMulIntegerToFloat"])
    # The fused kernel rounds as the Cast, Mul and Add do: onnxruntime's bytes.
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(sess.run(None, feeds)[0], want[0])


@pytest.mark.parametrize("case", ["cast_to_half", "product_read_twice"])
def test_integer_matmuls_that_are_not_a_scaled_linear_stay(case):
    model, feeds = (_dynamic_linear(cast_to=TensorProto.FLOAT16) if case == "cast_to_half"
                    else _dynamic_linear(extra_reader=True))
    graph, result = _fused(model, ["integer_linear"])
    assert not result.modified
    assert any(n.op_type == "MatMulInteger" for n in graph.nodes)
    _check(model, feeds)


# -- global_pool -------------------------------------------------------------------------
@pytest.mark.parametrize("axes", [(2, 3), (-1, -2)])
def test_a_spatial_mean_becomes_global_average_pool(axes):
    model, feeds = _spatial_mean_after_conv(axes)
    graph, result = _fused(model, ["global_pool"])
    assert result.modified
    assert [n.op_type for n in graph.nodes] == ["Conv", "GlobalAveragePool"]
    _check(model, feeds, ["FusedConv", "GlobalAveragePool"])


@pytest.mark.parametrize(("axes", "keepdims"), [((2,), 1), ((1, 2, 3), 1), ((2, 3), 0)])
def test_other_means_stay(axes, keepdims):
    model, feeds = _spatial_mean_after_conv(axes, keepdims)
    graph, result = _fused(model, ["global_pool"])
    assert not result.modified
    assert [n.op_type for n in graph.nodes] == ["Conv", "ReduceMean"]
    _check(model, feeds, ["FusedConv", "ReduceMean"])


# -- no-ops ------------------------------------------------------------------------------
def test_noops_are_removed():
    nodes = [
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("Dropout", ["a"], ["b"]),
        helper.make_node("Cast", ["b"], ["c"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["c", "shape"], ["d"]),
        helper.make_node("Transpose", ["d"], ["e"], perm=[1, 0]),
        helper.make_node("Transpose", ["e"], ["f"], perm=[1, 0]),
        helper.make_node("Relu", ["f"], ["out"]),
    ]
    model = _model(nodes, {"x": [3, 4]}, ["out"], {"shape": np.array([3, 4], np.int64)})
    graph, result = _fused(model, ["noops"])
    assert result.modified
    assert [n.op_type for n in graph.nodes] == ["Relu"]
    _check(model, {"x": _rand(3, 4)}, ["Relu"])


def test_transpose_pair_merges_into_one():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[1, 2, 0]),
             helper.make_node("Transpose", ["a"], ["out"], perm=[0, 2, 1])]
    model = _model(nodes, {"x": [2, 3, 4]}, ["out"])
    graph, result = _fused(model, ["noops"])
    assert result.modified and [n.op_type for n in graph.nodes] == ["Transpose"]
    assert graph.outputs[0].name == "out"
    _check(model, {"x": _rand(2, 3, 4)})


def _ops(graph):
    return [n.op_type for n in graph.nodes]


def test_a_transpose_of_unit_axes_and_the_reshape_before_it_become_one_reshape():
    model, feeds = _head_split()
    graph, result = _fused(model, ["views"])
    assert result.modified and _ops(graph) == ["Reshape", "MatMul", "Reshape", "Relu"]
    reshape = graph.nodes[2]
    assert reshape.inputs[0].name == "m" and reshape.outputs[0].name == "t"
    assert tuple(reshape.inputs[1].const.tolist()) == (1, 2, 1, 4)
    feeds["x"][0, 0, 3] = np.nan
    feeds["x"][0, 0, 5] = -np.inf
    _check(model, feeds)


def test_a_transpose_that_moves_data_stays():
    model, feeds = _head_split(seq=3)
    graph, result = _fused(model, ["views"])
    assert not result.modified
    assert _ops(graph) == ["Reshape", "MatMul", "Reshape", "Transpose", "Relu"]
    _check(model, feeds)


def test_a_run_of_views_read_elsewhere_keeps_the_shared_reshape():
    model, feeds = _head_split(shared=True)
    graph, _ = _fused(model, ["views"])
    assert Counter(_ops(graph)) == Counter(["Reshape", "MatMul", "Reshape", "Reshape",
                                            "Relu", "Neg"])
    assert not any(n.op_type == "Transpose" for n in graph.nodes)
    _check(model, feeds)


def test_a_run_of_views_back_to_the_first_shape_is_dropped():
    nodes = [helper.make_node("Unsqueeze", ["x", "axes"], ["a"]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0, 2]),
             helper.make_node("Flatten", ["b"], ["c"], axis=1),
             helper.make_node("Relu", ["c"], ["out"])]
    model = _model(nodes, {"x": [1, 6]}, ["out"], {"axes": np.array([0], np.int64)})
    graph, result = _fused(model, ["views"])
    assert result.modified and _ops(graph) == ["Relu"]
    assert graph.nodes[0].inputs[0].name == "x"
    _check(model, {"x": _rand(1, 6)})


def test_views_with_an_unknown_dim_stay():
    model, feeds = _head_split(batch="batch")
    graph, result = _fused(model, ["views"])
    assert not result.modified and "Transpose" in _ops(graph)
    _check(model, feeds)


@pytest.mark.parametrize("auto_pad", [None, "VALID", "NOTSET"])
@pytest.mark.parametrize("pads", [(0, 0, 0, 0, 0, 0, 1, 1), (0, 0, 1, 2, 0, 0, 2, 0)])
def test_a_zero_pad_before_a_conv_becomes_its_padding(pads, auto_pad):
    model, feeds = _pad_conv(pads, auto_pad=auto_pad)
    sess = _check(model, feeds, ["FusedConv"])
    (conv,) = sess.graph.nodes
    assert list(conv.attrs["pads"]) == [pads[2], pads[3], pads[6], pads[7]]
    assert conv.attrs.get("auto_pad", "NOTSET") == "NOTSET"
    feeds["x"][0, 1, 3, 2] = np.nan       # a NaN stays where the unpadded conv puts it
    feeds["x"][1, 0, 0, 0] = np.inf
    _check(model, feeds)
    _check(*_pad_conv(pads, value=0.0), expect_ops=["FusedConv"])


@pytest.mark.parametrize("case", ["value", "mode", "batch", "negative", "same"])
def test_pads_that_are_not_zero_padding_of_the_spatial_dims_stay(case):
    model, feeds = {
        "value": lambda: _pad_conv(value=1.5),
        "mode": lambda: _pad_conv((0, 0, 1, 1, 0, 0, 1, 1), mode="reflect"),
        "batch": lambda: _pad_conv((1, 0, 0, 0, 0, 0, 1, 1)),
        "negative": lambda: _pad_conv((0, 0, 0, -1, 0, 0, 1, 1)),
        "same": lambda: _pad_conv(auto_pad="SAME_UPPER"),
    }[case]()
    graph, _ = _fused(model, ["pad"])
    assert [n.op_type for n in graph.nodes] == ["Pad", "Conv"]
    _check(model, feeds)


def test_a_pad_of_nothing_is_dropped():
    model, feeds = _pad_conv((0,) * 8)
    graph, _ = _fused(model, ["pad"])
    assert [n.op_type for n in graph.nodes] == ["Conv"]
    _check(model, feeds)


def test_noops_that_change_things_stay():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["a"]),
             helper.make_node("Cast", ["a"], ["b"], to=TensorProto.DOUBLE),
             helper.make_node("Cast", ["b"], ["out"], to=TensorProto.FLOAT),
             helper.make_node("Dropout", ["x", "ratio", "train"], ["d"])]
    model = _model(nodes, {"x": [3, 4]}, ["out", "d"],
                   {"shape": np.array([4, 3], np.int64), "ratio": np.array(0.5, np.float32)})
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "train"))
    graph, result = _fused(model, ["noops"])
    assert not result.modified
    assert [n.op_type for n in graph.nodes] == ["Reshape", "Cast", "Cast", "Dropout"]


def test_identity_producing_a_graph_output_of_an_input_stays():
    model = _model([helper.make_node("Identity", ["x"], ["out"])], {"x": [2]}, ["out"])
    graph, result = _fused(model)
    assert not result.modified and graph.outputs[0].name == "out"


# -- BatchNormalization, Conv, activations ---------------------------------------------------
def _conv_bn_relu(residual=False, act="Relu", shared=False):
    inits = {"w": _rand(8, 4, 3, 3, scale=0.3), "cb": _rand(8), **_bn_inits(8)}
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]),
             _bn("c", "n")]
    last = "n"
    if residual:
        inits["w2"] = _rand(8, 4, 1, 1, scale=0.3)
        nodes.append(helper.make_node("Conv", ["x", "w2"], ["side"]))
        nodes.append(helper.make_node("Add", ["n", "side"], ["s"]))
        last = "s"
    if act == "Clip":
        inits.update({"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)})
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["out"]))
    else:
        nodes.append(helper.make_node(act, [last], ["out"]))
    outputs = ["out", "n"] if shared else ["out"]
    return _model(nodes, {"x": ["batch", 4, 6, 6]}, outputs, inits)


@pytest.mark.parametrize("act", ["Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "HardSwish"])
def test_conv_batchnorm_activation_become_one_fused_conv(act):
    model = _conv_bn_relu(act=act)
    sess = _check(model, {"x": _rand(2, 4, 6, 6)}, ["FusedConv"])
    (node,) = sess.graph.nodes
    assert node.attrs["activation"] == act


def test_conv_residual_add_relu_fuse():
    model = _conv_bn_relu(residual=True)
    sess = _check(model, {"x": _rand(1, 4, 6, 6)}, ["FusedConv", "FusedConv"])
    assert sum(1 for n in sess.graph.nodes if len(n.inputs) == 4) == 1
    _check(model, {"x": _rand(3, 4, 6, 6)}, compile="none")


def test_conv_feeding_a_graph_output_keeps_batchnorm_visible():
    model = _conv_bn_relu(shared=True)
    graph, _ = _fused(model)
    # n (the BatchNorm output) is a graph output: BN folds, but Relu cannot join the conv.
    assert Counter(n.op_type for n in graph.nodes) == Counter(["FusedConv", "Relu"])
    _check(model, {"x": _rand(1, 4, 6, 6)})


def test_training_batchnorm_is_not_folded():
    inits = {"w": _rand(8, 4, 3, 3), **_bn_inits(8)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             _bn("c", "out", training_mode=1)]
    graph, _ = _fused(_model(nodes, {"x": [1, 4, 6, 6]}, ["out"], inits, opset=15))
    assert "BatchNormalization" in [n.op_type for n in graph.nodes]


def test_batchnorm_folds_into_gemm():
    inits = {"w": _rand(5, 6), "c": _rand(5), **_bn_inits(5)}
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["g"], transB=1),
             _bn("g", "out")]
    model = _model(nodes, {"x": [3, 6]}, ["out"], inits)
    _check(model, {"x": _rand(3, 6)}, ["FusedGemm"])


def test_auto_pad_same_is_resolved_for_static_inputs():
    inits = {"w": _rand(4, 3, 3, 3)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["out"], auto_pad="SAME_UPPER", strides=[2, 2])]
    model = _model(nodes, {"x": [1, 3, 7, 7]}, ["out"], inits)
    _check(model, {"x": _rand(1, 3, 7, 7)}, ["FusedConv"])


def test_asymmetric_pads_run_through_the_torch_path():
    inits = {"w": _rand(4, 3, 3, 3)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[0, 1, 1, 0]),
             helper.make_node("Relu", ["c"], ["out"])]
    model = _model(nodes, {"x": [1, 3, 5, 5]}, ["out"], inits)
    sess = _check(model, {"x": _rand(1, 3, 5, 5)}, ["FusedConv"])
    assert "channels_last" not in sess.graph.nodes[0].attrs  # oneDNN needs symmetric pads


# -- linear ------------------------------------------------------------------------------
@pytest.mark.parametrize("avx512", [False, True])
def test_transcendental_post_ops_of_a_linear_follow_the_cpu(monkeypatch, avx512):
    """Sigmoid/Tanh/GELU are fused into oneDNN's matmul only on AVX-512 CPUs; elsewhere
    the linear runs plain and torch applies them in place. Relu/Clip are always fused."""
    as_cpu(monkeypatch, avx512=avx512)
    fuses = CpuTarget.detect().fuses_transcendental_post_ops()
    for name in ("Sigmoid", "Tanh", "Gelu", "GeluTanh"):
        act = fused.ACTIVATIONS[name]
        assert (fused.linear_post_op(act, [], fuses) is not None) is avx512
        assert act.inplace is not None
    assert fused.linear_post_op(fused.ACTIVATIONS["Relu"], [], fuses) == ("relu", [], "")
    assert fused.linear_post_op(fused.ACTIVATIONS["Clip"], [0.0, 6.0], fuses) == (
        "hardtanh", [0.0, 6.0], "")


@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize("compile_mode", ["none", "codegen"])
@pytest.mark.parametrize("act", ["Sigmoid", "Tanh", "Gelu", "GeluTanh"])
def test_prepacked_linear_with_a_transcendental_activation_matches_onnxruntime(
        monkeypatch, avx512, compile_mode, act):
    # 768 x 768 is above LINEAR_PACK_MIN_WEIGHT: the kernel selection packs it for oneDNN,
    # or for the native linear where that is preferred (AVX2 + FMA, no AVX-512).
    k = n = 768
    assert k * n >= fused.LINEAR_PACK_MIN_WEIGHT
    as_cpu(monkeypatch, avx512=avx512)
    inits = {"w": _rand(k, n, scale=0.05), "b": _rand(n)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["y"])]
    opset = 17
    if act in ("Sigmoid", "Tanh"):
        nodes.append(helper.make_node(act, ["y"], ["out"]))
    else:
        opset = 20
        nodes.append(helper.make_node("Gelu", ["y"], ["out"],
                                      approximate="tanh" if act == "GeluTanh" else "none"))
    model = _model(nodes, {"x": ["batch", 16, k]}, ["out"], inits, opset=opset)
    sess = _check(model, {"x": _rand(2, 16, k)}, ["FusedGemm"], compile=compile_mode)
    assert sess.graph.nodes[0].attrs["activation"] == act
    node = sess.graph.nodes[0]
    assert sess.plan.choices[node].kind in (KernelKind.ONEDNN_LINEAR, KernelKind.DIRECT_LINEAR,
                                            KernelKind.NATIVE_LINEAR)
    # The output is the activation's, not the plain linear's (the unfused path applies it).
    out = sess.run(None, {"x": np.zeros((1, 16, k), np.float32)})[0]
    expect = {"Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Gelu": F.gelu,
              "GeluTanh": lambda t: F.gelu(t, approximate="tanh")}[act](
        torch.from_numpy(inits["b"]))
    np.testing.assert_allclose(out[0, 3], expect.numpy(), atol=1e-5, rtol=1e-5)


def test_gelu_without_a_linear_before_it_is_one_gelu_node():
    inits = {"isq": np.array(1 / math.sqrt(2), np.float32), "one": np.array(1.0, np.float32),
             "half": np.array(0.5, np.float32)}
    nodes = [helper.make_node("Mul", ["x", "isq"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["one", "e"], ["e1"]),
             helper.make_node("Mul", ["x", "half"], ["h"]),
             helper.make_node("Mul", ["h", "e1"], ["out"])]
    model = _model(nodes, {"x": [4, 5]}, ["out"], inits)
    _check(model, {"x": _rand(4, 5)}, ["Gelu"])


def _check_nonfinite(model, feeds, **session):
    """Feeds with NaN, +Inf and -Inf at a few places give onnxruntime's results, the
    non-finite ones included (assert_allclose takes NaN as equal to NaN only)."""
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = segflow.InferenceSession(model, engine="inline", **session)
    for value in (np.nan, np.inf, -np.inf):
        poisoned = {}
        for name, array in feeds.items():
            array = array.copy()
            array.reshape(-1)[[0, 7, array.size // 2]] = value
            poisoned[name] = array
        want = ref.run(None, poisoned)
        assert not all(np.isfinite(w).all() for w in want)
        for w, g in zip(want, sess.run(None, poisoned), strict=True):
            np.testing.assert_allclose(g, w, atol=ATOL, rtol=RTOL, err_msg=f"feeds with {value}")


def _erf_gelu_after_linear(tail):
    """MatMul + bias, then the erf GELU with its tail associated as ``tail`` says:
    ``x_first`` ``(x * (1 + e)) * 0.5`` (TorchScript), ``half_last``
    ``x * (0.5 * (1 + e))`` (dynamo), ``half_x_first`` ``(x * 0.5) * (1 + e)``."""
    k, n = 8, 6
    inits = {"w": _rand(k, n), "b": _rand(n), "sqrt2": np.array(math.sqrt(2), np.float32),
             "one": np.array(1.0, np.float32), "half": np.array(0.5, np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["b", "m"], ["y"]),
             helper.make_node("Div", ["y", "sqrt2"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"])]
    nodes += {"x_first": [helper.make_node("Mul", ["y", "e1"], ["p"]),
                          helper.make_node("Mul", ["p", "half"], ["out"])],
              "half_last": [helper.make_node("Mul", ["half", "e1"], ["h"]),
                            helper.make_node("Mul", ["y", "h"], ["out"])],
              "half_x_first": [helper.make_node("Mul", ["y", "half"], ["h"]),
                               helper.make_node("Mul", ["h", "e1"], ["out"])]}[tail]
    return _model(nodes, {"x": ["batch", 5, k]}, ["out"], inits), {"x": _rand(2, 5, 8)}


@pytest.mark.parametrize("tail", ["x_first", "half_last", "half_x_first"])
def test_erf_gelu_in_each_association_becomes_a_post_op(tail):
    model, feeds = _erf_gelu_after_linear(tail)
    sess = _check(model, feeds, ["FusedGemm"])
    assert sess.graph.nodes[0].attrs["activation"] == "Gelu"
    _check_nonfinite(model, feeds)


@pytest.mark.parametrize("swap", [False, True], ids=["x_first", "const_first"])
@pytest.mark.parametrize("cube", ["pow", "mul"])
@pytest.mark.parametrize("tail", ["half_x_first", "x_first", "half_last"])
def test_tanh_gelu_in_each_association_becomes_a_post_op(tail, cube, swap):
    model, feeds = _tanh_gelu_after_linear(tail, cube, swap)
    sess = _check(model, feeds, ["FusedGemm"])
    node = sess.graph.nodes[0]
    assert node.attrs["activation"] == "GeluTanh"
    _check_nonfinite(model, feeds)


def test_tanh_gelu_after_a_reshaped_gemm_moves_before_the_reshape():
    """GPT-2's form: 2-D Gemm, Reshape to 3-D, GELU; the GELU becomes the Gemm's
    post-op and the Reshape then carries the output's name."""
    model, feeds = _tanh_gelu_after_linear(rank=2)
    sess = _check(model, feeds)
    ops = Counter(n.op_type for n in sess.graph.nodes)
    assert ops["FusedGemm"] == 1 and not {"Tanh", "Pow", "Mul", "Add", "Gelu"} & set(ops)
    (gemm,) = [n for n in sess.graph.nodes if n.op_type == "FusedGemm"]
    assert gemm.attrs["activation"] == "GeluTanh"
    assert sess.graph.outputs[0].name == "out"
    _check_nonfinite(model, feeds)


def test_tanh_gelu_with_other_constants_is_left_alone():
    model, feeds = _tanh_gelu_after_linear()
    for init in model.graph.initializer:
        if init.name == "kappa":
            init.CopyFrom(numpy_helper.from_array(np.array(0.05, np.float32), "kappa"))
    sess = _check(model, feeds)
    assert "Tanh" in {n.op_type for n in sess.graph.nodes}
    assert sess.graph.nodes[0].attrs.get("activation", "") == ""


def test_tanh_gelu_without_a_linear_is_one_gelu_node():
    model, feeds = _tanh_gelu_after_linear()
    # Drop the linear: the pattern reads the graph input.
    nodes = [n for n in model.graph.node if n.op_type not in ("MatMul",)
             and n.output[0] != "y"]
    for n in nodes:
        n.input[:] = ["x" if i == "y" else i for i in n.input]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    sess = _check(model, feeds, ["Gelu"])
    assert sess.graph.nodes[0].attrs["approximate"] == "tanh"
    _check_nonfinite(model, feeds)


@pytest.mark.parametrize("swap", [False, True])
def test_silu_after_a_conv_becomes_its_post_op(swap):
    model, feeds = _silu_after_conv(swap)
    sess = _check(model, feeds, ["FusedConv"])
    node = sess.graph.nodes[0]
    assert (node.attrs["activation"], list(node.attrs["activation_params"])) == ("Swish", [1.0])
    _check_nonfinite(model, feeds)
    _check(model, feeds, compile="none")


@pytest.mark.parametrize("swap", [False, True])
def test_scaled_swish_after_a_conv_becomes_its_post_op(swap):
    model, feeds = _silu_after_conv(swap, alpha=1.702)
    sess = _check(model, feeds, ["FusedConv"])
    node = sess.graph.nodes[0]
    assert node.attrs["activation"] == "Swish"
    assert node.attrs["activation_params"][0] == pytest.approx(1.702)
    _check_nonfinite(model, feeds)


def test_silu_without_a_conv_is_one_swish_node():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]),
             helper.make_node("Mul", ["s", "x"], ["out"])]
    model = _model(nodes, {"x": [4, 5]}, ["out"])
    feeds = {"x": _rand(4, 5, scale=3.0)}
    _check(model, feeds, ["Swish"])
    _check_nonfinite(model, feeds)


def test_silu_whose_sigmoid_is_read_elsewhere_is_left_alone():
    model, feeds = _silu_after_conv()
    model.graph.output.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    sess = _check(model, feeds)
    assert Counter(n.op_type for n in sess.graph.nodes) == Counter(["FusedConv", "Sigmoid", "Mul"])
    # A sigmoid of another value is a gate, not SiLU.
    nodes = [helper.make_node("Sigmoid", ["g"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["out"])]
    model = _model(nodes, {"x": [4, 5], "g": [4, 5]}, ["out"])
    _check(model, {"x": _rand(4, 5), "g": _rand(4, 5)}, ["Sigmoid", "Mul"])


def test_gemm_with_alpha_or_full_c_is_left_alone():
    inits = {"w": _rand(6, 5), "c": _rand(3, 5)}
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["out"], alpha=2.0)]
    model = _model(nodes, {"x": [3, 6]}, ["out"], inits)
    graph, result = _fused(model, ["linear"])
    assert not result.modified
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["out"])]
    graph, result = _fused(_model(nodes, {"x": [3, 6]}, ["out"], inits), ["linear"])
    assert not result.modified  # C is a full [3, 5] matrix, not a bias vector


def test_matmul_with_a_computed_weight_is_left_alone():
    model = _model([helper.make_node("MatMul", ["x", "y"], ["out"])],
                   {"x": [3, 4], "y": [4, 2]}, ["out"])
    _, result = _fused(model)
    assert not result.modified


# -- attention ---------------------------------------------------------------------------
def test_attention_pattern_becomes_one_node():
    b, h, s, d = 2, 3, 5, 4
    inits = {"scale": np.array(math.sqrt(d), np.float32)}
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["sc"]),
             helper.make_node("Div", ["sc", "scale"], ["sd"]),
             helper.make_node("Add", ["sd", "mask"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["out"])]
    model = _model(nodes, {"q": [b, h, s, d], "kt": [b, h, d, s], "v": [b, h, s, d],
                           "mask": [b, 1, 1, s]}, ["out"], inits)
    feeds = {"q": _rand(b, h, s, d), "kt": _rand(b, h, d, s), "v": _rand(b, h, s, d),
             "mask": (RNG.integers(0, 2, (b, 1, 1, s)) * -10000).astype(np.float32)}
    sess = _check(model, feeds, ["Attention"])
    assert sess.graph.nodes[0].attrs["scale"] == pytest.approx(1 / math.sqrt(d))


def test_attention_with_a_growing_mask_is_left_alone():
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["sc"]),
             helper.make_node("Add", ["sc", "mask"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["out"])]
    model = _model(nodes, {"q": [1, 2, 3, 4], "kt": [1, 2, 4, 3], "v": [1, 2, 3, 4],
                           "mask": [2, 2, 3, 3]}, ["out"])
    _, result = _fused(model, ["attention"])
    assert not result.modified


# -- sibling linears ------------------------------------------------------------------------
def test_sibling_linears_become_one_linear_and_a_split_of_views():
    model, feeds = _sibling_linears()
    sess = _check(model, feeds, compile="none")
    gemms = [n for n in sess.graph.nodes if n.op_type == "FusedGemm"]
    assert len(gemms) == 1 and gemms[0].attrs["activation"] == "Relu"
    assert gemms[0].outputs[0].spec.shape == ("batch", 5, 20)
    split = next(n for n in sess.graph.nodes if n.op_type == "Split")
    assert [v.name for v in split.outputs] == ["y0", "y1"]
    assert split.inputs[1].const.tolist() == [8, 12]
    _check(model, feeds, compile="codegen")


def test_a_matmul_weight_is_kept_as_a_view_of_its_initializer_not_copied():
    # MatMul stores W^T ([K, N]); FusedGemm reads [N, K]: the fuse pass keeps the
    # transposed view (no copy of the weights), and siblings join such views along N in
    # their own layout. The pipeline's end makes every constant contiguous (test_pipeline).
    k, n = 16, 24
    w = _rand(k, n)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": [3, k]}, ["y"],
                   {"w": w})
    graph, _ = _fused(model)
    (gemm,) = graph.nodes
    weight = gemm.inputs[1].const
    assert weight.shape == (n, k) and not weight.is_contiguous() and weight.t().is_contiguous()
    assert torch.equal(weight, torch.from_numpy(w).t())
    model, _ = _sibling_linears()
    graph, _ = _fused(model)
    (gemm,) = [node for node in graph.nodes if node.op_type == "FusedGemm"]
    merged = gemm.inputs[1].const
    assert merged.shape == (20, 16) and merged.t().is_contiguous()
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert torch.equal(merged, torch.from_numpy(np.concatenate([inits["w0"], inits["w1"]], 1)).t())


def test_a_matmul_over_the_transpose_of_a_weight_reads_the_weight_itself():
    # A language model's head: MatMul(x, Transpose(W)) with W [N, K] (too large to fold):
    # the FusedGemm reads W as it is stored, and the Transpose goes.
    k, n = 16, 24
    w = _rand(n, k)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    model = _model(nodes, {"x": [2, 3, k]}, ["y"], {"w": w})
    graph, _ = _fused(model, ["linear"])
    (gemm,) = graph.nodes
    assert gemm.op_type == "FusedGemm" and torch.equal(gemm.inputs[1].const, torch.from_numpy(w))
    _check(model, {"x": _rand(2, 3, k)}, ["FusedGemm"])
    # A Transpose read elsewhere too stays; one that is not 2-D leaves the MatMul alone.
    nodes.append(helper.make_node("Relu", ["wt"], ["r"]))
    graph, _ = _fused(_model(nodes, {"x": [2, 3, k]}, ["y", "r"], {"w": w}), ["linear"])
    assert Counter(node.op_type for node in graph.nodes) == {"FusedGemm": 1, "Transpose": 1,
                                                             "Relu": 1}
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    model = _model(nodes, {"x": [2, 3, k]}, ["y"], {"w": _rand(2, n, k)})
    _, result = _fused(model, ["linear"])
    assert not result.modified


@pytest.mark.parametrize("case", ["activations differ", "one has no bias", "a graph output"])
def test_sibling_linears_that_differ_stay_apart(case):
    if case == "activations differ":
        model, feeds = _sibling_linears(acts=("Relu", "Sigmoid"))
    elif case == "one has no bias":
        model, feeds = _sibling_linears(bias=(True, False))
    else:
        model, feeds = _sibling_linears(graph_output=True)
    sess = _check(model, feeds)
    assert [n.op_type for n in sess.graph.nodes].count("FusedGemm") == 2
    assert "Split" not in [n.op_type for n in sess.graph.nodes]


def test_bert_merges_each_layers_query_key_and_value():
    model, feeds = _bert()
    sess = _check(model, feeds)
    splits = [n for n in sess.graph.nodes if n.op_type == "Split"]
    assert len(splits) == 2
    attention = [n for n in sess.graph.nodes if n.op_type == "Attention"]
    assert all(n.inputs[i] is split.outputs[i] for n, split in zip(attention, splits)
               for i in range(3))


# -- every builder model stays correct ------------------------------------------------------
SMALL = {
    "resnet18": ({"num_classes": 10, "image_size": 64}, {}),
    "mobilenet_v2": ({"num_classes": 10, "image_size": 64}, {}),
    "bert_tiny": ({}, {"seq_len": 16}),
    "mlp_chain": ({"layers": 6}, {}),
    "nonzero_mid": ({}, {}),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_builder_models_match_onnxruntime_after_fusion(name):
    build, feed_opts = SMALL[name]
    model = models.build(name, **build)
    feeds = models.example_inputs(name, batch_size=2, **build, **feed_opts) \
        if name != "bert_tiny" else models.example_inputs(name, batch_size=2, **feed_opts)
    sess = _check(model, feeds)
    assert any(n.domain == "segflow" for n in sess.graph.nodes)
    unfused = segflow.InferenceSession(model, engine="inline", optimize={"fuse": False})
    assert not any(n.domain == "segflow" for n in unfused.graph.nodes)


def test_fuse_can_be_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("SEGFLOW_NO_FUSE", "1")
    sess = segflow.InferenceSession(models.build("mlp_chain", layers=2))
    assert [n.op_type for n in sess.graph.nodes] == ["Gemm", "Relu", "Gemm", "Relu"]
    assert "fuse: off" in sess.explain()


def test_fuse_rules_can_be_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("SEGFLOW_NO_FUSE", "activation,batchnorm")
    model, feeds = _resnet()
    sess = _check(model, feeds)
    kinds = Counter(n.op_type for n in sess.graph.nodes)
    assert kinds["BatchNormalization"] == 20 and kinds["FusedConv"] == 20 and kinds["Relu"] > 0
    assert "rules off: batchnorm, activation" in sess.explain()


def test_fused_model_still_serializes_through_onnx_checker():
    # The fuse pass only rewrites segflow's IR; the caller's ModelProto is untouched.
    model = models.build("mlp_chain", layers=2)
    before = model.SerializeToString()
    segflow.InferenceSession(model)
    assert model.SerializeToString() == before
    onnx.checker.check_model(model)


def test_attention_falls_back_when_the_mask_grows_the_scores():
    # Symbolic dims pass the fuse rule; at run time the mask has a bigger batch than Q.
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["sc"]),
             helper.make_node("Add", ["sc", "mask"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["out"])]
    model = _model(nodes, {"q": ["a", 2, 3, 4], "kt": ["a", 2, 4, 3], "v": ["a", 2, 3, 4],
                           "mask": ["m", 1, 1, 3]}, ["out"])
    feeds = {"q": _rand(1, 2, 3, 4), "kt": _rand(1, 2, 4, 3), "v": _rand(1, 2, 3, 4),
             "mask": _rand(2, 1, 1, 3)}
    _check(model, feeds, ["Attention"])


def test_layout_switch_keeps_results():
    model = models.build("resnet18", num_classes=10, image_size=32)
    feeds = models.example_inputs("resnet18", batch_size=2, num_classes=10, image_size=32)
    # codegen: the onednn backend (auto's choice for convolutions) packs its own weights.
    on = segflow.InferenceSession(model, engine="inline", compile="codegen")
    off = segflow.InferenceSession(model, engine="inline", optimize={"layout": False},
                                   compile="codegen")
    assert any(on.plan.choices[n].channels_last for n in on.graph.nodes)
    assert not any(off.plan.choices[n].channels_last for n in off.graph.nodes)
    np.testing.assert_allclose(on.run(None, feeds)[0], off.run(None, feeds)[0],
                               atol=ATOL, rtol=RTOL)


def test_conv_weights_are_repacked_once_per_new_input_shape():
    model = models.build("resnet18", num_classes=10, image_size=32)
    sess = segflow.InferenceSession(model, engine="inline", compile="none")
    conv = next(n for n in sess.graph.nodes if n.op_type == "FusedConv")
    # A symbolic batch is packed as 1.
    assert sess.plan.choices[conv].packed_for == (1, 3, 32, 32)
    for batch in (1, 3, 3, 1):
        feeds = models.example_inputs("resnet18", batch_size=batch, num_classes=10,
                                      image_size=32)
        ref = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=ATOL, rtol=RTOL)


def _packed_conv(shape: list[int], ic: int, oc: int, k: int) -> tuple[Any, torch.Tensor]:
    spec = fused.ConvSpec(spatial=2, strides=[1, 1], pads=[k // 2] * 2, begin_end=[],
                          dilations=[1, 1], group=1, has_bias=False, has_residual=False)
    w = torch.ops.mkldnn._reorder_convolution_weight(
        torch.randn(oc, ic, k, k), spec.pads, spec.strides, spec.dilations, 1, shape)
    return spec, w


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_weight_for_a_new_shape_shares_the_packed_weight_when_the_format_is_the_same():
    spec, w = _packed_conv([1, 16, 8, 8], 16, 16, 3)
    weight_for = conv_kernels.WeightForInput(spec, [1, 16, 8, 8])
    x = torch.randn(4, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    packed = weight_for(x, w)
    fresh = torch.ops.mkldnn._reorder_convolution_weight(
        w.to_dense(), spec.pads, spec.strides, spec.dilations, 1, list(x.shape))
    same_format = conv_kernels.blocked_layout(fresh) == conv_kernels.blocked_layout(w)
    if conv_kernels.blocked_layout(w) is not None and same_format:
        assert packed is w and weight_for.copies == 0     # no second copy of the weight
    else:
        assert packed is not w and weight_for.copies == 1
    assert weight_for(x, w) is packed                      # decided once per shape
    conv = torch.ops.mkldnn._convolution_pointwise.default
    y = conv(x, packed, None, spec.pads, spec.strides, spec.dilations, 1, "none", [], "")
    ref = F.conv2d(x, w.to_dense(), padding=1)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_weight_for_keeps_at_most_max_repacks_copies(monkeypatch: pytest.MonkeyPatch):
    # Pretend every shape gets its own format: copies stop at MAX_REPACKS, and
    # later shapes run on the weight as packed (oneDNN reorders on the fly).
    formats = iter(range(1000))
    monkeypatch.setattr(conv_kernels, "blocked_layout", lambda t: bytes([next(formats)]))
    spec, w = _packed_conv([1, 8, 6, 6], 8, 8, 1)
    weight_for = conv_kernels.WeightForInput(spec, [1, 8, 6, 6])
    results = [weight_for(torch.randn(b, 8, 6, 6), w) for b in (2, 3, 4, 5)]
    assert weight_for.copies == conv_kernels.MAX_REPACKS == 2
    assert [r is w for r in results] == [False, False, True, True]
    assert len({id(r) for r in results[:2]}) == 2
