"""NaN and infinities come back where onnxruntime puts them (runtime/nonfinite.py).

Every kernel path segflow can choose on the CPU is run with NaN, +Inf and -Inf at
random positions of its feeds, under the default settings and under each switch that
changes which kernel runs; the NaN, +Inf and -Inf masks of the outputs must equal
onnxruntime's. The one stated exception is max pooling: onnxruntime's kernel keeps a
NaN only when it comes last in the window, segflow returns NaN wherever the window
holds one (torch's rule); there the expected masks are segflow's reference kernels'
(``optimize=False``), and onnxruntime's NaN must be among them.
"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models
from segflow.kernels.onednn.library import Library

VALUES = (np.nan, np.inf, -np.inf)
# The switches that change which kernel runs: (id, optimize, SEGFLOW_NATIVE).
SWITCHES = [
    ("default", None, None),
    ("native_off", None, "0"),
    ("layout_off", {"layout": False}, None),
    ("winograd_on", {"layout.winograd": True}, None),
    ("winograd_off", {"layout.winograd": False}, None),
    ("stem_on", {"layout.native_stem": True}, None),
    ("stem_off", {"layout.native_stem": False}, None),
    ("direct_off", {"layout.direct": False}, None),
]


def _masks(array: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.isnan(array), np.isposinf(array), np.isneginf(array)


def _assert_masks(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, gm, wm in zip(("NaN", "+Inf", "-Inf"), _masks(g), _masks(w)):
            assert np.array_equal(gm, wm), (
                f"{what}: output {i}: {name} at {int(gm.sum())} places, expected "
                f"{int(wm.sum())} ({int((gm != wm).sum())} differ)")


def _ort(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _poisoned(feeds: dict[str, np.ndarray], value: float, rng: np.random.Generator
              ) -> dict[str, np.ndarray]:
    """``feeds`` with ``value`` at two random places of every float feed."""
    out = {}
    for name, array in feeds.items():
        array = array.copy()
        if array.dtype.kind == "f":
            for _ in range(2):
                array[tuple(int(rng.integers(0, d)) for d in array.shape)] = value
        out[name] = array
    return out


# -- handmade graphs, one per kernel path ------------------------------------------------
def _model(nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray],
           inputs: dict[str, list[int]], opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, s)
                     for k, s in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _w(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)


def _conv(x: str, w: str, y: str, **attrs: object) -> onnx.NodeProto:
    return helper.make_node("Conv", [x, w], [y], **attrs)


def _graphs() -> dict[str, tuple[onnx.ModelProto, bool]]:
    """name -> (model, whether it max-pools)."""
    rng = np.random.default_rng(7)
    p1 = {"pads": [1, 1, 1, 1]}
    lo, hi = np.array(0, np.float32), np.array(6, np.float32)
    return {
        # The stem kernel (<= 4 channels, NCHW read in place) with ReLU, then max pooling.
        "stem_maxpool": (_model([
            _conv("x", "w", "c", pads=[3, 3, 3, 3], strides=[2, 2]),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                             pads=[1, 1, 1, 1])],
            {"w": _w(rng, 16, 3, 7, 7)}, {"x": [1, 3, 32, 32]}), True),
        # 3x3 convolutions with 49 tiles an image: Winograd where it is chosen; Clip
        # and ReLU post-ops; a residual add with ReLU (the sum post-op).
        "winograd_residual": (_model([
            _conv("x", "w1", "a", **p1), helper.make_node("Clip", ["a", "lo", "hi"], ["b"]),
            _conv("b", "w2", "c", **p1), helper.make_node("Add", ["c", "x"], ["d"]),
            helper.make_node("Relu", ["d"], ["y"])],
            {"w1": _w(rng, 16, 16, 3, 3), "w2": _w(rng, 16, 16, 3, 3), "lo": lo, "hi": hi},
            {"x": [1, 16, 28, 28]}), False),
        # Depthwise 3x3 with Clip, a 1x1 with HardSigmoid, average pooling.
        "depthwise_avgpool": (_model([
            _conv("x", "dw", "a", group=16, **p1),
            helper.make_node("Clip", ["a", "lo", "hi"], ["b"]),
            _conv("b", "pw", "c"), helper.make_node("HardSigmoid", ["c"], ["d"]),
            helper.make_node("AveragePool", ["d"], ["y"], kernel_shape=[3, 3],
                             strides=[2, 2])],
            {"dw": _w(rng, 16, 1, 3, 3), "pw": _w(rng, 32, 16, 1, 1), "lo": lo, "hi": hi},
            {"x": [1, 16, 20, 20]}), False),
        # Global max and average pooling, the classifier's linear.
        "global_pools_classifier": (_model([
            _conv("x", "w", "a", **p1), helper.make_node("Relu", ["a"], ["b"]),
            helper.make_node("GlobalMaxPool", ["b"], ["m"]),
            helper.make_node("GlobalAveragePool", ["b"], ["v"]),
            helper.make_node("Add", ["m", "v"], ["s"]),
            helper.make_node("Flatten", ["s"], ["f"], axis=1),
            helper.make_node("Gemm", ["f", "g", "gb"], ["y"], transB=1)],
            {"w": _w(rng, 64, 8, 3, 3), "g": _w(rng, 100, 64),
             "gb": rng.standard_normal(100).astype(np.float32)}, {"x": [1, 8, 14, 14]}), True),
        # Large linears (native panels, Strassen, oneDNN) with ReLU and erf-GELU.
        "linears": (_model([
            helper.make_node("Gemm", ["x", "g1", "b1"], ["a"], transB=1),
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node("MatMul", ["r", "g2"], ["m"]), helper.make_node("Add", ["m", "b2"],
                                                                            ["n"]),
            helper.make_node("Gelu", ["n"], ["y"])],
            {"g1": _w(rng, 512, 256), "b1": rng.standard_normal(512).astype(np.float32),
             "g2": _w(rng, 512, 512).T.copy(), "b2": rng.standard_normal(512).astype(np.float32)},
            {"x": [64, 256]}, opset=20), False),
        # A single row (GEMV) with Clip, and a chain of tiny layers (the dense chain).
        "gemv_chain": (_model([
            helper.make_node("Gemm", ["x", "g1", "b1"], ["a"], transB=1),
            helper.make_node("Clip", ["a", "lo", "hi"], ["b"]),
            *[n for i in range(4) for n in (
                helper.make_node("Gemm", ["b" if i == 0 else f"h{i}", f"c{i}", f"cb{i}"],
                                 [f"l{i}"], transB=1),
                helper.make_node("Relu", [f"l{i}"], ["y" if i == 3 else f"h{i + 1}"]))]],
            {"g1": _w(rng, 64, 512), "b1": rng.standard_normal(64).astype(np.float32),
             "lo": lo, "hi": hi,
             **{f"c{i}": _w(rng, 64, 64) for i in range(4)},
             **{f"cb{i}": rng.standard_normal(64).astype(np.float32) for i in range(4)}},
            {"x": [1, 512]}), False),
        # SiLU (x * sigmoid(x)) after a 3x3 and a 1x1 convolution: the Swish post-op,
        # which oneDNN's eltwise applies.
        "conv_silu": (_model([
            _conv("x", "w1", "a", **p1), helper.make_node("Sigmoid", ["a"], ["sa"]),
            helper.make_node("Mul", ["a", "sa"], ["b"]),
            _conv("b", "w2", "c"), helper.make_node("Sigmoid", ["c"], ["sc"]),
            helper.make_node("Mul", ["sc", "c"], ["y"])],
            {"w1": _w(rng, 16, 16, 3, 3), "w2": _w(rng, 32, 16, 1, 1)},
            {"x": [1, 16, 28, 28]}), False),
        # Large linears with the exporters' tanh-GELU and erf-GELU chains (post-ops).
        "linears_gelu_chains": (_model([
            helper.make_node("MatMul", ["x", "g1"], ["m"]),
            helper.make_node("Add", ["m", "b1"], ["a"]),
            helper.make_node("Pow", ["a", "three"], ["p"]),
            helper.make_node("Mul", ["p", "kappa"], ["pk"]),
            helper.make_node("Add", ["a", "pk"], ["i"]),
            helper.make_node("Mul", ["i", "beta"], ["ib"]),
            helper.make_node("Tanh", ["ib"], ["t"]),
            helper.make_node("Add", ["t", "one"], ["t1"]),
            helper.make_node("Mul", ["a", "half"], ["h"]),
            helper.make_node("Mul", ["h", "t1"], ["g"]),
            helper.make_node("MatMul", ["g", "g2"], ["n"]),
            helper.make_node("Add", ["n", "b2"], ["o"]),
            helper.make_node("Div", ["o", "sqrt2"], ["d"]),
            helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["e1"]),
            helper.make_node("Mul", ["half", "e1"], ["he"]),
            helper.make_node("Mul", ["o", "he"], ["y"])],
            {"g1": _w(rng, 512, 256).T.copy(), "b1": rng.standard_normal(512).astype(np.float32),
             "g2": _w(rng, 512, 512).T.copy(), "b2": rng.standard_normal(512).astype(np.float32),
             "three": np.array(3, np.float32), "kappa": np.array(0.044715, np.float32),
             "beta": np.array(np.sqrt(2 / np.pi), np.float32),
             "one": np.array(1, np.float32), "half": np.array(0.5, np.float32),
             "sqrt2": np.array(np.sqrt(2), np.float32)},
            {"x": [64, 256]}), False),
        # A residual add with LayerNormalization (one native kernel).
        "add_layer_norm": (_model([
            helper.make_node("Add", ["x", "z"], ["s"]),
            helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1)],
            {"gamma": rng.standard_normal(128).astype(np.float32),
             "beta": rng.standard_normal(128).astype(np.float32)},
            {"x": [16, 128], "z": [16, 128]}), False),
    }


GRAPHS = _graphs()


def _expected(model: onnx.ModelProto, feeds: dict[str, np.ndarray], pools: bool,
              oracle: ort.InferenceSession, reference: segflow.InferenceSession | None
              ) -> list[np.ndarray]:
    want = oracle.run(None, feeds)
    if not pools:
        return want
    assert reference is not None
    ref = reference.run(None, feeds)
    for r, w in zip(ref, want):   # onnxruntime's NaN are among torch's rule's
        assert not (np.isnan(w) & ~np.isnan(r)).any()
        assert np.array_equal(np.isinf(w) & ~np.isnan(r), np.isinf(r))
    return ref


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("switch", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_kernel_paths_give_onnxruntimes_nan_and_inf(graph: str, switch: tuple,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    name, optimize, native = switch
    if native is not None:
        monkeypatch.setenv("SEGFLOW_NATIVE", native)
    model, pools = GRAPHS[graph]
    sess = segflow.InferenceSession(model, optimize=optimize)
    oracle = _ort(model)
    reference = segflow.InferenceSession(model, optimize=False) if pools else None
    rng = np.random.default_rng(zlib.crc32(f"{graph}/{name}".encode()))
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
              for i in model.graph.input}
    for value in VALUES:
        for _ in range(2):
            feeds = _poisoned({k: rng.standard_normal(s).astype(np.float32)
                               for k, s in shapes.items()}, value, rng)
            got = sess.run(None, feeds)
            _assert_masks(got, _expected(model, feeds, pools, oracle, reference),
                          f"{graph} [{name}] with {value}")
    # Finite feeds stay within tolerance of onnxruntime on whichever executor ran last.
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    np.testing.assert_allclose(sess.run(None, feeds)[0], oracle.run(None, feeds)[0],
                               rtol=1e-3, atol=1e-3)


# -- the built-in models -------------------------------------------------------------------
_IMAGE = {"image_size": 64, "num_classes": 10}


@pytest.mark.parametrize("name,options", [("resnet18", _IMAGE), ("mobilenet_v2", _IMAGE),
                                          ("resnet50", _IMAGE), ("mlp_chain", {}),
                                          ("nonzero_mid", {})])
def test_builtin_models_with_nonfinite_feeds(name: str, options: dict[str, int]) -> None:
    model = models.build(name, **options)
    sess, oracle = segflow.InferenceSession(model), _ort(model)
    rng = np.random.default_rng(3)
    for value in VALUES:
        feeds = _poisoned(models.example_inputs(name, **options), value, rng)
        _assert_masks(sess.run(None, feeds), oracle.run(None, feeds), f"{name} with {value}")


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("name", ["bert_tiny", "bert_base"])
def test_bert_with_a_nonfinite_weight(name: str, value: float) -> None:
    """BERT's feeds are integers: the NaN or Inf sits in a weight the ids select, so no
    kernel may lose it (attention, add + layer norm, the GELU linears)."""
    model = models.build(name)
    feeds = models.example_inputs(name)
    embedding = max(model.graph.initializer, key=lambda t: t.dims[0] if t.dims else 0)
    table = numpy_helper.to_array(embedding).copy()
    table[int(feeds["input_ids"].reshape(-1)[5]), 3] = value
    embedding.CopyFrom(numpy_helper.from_array(table, embedding.name))
    sess = segflow.InferenceSession(model)
    _assert_masks(sess.run(None, feeds), _ort(model).run(None, feeds), f"{name} with {value}")
    assert sess._nonfinite.exact is None and not sess._nonfinite.inexact


# -- which executor runs ------------------------------------------------------------------
def test_finite_feeds_keep_the_fast_kernels_and_nonfinite_ones_run_exact() -> None:
    model = models.build("resnet18", **_IMAGE)
    feeds = models.example_inputs("resnet18", **_IMAGE)
    sess = segflow.InferenceSession(model)
    if Library.load() is None:
        pytest.skip("libdnnl is not installed: no kernel loses NaN")
    policy = sess._nonfinite
    assert policy.exact == frozenset()          # nothing inside ResNet creates a NaN
    assert any("Relu post-op" in why for why in policy.inexact.values())
    sess.run(None, feeds)
    assert sess.exact_runs == 0
    assert "nonfinite" not in sess.last_run_stats.settings
    feeds["input"][0, 0, 3, 3] = np.nan
    assert np.isnan(sess.run(None, feeds)[0]).all()
    assert sess.exact_runs == 1
    assert sess.last_run_stats.settings["nonfinite"] == "exact"
    assert "1 so far" in sess.explain()


@pytest.mark.parametrize("backend", ["inductor", "onednn"])
def test_segments_lowered_by_a_backend_send_nonfinite_feeds_the_exact_way(backend: str) -> None:
    """inductor and oneDNN Graph choose their own fused post-ops: a NaN feed runs the
    exact executor (which compiles nothing), and a segment a NaN can reach from inside
    the graph stays generated."""
    model, _ = GRAPHS["winograd_residual"]
    sess = segflow.InferenceSession(model, compile=backend)
    assert "compiled segments" in sess._nonfinite.inexact
    rng = np.random.default_rng(9)
    feeds = _poisoned({"x": rng.standard_normal((1, 16, 28, 28)).astype(np.float32)},
                      np.nan, rng)
    _assert_masks(sess.run(None, feeds), _ort(model).run(None, feeds), backend)
    assert sess.exact_runs == 1 and sess.compile_report.first_run_compile_s == 0.0
    inner = _model([helper.make_node("Div", ["x", "x"], ["q"]),
                    _conv("q", "w", "c", pads=[1, 1, 1, 1]),
                    helper.make_node("Relu", ["c"], ["y"])],
                   {"w": _w(rng, 16, 16, 3, 3)}, {"x": [1, 16, 8, 8]})
    kept = segflow.InferenceSession(inner, compile=backend)
    assert kept._nonfinite.exact and "compiled segments" not in kept._nonfinite.inexact


def test_a_nan_made_inside_the_graph_reaches_exact_kernels() -> None:
    """x / x is NaN where x is 0: finite feeds, so the run check cannot see it; the
    nodes after the division bind kernels that keep NaN."""
    rng = np.random.default_rng(5)
    model = _model([
        helper.make_node("Div", ["x", "x"], ["q"]), helper.make_node("Mul", ["q", "x"], ["m"]),
        _conv("m", "w", "c", pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
        {"w": _w(rng, 16, 16, 3, 3)}, {"x": [1, 16, 28, 28]})
    sess = segflow.InferenceSession(model)
    assert {n.op_type for n in sess._nonfinite.exact or ()} >= {"FusedConv", "MaxPool"}
    x = rng.standard_normal((1, 16, 28, 28)).astype(np.float32)
    x[0, 3, 10, 10] = 0.0
    got = sess.run(None, {"x": x})
    assert sess.exact_runs == 0
    ref = segflow.InferenceSession(model, optimize=False).run(None, {"x": x})
    assert np.isnan(got[0]).any()
    _assert_masks(got, ref, "x / x")


def test_a_nan_folded_into_a_constant_still_reaches_exact_kernels() -> None:
    """0 / 0 between constants is folded away before the kernels are chosen: the walk over
    the graph before its passes still sees it, by the folded constant's name."""
    rng = np.random.default_rng(8)
    zero = np.zeros((1, 16, 1, 1), np.float32)
    zero[0, 2] = 1.0
    model = _model([helper.make_node("Div", ["z", "z"], ["q"]),
                    helper.make_node("Add", ["x", "q"], ["a"]),
                    _conv("a", "w", "c", pads=[1, 1, 1, 1]),
                    helper.make_node("Relu", ["c"], ["y"])],
                   {"z": zero, "w": _w(rng, 16, 16, 3, 3)}, {"x": [1, 16, 8, 8]})
    sess = segflow.InferenceSession(model)
    assert "Div" not in {n.op_type for n in sess.graph.nodes}        # folded
    assert "FusedConv" in {n.op_type for n in sess._nonfinite.exact or ()}
    x = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)
    got = sess.run(None, {"x": x})
    assert np.isnan(got[0]).all()
    _assert_masks(got, _ort(model).run(None, {"x": x}), "folded 0 / 0")


