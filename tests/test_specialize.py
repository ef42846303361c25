"""passes/specialize.py, passes/static_shapes.py and runtime/specialized.py: a graph that
computes its reshape targets from Shape outputs over symbolic dims is planned again per
input shape, its shape arithmetic folded; results equal onnxruntime's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import segflow

ort = pytest.importorskip("onnxruntime")


def _model() -> onnx.ModelProto:
    """x[B, S, 8] -> Reshape to [B, S, 2, 4] from Shape arithmetic -> Transpose ->
    Reshape back to [B, S, 8] (Shape/Gather/Unsqueeze/Concat, as exporters write it)."""
    c = helper.make_tensor
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["q"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax"], ["bu"]),
        helper.make_node("Unsqueeze", ["q", "ax"], ["qu"]),
        helper.make_node("Concat", ["bu", "qu", "two", "four"], ["shape4"], axis=0),
        helper.make_node("Reshape", ["x", "shape4"], ["x4"]),
        helper.make_node("Transpose", ["x4"], ["t"], perm=[0, 1, 3, 2]),
        helper.make_node("Concat", ["bu", "qu", "eight"], ["shape3"], axis=0),
        helper.make_node("Reshape", ["t", "shape3"], ["y"]),
    ]
    inits = [c("i0", TensorProto.INT64, [], [0]), c("i1", TensorProto.INT64, [], [1]),
             c("ax", TensorProto.INT64, [1], [0]), c("two", TensorProto.INT64, [1], [2]),
             c("four", TensorProto.INT64, [1], [4]), c("eight", TensorProto.INT64, [1], [8])]
    graph = helper.make_graph(
        nodes, "shape_arith",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ops(graph) -> list[str]:  # type: ignore[no-untyped-def]
    return [n.op_type for n in graph.nodes]


@pytest.mark.parametrize("shape", [(1, 16, 8), (4, 128, 8)])
def test_plan_per_shape_folds_the_shape_arithmetic(shape: tuple[int, int, int]) -> None:
    model = _model()
    sess = segflow.InferenceSession(model.SerializeToString())
    oracle = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0],
                               atol=1e-6, rtol=0)
    # the session's own plan keeps the arithmetic: 10 nodes
    assert len(sess.graph.nodes) == 10
    assert "specialize: shapes computed at run time from x (Shape 1)" in sess.explain()
    (key, specialized), = sess.specializations.items()
    assert key == (shape,)
    # bound: the arithmetic folds, the first Reshape gets a static shape and the
    # reshapes and the transpose are all that is left
    assert _ops(specialized.graph) == ["Reshape", "Transpose", "Reshape"]
    assert all(v.spec.is_static for n in specialized.graph.nodes for v in n.outputs)


def test_each_shape_planned_once_and_the_switch() -> None:
    model = _model().SerializeToString()
    sess = segflow.InferenceSession(model)
    for shape in [(1, 4, 8), (2, 4, 8), (1, 4, 8)]:
        sess.run(None, {"x": np.ones(shape, np.float32)})
    assert sorted(sess.specializations) == [((1, 4, 8),), ((2, 4, 8),)]
    off = segflow.InferenceSession(model, optimize={"specialize": False})
    off.run(None, {"x": np.ones((1, 4, 8), np.float32)})
    assert off.specializations == {}
    assert "specialize: off" in off.explain()
    assert off.options.specialize is False and sess.options.specialize is True


def test_static_inputs_are_not_specialized() -> None:
    model = _model()
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_value, dims[1].dim_value = 2, 3
    sess = segflow.InferenceSession(model.SerializeToString())
    sess.run(None, {"x": np.ones((2, 3, 8), np.float32)})
    assert sess.specializations == {}
    assert _ops(sess.graph) == ["Reshape", "Transpose", "Reshape"]
    assert "specialize: nothing computes shapes at run time" in sess.explain()


def test_cap_runs_the_own_plan_past_it() -> None:
    from segflow.runtime.specialized import Specializations
    model = _model().SerializeToString()
    sess = segflow.InferenceSession(model)
    specialized = sess._specialized
    assert isinstance(specialized, Specializations)
    specialized.cap = 1
    oracle = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for shape in [(1, 2, 8), (3, 2, 8)]:
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                                   oracle.run(None, {"x": x})[0], atol=1e-6, rtol=0)
    assert list(sess.specializations) == [((1, 2, 8),)]
    assert specialized.declined == 1


def _packed_weights(sess) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The constant each FusedGemm reads as its weight, by node name."""
    return {n.name: n.inputs[1].const for n in sess.graph.nodes
            if n.op_type == "FusedGemm" and n.inputs[1] is not None}


