"""Tests for the dense-chain pass (passes/dense_chain.py), its op (ops/dense_chain.py) and the
native library it calls (kernels/native/build.py): changed and unchanged graphs, numerics
against onnxruntime and torch, the torch path, and what explain() says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import segflow
from concurrency import run_in_threads
from segflow import models
from segflow.frontend.onnx_import import import_model
from segflow.ir.types import Device
from segflow.kernels.choice import DENSE_CHAIN_ACTIVATIONS as NATIVE_ACTIVATIONS
from segflow.kernels.dense_chain import NATIVE_MAX_MACS, DenseChain
from segflow.kernels.native.build import NativeLibrary
from segflow.ops.dense_chain import ChainLayer, traceable_chain
from segflow.ops.fused import ACTIVATIONS
from segflow.passes.dense_chain import CHAIN_MAX_WEIGHT, chain_dense, find_chains
from segflow.passes.pipeline import OptimizeOptions, optimize

CPU = Device.parse("cpu")
ATOL, RTOL = 1e-5, 1e-4
RNG = np.random.default_rng(0)

needs_native = pytest.mark.skipif(NativeLibrary.probe()[0] is None,
                                  reason=f"native kernels {NativeLibrary.probe()[1]}")


def _rand(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# One activation per layer, as ONNX nodes after the Gemm: (op, attrs, extra inputs)
ONNX_ACTIVATIONS = {
    "": None,
    "Relu": ("Relu", {}, {}),
    "LeakyRelu": ("LeakyRelu", {"alpha": 0.07}, {}),
    "Clip": ("Clip", {}, {"lo": np.float32(-0.3), "hi": np.float32(0.4)}),
    "Sigmoid": ("Sigmoid", {}, {}),
    "Tanh": ("Tanh", {}, {}),
    "HardSigmoid": ("HardSigmoid", {"alpha": 0.3, "beta": 0.45}, {}),
    "HardSwish": ("HardSwish", {}, {}),
    "Gelu": ("Gelu", {}, {}),
    "GeluTanh": ("Gelu", {"approximate": "tanh"}, {}),
}


def mlp(widths: list[int], acts: list[str], *, matmul: bool = False, rank: int = 2,
        outputs: tuple[int, ...] = (), bias: bool = True):
    """x [batch, (3,) widths[0]] -> one Gemm (or MatMul + Add) + activation per layer.
    ``outputs``: indices of layers whose result is also a graph output."""
    nodes, inits = [], {}
    x = "x"
    shape: list[int | str] = ["batch", *([3] if rank == 3 else []), widths[0]]
    graph_outputs = []
    for i, act in enumerate(acts):
        k, n = widths[i], widths[i + 1]
        inits[f"w{i}"] = _rand(k, n, scale=(2.0 / k) ** 0.5)
        if bias:
            inits[f"b{i}"] = _rand(n, scale=0.1)
        if matmul or rank == 3:
            nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
            y = f"m{i}"
            if bias:
                nodes.append(helper.make_node("Add", [y, f"b{i}"], [f"g{i}"]))
                y = f"g{i}"
        else:
            nodes.append(helper.make_node("Gemm", [x, f"w{i}"] + ([f"b{i}"] if bias else []),
                                          [f"g{i}"]))
            y = f"g{i}"
        spec = ONNX_ACTIVATIONS[act]
        if spec is not None:
            op, attrs, extra = spec
            names = []
            for key, value in extra.items():
                inits[f"{key}{i}"] = value
                names.append(f"{key}{i}")
            nodes.append(helper.make_node(op, [y, *names], [f"a{i}"], **attrs))
            y = f"a{i}"
        x = y
        if i in outputs:
            graph_outputs.append(y)
    if x not in graph_outputs:
        graph_outputs.append(x)
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in graph_outputs],
        initializer=[numpy_helper.from_array(np.asarray(a), n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return model


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def _chains(sess: segflow.InferenceSession) -> list:
    return [n for n in sess.graph.nodes if n.op_type == "DenseChain"]


# -- the pass ------------------------------------------------------------------------------
def test_mlp_becomes_one_chain_with_input_major_weights():
    graph = import_model(models.build("mlp_chain", layers=5, width=16))
    log = optimize(graph, OptimizeOptions.resolve(env={}), device=CPU)
    assert "dense_chain: 5 -> 1 nodes (1 chain of 5 small dense layers, one native call each)" \
        in log
    (node,) = graph.nodes
    assert node.op_type == "DenseChain" and node.attrs["activations"] == ["Relu"] * 5
    assert node.outputs[0].name == "y" and len(node.inputs) == 11
    # Only the chain's constants remain: the FusedGemm's [N, K] copies are gone.
    assert len(graph.initializers) == 10
    assert all(v.const is not None and v.const.is_contiguous() for v in node.inputs[1:])
    assert node.inputs[1].const.shape == (16, 16)


def test_gemm_weights_are_transposed_to_input_major():
    model = mlp([5, 7, 3], ["Relu", ""])
    graph = import_model(model)
    optimize(graph, OptimizeOptions.resolve(env={}), device=CPU)
    (node,) = graph.nodes
    w0 = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_array_equal(node.inputs[1].const.numpy(), w0)   # ONNX B is [K, N]
    assert node.inputs[3].const.shape == (7, 3)


def test_unchanged_cases():
    def chains(model):
        graph = import_model(model)
        optimize(graph, OptimizeOptions.resolve({"dense_chain": False}, env={}), device=CPU)
        return [len(c) for c in find_chains(graph)]

    assert chains(mlp([8, 8], ["Relu"])) == []                        # one layer is no chain
    assert chains(mlp([8, 8, 8, 8], ["Relu"] * 3)) == [3]
    # An intermediate graph output ends a chain: the value must exist.
    assert chains(mlp([8, 8, 8, 8, 8], ["Relu"] * 4, outputs=(1,))) == [2, 2]
    assert chains(mlp([8, 8, 8, 8], ["Relu"] * 3, outputs=(0,))) == [2]
    big = int(CHAIN_MAX_WEIGHT ** 0.5) + 1                              # a weight too large
    assert chains(mlp([8, big, big, 8], ["Relu"] * 3)) == []           # splits 1 + (big) + 1
    assert chains(mlp([8, 8, 8, big, big], ["Relu"] * 4)) == [3]
    # Two readers of a layer's output: the chain cannot pass it.
    model = mlp([8, 8, 8, 8], ["Relu"] * 3)
    model.graph.node.append(helper.make_node("Neg", ["a0"], ["neg"]))
    model.graph.output.append(helper.make_tensor_value_info("neg", TensorProto.FLOAT, None))
    assert chains(model) == [2]


def test_switches_and_devices_keep_the_layers():
    graph = import_model(models.build("mlp_chain", layers=3, width=8))
    log = optimize(graph, OptimizeOptions.resolve({"dense_chain": False}, env={}), device=CPU)
    assert "dense_chain: off" in log and len(graph.nodes) == 3
    graph = import_model(models.build("mlp_chain", layers=3, width=8))
    log = optimize(graph, OptimizeOptions.resolve(env={"SEGFLOW_NO_DENSE_CHAIN": "1"}),
                   device=CPU)
    assert "dense_chain: off" in log
    graph = import_model(models.build("mlp_chain", layers=3, width=8))
    log = optimize(graph, OptimizeOptions.resolve(env={}), device=Device.parse("cuda:0"))
    assert "dense_chain: skipped (not a CPU device)" in log and len(graph.nodes) == 3
    graph = import_model(models.build("mlp_chain", layers=3, width=8))
    assert not chain_dense(graph).modified   # not fused yet: Gemm nodes are not chained


# -- numerics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("act", sorted(ONNX_ACTIVATIONS))
def test_every_activation_matches_onnxruntime(act):
    model = mlp([33, 20, 7, 64], [act, act, act])
    sess = segflow.InferenceSession(model)
    assert len(_chains(sess)) == 1
    for batch in (1, 3, 6):
        feeds = {"x": _rand(batch, 33)}
        (got,) = sess.run(None, feeds)
        np.testing.assert_allclose(got, _ort(model, feeds)[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("widths", [[1, 1, 1], [7, 9, 15, 17], [64, 64, 64], [100, 40, 130],
                                    [16, 8, 33, 64, 65]])
@pytest.mark.parametrize("matmul", [False, True])
def test_widths_batches_and_matmul_add_match_onnxruntime(widths, matmul):
    model = mlp(widths, ["Relu"] * (len(widths) - 1), matmul=matmul)
    sess = segflow.InferenceSession(model)
    assert len(_chains(sess)) == 1
    for batch in (1, 2, 4, 5, 17):
        feeds = {"x": _rand(batch, widths[0])}
        np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0],
                                   atol=ATOL, rtol=RTOL)


def test_rank_3_input_no_bias_and_intermediate_outputs():
    model = mlp([12, 10, 8, 6, 4], ["Tanh", "Relu", "", "Sigmoid"], rank=3, bias=False,
                outputs=(1,))
    sess = segflow.InferenceSession(model)
    assert [len(n.attrs["activations"]) for n in _chains(sess)] == [2, 2]
    feeds = {"x": _rand(2, 3, 12)}
    for got, want in zip(sess.run(None, feeds), _ort(model, feeds), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_builder_mlp_matches_onnxruntime_and_counts_one_kernel():
    model = models.build("mlp_chain")
    sess = segflow.InferenceSession(model)
    for batch in (1, 8):
        feeds = models.example_inputs("mlp_chain", batch_size=batch)
        np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0],
                                   atol=ATOL, rtol=RTOL)
    stats = sess.last_run_stats
    assert (stats.nodes, stats.kernels, stats.segments, stats.syncs) == (1, 1, 1, 1)
    assert stats.settings["dense_chain"] is True


def _layers(widths: list[int], acts: list[str], seed: int = 0) -> list[ChainLayer]:
    gen = torch.Generator().manual_seed(seed)
    params = {"LeakyRelu": (0.1, 0.0), "Clip": (-0.5, 0.25), "HardSigmoid": (0.2, 0.5)}
    return [ChainLayer(torch.randn(k, n, generator=gen) / k ** 0.5,
                       torch.randn(n, generator=gen) * 0.1, ACTIVATIONS[act],
                       params.get(act, (0.0, 0.0)))
            for k, n, act in zip(widths, widths[1:], acts)]


def _reference(layers: list[ChainLayer], x: torch.Tensor) -> torch.Tensor:
    h = x.double().reshape(-1, x.shape[-1])
    for layer in layers:
        h = layer.activation.apply(h @ layer.weight.double() + layer.bias.double(),
                                   list(layer.params))
    return h.reshape(*x.shape[:-1], h.shape[-1]).float()


@needs_native
@settings(max_examples=40, deadline=None)
@given(widths=st.lists(st.integers(1, 70), min_size=2, max_size=6),
       rows=st.integers(0, 20), data=st.data())
def test_native_kernel_against_float64(widths, rows, data):
    acts = [data.draw(st.sampled_from(NATIVE_ACTIVATIONS)) for _ in widths[1:]]
    layers = _layers(widths, acts, seed=rows)
    op = DenseChain(layers, *NativeLibrary.probe())
    x = torch.randn(rows, widths[0])
    got = op(x)
    assert op.native_calls == 1 and op.torch_calls == 0
    torch.testing.assert_close(got, _reference(layers, x), atol=1e-4, rtol=1e-4)


@needs_native
def test_large_calls_go_through_torch_and_say_why():
    layers = _layers([64, 64, 64], ["Relu", "Relu"])
    op = DenseChain(layers, *NativeLibrary.probe())
    small_rows = NATIVE_MAX_MACS // (64 * 64)
    small, large = torch.randn(small_rows, 64), torch.randn(small_rows + 1, 64)
    torch.testing.assert_close(op(small), _reference(layers, small), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(op(large), _reference(layers, large), atol=1e-4, rtol=1e-4)
    assert (op.native_calls, op.torch_calls) == (1, 1)
    (why,) = op.why_torch
    assert why.startswith(f"{small_rows + 1} rows: a layer is") and "MKL" in why


def test_without_the_library_the_chain_runs_through_torch():
    layers = _layers([10, 20, 5], ["Relu", "Tanh"])
    op = DenseChain(layers, None, "need a C compiler and found none ('cc' is not on PATH)")
    x = torch.randn(3, 10)
    torch.testing.assert_close(op(x), _reference(layers, x), atol=1e-5, rtol=1e-5)
    assert (op.native_calls, op.torch_calls) == (0, 1)
    assert list(op.why_torch) == ["native kernels need a C compiler and found none ('cc' is "
                                  "not on PATH)"]


def test_session_without_a_compiler_reports_it(monkeypatch):
    why = "need a C compiler and found none ('cc' is not on PATH; set CC)"
    monkeypatch.setattr(NativeLibrary, "probe", staticmethod(lambda: (None, why)))
    model = models.build("mlp_chain", layers=4, width=8)
    sess = segflow.InferenceSession(model)
    feeds = models.example_inputs("mlp_chain", batch_size=2, layers=4, width=8)
    np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], atol=ATOL,
                               rtol=RTOL)
    (line,) = [x for x in sess.kernel_report() if x.startswith("dense chains")]
    assert line == (f"dense chains: 1 chain of 4 layers, through torch: native kernels {why}; "
                    "0 calls native, 1 through torch")


@needs_native
def test_explain_counts_native_calls_and_codegen_calls_the_kernels_op():
    model = models.build("mlp_chain", layers=3, width=8)
    feeds = models.example_inputs("mlp_chain", layers=3, width=8)
    for mode in ("codegen", "none"):
        sess = segflow.InferenceSession(model, compile=mode)
        sess.run(None, feeds)
        sess.run(None, feeds)
        (op,) = [op for _, op in sess._executor.kernel_ops if isinstance(op, DenseChain)]
        assert (op.native_calls, op.torch_calls) == (2, 0)
        text = sess.explain()
        assert "dense chains: 1 chain of 3 layers, native (" in text
        assert "; 2 calls native, 0 through torch" in text


def test_traceable_form_matches_the_op():
    model = mlp([6, 5, 4], ["HardSwish", "Clip"], rank=3)
    sess = segflow.InferenceSession(model)
    (node,) = _chains(sess)
    fn = traceable_chain(node).bound["fn"]
    x = torch.randn(2, 3, 6)
    consts = [v.const for v in node.inputs[1:]]
    (op,) = [op for _, op in sess._executor.kernel_ops if isinstance(op, DenseChain)]
    torch.testing.assert_close(fn(x, *consts), op(x), atol=1e-5, rtol=1e-5)


def test_onednn_backend_traces_the_chain():
    model = mlp([16, 16, 16], ["Relu", "Relu"])
    sess = segflow.InferenceSession(model, compile="onednn")
    feeds = {"x": _rand(2, 16)}
    np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], atol=ATOL,
                               rtol=RTOL)
    assert sess.compile_report.fallbacks == []


def test_threads_share_one_chain():
    model = models.build("mlp_chain", layers=20, width=32)
    sess = segflow.InferenceSession(model)
    feeds = [{"x": _rand(1 + i % 4, 32)} for i in range(6)]
    reference = [_ort(model, f)[0] for f in feeds]

    def worker(i: int) -> None:
        for _ in range(30):
            np.testing.assert_allclose(sess.run(None, feeds[i])[0], reference[i],
                                       atol=ATOL, rtol=RTOL)

    run_in_threads(worker, len(feeds))


# -- the library -----------------------------------------------------------------------------
def test_library_is_built_once_then_loaded_from_the_cache(tmp_path: Path):
    env = {"SEGFLOW_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    first, why = NativeLibrary.find(env)
    if first is None:
        pytest.skip(f"native kernels {why}")
    assert first.build_s > 0 and first.path.parent == tmp_path / "native"
    assert first.describe().startswith("built in ")
    second, _ = NativeLibrary.find(env)
    assert second is not None and second.build_s == 0 and second.path == first.path
    assert second.describe() == f"loaded from {first.path}"
    # Beside it its description, recorded digest and build lock (cache_store.py); no
    # partial build.
    name = first.path.name
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == \
        [name, f"{name}.json", f"{name}.lock", f"{name}.sha256"]


def test_library_refusals_are_one_phrase(tmp_path: Path):
    cache = str(tmp_path)
    assert NativeLibrary.find({"SEGFLOW_NATIVE": "0"}) == (None, "are off (SEGFLOW_NATIVE=0)")
    lib, why = NativeLibrary.find({"SEGFLOW_CACHE_DIR": cache, "CC": "no-such-cc",
                                   "PATH": "/usr/bin:/bin"})
    assert lib is None and why == ("need a C compiler and found none ('no-such-cc' is not on "
                                   "PATH; set CC)")
    lib, why = NativeLibrary.find({"SEGFLOW_CACHE_DIR": cache, "CC": "false",
                                   "PATH": "/usr/bin:/bin"})
    assert lib is None and why.startswith("could not be built: ") and "exited with 1" in why
    assert not list((tmp_path / "native").glob("*.so"))   # nothing half-written is left


def _ffn_model(rows: int) -> bytes:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((256, 1024)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((1024, 256)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(
        nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 256])], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


@pytest.mark.parametrize(("rows", "ops"), [(1, ["DenseChain"]),
                                           (128, ["FusedGemm", "FusedGemm"])])
def test_static_rows_past_the_native_limit_stay_apart(rows: int, ops: list[str]) -> None:
    """128 rows x 256 x 1024 is past the kernel's per-call limit: the layers stay
    FusedGemms; at 1 row they chain."""
    model = _ffn_model(rows)
    sess = segflow.InferenceSession(model, optimize={"layout": False})
    assert [n.op_type for n in sess.graph.nodes] == ops
    x = np.random.default_rng(1).standard_normal((rows, 256)).astype(np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want[0], atol=1e-3, rtol=1e-4)