def test_a_divisor_that_is_a_safe_constant_creates_no_nan() -> None:
    rng = np.random.default_rng(6)
    model = _model([helper.make_node("Div", ["x", "s"], ["q"]),
                    _conv("q", "w", "c", pads=[1, 1, 1, 1]),
                    helper.make_node("Relu", ["c"], ["y"])],
                   {"s": np.array(2.0, np.float32), "w": _w(rng, 16, 16, 3, 3)},
                   {"x": [1, 16, 8, 8]})
    assert segflow.InferenceSession(model)._nonfinite.exact == frozenset()


# -- reference kernels at the edges ----------------------------------------------------------
def test_gelu_and_clip_at_infinity() -> None:
    x = np.array([np.inf, -np.inf, np.nan, 1.0, -2.0], np.float32)
    for nodes, inits, opset in [
            ([helper.make_node("Gelu", ["x"], ["y"])], {}, 20),
            ([helper.make_node("Clip", ["x"], ["y"])], {}, 17),
            ([helper.make_node("Clip", ["x", "lo"], ["y"])], {"lo": np.array(0, np.float32)}, 17),
            ([helper.make_node("Clip", ["x"], ["y"], min=-1.0)], {}, 6)]:
        model = _model(nodes, inits, {"x": [5]}, opset)
        got, want = segflow.InferenceSession(model).run(None, {"x": x}), _ort(model).run(None,
                                                                                      {"x": x})
        np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_the_feed_scan_finds_nan_and_inf_in_float_feeds_only(native: bool) -> None:
    from segflow.kernels.native.build import NativeLibrary
    from segflow.runtime.nonfinite import NonFiniteScan

    library = NativeLibrary.for_session()[0] if native else None
    if native and library is None:
        pytest.skip("no native library")
    scan = NonFiniteScan(library)
    assert not scan([torch.ones(3), torch.arange(4), torch.empty(0)])
    big = torch.rand(3, 5000)        # past the native scan's first block
    assert not scan([big])
    for value in VALUES:
        for where in (0, 4095, 4096, 14999):
            poisoned = big.clone()
            poisoned.view(-1)[where] = value
            assert scan([torch.ones(2), poisoned])
            assert scan([poisoned.t()])            # not contiguous: torch's sum
        assert scan([torch.tensor([value], dtype=torch.float16)])
        assert scan([torch.tensor([2.0, value], dtype=torch.float64)])
    # An ordinary half-precision image does not overflow the float32 sum; finite values
    # whose sum overflows float range are sent the exact way by torch's sum only.
    assert not scan([torch.full((1, 3, 224, 224), 60000.0, dtype=torch.float16)])
    assert scan([torch.full((8,), 3.0e38)]) is not native