def test_plans_per_shape_share_the_packed_weights() -> None:
    from segflow import models
    from segflow.kernels.native.build import NativeLibrary
    if NativeLibrary.probe()[0] is None:
        pytest.skip("native kernels unavailable: no linear is packed")
    # BERT-base's widths, so the linears are packed; the encoder reads its sequence
    # length off a Shape, so each input shape gets a plan of its own.
    size = {"layers": 1, "hidden": 768, "heads": 12, "ffn": 3072, "vocab": 50,
            "max_positions": 32}
    model = models.build("bert_tiny", **size, seq_len=8)
    sess = segflow.InferenceSession(model)
    oracle = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in (8, 16):
        feeds = models.example_inputs("bert_tiny", batch_size=1, seed=seq, **size, seq_len=seq)
        for got, want in zip(sess.run(None, feeds), oracle.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    own = _packed_weights(sess)
    assert own
    assert len(sess.specializations) == 2
    for specialized in sess.specializations.values():
        theirs = _packed_weights(specialized)
        # every linear the shape leaves alone reads the very tensor the session packed
        shared = [name for name, w in theirs.items() if own.get(name) is w]
        assert len(shared) == len(own) == len(theirs), (len(shared), len(own), len(theirs))


def test_a_shape_read_off_a_nonzero_does_not_specialize() -> None:
    from segflow import models
    model = models.build("nonzero_mid")
    sess = segflow.InferenceSession(model)
    assert "specialize: nothing computes shapes at run time" in sess.explain()
    feeds = models.example_inputs("nonzero_mid", batch_size=3)
    oracle = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for got, want in zip(sess.run(None, feeds), oracle.run(None, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert sess.specializations == {}


def _padded_conv_model() -> onnx.ModelProto:
    """x[B, 3, 8, 8] -> Pad by amounts computed from x's height (TensorFlow's "same"
    padding as exporters write it) -> Conv: shape inference names the Conv's output dims
    with symbols no input declares."""
    c = helper.make_tensor
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i2"], ["h"], axis=0),
        helper.make_node("Sub", ["h", "seven"], ["one"]),         # 8 - 7 = 1
        helper.make_node("Unsqueeze", ["one", "ax"], ["end"]),
        helper.make_node("Concat", ["zeros6", "end", "end"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["xp"]),
        helper.make_node("Conv", ["xp", "w"], ["y"], strides=[2, 2]),
    ]
    inits = [c("i2", TensorProto.INT64, [], [2]), c("seven", TensorProto.INT64, [], [7]),
             c("ax", TensorProto.INT64, [1], [0]), c("zeros6", TensorProto.INT64, [6], [0] * 6),
             onnx.numpy_helper.from_array(w, "w")]
    graph = helper.make_graph(
        nodes, "padded_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_padding_computed_from_the_input_size_is_planned_per_shape() -> None:
    model = _padded_conv_model()
    sess = segflow.InferenceSession(model.SerializeToString())
    oracle = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert "specialize: shapes computed at run time from x (Shape 1)" in sess.explain()
    (conv,) = [n for n in sess.graph.nodes if n.op_type == "FusedConv"]
    assert any(isinstance(d, str) and d != "batch" for d in conv.outputs[0].spec.shape)
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0],
                                   atol=1e-5, rtol=1e-5)
    for (shape,), specialized in sess.specializations.items():
        (conv,) = [n for n in specialized.graph.nodes if n.op_type == "FusedConv"]
        assert conv.outputs[0].spec.shape == (shape[0], 4, 4, 4)
    assert len(sess.specializations) == 2


def test_dims_no_input_declares_are_planned_per_shape() -> None:
    from segflow.frontend.onnx_import import import_model
    from segflow.passes.specialize import specialize_reason, unbound_dims
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, ["rows", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    imported = import_model(model)
    assert unbound_dims(imported) == ["rows"]
    assert specialize_reason(imported) == "dims unknown until run time (rows) over x"
    sess = segflow.InferenceSession(model.SerializeToString())
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], 1 / (1 + np.exp(-np.maximum(x, 0))),
                               atol=1e-6, rtol=0)
    ((key, specialized),) = sess.specializations.items()
    assert key == ((3, 8),) and specialized.graph.nodes[0].outputs[0].spec.shape == (3, 8)


class _Counted:
    """Counts the pipeline runs and the plans sessions make (each wrapped where the
    session calls it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from segflow.runtime import ort_session, session
        self.pipelines = self.plans = 0
        run_pipeline, make_plan = ort_session.run_pipeline, session.make_plan

        def pipeline(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.pipelines += 1
            return run_pipeline(*args, **kwargs)

        def plan(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.plans += 1
            return make_plan(*args, **kwargs)
        monkeypatch.setattr(ort_session, "run_pipeline", pipeline)
        monkeypatch.setattr(session, "make_plan", plan)

    @property
    def counts(self) -> tuple[int, int]:
        return self.pipelines, self.plans


def test_the_own_plan_is_made_when_first_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _Counted(monkeypatch)
    model = _model().SerializeToString()
    sess = segflow.InferenceSession(model)
    # every run below the cap takes a plan per shape: loading plans nothing
    assert counted.counts == (0, 0) and not sess.planned
    oracle = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for shape in [(2, 4, 8), (2, 4, 8), (3, 4, 8)]:
        x = np.random.default_rng(shape[0]).standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0],
                                   atol=1e-6, rtol=0)
    assert counted.counts == (2, 2) and not sess.planned   # one per shape
    text = sess.explain()                                    # needs the session's plan
    assert counted.counts == (3, 3) and sess.planned
    assert "specialize: shapes computed at run time from x (Shape 1)" in text
    assert "specialized for x=2x4x8: 3 nodes" in text
    assert len(sess.graph.nodes) == 10
    sess.explain()
    sess.run(None, {"x": np.ones((2, 4, 8), np.float32)})
    assert counted.counts == (3, 3)
    sess.close()


def test_explain_before_the_first_run_makes_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _Counted(monkeypatch)
    sess = segflow.InferenceSession(_model().SerializeToString())
    assert "specialize: shapes computed at run time from x (Shape 1)" in sess.explain()
    assert counted.counts == (1, 1) and sess.specializations == {}


def test_a_shape_past_the_cap_makes_the_own_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _Counted(monkeypatch)
    model = _model().SerializeToString()
    sess = segflow.InferenceSession(model)
    assert sess._specialized is not None
    sess._specialized.cap = 1
    oracle = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for shape, counts in [((1, 2, 8), (1, 1)), ((3, 2, 8), (2, 2)), ((4, 2, 8), (2, 2))]:
        x = np.random.default_rng(shape[0]).standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0],
                                   atol=1e-6, rtol=0)
        assert counted.counts == counts, shape
    assert sess.planned and sess.last_run_stats is not None


@pytest.mark.parametrize("specialize", [True, False])
def test_a_graph_not_planned_per_shape_is_planned_at_load(
        monkeypatch: pytest.MonkeyPatch, specialize: bool) -> None:
    counted = _Counted(monkeypatch)
    model = _model()
    if specialize:   # fixed input dims: nothing to specialize
        dims = model.graph.input[0].type.tensor_type.shape.dim
        dims[0].dim_value, dims[1].dim_value = 2, 3
    sess = segflow.InferenceSession(model.SerializeToString(),
                                    optimize={"specialize": specialize})
    assert counted.counts == (1, 1) and sess.planned
    sess.run(None, {"x": np.ones((2, 3, 8), np.float32)})
    assert counted.counts == (1, 1) and sess.specializations == {}


def test_an_invalid_node_still_fails_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """LpNormalization's p is checked when its kernel binds: a session that makes its
    plan later binds every node at load all the same."""
    from segflow.errors import InvalidModel
    counted = _Counted(monkeypatch)
    model = _model()
    model.graph.node[-1].output[0] = "r"
    model.graph.node.append(helper.make_node("LpNormalization", ["r"], ["y"], name="lp1",
                                             axis=-1, p=3))
    data = model.SerializeToString()
    with pytest.raises(InvalidModel, match="lp1.*p=1 or p=2, got 3"):
        segflow.InferenceSession(data)
    assert counted.counts == (0, 0)
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail
    with pytest.raises(Fail, match=r"p_ == 1 \|\| p_ == 2"):   # onnxruntime refuses it too
        ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    model.graph.node[-1].attribute[-1].i = 2    # the same model with p=2 loads and runs
    sess = segflow.InferenceSession(model.SerializeToString())
    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    oracle = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0],
                               atol=1e-6, rtol=1e-5)


def test_a_plan_per_shape_does_not_check_the_model_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What no dim changes (structure, attributes against the schemas, input types) is
    checked when the session loads; its plans per shape run ONNX's shape inference."""
    from segflow.frontend import onnx_import, validate
    calls = {"structure": 0, "node": 0, "types": 0, "inference": 0}

    def counted(name, fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(onnx_import, "check_structure",
                        counted("structure", onnx_import.check_structure))
    monkeypatch.setattr(onnx_import, "_with_inferred_shapes",
                        counted("inference", onnx_import._with_inferred_shapes))
    checker = validate.SchemaChecker
    monkeypatch.setattr(checker, "check_node", counted("node", checker.check_node))
    monkeypatch.setattr(checker, "check_types", counted("types", checker.check_types))
    sess = segflow.InferenceSession(_model().SerializeToString())
    assert calls == {"structure": 1, "node": 10, "types": 10, "inference": 1}
    for batch in (1, 2):
        sess.run(None, {"x": np.ones((batch, 4, 8), np.float32)})
    assert len(sess.specializations) == 2
    assert calls == {"structure": 1, "node": 10, "types": 10, "inference": 3}


def test_a_nan_in_the_shared_weights_reaches_the_plans_per_shape() -> None:
    """The session scans the weights its plans per shape share; a plan per shape over a
    weight holding NaN binds every kernel exact, as the session's own plan does."""
    model = _model()
    # 8 KiB: over what the plans per shape read from the model, so they share it
    weight = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    finite = {}
    for nan in (False, True):
        weight[3, 5] = np.nan if nan else 0.5
        model.graph.node[-1].output[0] = "r"
        del model.graph.node[10:]
        model.graph.node.append(helper.make_node("MatMul", ["r", "w"], ["y"]))
        del model.graph.initializer[6:]
        model.graph.initializer.append(onnx.numpy_helper.from_array(weight, "w"))
        data = model.SerializeToString()
        sess = segflow.InferenceSession(data)
        x = np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32)
        oracle = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0],
                                   atol=1e-5, rtol=1e-5)
        ((_, specialized),) = sess.specializations.items()
        finite[nan] = (specialized._nonfinite.exact is not None, sess._nonfinite.exact is not None)
    assert finite == {False: (True, True), True: (False, False)}


def test_a_session_loaded_again_drops_its_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _Counted(monkeypatch)
    sess = segflow.InferenceSession(_model().SerializeToString())
    sess.explain()
    first = sess.plan
    assert counted.counts == (1, 1) and sess.planned
    sess.set_providers(["CPUExecutionProvider"])     # loads the model again
    assert counted.counts == (1, 1) and not sess.planned
    x = np.ones((1, 4, 8), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0],
                                  x.reshape(1, 4, 2, 4).transpose(0, 1, 3, 2).reshape(1, 4, 8))
    assert counted.counts == (2, 2)
    assert sess.plan is not first and counted.counts == (3, 3)
