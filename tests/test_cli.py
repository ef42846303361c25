"""The segflow command line, run in-process through cli.main."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from segflow import cli, models
from segflow.kernels.onednn.library import Library
from segflow.kernels.target import CpuTarget


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_with_no_model_runs_builtin_resnet50(capsys):
    code, out, _ = run_cli(capsys, "--verbose")
    assert code == 0
    assert "builtin:resnet50" in out
    assert "output logits: float32[1, 1000] checksum=" in out
    assert "segments=1 pushes=1 syncs=1" in out
    if Library.load() is not None:   # what the kernels did: libdnnl, fallbacks, the arena
        # The classifier goes through segflow's native linear, else libdnnl's inner
        # product, on CPUs that prefer them.
        target = CpuTarget.detect()
        native = target.native_linear_preferred()
        linear = ", 1 linear" if target.direct_linear_preferred() and not native else ""
        assert f"direct kernels (libdnnl): 53 convolutions, 2 poolings{linear}; " in out
        assert ("native linears: 1 node (" in out) == native
        assert "arena: 40 views in 5.0 MiB at batch=1" in out


def test_run_list(capsys):
    code, out, _ = run_cli(capsys, "run", "--list")
    assert code == 0
    for name in models.available():
        assert name in out


def test_run_with_inputs(tmp_path, capsys):
    path = tmp_path / "mlp.onnx"
    onnx.save(models.build("mlp_chain", layers=2), path)
    x = np.ones((3, 64), np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out, _ = run_cli(capsys, "run", str(path), "--input", f"x={tmp_path / 'x.npy'}")
    assert code == 0 and "output y: float32[3, 64]" in out
    code, out, _ = run_cli(capsys, "run", str(path), "--input", "x=rand:5x64")
    assert code == 0 and "float32[5, 64]" in out


def test_run_same_seed_same_checksum(capsys):
    _, first, _ = run_cli(capsys, "run", "builtin:mlp_chain", "--seed", "3")
    _, second, _ = run_cli(capsys, "run", "builtin:mlp_chain", "--seed", "3")
    line = [ln for ln in first.splitlines() if "checksum" in ln]
    assert line and line == [ln for ln in second.splitlines() if "checksum" in ln]


def test_builtin_models_run_on_their_own_example_inputs(capsys):
    # Not random data with every symbolic dimension 1: BERT runs at its sequence length.
    seq = models.example_inputs("bert_tiny")["input_ids"].shape[1]
    assert seq > 1
    code, out, _ = run_cli(capsys, "run", "builtin:bert_tiny")
    assert code == 0 and f"input  input_ids: int64[1, {seq}]" in out
    code, out, _ = run_cli(capsys, "profile", "builtin:bert_tiny", "--runs", "1")
    assert code == 0 and f"inputs: input_ids int64[1, {seq}], attention_mask" in out
    _, other, _ = run_cli(capsys, "run", "builtin:mlp_chain", "--seed", "4")
    _, same, _ = run_cli(capsys, "run", "builtin:mlp_chain", "--seed", "3")
    checksums = [[ln for ln in text.splitlines() if "checksum" in ln] for text in (other, same)]
    assert checksums[0] != checksums[1]  # the seed still picks the example inputs


def test_check_passes_within_tolerance(capsys):
    code, out, _ = run_cli(capsys, "check", "builtin:bert_tiny")
    assert code == 0
    assert "last_hidden_state: worst " in out and "max abs err" in out and "FAIL" not in out


def test_check_fails_over_tolerance(capsys):
    code, out, _ = run_cli(capsys, "check", "builtin:resnet18", "--atol", "0", "--rtol", "0")
    assert code == 1 and "FAIL" in out


def test_explain_names_the_local_op(capsys):
    code, out, _ = run_cli(capsys, "explain", "builtin:nonzero_mid")
    assert code == 0
    assert "non-sync op NonZero" in out
    assert "3 tasks" in out


def test_explain_bulk_off(capsys, monkeypatch):
    monkeypatch.setenv("SEGFLOW_NO_DENSE_CHAIN", "1")  # keep the 200 layers separate nodes
    code, out, _ = run_cli(capsys, "explain", "builtin:mlp_chain", "--bulk", "off")
    assert code == 0 and "bulking disabled" in out and "200 tasks" in out


def test_compile_and_threads_reach_the_session(capsys):
    import torch

    before = torch.get_num_threads()
    try:
        code, out, _ = run_cli(capsys, "run", "builtin:mlp_chain", "--compile", "none",
                               "--threads", "1")
        assert code == 0 and "compile: backend=none" in out
        assert torch.get_num_threads() == 1
        code, out, _ = run_cli(capsys, "explain", "builtin:mlp_chain", "--compile", "codegen")
        assert code == 0 and "compile: codegen (requested)" in out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("argv", [["run", "builtin:mlp_chain", "--threads", "0"],
                                  ["run", "builtin:mlp_chain", "--compile", "tvm"]])
def test_bad_compile_or_threads_flag_is_a_usage_error(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and ("--threads" in err or "--compile" in err)
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,fragment", [
    (["run", "/no/such/model.onnx"], "model file not found: /no/such/model.onnx"),
    (["run", "builtin:nosuch"], "unknown built-in model 'nosuch'"),
    (["run", "builtin:mlp_chain", "--input", "z=rand:1x64"], "no input 'z'"),
    (["run", "builtin:mlp_chain", "--input", "x=rand:1x63"], "expected 64"),
    (["run", "builtin:mlp_chain", "--input", "x=/no/file.npy"], "file not found"),
    (["run", "builtin:mlp_chain", "--input", "x"], "expected NAME=VALUE"),
])
def test_bad_input_is_one_line_error(capsys, argv, fragment):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("segflow: error:") and fragment in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_help_for_every_command(capsys):
    for command in ("run", "check", "explain"):
        with pytest.raises(SystemExit) as info:
            cli.main([command, "--help"])
        assert info.value.code == 0
        assert "usage: segflow" in capsys.readouterr().out


def test_help_needs_neither_torch_nor_onnx() -> None:
    """``segflow --help`` and each command's help build the parser without importing
    torch or onnx (~3 s on the 2-core CI VM); ``import segflow`` loads them on first
    use of a name that needs them."""
    probe = ("import sys\n"
             "import segflow\n"
             "from segflow.cli import _build_parser\n"
             "parser = _build_parser()\n"
             "parser.format_help()\n"
             "for command in ('run', 'bench', 'profile', 'cache'):\n"
             "    parser.parse_known_args([command, '--counters-only'] if command == 'bench'"
             " else [command])\n"
             "print(sorted({'torch', 'onnx'} & set(sys.modules)))\n"
             "print(segflow.InferenceSession.__module__, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["[]", "segflow.runtime.session True"]


def test_train_demo_passes_flags_through(capsys):
    pytest.importorskip("sklearn")
    code, out, _ = run_cli(capsys, "train-demo", "--epochs", "1", "--quiet",
                           "--min-accuracy", "0.5")
    assert code == 0 and "after 1 epochs" in out


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--bogus"])
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--bogus"], ["--device", "cpu", "--bogus"]])
def test_unknown_flag_without_a_command_is_rejected_not_run(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "unrecognized arguments: --bogus" in err and "checksum" not in out


def test_version(capsys):
    import segflow

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"segflow {segflow.__version__}"


def test_a_model_path_alone_means_run(tmp_path, capsys):
    path = tmp_path / "mlp.onnx"
    onnx.save(models.build("mlp_chain", layers=2, width=8), str(path))
    code, out, _ = run_cli(capsys, str(path))
    assert code == 0 and f"model: {path}" in out and "checksum=" in out


def test_cache_shows_and_clears_packages(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SEGFLOW_CACHE_DIR", str(tmp_path))
    assert cli.main(["cache"]) == 0
    assert "0 packages, 0.0 MiB" in capsys.readouterr().out
    packages = tmp_path / "aoti"
    packages.mkdir()
    (packages / "a.pt2").write_bytes(b"x" * (1 << 20))
    (packages / "b.pt2").write_bytes(b"x" * (1 << 19))
    (packages / "notes.txt").write_text("not a package")
    assert cli.main(["cache", "--list"]) == 0
    out = capsys.readouterr().out
    assert "2 packages, 1.5 MiB" in out and "a.pt2" in out and "notes.txt" not in out
    assert "native kernels: " in out and ": 0 builds, 0.0 MiB" in out
    native = tmp_path / "native"
    native.mkdir()
    (native / "dense_chain-0123.so").write_bytes(b"x" * (1 << 19))
    assert cli.main(["cache", "--clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 packages (1.5 MiB)" in out
    assert "removed 1 native kernel builds (0.5 MiB)" in out
    assert sorted(p.name for p in packages.iterdir()) == ["notes.txt"]
    assert list(native.iterdir()) == []
