"""benchmarks/conv_kernels.py, host_memory.py, grad_mode.py, winograd_shapes.py,
cold_start.py and node_groups.py: parsing and one small run each."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _verbose(shape: str, ms: float) -> str:
    return (f"onednn_verbose,v1,primitive,exec,cpu,convolution,brgconv_1x1:avx512_core,"
            f"forward_inference,src:f32::blocked:acdb::f0,attr-scratchpad:user,"
            f"alg:convolution_direct,mb1_{shape}_iw56ow56kw1sw1dw0pw0,{ms}")


def test_conv_kernels_reads_oneDNN_verbose_run_by_run() -> None:
    probe = _load("conv_kernels")
    a, b = "ic64oc64_ih56oh56kh1sh1dh0ph0", "ic64oc256_ih56oh56kh1sh1dh0ph0"
    warmup = _verbose(a, 99.0)  # before the marker: the untimed run, ignored
    timed = [_verbose(a, 1.0), _verbose(b, 2.0), "onednn_verbose,v1,primitive,exec,cpu,reorder",
             _verbose(a, 3.0), _verbose(b, 6.0), _verbose(a, 2.0), _verbose(b, 4.0)]
    stdout = "\n".join([warmup, "RUNS", *timed, 'RESULT {"wall_ms": [1, 2, 3]}'])
    shapes, medians, sums = probe._verbose_convs(stdout, runs=3)
    assert shapes == [a, b]
    assert medians == [2.0, 4.0]
    assert sums == [3.0, 9.0, 6.0]


def test_host_memory_child_reports_faults_time_and_the_policy_in_force() -> None:
    probe = _load("host_memory")
    result = probe.child("mlp_chain", 1, warmup=1, runs=2, policy="system")
    assert result["policy"] == "system"
    faults, ms = result["faults"], result["ms"]
    assert isinstance(faults, list) and len(faults) == 2 and min(faults) >= 0
    assert isinstance(ms, list) and len(ms) == 2 and min(ms) > 0
    assert result["hwm_mib"] >= result["rss_mib"] > 0  # type: ignore[operator]


def test_grad_mode_times_run_against_run_tensors_on_one_session() -> None:
    probe = _load("grad_mode")
    run_ms, tensors_ms, ratio, q1, q3 = probe.measure("mlp_chain", {"layers": 4}, rounds=4,
                                                      calls=2)
    assert run_ms > 0 and tensors_ms > 0
    assert q1 <= ratio <= q3 and ratio > 0


@pytest.mark.parametrize("name", ["conv_kernels", "host_memory", "grad_mode",
                                  "node_groups"])
def test_probe_help_describes_it(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    probe = _load(name)
    sys_argv = sys.argv
    sys.argv = [name, "--help"]
    try:
        with pytest.raises(SystemExit):
            probe.main()
    finally:
        sys.argv = sys_argv
    assert probe.__doc__ is not None
    assert probe.__doc__.splitlines()[0] in capsys.readouterr().out


def test_mxnet_peer_hands_mxnet_the_weights_segflow_runs(tmp_path: Path) -> None:
    import numpy as np

    import segflow

    probe = _load("mxnet_peer")
    model, arrays = probe._weights(layers=3, width=8, batch=2)
    y = arrays["x"]
    for i in range(arrays["layers"]):   # what MXNet's Dense(activation="relu") computes
        y = np.maximum(y @ arrays[f"w{i}"].T + arrays[f"b{i}"], 0)
    got = segflow.InferenceSession(model).run(None, {"x": arrays["x"]})[0]
    np.testing.assert_allclose(got, y, atol=1e-5, rtol=1e-5)
    assert probe.main(["--mxnet-python", str(tmp_path / "missing")]) == 2


def test_winograd_shapes_compares_three_runs_of_a_small_shape(capsys) -> None:
    pytest.importorskip("onnxruntime")
    shapes = _load("winograd_shapes")
    shapes.main(["--shapes", "16x9", "--rounds", "2", "--per-round", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("batch 1, 2 threads")
    assert out[1].startswith("  16 ch @ 9x9: winograd / direct / ort ")
    assert " w/direct " in out[1] and " w/ort " in out[1]


def test_cold_start_times_both_runtimes_in_fresh_processes(capsys) -> None:
    pytest.importorskip("onnxruntime")
    probe = _load("cold_start")
    assert probe.main(["--models", "no_such_model"]) == 2
    assert "unknown model 'no_such_model'" in capsys.readouterr().err
    assert probe.main(["--models", "bert_tiny", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cold start, batch 1, 1 threads, median of 1 fresh")
    for runtime, line in zip(("segflow", "onnxruntime"), out[1:3], strict=True):
        fields = line.split()
        assert fields[:2] == ["bert_tiny", runtime]
        values = dict(zip(fields[2::2], map(float, fields[3::2]), strict=True))
        assert set(values) == {"import", "load", "run1", "run2", "steady"}
        assert all(v > 0 for v in values.values())
    assert out[3].split()[:4] == ["bert_tiny", "load", "+", "run1:"]


def test_node_groups_maps_both_profilers_names_to_groups() -> None:
    probe = _load("node_groups")
    trace = [{"cat": "Node", "name": "encoder.layer.0.intermediate.dense.matmul_kernel_time",
              "dur": 3000}, {"cat": "Node", "name": "encoder.layer.1.output.dense_fence_before",
                             "dur": 7}, {"cat": "Session", "name": "model_run", "dur": 9000},
             {"cat": "Node", "name": "BiasGelu_token_3_kernel_time", "dur": 500}]
    spans = probe.ort_spans(trace)
    assert spans == [("encoder.layer.0.intermediate.dense.matmul", 3.0),
                     ("BiasGelu_token_3", 0.5)]
    key = probe.KEYS["bert_base"]
    spans += [("encoder.layer.1.intermediate.dense.matmul", 5.0)]
    assert probe.group_times(spans, key, runs=2) == {"intermediate": 4.0, "other": 0.25}
    # ResNet's stem: segflow names it after its Conv, onnxruntime after Relu and MaxPool
    resnet = [("conv1", 1.0), ("relu_nchwc", 2.0), ("maxpool_nchwc", 3.0), ("maxpool", 4.0),
              ("layer1.0.conv1", 5.0), ("layer1.0.relu1_nchwc", 6.0), ("fc", 7.0),
              ("avgpool_nchwc", 8.0)]
    assert probe.group_times(resnet, probe.KEYS["resnet50"], runs=1) == {
        "stem": 10.0, "layer1.0": 11.0, "fc": 7.0, "other": 8.0}
    # no capture group: the whole match is the group
    assert probe.group_times([("features.3.conv.1", 2.0)], r"features\.\d+", 1) == {
        "features.3": 2.0}
    table = probe.report("bert_base", key, 2, {
        "segflow": {"groups": {"intermediate": 4.0, "output": 1.0}, "wall_ms": 5.5},
        "onnxruntime": {"groups": {"intermediate": 3.0, "other": 0.25}, "wall_ms": 3.5}}, top=2)
    lines = table.splitlines()
    assert lines[2].split() == ["intermediate", "4.000", "3.000", "+1.000"]
    assert lines[3].split() == ["output", "1.000", "0.000", "+1.000"]
    assert lines[4] == "  ... 1 more groups"
    assert lines[5].split()[-3:] == ["5.000", "3.250", "+1.750"]
    assert lines[6].split()[-3:] == ["5.500", "3.500", "+2.000"]


def test_node_groups_profiles_both_runtimes_in_fresh_processes(capsys) -> None:
    pytest.importorskip("onnxruntime")
    probe = _load("node_groups")
    assert probe.main(["--model", "no_such_model"]) == 2
    assert "unknown model 'no_such_model'" in capsys.readouterr().err
    assert probe.main(["--model", "bert_tiny", "--key", "(unclosed"]) == 2
    assert "--key is not a regular expression" in capsys.readouterr().err
    assert probe.main(["--model", "bert_tiny", "--runs", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bert_tiny, batch 1, ms a run over 2 profiled runs")
    groups = {line.split()[0]: [float(v) for v in line.split()[1:3]] for line in out[2:-2]}
    # both runtimes put time in BERT's four sublayers
    for group in ("attention.self", "attention.output", "intermediate", "output"):
        assert groups[group][0] > 0 and groups[group][1] > 0, group
    assert out[-1].split()[:3] == ["unprofiled", "run", "(median)"]
