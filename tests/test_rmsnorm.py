"""Tests for the fuse pass's ``rmsnorm`` rule (passes/fuse/rmsnorm.py) and the RMS form of
AddLayerNorm the ``layernorm`` rule makes of it: the exporters' decomposed RMS norm in its
variants, with and without a residual Add before it, against onnxruntime (NaN and Inf
rows included; atol/rtol 1e-5 on unit-scale rows), and the graphs it must leave alone.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow.frontend.onnx_import import import_model
from segflow.kernels.native.build import NativeLibrary
from segflow.passes.fuse import run_rules

LIB, WHY = NativeLibrary.probe()
RNG = np.random.default_rng(7)
WIDTH = 48
ATOL = RTOL = 1e-5

# The inverse root and its product with x, as the exporters write them ("h" is the
# normalized value's input, "v" the mean of squares plus eps).
ROOTS = {
    "sqrt-div": [("Sqrt", ["v"], ["root"]), ("Div", ["h", "root"], ["n"])],
    "sqrt-one-over": [("Sqrt", ["v"], ["root"]), ("Div", ["one", "root"], ["inv"]),
                      ("Mul", ["h", "inv"], ["n"])],
    "sqrt-reciprocal": [("Sqrt", ["v"], ["root"]), ("Reciprocal", ["root"], ["inv"]),
                        ("Mul", ["inv", "h"], ["n"])],
    "pow-minus-half": [("Pow", ["v", "minus_half"], ["inv"]), ("Mul", ["h", "inv"], ["n"])],
}


def _model(root="sqrt-one-over", square="pow", residual=True, read_again=True, eps=1e-6,
           axes=(-1,), axes_attr=False, keepdims=1, weight_shape=(WIDTH,), eps_input=False,
           weight_first=True, opset=18):
    """``out = w * rms(h)`` with ``h = x + r`` (``residual``) or ``h = x``; where the
    sum is ``read_again`` the graph also returns ``h + out`` (the next residual)."""
    nodes = [helper.make_node("Add", ["x", "r"], ["h"])] if residual else \
        [helper.make_node("Identity", ["x"], ["h"])]
    nodes.append(helper.make_node("Pow", ["h", "two"], ["sq"]) if square == "pow" else
                 helper.make_node("Mul", ["h", "h"], ["sq"]))
    mean_inputs = ["sq"] if axes_attr else ["sq", "axes"]
    mean_attrs = {"keepdims": keepdims, **({"axes": list(axes)} if axes_attr else {})}
    nodes.append(helper.make_node("ReduceMean", mean_inputs, ["m"], **mean_attrs))
    nodes.append(helper.make_node("Add", ["m", "eps"], ["v"]))
    nodes += [helper.make_node(op, i, o) for op, i, o in ROOTS[root]]
    nodes.append(helper.make_node("Mul", ["w", "n"] if weight_first else ["n", "w"], ["y"]))
    outputs = ["y"]
    if read_again:
        nodes.append(helper.make_node("Add", ["h", "y"], ["next"]))
        outputs.append("next")
    inits = {"two": np.float32(2), "one": np.float32(1), "minus_half": np.float32(-0.5),
             "w": RNG.standard_normal(weight_shape).astype(np.float32)}
    if not axes_attr:
        inits["axes"] = np.array(axes, np.int64)
    if not eps_input:
        inits["eps"] = np.float32(eps)
    inputs = {"x": ["batch", 8, WIDTH], "r": ["batch", 8, WIDTH]}
    if eps_input:
        inputs["eps"] = []
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _feeds(eps_input=False):
    feeds = {k: RNG.standard_normal((2, 8, WIDTH)).astype(np.float32) for k in ("x", "r")}
    feeds["x"][0, 3, 7] = np.nan
    feeds["r"][1, 5, 0] = np.inf
    feeds["x"][1, 6] = 0.0           # an all-zero row: eps alone under the root
    feeds["r"][1, 6] = 0.0
    if eps_input:
        feeds["eps"] = np.array(1e-6, np.float32)
    return feeds


def _run(model, feeds, **session):
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = segflow.InferenceSession(model, **session)
    for _ in range(3):       # the first run, the recording, the replay where there is one
        got = sess.run(None, feeds)
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_allclose(g, r, atol=ATOL, rtol=RTOL)
    return sess, Counter(n.op_type for n in sess.graph.nodes)


@pytest.mark.parametrize("root", sorted(ROOTS))
@pytest.mark.parametrize("square", ["pow", "mul"])
def test_each_form_becomes_one_rms_norm(root, square):
    graph = import_model(_model(root, square, residual=False, read_again=False))
    counts = run_rules(graph, ["rmsnorm"])
    graph.validate()
    assert counts == {"rmsnorm": 1}
    assert [n.op_type for n in graph.nodes] == ["Identity", "RMSNormalization"]
    (norm,) = [n for n in graph.nodes if n.op_type == "RMSNormalization"]
    assert norm.attrs == {"axis": -1, "epsilon": pytest.approx(1e-6)} and norm.opset == 23
    sess, ops = _run(_model(root, square, residual=False, read_again=False), _feeds())
    assert ops == {"AddLayerNorm": 1}    # the lone norm gets the native kernel too
    (fused,) = sess.graph.nodes
    assert fused.inputs[1] is None and fused.attrs["simplified"] == 1
    if LIB is not None:
        assert "3 calls native, 0 through torch" in "\n".join(sess.kernel_report())


@pytest.mark.parametrize("compile_mode", ["codegen", "none"])
@pytest.mark.parametrize("read_again", [True, False])
def test_a_residual_add_before_it_joins_with_the_sum_as_an_output(compile_mode, read_again):
    sess, ops = _run(_model(read_again=read_again), _feeds(), compile=compile_mode)
    assert ops == Counter({"AddLayerNorm": 1, **({"Add": 1} if read_again else {})})
    (fused,) = [n for n in sess.graph.nodes if n.op_type == "AddLayerNorm"]
    assert [v.name for v in fused.outputs] == (["y", "h"] if read_again else ["y"])
    assert fused.attrs["simplified"] == 1
    form = "1 RMS, 1 writing the sum" if read_again else "1 RMS"
    assert f"add + layer norm: 1 node ({form}); " in "\n".join(sess.kernel_report())


@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-5, 0.1])
@pytest.mark.parametrize("weight_first", [True, False])
def test_eps_and_operand_order_are_kept(eps, weight_first):
    _, ops = _run(_model(eps=eps, weight_first=weight_first), _feeds())
    assert ops == {"AddLayerNorm": 1, "Add": 1}


def test_the_axes_attribute_of_older_opsets_and_the_rank_minus_one_axis():
    _, ops = _run(_model(axes_attr=True, opset=17), _feeds())
    assert ops == {"AddLayerNorm": 1, "Add": 1}
    _, ops = _run(_model(axes=(2,)), _feeds())
    assert ops == {"AddLayerNorm": 1, "Add": 1}


def test_with_layernorm_off_the_rms_norm_node_runs_its_reference():
    sess, ops = _run(_model(), _feeds(), optimize={"fuse.layernorm": False})
    assert ops == {"RMSNormalization": 1, "Add": 2}
    _, ops = _run(_model(), _feeds(), optimize={"fuse.rmsnorm": False})
    assert ops["ReduceMean"] == 1 and "AddLayerNorm" not in ops


@pytest.mark.parametrize("case", ["wrong axis", "two axes", "keepdims 0", "eps computed",
                                  "weight not 1-D", "weight of another width"])
def test_what_is_not_an_rms_norm_stays(case):
    make = {"wrong axis": {"axes": (1,)}, "two axes": {"axes": (1, 2)},
            "keepdims 0": {"keepdims": 0}, "eps computed": {"eps_input": True},
            "weight not 1-D": {"weight_shape": (8, WIDTH)},
            "weight of another width": {"weight_shape": (1,)}}[case]
    model = _model(**make)
    graph = import_model(model)
    assert run_rules(graph, ["rmsnorm"]) == {"rmsnorm": 0}
    if case == "keepdims 0":     # the mean no longer broadcasts over the rows: no oracle
        return
    _, ops = _run(model, _feeds(eps_input=case == "eps computed"))
    assert "ReduceMean" in ops and "RMSNormalization" not in ops
    assert not any(n == "AddLayerNorm" for n in ops)


def test_an_intermediate_read_elsewhere_stays():
    model = _model(read_again=False)
    model.graph.output.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, None))
    graph = import_model(model)
    assert run_rules(graph, ["rmsnorm"]) == {"rmsnorm": 0}
    _, ops = _run(model, _feeds())
    assert ops["ReduceMean"] == 1
