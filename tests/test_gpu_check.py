"""benchmarks/gpu_check: the dry run end to end (through the .sh) and the trace summary."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from segflow.profiler.cuda import summarize_trace

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_through_the_shell_script(tmp_path):
    # The CPU dry run stands in for a CUDA device, where the dense_chain pass does not run.
    env = {**os.environ, "OUT": str(tmp_path), "SEGFLOW_ENGINE": "inline",
           "SEGFLOW_NO_DENSE_CHAIN": "1"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--models", "mlp_chain,nonzero_mid",
         "--workloads", "mlp_chain_b1", "--peers", "ort,torch",
         "--modes", "nobulk/stream,bulk/stream,bulk/event,bulk/event+graphs"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "x ort" in proc.stdout and "correctness: 2/2 ok" in proc.stdout
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["model"] for r in record["correctness"]] == ["mlp_chain", "nonzero_mid"]
    assert all(r["ok"] for r in record["correctness"])
    rows = {r["mode"]: r for r in record["bench"]}
    # The fake stream backend makes the CPU dry run count what a GPU run counts.
    nodes = rows["nobulk/stream"]["compute_nodes"]
    assert nodes >= 8 and rows["nobulk/stream"]["syncs"] == nodes + 1
    assert rows["bulk/stream"]["syncs"] == 2
    assert rows["bulk/event"]["syncs"] == 1
    assert rows["bulk/event+graphs"]["syncs"] == 1
    assert rows["bulk/event"]["settings"]["sync_mode"] == "event"
    assert rows["bulk/event+graphs"]["settings"]["cuda_graphs"] is True
    assert all(r["rel_error"] < 1e-5 for r in record["bench"] if "rel_error" in r)
    assert rows["bulk/event"]["x_torch"] > 0 and rows["ort"]["kind"] == "peer"
    assert record["environment"]["fake_streams"] is True


def test_summarize_trace_counts_per_run_and_merges_overlaps():
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 3, "dur": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 5, "dur": 9},
        {"ph": "X", "cat": "cuda_driver", "name": "cuStreamSynchronize", "ts": 6, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 10},     # 10..20
        {"ph": "X", "cat": "kernel", "name": "relu", "ts": 15, "dur": 10},     # 15..25 overlaps
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 30, "dur": 4},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0},
    ]
    metrics = summarize_trace(events, runs=2)
    assert metrics.launches == 1.0          # 2 launches over 2 runs
    assert metrics.graph_launches == 0.5
    assert metrics.host_syncs == 1.0
    assert metrics.kernels == 1.0
    assert metrics.busy_us == (15 + 4) / 2  # union 10..25 plus the copy


def test_summarize_trace_subtracts_an_empty_windows_calls():
    # Stopping torch.profiler synchronizes the device once per window: not the runs'.
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": t,
               "dur": 1} for t in range(5)]
    empty = summarize_trace(events[:1], runs=1)
    assert empty.host_syncs == 1
    metrics = summarize_trace(events, runs=4, baseline=empty)
    assert metrics.host_syncs == 1.0


def test_targets_need_rows_and_cuda(gpu_check):
    rows = [
        {"workload": "resnet50_b1", "mode": "bulk/event+graphs", "p50_ms": 1.0, "syncs": 1,
         "host_syncs": 1.0, "busy": 0.98},
        {"workload": "resnet50_b1", "mode": "bulk/event", "p50_ms": 1.2, "syncs": 1},
        {"workload": "resnet50_b1", "mode": "nobulk/stream", "p50_ms": 9.0, "syncs": 176,
         "compute_nodes": 175},
        {"workload": "resnet50_b1", "mode": "ort", "p50_ms": 1.5},
        {"workload": "resnet50_b1", "mode": "torch", "p50_ms": 1.2},
    ]
    results = {t.name: t.ok for t in gpu_check.evaluate_targets(rows, cuda=True)}
    assert results["graphs: syncs per inference == 1"] is True
    assert results["graphs: device busy >= 97%"] is True
    assert results["graphs: latency <= 0.8x onnxruntime CUDA"] is True   # 0.67x
    assert results["graphs: latency <= 0.7x torch eager"] is False       # 0.83x
    assert results["nobulk/stream syncs == compute nodes + 1, bulk/event == 1"] is True
    on_cpu = {t.name: t.ok for t in gpu_check.evaluate_targets(rows, cuda=False)}
    assert on_cpu["graphs: latency <= 0.8x onnxruntime CUDA"] is None
