"""The command line's argument checks, inputs and dims (segflow.model_args), in-process
through cli.main: each bad argument is one ``segflow: error:`` line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from segflow import cli
from segflow.cli import compare_outputs, compare_values
from segflow.errors import ExecutionError, SegflowError
from segflow.frontend.onnx_import import declared_inputs
from segflow.model_args import make_feeds, parse_input_arg
from segflow.training_demo import min_accuracy


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(capsys, *argv: str) -> str:
    """The one error line argparse-level checks print (exit 2)."""
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.startswith("segflow: error: ") and err.count("\n") == 1, err
    return err


def one_line_error(capsys, *argv: str) -> str:
    """The one error line a check after parsing prints (returns 2)."""
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert err.startswith("segflow: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# -- small models ---------------------------------------------------------------------------
def _save(tmp: Path, name: str, graph: onnx.GraphProto) -> str:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp / f"{name}.onnx"
    onnx.save(model, path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cli_args")
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    sym = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], name="conv"),
         helper.make_node("Relu", ["y"], ["z"], name="relu")], "sym",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 8, "H", "W"])], [weight])
    scalar = helper.make_graph(
        [helper.make_node("Mul", ["x", "sr"], ["y"])], "scalar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("sr", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    reshape = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"])], "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    paths = {name: _save(tmp, name, graph) for name, graph in
             (("sym", sym), ("scalar", scalar), ("reshape", reshape))}
    (tmp / "garbage.onnx").write_bytes(b"\xff\x00 not a protobuf \x13\x37" * 8)
    paths["garbage"] = str(tmp / "garbage.onnx")
    (tmp / "text.npy").write_text("not numpy")
    paths["text_npy"] = str(tmp / "text.npy")
    (tmp / "empty.onnx").write_bytes(b"")
    paths["empty"] = str(tmp / "empty.onnx")
    paths["dir"] = str(tmp)
    return paths


# -- unknown flags --------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["--bogus"], ["MODEL", "--bogus"], ["run", "MODEL", "--bogus"], ["check", "MODEL", "--bogus"],
    ["explain", "MODEL", "--bogus"], ["profile", "MODEL", "--bogus"],
    ["bench", "MODEL", "--bogus"], ["cache", "--bogus"], ["train-demo", "--bogus"],
])
def test_unknown_flags_are_errors_in_every_command(capsys, models, argv):
    err = usage_error(capsys, *[models["sym"] if a == "MODEL" else a for a in argv])
    assert "unrecognized arguments: --bogus" in err


def test_a_model_alone_means_run_with_its_flags(capsys, models):
    code, out, _ = run_cli(capsys, models["scalar"], "--input", "sr=2")
    assert code == 0 and f"model: {models['scalar']}" in out and "input  sr: float32[]" in out


# -- devices --------------------------------------------------------------------------------
@pytest.mark.parametrize("device,fragment", [
    ("gpu", "unknown device 'gpu'; expected 'cpu', 'cpu:N' or 'cuda:N'"),
    ("cuda:x", "bad device index in 'cuda:x'"),
    ("cuda:-1", "bad device index"),
])
@pytest.mark.parametrize("command", ["run", "explain", "bench"])
def test_a_bad_device_name_is_one_line(capsys, models, command, device, fragment):
    assert fragment in one_line_error(capsys, command, models["sym"], "--device", device)


def test_cuda_on_a_torch_without_it_is_one_line(capsys, models, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = one_line_error(capsys, "run", models["sym"], "--device", "cuda:0")
    assert "--device cuda:0: this torch" in err and "has no CUDA" in err


def test_a_cuda_device_torch_does_not_see_is_one_line(capsys, models, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = one_line_error(capsys, "run", models["sym"], "--device", "cuda:3")
    assert "--device cuda:3: torch sees only 1 CUDA device (cuda:0..cuda:0)" in err


# -- counts and tolerances ------------------------------------------------------------------
@pytest.mark.parametrize("argv,fragment", [
    (["run", "--repeat", "0"], "argument --repeat: expected a positive integer, got 0"),
    (["run", "--repeat", "two"], "argument --repeat: expected a positive integer, got 'two'"),
    (["run", "--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (["check", "--atol", "-1"], "argument --atol: expected a number >= 0, got -1"),
    (["check", "--rtol", "nan"], "argument --rtol: expected a number >= 0"),
    (["bench", "--batch-size", "0"], "argument --batch-size: expected a positive integer"),
    (["bench", "--runs", "0"], "argument --runs: expected a positive integer, got 0"),
    (["bench", "--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["bench", "--seconds", "0"], "argument --seconds: expected a number > 0, got 0"),
    (["bench", "--settle", "-1"], "argument --settle: expected a number >= 0"),
    (["profile", "--runs", "0"], "argument --runs: expected a positive integer"),
    (["profile", "--warmup", "-2"], "argument --warmup: expected an integer >= 0"),
    (["profile", "--limit", "-1"], "argument --limit: expected an integer >= 0"),
    (["train-demo", "--epochs", "0"], "argument --epochs: expected a positive integer, got 0"),
    (["train-demo", "--batch-size", "0"], "argument --batch-size: expected a positive integer"),
    (["train-demo", "--lr", "-0.1"], "argument --lr: expected a number > 0, got -0.1"),
    (["train-demo", "--lr", "0"], "argument --lr: expected a number > 0"),
    (["train-demo", "--seed", "-3"], "argument --seed: expected an integer >= 0"),
    (["train-demo", "--workers", "0"], "argument --workers: expected a positive integer"),
    (["train-demo", "--min-accuracy", "101"], "expected a percent from 0 to 100, got 101"),
    (["train-demo", "--min-accuracy", "high"], "expected a percent such as 95%"),
])
def test_bad_numbers_are_one_line_usage_errors(capsys, argv, fragment):
    assert fragment in usage_error(capsys, *argv)


def test_bench_checks_its_settings_before_any_model_loads(capsys):
    assert "--settle must be between 0 and 10" in one_line_error(
        capsys, "bench", "no-such-model", "--settle", "11")


# -- model files ----------------------------------------------------------------------------
@pytest.mark.parametrize("key,fragment", [
    ("dir", "model path is a directory, not an ONNX file"),
    ("garbage", "cannot read ONNX model"),
    ("text_npy", "cannot read ONNX model"),
    ("empty", "is not an ONNX model (no graph found)"),
])
@pytest.mark.parametrize("command", ["run", "check", "explain", "profile"])
def test_a_file_that_is_no_model_is_one_line(capsys, models, command, key, fragment):
    assert fragment in one_line_error(capsys, command, models[key])


def test_bench_names_a_missing_model_in_one_line(capsys):
    assert "neither a built-in model" in one_line_error(capsys, "bench", "/no/such.onnx",
                                                        "--no-progress")


def test_an_unsupported_op_is_one_line(capsys, tmp_path):
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "bad",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = _save(tmp_path, "bad", graph)
    assert "NoSuchOp" in one_line_error(capsys, "run", path)


# -- unexpected errors ----------------------------------------------------------------------
def test_an_unexpected_error_is_one_line_with_a_hint(capsys, models, monkeypatch):
    def boom(args):  # type: ignore[no-untyped-def]
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(cli, "open_model", boom)
    code, _, err = run_cli(capsys, "explain", models["sym"])
    assert code == 1
    assert err == ("segflow: error: unexpected RuntimeError: kernel exploded (rerun with "
                   "--traceback for the full traceback)\n")
    with pytest.raises(RuntimeError, match="kernel exploded"):
        cli.main(["explain", models["sym"], "--traceback"])


def test_a_segflow_error_message_stays_one_line(capsys, models, monkeypatch):
    def fails(args):  # type: ignore[no-untyped-def]
        raise SegflowError("first\nsecond")

    monkeypatch.setattr(cli, "open_model", fails)
    assert one_line_error(capsys, "run", models["sym"]) == "segflow: error: first second\n"


# -- --input and --dim ----------------------------------------------------------------------
def test_a_number_feeds_a_scalar_input_in_its_dtype(capsys, models):
    code, out, _ = run_cli(capsys, "run", models["scalar"], "--input", "sr=16000",
                           "--input", "x=[1,2,3,4]")
    assert code == 0 and "input  sr: float32[]" in out and "mean=40000" in out
    code, out, _ = run_cli(capsys, "run", models["scalar"], "--input", "sr=0.5",
                           "--input", "x=[2,2,2,2]")
    assert code == 0 and "mean=1\n" in out


def test_a_number_fills_an_input_at_its_dims(capsys, models):
    code, out, err = run_cli(capsys, "run", models["sym"], "--input", "x=0", "--dim", "N=2",
                             "--dim", "H=5", "--dim", "W=6")
    assert code == 0 and err == ""
    assert "input  x: float32[2, 3, 5, 6]" in out and "output z: float32[2, 8, 5, 6]" in out
    assert "mean=0\n" in out


def test_a_list_feeds_an_integer_input(capsys, models):
    code, out, _ = run_cli(capsys, "run", models["reshape"], "--input", "s=[3,2]")
    assert code == 0 and "input  s: int64[2]" in out and "output y: float32[3, 2]" in out


@pytest.mark.parametrize("spec,fragment", [
    ("s=[0.5,2]", "input 's' is int64, which holds no fractions"),
    ("s=[1,[2]]", "expected a list of numbers"),
    ("s=[1,2", "expected a list of numbers"),
    ("s=rand:2x", "bad dims '2x'"),
    ("s=rand:-2", "bad dims '-2'"),
    ("s=rand:3", "has dimension 3 at axis 0, expected 2"),
    ("s=", "expected NAME=VALUE"),
    ("=3", "expected NAME=VALUE"),
    ("q=1", "the model has no input 'q' (inputs: x, s)"),
    ("s=./no/such.npy", "file not found: no/such.npy"),
])
def test_a_bad_input_is_one_line(capsys, models, spec, fragment):
    assert fragment in one_line_error(capsys, "run", models["reshape"], "--input", spec)


def test_a_file_input_must_be_a_readable_npy(capsys, models, tmp_path):
    err = one_line_error(capsys, "run", models["reshape"], "--input", f"s={models['dir']}")
    assert "not a file" in err
    err = one_line_error(capsys, "run", models["reshape"], "--input", f"s={models['text_npy']}")
    assert "cannot read" in err and "as .npy" in err
    np.save(tmp_path / "s.npy", np.array([3.0, 2.0]))
    err = one_line_error(capsys, "run", models["reshape"], "--input", f"s={tmp_path / 's.npy'}")
    assert "has dtype double, expected int64" in err
    np.save(tmp_path / "s.npy", np.array([3, 2]))
    code, out, _ = run_cli(capsys, "run", models["reshape"], "--input", f"s={tmp_path / 's.npy'}")
    assert code == 0 and "output y: float32[3, 2]" in out


def test_an_input_given_twice_is_an_error(capsys, models):
    err = one_line_error(capsys, "run", models["scalar"], "--input", "sr=1", "--input", "sr=2")
    assert "input 'sr' is given twice" in err


@pytest.mark.parametrize("dims,fragment", [
    (["--dim", "C=3"], "the model's inputs have no symbolic dim 'C' (symbolic dims: N, H, W)"),
    (["--dim", "H"], "--dim 'H': expected NAME=SIZE"),
    (["--dim", "H=-1"], "expected NAME=SIZE"),
    (["--input", "x=rand:1x3x8x8", "--dim", "H=9"], "--dim H=9: --input x has H=8"),
])
def test_a_bad_dim_is_one_line(capsys, models, dims, fragment):
    assert fragment in one_line_error(capsys, "explain", models["sym"], *dims)


def test_guessed_dims_are_noted_with_how_to_set_them(capsys, models):
    code, out, err = run_cli(capsys, "run", models["sym"])
    assert code == 0 and "input  x: float32[1, 3, 224, 224]" in out
    assert err == ("note: symbolic dims guessed: N=1, H=224, W=224 (set them with "
                   "--input x=rand:1x3x224x224 or --dim H=224)\n")
    code, out, err = run_cli(capsys, "run", models["sym"], "--dim", "H=8", "--dim", "W=8")
    assert code == 0 and err.startswith("note: symbolic dims guessed: N=1 (")
    code, out, err = run_cli(capsys, "run", models["sym"], "--input", "x=rand:2x3x8x4")
    assert code == 0 and err == "" and "input  x: float32[2, 3, 8, 4]" in out


def test_guesses_follow_the_dim_names():
    inputs = declared_inputs(helper.make_model(helper.make_graph(
        [], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq_len"]),
                  helper.make_tensor_value_info("img", TensorProto.FLOAT,
                                                ["batch", 3, "height", "width"]),
                  helper.make_tensor_value_info("other", TensorProto.FLOAT, ["K", None])],
        [])))
    feeds = make_feeds(inputs, [], batch_size=4)
    assert feeds.dims == {"batch": 4, "seq_len": 128, "height": 224, "width": 224, "K": 4}
    assert feeds.guessed == {"seq_len": 128, "height": 224, "width": 224, "other[1]": 1}
    feeds = make_feeds(inputs, [parse_input_arg("other=rand:2x5")], {"height": 8, "width": 8})
    # Without a batch size (run, check, explain) the batch is guessed too.
    assert feeds.dims == {"K": 2, "height": 8, "width": 8, "batch": 1, "seq_len": 128}
    assert list(feeds.guessed) == ["batch", "seq_len"]


def test_a_builtin_models_own_sizes_are_not_guesses(capsys):
    code, out, err = run_cli(capsys, "run", "builtin:bert_tiny", "--dim", "seq=16")
    assert code == 0 and err == "" and "input  input_ids: int64[1, 16]" in out


def test_explain_plans_memory_at_the_given_shapes(capsys, models):
    code, out, err = run_cli(capsys, "explain", models["sym"], "--input", "x=rand:2x3x64x32")
    assert code == 0 and err == ""
    assert "inputs: x float32[2, 3, 64, 32]" in out
    assert "pass: plan_memory: " in out and " at N=2, H=64, W=32," in out
    code, out, err = run_cli(capsys, "explain", models["sym"], "--dim", "H=16")
    assert code == 0 and " at N=1, H=16, W=224," in out and "W=224" in err


def test_bench_runs_a_file_model_at_the_given_inputs(capsys, models, tmp_path):
    record = tmp_path / "bench.json"
    argv = ["bench", models["sym"], "--runs", "1", "--warmup", "0", "--peers", "none",
            "--modes", "bulk", "--no-progress", "--json", str(record)]
    code, out, _ = run_cli(capsys, *argv, "--input", "x=rand:2x3x16x8")
    assert code == 0 and "note:" not in out
    import json

    (model,) = json.loads(record.read_text())["models"]
    assert model["shapes"] == {"x": [2, 3, 16, 8]}
    assert model["variants"][0]["settings"]["memory_plan_dims"] == "N=2, H=16, W=8"
    code, out, _ = run_cli(capsys, *argv, "--batch-size", "3", "--dim", "H=4", "--dim", "W=4")
    assert code == 0 and "note:" not in out
    assert json.loads(record.read_text())["models"][0]["shapes"] == {"x": [3, 3, 4, 4]}
    code, out, _ = run_cli(capsys, *argv, "--dim", "H=4")
    assert code == 0 and "sym.onnx: note: symbolic dims guessed: W=224 (" in out
    assert "no input 'q'" in one_line_error(capsys, *argv, "--input", "q=1")


# -- check ----------------------------------------------------------------------------------
def test_check_prints_its_metric_inputs_and_worst_ratio(capsys, models):
    code, out, _ = run_cli(capsys, "check", models["sym"], "--dim", "H=8", "--dim", "W=8")
    assert code == 0
    assert "inputs: x float32[1, 3, 8, 8]" in out
    assert "metric: worst |segflow - ort| / (atol + rtol*|ort|)" in out and "<= 1 passes" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("  z: ")]
    assert "worst " in line and "max abs err " in line and line.endswith("  ok")
    code, out, _ = run_cli(capsys, "check", models["sym"], "--dim", "H=8", "--dim", "W=8",
                           "--atol", "0", "--rtol", "0")
    assert code == 1 and out.rstrip().endswith("FAIL")


def test_check_reports_an_onnxruntime_run_failure_in_one_line(capsys, models):
    err = one_line_error(capsys, "check", models["reshape"], "--input", "s=[7,7]")
    assert "onnxruntime cannot run" in err and "(x float32[2, 3], s int64[2])" in err
    assert "onnxruntime_src" not in err


def test_check_reports_an_onnxruntime_load_failure_in_one_line(capsys, models, monkeypatch):
    import onnxruntime

    def refuses(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : no\nmore")

    monkeypatch.setattr(onnxruntime, "InferenceSession", refuses)
    err = one_line_error(capsys, "check", models["scalar"])
    assert "onnxruntime cannot load" in err and "INVALID_GRAPH : no" in err


def test_check_reports_a_segflow_run_failure_in_one_line(capsys, models, monkeypatch):
    import segflow

    def fails(self, names, feeds):  # type: ignore[no-untyped-def]
        raise ExecutionError("While executing %y = Mul(%x, %sr): RuntimeError: no")

    monkeypatch.setattr(segflow.InferenceSession, "run", fails)
    err = one_line_error(capsys, "check", models["scalar"])
    assert "segflow cannot run" in err and "While executing %y = Mul" in err


def test_compare_outputs_metric_and_nonfinite_values():
    b = np.array([1.0, 100.0, 0.0])
    verdict = compare_outputs(b + 0.99e-4, b, atol=1e-4, rtol=0)
    assert verdict.ok and verdict.worst == pytest.approx(1, rel=1e-2)
    verdict = compare_outputs(b * 1.01, b, atol=0, rtol=1e-3)
    assert not verdict.ok and verdict.worst == pytest.approx(10, rel=1e-3)
    assert verdict.max_abs == pytest.approx(1.0, rel=1e-3)
    assert compare_outputs(b, b, atol=0, rtol=0).worst == 0
    nan = np.array([np.nan, np.inf, -np.inf, 1.0])
    verdict = compare_outputs(nan, nan.copy(), atol=1e-4, rtol=1e-3)
    assert verdict.ok and verdict.nonfinite == 3 and "3 NaN/Inf in the same places" in \
        verdict.describe()
    for other in ([1.0, np.inf, -np.inf, 1.0], [np.nan, -np.inf, -np.inf, 1.0],
                  [np.nan, np.inf, -np.inf, np.nan]):
        verdict = compare_outputs(nan, np.array(other), atol=1e-4, rtol=1e-3)
        assert not verdict.ok and "differ from onnxruntime's at 1 positions" in verdict.problem
    verdict = compare_outputs(np.zeros(3), np.zeros(4), atol=1, rtol=1)
    assert not verdict.ok and verdict.describe() == "shape [3] != onnxruntime [4]  FAIL"


def test_compare_values_over_sequences_and_optionals():
    a = [np.zeros(2), np.ones(3)]
    assert compare_values(a, [x.copy() for x in a], atol=0, rtol=0).ok
    assert compare_values(None, None, atol=0, rtol=0).ok
    verdict = compare_values([np.zeros(2), np.ones(3) * 1.01], a, atol=0, rtol=1e-3)
    assert not verdict.ok and verdict.worst == pytest.approx(10, rel=1e-3)
    verdict = compare_values([np.zeros(2), np.ones(4)], a, atol=1, rtol=1)
    assert not verdict.ok and "[1] shape [4] != onnxruntime [3]" in verdict.describe()
    for got, want, problem in ([a[:1], a, "a sequence of 1 != onnxruntime 2"],
                               [None, np.zeros(2), "an empty optional != onnxruntime a tensor"],
                               [np.zeros(2), a, "a tensor != onnxruntime a sequence of 2"]):
        verdict = compare_values(got, want, atol=1, rtol=1)
        assert not verdict.ok and verdict.problem == problem


def test_run_and_check_a_model_with_sequence_and_optional_outputs(tmp_path, capsys):
    held = helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph(
        [helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
         helper.make_node("Optional", ["x"], ["o"])], "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None),
         helper.make_value_info("o", helper.make_optional_type_proto(held))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    path = tmp_path / "seq.onnx"
    onnx.save(model, path)
    code, out, _ = run_cli(capsys, "run", str(path))
    assert code == 0
    assert "output s: sequence of 2\n    [0] float32[1, 3] checksum=" in out
    assert "output o: float32[2, 3] checksum=" in out
    code, out, _ = run_cli(capsys, "check", str(path))
    assert code == 0 and "  s: worst 0  max abs err 0  ok" in out


def test_sequence_inputs_are_refused_in_one_line(tmp_path, capsys):
    graph = helper.make_graph(
        [helper.make_node("SequenceLength", ["s"], ["n"])], "seq_in",
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "seq_in.onnx"
    onnx.save(model, path)
    for command in ("run", "check"):
        err = one_line_error(capsys, command, str(path))
        assert "input 's' is seq(float[2]): the command line makes tensor inputs only" in err


# -- run's output ---------------------------------------------------------------------------
def test_run_prints_a_few_lines_and_the_kernel_report_under_verbose(capsys):
    code, out, _ = run_cli(capsys, "run", "builtin:bert_tiny")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 1 + 2 + 2 + 2, out      # model, inputs, outputs, 2
    assert lines[-2].startswith("run: ") and lines[-1].startswith("compile: ")
    code, out, _ = run_cli(capsys, "run", "builtin:bert_tiny", "--verbose")
    assert code == 0 and out.startswith("\n".join(lines[:5]))
    assert "attention: " in out
    # A fused node's report line names it, not its whole IR (every input): short.
    assert all(len(line) < 300 for line in out.splitlines()), out
    assert "= DenseChain(" not in out


# -- train-demo -----------------------------------------------------------------------------
@pytest.mark.parametrize("text,fraction", [
    ("95", 0.95), ("95%", 0.95), ("0.95", 0.95), ("99.9", 0.999), ("1", 1.0), ("1%", 0.01),
    ("0.5%", 0.005), ("100%", 1.0), ("0", 0.0),
])
def test_min_accuracy_takes_a_percent_or_a_fraction(text, fraction):
    assert min_accuracy(text) == pytest.approx(fraction)


def test_train_demo_says_why_it_failed_min_accuracy(capsys):
    pytest.importorskip("sklearn")
    code, out, _ = run_cli(capsys, "train-demo", "--epochs", "1", "--quiet",
                           "--min-accuracy", "99.9")
    assert code == 1
    last = out.splitlines()[-1]
    assert last.startswith("test accuracy ") and last.endswith(" is below --min-accuracy 99.9%")


# -- help -----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "check", "explain", "bench", "profile"])
def test_help_documents_inputs_and_dims(capsys, command):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    assert "rand:1x3x224x224" in out and "16000" in out and "[1,2,3]" in out
    assert "--dim NAME=SIZE" in out and "--dim N=4 --dim H=224" in out


def test_top_level_help_names_traceback(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--traceback" in capsys.readouterr().out


def test_python_m_segflow_prints_one_line_not_a_traceback(models):
    result = subprocess.run([sys.executable, "-m", "segflow", models["sym"], "--device", "gpu"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == ("segflow: error: --device: unknown device 'gpu'; expected "
                             "'cpu', 'cpu:N' or 'cuda:N'\n")


def test_segflow_warnings_are_one_line(capsys, models, monkeypatch):
    import warnings

    from segflow.errors import NativeKernelsUnavailable

    def warn_then_run(args):  # type: ignore[no-untyped-def]
        warnings.warn("native kernels could not be built:\n  cc said no", NativeKernelsUnavailable,
                      stacklevel=1)
        return 0

    monkeypatch.setattr(cli, "_cmd_explain", warn_then_run)
    code, _, err = run_cli(capsys, "explain", models["sym"])
    assert code == 0
    assert err == "segflow: warning: native kernels could not be built: cc said no\n"


def test_version_verbose_is_the_doctor(capsys):
    code, out, _ = run_cli(capsys, "--version", "--verbose")
    assert code == 0
    assert out.startswith("segflow ") and "torch " in out and "native kernels" in out
