"""Tests for passes/pipeline.py: switches (API and environment), log lines, session wiring."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import segflow
from segflow import models
from segflow.errors import InvalidSetting
from segflow.frontend.onnx_import import import_model
from segflow.ir.types import Device
from segflow.kernels.choice import KernelKind
from segflow.passes.pipeline import (
    PASSES,
    CompileMode,
    OptimizeOptions,
    configure_threads,
    optimize,
    run_pipeline,
)
from targets import count, patch_target

CPU = Device.parse("cpu")


def test_defaults_are_all_on():
    options = OptimizeOptions.resolve(env={})
    assert (options.fold_constants, options.fuse, options.layout, options.plan_memory) == (
        True, True, True, True)
    assert options.compile is CompileMode.AUTO and options.intra_op_threads is None
    assert options.as_record()["compile"] == "codegen"


def test_api_wins_over_environment():
    env = {"SEGFLOW_NO_FUSE": "1", "SEGFLOW_COMPILE": "none", "SEGFLOW_INTRA_OP_THREADS": "3"}
    from_env = OptimizeOptions.resolve(env=env)
    assert not from_env.fuse and from_env.compile is CompileMode.NONE
    assert from_env.intra_op_threads == 3
    api = OptimizeOptions.resolve({"fuse": True}, compile="codegen", intra_op_threads=1, env=env)
    assert api.fuse and api.compile is CompileMode.CODEGEN and api.intra_op_threads == 1
    # A dict names only some passes: the others still follow the environment.
    assert not OptimizeOptions.resolve({"layout": True}, env=env).fuse


@pytest.mark.parametrize("optimize_arg,env,expected", [
    (False, {}, (False, False, False, False)),
    (None, {"SEGFLOW_OPTIMIZE": "0"}, (False, False, False, False)),
    (True, {"SEGFLOW_NO_FOLD": "1"}, (False, True, True, True)),
    (None, {"SEGFLOW_NO_LAYOUT": "1", "SEGFLOW_NO_MEMORY_PLAN": "1"}, (True, True, False, False)),
    ({"fold_constants": False}, {"SEGFLOW_OPTIMIZE": "0"}, (False, True, True, True)),
])
def test_switches(optimize_arg, env, expected):
    o = OptimizeOptions.resolve(optimize_arg, env=env)
    assert (o.fold_constants, o.fuse, o.layout, o.plan_memory) == expected


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match="unknown passes"):
        OptimizeOptions.resolve({"fusion": True}, env={})
    with pytest.raises(InvalidSetting, match="^SEGFLOW_COMPILE='fast': expected one of"):
        OptimizeOptions.resolve(env={"SEGFLOW_COMPILE": "fast"})
    with pytest.raises(InvalidSetting, match="^compile='fast': expected one of"):
        OptimizeOptions.resolve(compile="fast", env={})
    with pytest.raises(ValueError, match="SEGFLOW_NO_FUSE"):
        OptimizeOptions.resolve(env={"SEGFLOW_NO_FUSE": "maybe"})
    with pytest.raises(ValueError, match="intra_op_threads"):
        OptimizeOptions.resolve(intra_op_threads=0, env={})


def test_one_log_line_per_pass_and_compile():
    graph = import_model(models.build("resnet18", num_classes=10, image_size=32))
    log = optimize(graph, OptimizeOptions.resolve(compile="codegen", env={}), device=CPU)
    assert [line.split(":")[0] for line in log] == [*PASSES, "compile"]
    assert log[0] == "quantize: no QuantizeLinear (not a QDQ graph)"
    assert log[2].startswith("fuse: 69 -> 24 nodes (batchnorm 20")
    assert log[3] == "dense_chain: nothing to chain (no runs of small dense layers)"
    assert log[4].startswith("layout: prepacked for oneDNN: 20 convolutions (channels_last)")
    assert log[5] == "specialize: nothing computes shapes at run time"
    assert log[7] == "compile: codegen (requested)"
    graph.validate()
    # Without libdnnl's direct path, auto gives depthwise graphs to oneDNN Graph.
    auto = import_model(models.build("mobilenet_v2", num_classes=10, image_size=32))
    log = optimize(auto, OptimizeOptions.resolve(env={"SEGFLOW_ONEDNN_DIRECT": "0"}),
                   device=CPU)
    assert log[4] == "layout: skipped (oneDNN Graph packs its own weights)"
    assert log[7].startswith("compile: onednn (auto: 52 convolutions, 17 depthwise")


def test_everything_off_leaves_the_imported_graph():
    model = models.build("resnet18", num_classes=10, image_size=32)
    graph = import_model(model)
    before = [n.op_type for n in graph.nodes]
    result = run_pipeline(graph, OptimizeOptions.resolve(False, env={}), device=CPU)
    assert [n.op_type for n in graph.nodes] == before and result.memory is None
    assert all(line.endswith("off") for line in result.log[:5])


def test_custom_placement_keeps_imported_nodes():
    graph = import_model(models.build("mlp_chain", layers=2))
    log = optimize(graph, OptimizeOptions.resolve(env={}), device=None)
    assert "fuse: skipped (custom placement names the imported nodes)" in log
    assert "dense_chain: skipped (custom placement)" in log
    assert [n.op_type for n in graph.nodes] == ["Gemm", "Relu", "Gemm", "Relu"]


def test_session_counters_stay_exact_with_optimization():
    model = models.build("resnet50", num_classes=10, image_size=32)
    feeds = models.example_inputs("resnet50", num_classes=10, image_size=32)
    for engine in ("inline", "threaded"):
        sess = segflow.InferenceSession(model, engine=engine)
        sess.run(None, feeds)
        stats = sess.last_run_stats
        assert (stats.segments, stats.pushes, stats.syncs) == (1, 1, 1)
        assert stats.kernels == stats.nodes == sess.plan.compute_nodes == 57
        assert stats.settings["compile"] == "codegen" and stats.settings["fuse"] is True
        assert stats.settings["intra_op_threads"] == torch.get_num_threads()
    text = sess.explain()
    for prefix in ("pass: fold_constants:", "pass: fuse:", "pass: dense_chain:", "pass: layout:",
                   "pass: plan_memory:", "pass: compile: codegen"):
        assert prefix in text


def test_thread_option_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        assert configure_threads(OptimizeOptions(intra_op_threads=1)) == 1
        assert torch.get_num_threads() == 1
        assert configure_threads(OptimizeOptions()) == 1  # unset: leaves torch alone
    finally:
        torch.set_num_threads(before)


_CHILD = """
import json, segflow, torch
from segflow import models
from segflow.errors import InvalidSetting
sess = segflow.InferenceSession(models.build("mlp_chain", layers=4))
sess.run(None, models.example_inputs("mlp_chain", layers=4))
s = sess.last_run_stats
print(json.dumps({"nodes": s.nodes, "settings": s.settings, "threads": torch.get_num_threads(),
                  "log": list(sess.plan.pass_log)}))
