"""Tests for segflow bench: runner, peers, records, table, plot and the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx
import pytest

from segflow import cli, models
from segflow.bench import peers
from segflow.bench.report import format_results
from segflow.bench.runner import (
    DEFAULT_MODELS,
    BenchSettings,
    VariantKind,
    parse_model_spec,
    resolve_models,
    run_benchmark,
    to_record,
)
from segflow.errors import SegflowError

TINY = "mlp_chain:layers=3"


@pytest.fixture(autouse=True)
def _layers_stay_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count per-node work (kernels, tasks, syncs) over a small MLP; the
    dense_chain pass would make all its layers one node (tests/test_dense_chain.py)."""
    monkeypatch.setenv("SEGFLOW_NO_DENSE_CHAIN", "1")


def test_model_specs() -> None:
    spec = parse_model_spec("mlp_chain:layers=3,width=8")
    assert (spec.builtin, dict(spec.options), spec.label) == (
        "mlp_chain", {"layers": 3, "width": 8}, "mlp_chain:layers=3,width=8")
    assert parse_model_spec("builtin:resnet18").builtin == "resnet18"
    assert [s.builtin for s in resolve_models(None)] == list(DEFAULT_MODELS)
    with pytest.raises(SegflowError, match="bad option"):
        parse_model_spec("mlp_chain:layers")
    with pytest.raises(SegflowError, match="neither a built-in model"):
        parse_model_spec("no_such_model.onnx")
    with pytest.raises(SegflowError, match="unknown built-in"):
        parse_model_spec("builtin:nope")


def test_settings_are_validated() -> None:
    with pytest.raises(SegflowError, match="unknown mode"):
        BenchSettings(modes=("turbo",)).validate()
    with pytest.raises(SegflowError, match="unknown peer"):
        BenchSettings(peers=("mxnet",)).validate()
    with pytest.raises(SegflowError, match="--batch-size"):
        BenchSettings(batch_size=0).validate()


def test_benchmark_measures_modes_and_peers() -> None:
    settings = BenchSettings(runs=4, warmup=1, batch_size=2)
    (result,) = run_benchmark(resolve_models([TINY]), settings)
    assert [v.name for v in result.variants] == ["bulk", "nobulk", "onnxruntime", "torch"]
    assert all(v.ok for v in result.variants), [v.detail for v in result.variants]
    assert result.rounds == 4 and result.reference == "bulk"
    bulk, nobulk, ort, torch_peer = result.variants
    # 3 Gemm + Relu layers: 3 fused kernels
    assert bulk.counters == {"segments": 1, "pushes": 1, "syncs": 1, "kernels": 3, "copies": 0}
    assert nobulk.counters is not None and nobulk.counters["pushes"] == 3
    assert bulk.relative == 1.0
    assert ort.kind is VariantKind.PEER and ort.counters is None
    for v in result.variants:
        assert v.latency is not None and v.latency.runs == 4
        assert v.latency.min_ms <= v.latency.p50_ms <= v.latency.p90_ms <= v.latency.p99_ms
        assert v.latency.throughput > 0
    assert ort.max_abs_diff is not None and ort.max_abs_diff < 1e-3
    assert torch_peer.max_abs_diff is not None and torch_peer.max_abs_diff < 1e-3
    assert set(result.ratios) == {"bulk/nobulk", "bulk/onnxruntime", "bulk/torch",
                                  "nobulk/onnxruntime", "nobulk/torch"}
    assert result.shapes == {"x": [2, 64]}
    text = format_results([result])
    for word in ("p50 ms", "p99 ms", "items/s", "segments", "pushes", "syncs", "kernels",
                 "peak MiB", "onnxruntime (peer, f32)", "bulk/onnxruntime"):
        assert word in text


