"""segflow bench's openvino peer: same outputs as onnxruntime, float32 recorded, a clear
line when openvino is missing; and the output check that marks a peer computing
something else."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from segflow import models
from segflow.bench import peers
from segflow.bench.modes import PEER_NAMES
from segflow.bench.report import format_results
from segflow.bench.runner import (
    BenchSettings,
    OutputCheck,
    resolve_models,
    run_benchmark,
    to_record,
)
from segflow.ir.types import Device

TINY = "mlp_chain:layers=3"
CPU = Device.parse("cpu")


@pytest.fixture(autouse=True)
def _layers_stay_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEGFLOW_NO_DENSE_CHAIN", "1")


def _source(batch_size: int = 1) -> tuple[peers.ModelSource, dict[str, np.ndarray]]:
    source = peers.ModelSource(models.build("mlp_chain", layers=3), "mlp_chain", {"layers": 3})
    return source, models.example_inputs("mlp_chain", layers=3, batch_size=batch_size)


def test_peer_names_for_help_are_the_peer_table() -> None:
    assert PEER_NAMES == tuple(peers.PEERS)


def test_openvino_matches_onnxruntime_in_float32() -> None:
    pytest.importorskip("openvino")
    # Batch 3 against the model's symbolic batch dim: the peer compiles at the feeds' shapes.
    source, feeds = _source(batch_size=3)
    runner = peers.prepare_peer("openvino", source, feeds, CPU)
    expected = peers.prepare_peer("onnxruntime", source, feeds, CPU).run()
    got = runner.run()
    assert len(got) == len(expected) == 1 and got[0].shape == (3, 64)
    # Both float32; the kernels' summation order may differ.
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert runner.precision == "f32"
    assert runner.settings["threads"] == torch.get_num_threads()
    assert runner.settings["performance_hint"] == "LATENCY"
    with pytest.raises(peers.PeerUnavailable, match="CPU only"):
        peers.prepare_peer("openvino", source, feeds, Device.parse("cuda:0"))


def test_openvino_in_the_benchmark_records_f32_and_its_check() -> None:
    pytest.importorskip("openvino")
    settings = BenchSettings(runs=2, warmup=0, peers=("openvino", "onnxruntime"))
    (result,) = run_benchmark(resolve_models([TINY]), settings)
    ov = result.variant("openvino")
    assert ov is not None and ov.ok and ov.latency is not None and ov.latency.runs == 2
    # Checked against onnxruntime though onnxruntime ran after it.
    assert ov.check is not None and ov.check.against == "onnxruntime" and ov.check.ok
    assert ov.check.relative_diff < 1e-5
    assert "openvino (peer, f32)" in format_results([result])
    record = json.loads(json.dumps(to_record([result], settings)))
    (variant,) = [v for v in record["models"][0]["variants"] if v["name"] == "openvino"]
    assert variant["precision"] == "f32" and variant["check"]["ok"] is True
    assert "openvino" in record["versions"]


def test_missing_openvino_is_one_line_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)   # import fails
    source, feeds = _source()
    for name in ("openvino", "openvino-default"):
        with pytest.raises(peers.PeerUnavailable) as info:
            peers.prepare_peer(name, source, feeds, CPU)
        assert str(info.value) == "openvino is not installed (pip install openvino)"
    settings = BenchSettings(runs=2, warmup=0, peers=("onnxruntime", "openvino"))
    (result,) = run_benchmark(resolve_models([TINY]), settings)
    ov = result.variant("openvino")
    assert ov is not None and (ov.status, ov.detail) == (
        "missing", "openvino is not installed (pip install openvino)")
    assert all(v.ok for v in result.variants if v.name != "openvino")
    notes = [line for line in format_results([result]).splitlines() if "[openvino]" in line]
    assert notes == ["  mlp_chain:layers=3 [openvino]: missing: openvino is not installed "
                     "(pip install openvino)"]


def test_a_peer_computing_something_else_is_timed_and_marked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs off by 1% of their largest magnitude (bfloat16's size of error) fail the
    check: the row is timed, named DIFFERS, and a note says by how much."""
    def skewed(source: peers.ModelSource, feeds: dict[str, np.ndarray],
               device: Device) -> peers.PeerRunner:
        real = peers.prepare_peer("onnxruntime", source, feeds, device)

        def run() -> list[np.ndarray]:
            out = real.run()
            return [o + 0.01 * np.max(np.abs(o)) for o in out]
        return peers.PeerRunner("skewed", "onnxruntime, shifted", "0", run, "bf16")
    monkeypatch.setitem(peers.PEERS, "skewed", skewed)   # type: ignore[index]
    settings = BenchSettings(runs=2, warmup=0, peers=("onnxruntime", "skewed", "torch"))
    (result,) = run_benchmark(resolve_models([TINY]), settings)
    bad, torch_peer = result.variant("skewed"), result.variant("torch")
    assert bad is not None and bad.ok and bad.latency is not None
    assert bad.check is not None and not bad.check.ok
    assert bad.check.relative_diff == pytest.approx(0.01, rel=1e-3)
    assert torch_peer is not None and torch_peer.check is not None and torch_peer.check.ok
    text = format_results([result])
    assert "skewed (peer, bf16) DIFFERS" in text
    assert "[skewed]: DIFFERS: outputs differ from onnxruntime's" in text
    assert "torch (peer, f32) DIFFERS" not in text


def test_output_check_is_relative_to_the_largest_output() -> None:
    expected = [np.array([100.0, -200.0], np.float32), np.zeros(0, np.float32)]
    near = [np.array([100.1, -200.0], np.float32), np.zeros(0, np.float32)]
    check = OutputCheck.of(near, expected, "onnxruntime")
    assert check.ok and check.relative_diff == pytest.approx(0.1 / 200, rel=1e-3)
    assert not OutputCheck.of([np.array([100.0])], expected, "onnxruntime").ok  # count
    zeros = [np.zeros(2, np.float32)]
    assert OutputCheck.of(zeros, zeros, "onnxruntime").ok
    assert not OutputCheck.of([np.ones(2, np.float32)], zeros, "onnxruntime").ok