"""


@pytest.mark.parametrize("env,nodes,key,value", [
    ({}, 1, "dense_chain", True),     # 4 x (Gemm, Relu): fused, then one chain
    ({"SEGFLOW_NO_DENSE_CHAIN": "1"}, 4, "dense_chain", False),
    ({"SEGFLOW_NO_FUSE": "1"}, 8, "fuse", False),
    ({"SEGFLOW_OPTIMIZE": "0"}, 8, "fold_constants", False),
    ({"SEGFLOW_COMPILE": "none"}, 1, "compile", "none"),
    ({"SEGFLOW_INTRA_OP_THREADS": "1"}, 1, "intra_op_threads", 1),
])
def test_environment_flags_in_a_fresh_process(env, nodes, key, value):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SEGFLOW_")}
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**clean, **env},
                         capture_output=True, text=True, check=True, timeout=120)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["nodes"] == nodes
    assert record["settings"][key] == value
    if "SEGFLOW_INTRA_OP_THREADS" in env:
        assert record["threads"] == 1


def test_optimized_and_plain_sessions_agree_on_every_builder_model():
    cases = {"resnet18": {"num_classes": 10, "image_size": 32},
             "mobilenet_v2": {"num_classes": 10, "image_size": 32},
             "mlp_chain": {"layers": 4}, "nonzero_mid": {}}
    for name, opts in cases.items():
        model = models.build(name, **opts)
        feeds = models.example_inputs(name, batch_size=3, **opts)
        fast = segflow.InferenceSession(model).run(None, feeds)
        plain = segflow.InferenceSession(model, optimize=False, compile="none").run(None, feeds)
        for a, b in zip(fast, plain):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)


def test_fuse_rules_switch_off_by_name_from_the_api_or_the_environment():
    api = OptimizeOptions.resolve({"fuse.batchnorm": False, "fuse.gelu": True}, env={})
    assert api.fuse and api.fuse_off == {"batchnorm"}
    env = {"SEGFLOW_NO_FUSE": "conv, batchnorm"}
    from_env = OptimizeOptions.resolve(env=env)
    assert from_env.fuse and from_env.fuse_off == {"batchnorm", "conv"}
    assert from_env.as_record()["fuse_off"] == "batchnorm,conv"      # in the rules' order
    # API rule switches replace the environment's list; other API keys leave it.
    assert OptimizeOptions.resolve({"fuse.conv": False}, env=env).fuse_off == {"conv"}
    assert OptimizeOptions.resolve({"fuse.batchnorm": True}, env=env).fuse_off == set()
    assert OptimizeOptions.resolve({"layout": False}, env=env).fuse_off == {"batchnorm", "conv"}
    # 1 still turns the whole pass off, 0 leaves it all on.
    assert not OptimizeOptions.resolve(env={"SEGFLOW_NO_FUSE": "1"}).fuse
    zero = OptimizeOptions.resolve(env={"SEGFLOW_NO_FUSE": "0"})
    assert zero.fuse and zero.fuse_off == set()


def test_unknown_fuse_rules_are_one_line_errors():
    with pytest.raises(InvalidSetting, match=r"unknown passes \['fuse.bn'\]; known: .*fuse.<rule>"):
        OptimizeOptions.resolve({"fuse.bn": False}, env={})
    with pytest.raises(InvalidSetting,
                       match=r"^SEGFLOW_NO_FUSE='bn,conv': unknown fuse rules \['bn'\]; expected"):
        OptimizeOptions.resolve(env={"SEGFLOW_NO_FUSE": "bn,conv"})


def test_log_line_names_the_rules_switched_off():
    graph = import_model(models.build("resnet18", num_classes=10, image_size=32))
    options = OptimizeOptions.resolve({"fuse.batchnorm": False}, compile="codegen", env={})
    log = optimize(graph, options, device=CPU)
    assert log[2].startswith("fuse: 69 -> ") and log[2].endswith("; rules off: batchnorm")
    assert "batchnorm 20" not in log[2]
    assert sum(1 for n in graph.nodes if n.op_type == "BatchNormalization") == 20


def test_layout_choices_from_the_api_win_over_the_environment():
    env = {"SEGFLOW_WINOGRAD": "1", "SEGFLOW_ONEDNN_DIRECT": "1", "SEGFLOW_ONEDNN_BLOCKED": "0"}
    from_env = OptimizeOptions.resolve(env=env)
    assert (from_env.winograd, from_env.onednn_direct, from_env.onednn_blocked) == (
        True, True, False)
    api = OptimizeOptions.resolve({"layout.winograd": False, "layout.direct": False,
                                   "layout.blocked": True}, env=env)
    assert (api.winograd, api.onednn_direct, api.onednn_blocked) == (False, False, True)
    assert api.layout and api.as_record()["winograd"] is False
    # Unset in the API: the environment's, or the measured default (None) without one.
    assert OptimizeOptions.resolve({"layout.direct": False}, env={}).winograd is None


def test_winograd_switched_off_from_the_api_runs_no_winograd_convolution():
    from segflow.kernels.native.build import NativeLibrary
    from segflow.kernels.onednn.library import Library

    model = models.build("resnet18", num_classes=10, image_size=32)
    feeds = models.example_inputs("resnet18", batch_size=2, num_classes=10, image_size=32)
    on = segflow.InferenceSession(model, optimize={"layout.winograd": True})
    off = segflow.InferenceSession(model, optimize={"layout.winograd": False})
    winograd = [count(s, KernelKind.WINOGRAD) for s in (on, off)]
    assert winograd[1] == 0
    if Library.load() is not None and NativeLibrary.for_session()[0] is not None:
        assert winograd[0] > 0
    np.testing.assert_allclose(on.run(None, feeds)[0], off.run(None, feeds)[0],
                               atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("options", [{}, {"layout": False}, {"fuse": False},
                                     {"native_linear": False}])
def test_every_constant_leaves_the_pipeline_contiguous(options):
    # The fuse pass leaves MatMul weights as transposed views; the layout pass packs the
    # large ones from the view, and whatever is left is made contiguous at the end.
    graph = import_model(models.build("bert_tiny"))
    run_pipeline(graph, OptimizeOptions(**options), device=CPU)
    strided = [v.name for v in graph.initializers.values() if v.const is not None
               and not v.const.is_mkldnn and not v.const.is_contiguous()]
    assert strided == []


@pytest.mark.parametrize("width,merged", [(48, False), (24, True)])
def test_siblings_packed_for_the_avx512_kernel_stay_apart_unless_named(monkeypatch, width,
                                                                       merged):
    # A 768-wide encoder: its query, key and value weights are each packed for the
    # native kernel. With AVX-512's 48-wide panels they stay three linears; with AVX2's
    # 24-wide ones (or when fuse.siblings is named on) they become one and a Split.
    from segflow.kernels.native.build import NativeLibrary
    if NativeLibrary.for_session()[0] is None:
        pytest.skip("no native library")
    patch_target(monkeypatch, native_panel_width=width)
    model = models.build("bert_tiny", layers=1, hidden=768, heads=12, ffn=3072, vocab=50,
                         max_positions=16, seq_len=8)
    for chosen, want in ((None, merged), ({"fuse.siblings": True}, True)):
        graph = import_model(model)
        log = optimize(graph, OptimizeOptions.resolve(chosen, env={}), device=CPU)
        splits = sum(1 for n in graph.nodes if n.op_type == "Split")
        assert splits == (1 if want else 0)
        assert ("siblings 1" in log[2]) == want
        assert log[2].endswith("siblings off (auto): 1 group of linears left separate, the "
                               "native kernel's 48-column panels run packed sibling linears "
                               "faster as separate calls") != want
    # Small siblings (not packed for the native kernel) are merged either way.
    graph = import_model(models.build("bert_tiny"))
    optimize(graph, OptimizeOptions.resolve(None, env={}), device=CPU)
    assert sum(1 for n in graph.nodes if n.op_type == "Split") == 2


# -- the table: every pass has one signature and reports changed / unchanged -----------------
def _context(device=CPU, **optimize):  # type: ignore[no-untyped-def]
    from segflow.kernels.target import CpuTarget
    from segflow.passes.pipeline import PassContext
    return PassContext(device, OptimizeOptions.resolve(optimize or None, env={}),
                       CpuTarget.detect())


def _relu_graph():  # type: ignore[no-untyped-def]
    from segflow.frontend.builder import GraphBuilder
    from segflow.ir import DType
    b = GraphBuilder("relu")
    b.output(b.op("Relu", b.input("x", DType.FLOAT32, [2, 3])), "y")
    return b.to_graph()


def test_the_table_rows_are_the_switchable_passes_in_order():
    from segflow.passes.pipeline import PIPELINE
    switched = [entry.switch for entry in PIPELINE if entry.switch is not None]
    assert [*switched, "plan_memory"] == list(PASSES)
    assert [entry.name for entry in PIPELINE if entry.training] == ["contiguous_constants"]


def test_fold_constants_pass_changed_and_unchanged():
    from segflow.frontend.builder import GraphBuilder
    from segflow.ir import DType
    from segflow.passes.pipeline import fold_constants_pass
    b = GraphBuilder("fold")
    two = b.op("Add", b.param("a", np.ones(3, np.float32)), b.param("b", np.ones(3, np.float32)))
    b.output(b.op("Mul", b.input("x", DType.FLOAT32, [3]), two), "y")
    graph = b.to_graph()
    result = fold_constants_pass(graph, _context())
    assert result.changed and result.graph is graph and len(result.log) == 1
    assert result.log[0].startswith("fold_constants: 2 -> 1 nodes")
    unchanged = fold_constants_pass(_relu_graph(), _context())
    assert not unchanged.changed and unchanged.log == ("fold_constants: 1 -> 1 nodes "
                                                       "(nothing to fold)",)


def test_fuse_pass_changed_and_unchanged():
    from segflow.passes.pipeline import fuse_pass
    graph = import_model(models.build("resnet18", num_classes=10, image_size=32))
    result = fuse_pass(graph, _context())
    assert result.changed and result.log[0].startswith("fuse: 69 -> 24 nodes")
    assert not fuse_pass(_relu_graph(), _context()).changed
    skipped = fuse_pass(import_model(models.build("mlp_chain", layers=2)), _context(None))
    assert not skipped.changed and "custom placement" in skipped.log[0]


def test_dense_chain_pass_changed_and_unchanged():
    from segflow.passes.pipeline import dense_chain_pass, fuse_pass
    graph = import_model(models.build("mlp_chain", layers=3, width=8))
    fuse_pass(graph, _context())
    result = dense_chain_pass(graph, _context())
    assert result.changed and "1 chain of 3 small dense layers" in result.log[0]
    assert not dense_chain_pass(_relu_graph(), _context()).changed
    gpu = dense_chain_pass(_relu_graph(), _context(Device.parse("cuda:0")))
    assert not gpu.changed and gpu.log == ("dense_chain: skipped (not a CPU device)",)


def test_layout_pass_changed_and_unchanged():
    from segflow.passes.pipeline import fuse_pass, layout_pass
    graph = import_model(models.build("resnet18", num_classes=10, image_size=32))
    fuse_pass(graph, _context())
    result = layout_pass(graph, _context())
    assert result.changed and result.log[0].startswith("layout: prepacked for oneDNN")
    unchanged = layout_pass(_relu_graph(), _context())
    assert not unchanged.changed and unchanged.log[0].startswith("layout: nothing to do")


def test_contiguous_constants_pass_changed_and_unchanged():
    from segflow.passes.pipeline import contiguous_constants_pass
    graph = _relu_graph()
    assert not contiguous_constants_pass(graph, _context()).changed
    from segflow.ir import Value
    from segflow.ir.types import DType, TensorSpec
    graph.add_initializer(Value("w", TensorSpec(DType.FLOAT32, (3, 2)),
                                const=torch.ones(2, 3).t()))
    result = contiguous_constants_pass(graph, _context())
    assert result.changed and result.log == () and graph.initializers["w"].const.is_contiguous()


def test_training_runs_only_the_training_rows():
    graph = import_model(models.build("resnet18", num_classes=10, image_size=32))
    before = [n.op_type for n in graph.nodes]
    result = run_pipeline(graph, OptimizeOptions.resolve(env={}), device=CPU, training=True)
    assert [n.op_type for n in graph.nodes] == before and result.memory is None
    assert result.log == ("quantize: off (training)", "fold_constants: off (training)",
                          "fuse: off (training)", "dense_chain: off (training)",
                          "layout: off (training)", "specialize: off (training)",
                          "plan_memory: off (training)")


def test_debug_prints_one_line_per_pass(capsys):
    graph = import_model(models.build("mlp_chain", layers=2))
    options = OptimizeOptions.resolve(compile="codegen", env={"SEGFLOW_DEBUG": "1"})
    log = optimize(graph, options, device=CPU)
    printed = capsys.readouterr().err.splitlines()
    assert printed == [f"segflow pass: {line}" for line in log]
    optimize(import_model(models.build("mlp_chain", layers=2)),
             OptimizeOptions.resolve(compile="codegen", env={}), device=CPU)
    assert capsys.readouterr().err == ""
