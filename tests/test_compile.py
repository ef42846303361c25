"""Tests for runtime/compile.py: generated segments match the interpreter and onnxruntime."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import segflow
from segflow import models
from segflow.errors import ExecutionError
from segflow.passes.pipeline import CompileMode
from segflow.runtime.compile import generate

ATOL, RTOL = 1e-4, 1e-3

SMALL = {
    "resnet18": ({"num_classes": 10, "image_size": 64}, {}),
    "mobilenet_v2": ({"num_classes": 10, "image_size": 32}, {}),
    "bert_tiny": ({}, {"seq_len": 12}),
    "mlp_chain": ({"layers": 5}, {}),
    "nonzero_mid": ({}, {}),
}


def _feeds(name, batch=2):
    build, feed_opts = SMALL[name]
    opts = {**feed_opts} if name == "bert_tiny" else {**build}
    return models.example_inputs(name, batch_size=batch, **opts)


@pytest.mark.parametrize("engine", ["inline", "threaded"])
@pytest.mark.parametrize("name", list(SMALL))
def test_codegen_matches_interpreter_and_onnxruntime(name, engine):
    model = models.build(name, **SMALL[name][0])
    feeds = _feeds(name)
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    compiled = segflow.InferenceSession(model, engine=engine, compile="codegen")
    interpreted = segflow.InferenceSession(model, engine=engine, compile="none")
    for _ in range(2):  # a second run must not see state left by the first (in-place ops)
        got = compiled.run(None, feeds)
        plain = interpreted.run(None, feeds)
        for r, g, p in zip(ref, got, plain):
            np.testing.assert_allclose(g, r, atol=ATOL, rtol=RTOL)
            np.testing.assert_allclose(g, p, atol=1e-5, rtol=1e-5)
    a, b = compiled.last_run_stats, interpreted.last_run_stats
    assert a.counters() == b.counters() and a.nodes == b.nodes
    assert a.settings["compile"] == "codegen" and b.settings["compile"] == "none"
    assert compiled.compile_report.segments == sum(
        1 for s in compiled.plan.segments if s.exec_type.value == "sync")


def test_generated_code_is_straight_line_with_locals():
    sess = segflow.InferenceSession(models.build("mlp_chain", layers=3), engine="inline",
                                    optimize={"dense_chain": False})
    ex = sess._executor
    steps = ex.tasks[0].steps
    program = generate(steps, ex.template, set(ex.output_slots), None)
    body = program.source.split("\n", 1)[1]  # after the factory's parameter list
    assert "for " not in body and "env[" in body  # no per-node loop; env only at the edges
    # Linear+Relu is one ATen call (addmm with the relu epilogue), no separate relu_.
    assert body.count("addmm_activation") == 3 and "relu_" not in body
    assert sum(line.strip().startswith("v") for line in body.splitlines()) >= 3


def test_in_place_ops_follow_the_memory_plan():
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Mul", ["b", "x"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                          [3, 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = segflow.InferenceSession(model, engine="inline")
    ex = sess._executor
    source = generate(ex.tasks[0].steps, ex.template, set(ex.output_slots),
                      ex_memory(sess)).source
    assert "relu_" in source and "mul_" in source
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], np.maximum(2 * x, 0) * x, rtol=1e-6)
    assert sess.run(None, {"x": x})[0].shape == (3, 4)
    np.testing.assert_array_equal(x, np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))


def ex_memory(sess):
    from segflow.passes.plan_memory import plan_memory
    return plan_memory(sess.graph)


def test_runtime_errors_name_the_node():
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Reshape", ["a", "shape"], ["out"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array([2, 3], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = segflow.InferenceSession(model, engine="inline")
    assert sess.run(None, {"x": np.ones(6, np.float32)})[0].shape == (2, 3)
    with pytest.raises(ExecutionError, match=r"While executing %out = Reshape\(%a, %shape\)"):
        sess.run(None, {"x": np.ones(5, np.float32)})


def test_compile_mode_resolution():
    assert CompileMode.parse("auto").resolve() is CompileMode.CODEGEN
    assert CompileMode.parse(" Inductor ") is CompileMode.INDUCTOR
    with pytest.raises(ValueError, match="compile='jit'"):
        CompileMode.parse("jit")
    sess = segflow.InferenceSession(models.build("mlp_chain", layers=2))
    assert "compile: codegen (auto" in sess.explain()
    assert sess.compile_report.backend == "codegen" and sess.compile_report.compile_time_s >= 0


def _small_mlp_sessions(tmp_path, monkeypatch, compile: str
                        ) -> Callable[[], segflow.InferenceSession]:
    """Makes sessions on a 2-layer MLP with the package cache in ``tmp_path``; each new
    session runs twice and must match onnxruntime both times."""
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path))
    model = models.build("mlp_chain", layers=2, width=16)
    feeds = models.example_inputs("mlp_chain", layers=2, width=16)
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)

    def session() -> segflow.InferenceSession:
        sess = segflow.InferenceSession(model, engine="inline", compile=compile)
        for _ in range(2):
            np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], atol=ATOL, rtol=RTOL)
        return sess
    return session


@pytest.mark.slow
def test_inductor_backend_matches_onnxruntime_and_caches_on_disk(tmp_path, monkeypatch):
    """AOTInductor on one small segment (~10 s per compile on 2 cores), then the disk cache."""
    session = _small_mlp_sessions(tmp_path, monkeypatch, "inductor")
    # A stale package over the cap: writing the new one evicts it (the new one stays,
    # even alone over the cap).
    (tmp_path / "aoti").mkdir()
    stale = tmp_path / "aoti" / "stale.pt2"
    stale.write_bytes(b"x" * (2 << 20))
    os.utime(stale, (1e9, 1e9))
    monkeypatch.setenv("SEGFLOW_CACHE_MAX_MB", "1")
    sess = session()
    assert "layout: skipped (inductor" in sess.explain()
    report = sess.compile_report
    assert report.backend == "inductor" and report.segments == 1
    assert report.fallbacks == [] and report.cache_hits == 0 and report.first_run_compile_s > 0
    assert sess.last_run_stats.settings["compile"] == "inductor"
    assert report.evicted == 1 and "1 least recently used packages evicted" in report.describe()
    packages = list((tmp_path / "aoti").glob("*.pt2"))
    assert len(packages) == 1 and not stale.exists()  # no temporary files left behind

    os.utime(packages[0], (1e9, 1e9))
    again = session()  # as a second process would: found on disk, not compiled
    assert again.compile_report.cache_hits == 1 and again.compile_report.fallbacks == []
    assert "loaded from the disk cache" in again.compile_report.describe()
    assert packages[0].stat().st_mtime > 1e9  # a hit marks it used, for eviction by age

    packages[0].write_bytes(b"not a package")  # damaged: compiled again, not trusted
    third = session()
    assert third.compile_report.cache_hits == 0 and third.compile_report.fallbacks == []


@pytest.mark.slow
def test_auto_runs_a_cached_inductor_package_and_never_compiles_one(tmp_path, monkeypatch):
    from segflow.cache_descriptions import PackageDescription
    from segflow.cache_store import ArtifactStore
    from segflow.runtime.aot_inductor import AotInductorSegment

    auto = _small_mlp_sessions(tmp_path, monkeypatch, "auto")
    cold = auto()  # nothing cached: codegen, nothing compiled or written
    assert cold.compile_report.backend == "codegen" and cold.compile_report.cache_hits == 0
    assert cold.compile_report.fallbacks == [] and not list(tmp_path.rglob("*.pt2"))
    assert not isinstance(cold._executor.compiled[0], AotInductorSegment)  # not even a lookup
    assert "or for a small segment its inductor package" in cold.explain()

    _small_mlp_sessions(tmp_path, monkeypatch, "inductor")()  # compiles into the cache
    warm = auto()  # the package the inductor session left in the cache
    assert warm.compile_report.cache_hits == 1 and warm.compile_report.fallbacks == []
    assert "1 segments run cached inductor packages" in warm.compile_report.describe()
    # The package was written with its description, which the report reads back.
    [used] = warm.compile_report.cached_packages
    [package] = tmp_path.rglob("*.pt2")
    assert (used.segment, used.name) == (0, package.name) and used.created > 0
    described = PackageDescription.parse(ArtifactStore.inspect("aoti").description(package.name))
    assert described is not None and described.model.name == "mlp_chain"
    assert [(s.dtype, s.shape) for s in described.inputs] == [("float32", (1, 16))]
    assert "disk cache: using 1 cached inductor package for segment 0" in warm.explain()
    counters = ("segments", "pushes", "syncs", "kernels", "copies")
    assert [getattr(warm.last_run_stats, c) for c in counters] == \
        [getattr(cold.last_run_stats, c) for c in counters]

    # Another batch size has no package: codegen for it, the package still for batch 1.
    segment = warm._executor.compiled[0]
    assert isinstance(segment, AotInductorSegment)
    x3 = {"x": np.random.default_rng(1).standard_normal((3, 16), dtype=np.float32)}
    ort_mlp = ort.InferenceSession(models.build("mlp_chain", layers=2, width=16)
                                   .SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(warm.run(None, x3)[0], ort_mlp.run(None, x3)[0],
                               atol=ATOL, rtol=RTOL)
    assert not segment.codegen_only and warm.compile_report.cache_hits == 1
    assert sorted(fn is not None for fn in segment._compiled.values()) == [False, True]


def test_only_small_dense_segments_look_for_cached_packages(monkeypatch):
    from segflow.runtime import compile as compile_module

    def eligible(name: str, **opts: int) -> bool:
        sess = segflow.InferenceSession(models.build(name, **opts), compile="codegen")
        return compile_module.uses_cached_package(sess._executor.tasks[0].steps)

    assert eligible("mlp_chain", layers=3)
    assert not eligible("resnet18", num_classes=10, image_size=32)  # oneDNN-packed weights
    monkeypatch.setattr(compile_module, "CACHED_PACKAGE_MAX_BYTES", 3 * 64 * 64 * 4)
    assert not eligible("mlp_chain", layers=3)  # 3 weights and 3 biases: over the limit


def test_package_key_follows_graph_weights_and_inputs():
    from segflow.runtime.aot_inductor import package_key

    def key(model, x: torch.Tensor) -> str:
        sess = segflow.InferenceSession(model, engine="inline", compile="none")
        ex = sess._executor
        steps = ex.tasks[0].steps
        program = generate(steps, ex.template, set(ex.output_slots), None, pure=True,
                           traceable=True)
        return package_key([s.node for s in steps], program.source, [x])

    model = models.build("mlp_chain", layers=2, width=8)
    x = torch.randn(1, 8)
    assert key(model, x) == key(models.build("mlp_chain", layers=2, width=8), x.clone())
    other_weights = models.build("mlp_chain", layers=2, width=8)
    other_weights.graph.initializer[0].raw_data = bytes(len(model.graph.initializer[0].raw_data))
    assert key(model, x) != key(other_weights, x)
    assert key(model, x) != key(model, torch.randn(3, 8))                          # input shape
    assert key(model, x) != key(models.build("mlp_chain", layers=3, width=8), x)   # graph
    threads, before = torch.get_num_threads(), key(model, x)
    try:  # the package bakes in the intra-op thread count
        torch.set_num_threads(threads + 1)
        assert key(model, x) != before
    finally:
        torch.set_num_threads(threads)


def test_largest_op_work_counts_multiply_adds_and_elements():
    from segflow.runtime.aot_inductor import SERIAL_MAX_WORK, largest_op_work

    def work(module: torch.nn.Module, *inputs: torch.Tensor) -> int:
        return largest_op_work(torch.export.export(module.eval(), inputs).graph)

    linear = torch.nn.Linear(64, 32)
    assert work(linear, torch.randn(3, 64)) == 3 * 32 * 64          # rows x out x in
    conv = torch.nn.Conv2d(4, 8, 3, padding=1)
    assert work(conv, torch.randn(1, 4, 10, 10)) == 8 * 100 * 4 * 9  # outputs x (in x 3 x 3)
    assert work(torch.nn.ReLU(), torch.randn(5, 7)) == 35            # elementwise: elements
    # the MLP chain's 64x64 layers at batch 1 run single-threaded; ResNet's do not
    assert work(torch.nn.Linear(64, 64), torch.randn(1, 64)) <= SERIAL_MAX_WORK
    assert work(torch.nn.Conv2d(64, 64, 3), torch.randn(1, 64, 56, 56)) > SERIAL_MAX_WORK


def test_inductor_options_follow_the_segments_layers():
    from segflow.runtime.aot_inductor import inductor_options

    def options(name: str, device: str = "cpu", **opts: int) -> dict:
        model = models.build(name, **opts) if name != "relu" else helper.make_model(
            helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])]))
        sess = segflow.InferenceSession(model, compile="none")
        return inductor_options(sess.plan.graph.nodes, torch.device(device))

    mlp = options("mlp_chain", layers=3)  # linears: GEMMs autotuned, the C++ template needs packing
    assert mlp["max_autotune"] and mlp["max_autotune_gemm_backends"] == "CPP,ATEN"
    assert mlp["cpp.weight_prepack"] and mlp["freezing"]
    resnet = options("resnet18", num_classes=10, image_size=32)  # convs (and the fc linear)
    assert resnet["cpp.weight_prepack"]
    assert options("mlp_chain", "cuda", layers=3) == {"freezing": True,  # CPU-only choices
                                                       "cpp.weight_prepack": False}
    plain = options("relu")  # no linear, no convolution: nothing to pack or tune
    assert plain == {"freezing": True, "cpp.weight_prepack": False}


def test_eviction_drops_least_recently_used_packages_first(tmp_path, monkeypatch):
    from segflow.runtime.aot_inductor import evict_packages

    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path))
    directory = tmp_path / "aoti"
    directory.mkdir()
    files = {}
    for age, name in enumerate(["newest", "middle", "oldest", "kept"]):
        path = directory / f"{name}.pt2"
        path.write_bytes(b"x" * (1 << 20))
        os.utime(path, (1e9 - age * 100, 1e9 - age * 100))
        files[name] = path
    # Builds in progress live in .build-* directories: one just made (another process may
    # be writing it) stays; one untouched for long and unlocked, a killed build's, goes.
    (directory / ".build-live").mkdir()
    (directory / ".build-live" / "k.pt2").write_bytes(b"x" * (1 << 20))
    (directory / ".build-killed").mkdir()
    os.utime(directory / ".build-killed", (1e9, 1e9))
    # 4 MiB of packages, cap 2 MiB: "kept" is the package just written; of the rest the
    # oldest go.
    cleared = evict_packages(2 << 20, keep=files["kept"])
    assert (cleared.files, cleared.bytes, cleared.partial_builds) == (2, 2 << 20, 1)
    assert sorted(p.name for p in directory.iterdir()) == [".build-live", "kept.pt2",
                                                            "newest.pt2"]
    assert evict_packages(10 << 20).files == 0  # under the cap: nothing to do
    assert evict_packages(0).files == 2  # without a package to keep, all can go
    assert [p.name for p in directory.iterdir()] == [".build-live"]


def test_cache_cap_comes_from_the_environment():
    from segflow.errors import InvalidSetting
    from segflow.settings import cache_max_bytes

    assert cache_max_bytes({}) == 2048 << 20
    assert cache_max_bytes({"SEGFLOW_CACHE_MAX_MB": "3"}) == 3 << 20
    with pytest.raises(InvalidSetting, match="^SEGFLOW_CACHE_MAX_MB='lots': expected a positive"):
        cache_max_bytes({"SEGFLOW_CACHE_MAX_MB": "lots"})


def _split_flatten_model(opset: int, sizes: list[int], axis: int = -1, flatten_axis: int = 1,
                         width: str | int = 6):
    """x [n, 2, 3, width] -> Relu -> Split(sizes, axis) -> each part Flatten(flatten_axis)."""
    names = [f"part{i}" for i in range(len(sizes))]
    split_inputs = ["a"] if opset < 13 else ["a", "sizes"]
    attrs = {"split": sizes} if opset < 13 else {}
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Split", split_inputs, names, axis=axis, **attrs)]
    nodes += [helper.make_node("Flatten", [name], [f"out{i}"], axis=flatten_axis)
              for i, name in enumerate(names)]
    init = [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")] if opset >= 13 else []
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 3, width])],
        [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, None)
         for i in range(len(sizes))], initializer=init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _generated_source(sess) -> str:
    ex = sess._executor
    return generate(ex.tasks[0].steps, ex.template, set(ex.output_slots), None).source


@pytest.mark.parametrize("opset", [11, 13, 18])
@pytest.mark.parametrize("flatten_axis", [1, -3, 2])
def test_a_split_of_constant_sizes_and_a_flatten_at_axis_one_are_one_line_each(
        opset, flatten_axis):
    model = _split_flatten_model(opset, [1, 3, 2], flatten_axis=flatten_axis)
    sess = segflow.InferenceSession(model, engine="inline")
    source = _generated_source(sess)
    # The Split is unpacked in place, each Flatten at axis 1 a method call (no kernels).
    assert ".split([1, 3, 2], -1)" in source
    assert source.count(".flatten(1)") == (3 if flatten_axis in (1, -3) else 0)
    x = np.random.default_rng(0).standard_normal((2, 2, 3, 6)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = sess.run(None, {"x": x})
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_a_split_without_constant_sizes_stays_a_kernel():
    # Sizes from the number of outputs: the kernel computes them from the input's extent.
    nodes = [helper.make_node("Split", ["x"], ["a", "b"], axis=1),
             helper.make_node("Add", ["a", "b"], ["out"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = segflow.InferenceSession(model, engine="inline")
    assert ".split(" not in _generated_source(sess)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x[:, :2] + x[:, 2:])


def test_an_inline_split_whose_sizes_do_not_fit_names_the_node():
    model = _split_flatten_model(13, [1, 3, 2], width="w")
    sess = segflow.InferenceSession(model, engine="inline")
    assert ".split([1, 3, 2], -1)" in _generated_source(sess)
    assert sess.run(None, {"x": np.ones((1, 2, 3, 6), np.float32)})[0].shape == (1, 6)
    with pytest.raises(ExecutionError, match=r"While executing .*Split\(%a, %sizes\)"):
        sess.run(None, {"x": np.ones((1, 2, 3, 7), np.float32)})


@pytest.mark.parametrize("allowzero", [0, 1])
def test_a_reshape_to_a_constant_shape_and_a_transpose_are_one_line_each(allowzero):
    # x [n, 4, 6] -> Relu -> Reshape [0, 4, 2, 3] (0: the input's dim) -> Transpose
    # (0, 2, 1, 3) -> Reshape [-1, 12] -> Transpose (no perm: reversed).
    shape0 = [0, 4, 2, 3] if not allowzero else [2, 4, 2, 3]
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Reshape", ["a", "s0"], ["b"], allowzero=allowzero),
             helper.make_node("Transpose", ["b"], ["c"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["c", "s1"], ["d"]),
             helper.make_node("Transpose", ["d"], ["out"])]
    inits = [numpy_helper.from_array(np.array(shape0, np.int64), "s0"),
             numpy_helper.from_array(np.array([-1, 12], np.int64), "s1")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    sess = segflow.InferenceSession(model, engine="inline", optimize={"fuse": False})
    source = _generated_source(sess)
    assert (".shape[0], 4, 2, 3))" if not allowzero else ".reshape((2, 4, 2, 3))") in source
    assert ".reshape((-1, 12))" in source and ".permute((0, 2, 1, 3))" in source
    assert ".permute((1, 0))" in source
    x = np.random.default_rng(0).standard_normal((2, 4, 6)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)
    if allowzero:   # a shape that does not fit fails at run time, naming the node
        with pytest.raises(ExecutionError, match=r"While executing .*Reshape"):
            sess.run(None, {"x": np.ones((3, 4, 6), np.float32)})