def test_rounds_pause_at_every_change_of_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime's thread pool spins after a run: whenever the runtime changes (segflow's
    modes are one runtime, each peer another), the next starts ``settle_s`` later
    (untimed); between two segflow modes there is no pause."""
    from segflow.bench import runner

    calls: list[str] = []
    real_sleep = runner.time.sleep

    def sleep(seconds: float) -> None:
        if seconds == 0.0123:
            calls.append("settle")
        else:
            real_sleep(seconds)
    monkeypatch.setattr(runner.time, "sleep", sleep)
    settings = BenchSettings(runs=3, warmup=1, settle_s=0.0123)
    (result,) = run_benchmark(resolve_models([TINY]), settings)
    assert [v.name for v in result.variants] == ["bulk", "nobulk", "onnxruntime", "torch"]
    # Rounds [bulk nobulk ORT torch], [nobulk ORT torch bulk], [ORT torch bulk nobulk],
    # after the warm-up ended with torch: every change but bulk -> nobulk, 3 + 4 + 3.
    assert calls == ["settle"] * 10
    # Each pause is followed by one untimed run: the timed runs are still one a round.
    assert all(v.latency is not None and v.latency.runs == 3 for v in result.variants)
    assert to_record([result], settings)["settings"]["settle_s"] == 0.0123
    with pytest.raises(SegflowError, match="--settle"):
        BenchSettings(settle_s=-1).validate()


def test_every_variant_runs_once_untimed_after_another_ones_call() -> None:
    """Each timed call follows an untimed one of the same variant, whatever ran
    before (not only around onnxruntime): no variant's timed call is the first after
    another's, which would find the caches holding the other's weights."""
    from segflow.bench import runner

    log: list[str] = []
    active = [runner._Live(name, runner.VariantKind.SEGFLOW, lambda name=name: log.append(name),
                           runtime="peer" if name == "b" else "segflow") for name in "abc"]
    settings = BenchSettings(runs=3, warmup=0, settle_s=0.0)
    assert runner._timed_rounds(active, settings, lambda done: None) == 3
    # Rounds [a b c], [b c a], [c a b], after the warm-up ended with c: every call a pair.
    assert log == [name for name in "abcbcacab" for _ in range(2)]
    assert all(len(v.times) == 3 for v in active)


def test_missing_peers_are_reported_not_raised(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(models.build("mlp_chain", layers=2), path)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    (result,) = run_benchmark(resolve_models([str(path)]), BenchSettings(runs=2, warmup=0))
    status = {v.name: (v.status, v.detail) for v in result.variants}
    assert status["bulk"][0] == "ok"
    assert status["onnxruntime"] == ("missing",
                                     "onnxruntime is not installed (pip install onnxruntime)")
    assert status["torch"] == ("missing", "no PyTorch module for a model loaded from a file")
    assert result.ratios == {"bulk/nobulk": pytest.approx(result.ratios["bulk/nobulk"])}
    assert "missing: no PyTorch module" in format_results([result])


def test_onnxruntime_without_cuda_provider_is_missing() -> None:
    from segflow.ir.types import Device

    source = peers.ModelSource(models.build("mlp_chain", layers=2), "mlp_chain", {"layers": 2})
    feeds = models.example_inputs("mlp_chain", layers=2)
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(peers.PeerUnavailable, match="CUDAExecutionProvider"):
        peers.prepare_peer("onnxruntime", source, feeds, Device.parse("cuda:0"))


def test_counters_only_runs_each_mode_once_without_peers() -> None:
    settings = BenchSettings(counters_only=True, warmup=0)
    (result,) = run_benchmark(resolve_models(["nonzero_mid"]), settings)
    assert [v.name for v in result.variants] == ["bulk", "nobulk"]
    assert all(v.latency is None and v.counters for v in result.variants)
    assert result.rounds == 0 and result.ratios == {}
    assert "status" in format_results([result], counters_only=True)


def test_record_is_machine_readable() -> None:
    settings = BenchSettings(runs=2, peers=("onnxruntime",))
    results = run_benchmark(resolve_models([TINY]), settings)
    record = json.loads(json.dumps(to_record(results, settings)))
    assert record["kind"] == "segflow-bench" and record["schema"] == 1
    assert {"segflow", "torch", "onnx", "numpy", "python"} <= set(record["versions"])
    assert record["settings"]["runs"] == 2 and "memory" in record["settings"]
    (model,) = record["models"]
    assert model["model"] == TINY and model["shapes"] == {"x": [1, 64]}
    assert model["device"] == "cpu:0" and model["batch_size"] == 1
    bulk = model["variants"][0]
    assert bulk["kind"] == "segflow" and bulk["counters"]["kernels"] == 3
    # engine "auto" resolves to inline for a one-device plan
    assert bulk["settings"]["inference"] is True and bulk["settings"]["engine"] == "inline"
    assert set(bulk["latency"]) >= {"p50_ms", "p90_ms", "p99_ms", "throughput"}
    assert "bulk/onnxruntime" in model["ratios"]


def test_cli_bench_prints_table_and_writes_json(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    rc = cli.main(["bench", TINY, "--runs", "2", "--peers", "none", "--modes", "bulk,inline",
                   "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "p50 ms" in text and "inline" in text and f"wrote {out}" in text
    record = json.loads(out.read_text())
    assert [v["name"] for v in record["models"][0]["variants"]] == ["bulk", "inline"]


def test_cli_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    assert cli.main(["bench", TINY, "--runs", "2", "--peers", "onnxruntime", "--plot", str(png),
                     "--no-progress"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_plot_without_matplotlib_says_how_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["bench", TINY, "--runs", "1", "--plot", "x.png"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_cli_bad_mode_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", TINY, "--modes", "fast"]) == 2
    assert "unknown mode(s) fast" in capsys.readouterr().err


def test_cli_profile_prints_table_and_writes_trace(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from segflow.profiler.chrome_trace import check_trace

    trace = tmp_path / "trace.json"
    assert cli.main(["profile", "builtin:nonzero_mid", "--trace", str(trace), "--runs", "2"]) == 0
    text = capsys.readouterr().out
    assert "Engine calls (2 runs" in text and "NonZero" in text and "syncs=2" in text
    assert check_trace(json.loads(trace.read_text())) == []
