"""Tests for segflow.models: ONNX validity, determinism, and torch twins vs onnxruntime."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from segflow import models

ATOL, RTOL = 1e-4, 1e-3

# Reduced sizes where the point is correctness, not scale.
SMALL: Mapping[str, dict[str, int]] = {
    "resnet18": {"num_classes": 10, "image_size": 64},
    "resnet50": {"num_classes": 10, "image_size": 32},
    "mobilenet_v2": {"num_classes": 10, "image_size": 64},
    "bert_tiny": {"seq_len": 16},
    "mlp_chain": {},
    "nonzero_mid": {},
}

# The ops each family may use (what torch.onnx emits for the same architecture).
ALLOWED_OPS = {
    "resnet": {
        "Conv",
        "BatchNormalization",
        "Relu",
        "MaxPool",
        "Add",
        "GlobalAveragePool",
        "Flatten",
        "Gemm",
    },
    "mobilenet": {
        "Conv",
        "BatchNormalization",
        "Clip",
        "Add",
        "GlobalAveragePool",
        "Flatten",
        "Gemm",
    },
    "bert": {
        "Gather",
        "Shape",
        "Range",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Cast",
        "Unsqueeze",
        "LayerNormalization",
        "MatMul",
        "Reshape",
        "Transpose",
        "Softmax",
        "Erf",
        "Gemm",
        "Tanh",
    },
    "mlp": {"Gemm", "Relu"},
}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run_torch(name: str, feeds: Mapping[str, np.ndarray], **options: int) -> list[np.ndarray]:
    module = models.torch_module(name, **options)
    assert not module.training
    with torch.no_grad():
        out = module(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return [t.numpy() for t in outs]


def _expected_shapes(name: str, batch: int, options: Mapping[str, int]) -> list[tuple[int, ...]]:
    opts = {**models.info(name).default_options, **options}
    if name.startswith(("resnet", "mobilenet")):
        return [(batch, opts["num_classes"])]
    if name.startswith("bert"):
        return [(batch, opts["seq_len"], opts["hidden"]), (batch, opts["hidden"])]
    if name == "mlp_chain":
        return [(batch, opts["width"])]
    return [(batch, 8)]


def _check_against_ort(name: str, batch: int, **options: int) -> None:
    """Build, check, run in onnxruntime and in torch; compare shapes and values."""
    model = models.build(name, **options)
    onnx.checker.check_model(model)
    feeds = models.example_inputs(name, batch_size=batch, **options)
    assert list(feeds) == list(models.info(name).inputs)
    ort_outs = _session(model).run(None, feeds)
    assert [o.shape for o in ort_outs] == _expected_shapes(name, batch, options)
    for out in ort_outs:
        assert np.isfinite(out).all()
        assert out.std() > 1e-3, "output is (nearly) constant"
    for torch_out, ort_out in zip(_run_torch(name, feeds, **options), ort_outs, strict=True):
        np.testing.assert_allclose(torch_out, ort_out, atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module", params=list(SMALL))
def small(request: pytest.FixtureRequest) -> tuple[str, dict[str, int], onnx.ModelProto]:
    name = request.param
    return name, SMALL[name], models.build(name, **SMALL[name])


def test_available_names() -> None:
    assert models.available() == [
        "resnet50",
        "resnet18",
        "mobilenet_v2",
        "bert_base",
        "bert_tiny",
        "mlp_chain",
        "nonzero_mid",
    ]


def test_unknown_name_lists_available() -> None:
    for call in (models.build, models.torch_module, models.example_inputs, models.info):
        with pytest.raises(ValueError, match="available: resnet50, resnet18, .*nonzero_mid"):
            call("resnet99")


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="no option depth; accepts: num_classes, image_size"):
        models.build("resnet18", depth=34)
    with pytest.raises(ValueError, match="positive int"):
        models.build("mlp_chain", width=0)
    with pytest.raises(ValueError, match="seq_len must be in"):
        models.example_inputs("bert_tiny", seq_len=129)
    with pytest.raises(ValueError, match="batch_size"):
        models.example_inputs("mlp_chain", batch_size=0)


def test_info_is_frozen_and_matches_graph(small: tuple) -> None:
    name, _, model = small
    info = models.info(name)
    assert info.name == name and info.summary
    assert tuple(i.name for i in model.graph.input) == info.inputs
    assert tuple(o.name for o in model.graph.output) == info.outputs
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        info.default_options["x"] = 1  # type: ignore[index]


def test_model_structure(small: tuple) -> None:
    name, _, model = small
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert all(
        i.data_type == onnx.TensorProto.FLOAT or i.name.startswith(("int.", "shape."))
        for i in model.graph.initializer
    )
    for value in list(model.graph.input) + list(model.graph.output):
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch"
    family = next((f for f in ALLOWED_OPS if name.startswith(f)), None)
    if family is not None:
        assert {n.op_type for n in model.graph.node} <= ALLOWED_OPS[family]


def test_deterministic_per_seed(small: tuple) -> None:
    name, options, model = small
    assert models.build(name, seed=0, **options).SerializeToString() == model.SerializeToString()
    other = {i.name: i for i in models.build(name, seed=1, **options).graph.initializer}
    weights = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert any(other[w.name].raw_data != w.raw_data for w in weights)
    feeds_a = models.example_inputs(name, batch_size=2, seed=3, **options)
    feeds_b = models.example_inputs(name, batch_size=2, seed=3, **options)
    assert all(np.array_equal(feeds_a[k], feeds_b[k]) for k in feeds_a)


def test_small_models_match_torch(small: tuple) -> None:
    name, options, _ = small
    _check_against_ort(name, batch=2, **options)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2", "bert_base"])
def test_full_size_models_match_torch(name: str) -> None:
    _check_against_ort(name, batch=1)


def test_bert_sequence_dim_is_symbolic() -> None:
    sess = _session(models.build("bert_tiny"))
    for seq_len in (1, 7, 128):
        feeds = models.example_inputs("bert_tiny", batch_size=3, seq_len=seq_len)
        ort_outs = sess.run(None, feeds)
        assert ort_outs[0].shape == (3, seq_len, 128)
        torch_outs = _run_torch("bert_tiny", feeds)
        for torch_out, ort_out in zip(torch_outs, ort_outs, strict=True):
            np.testing.assert_allclose(torch_out, ort_out, atol=ATOL, rtol=RTOL)


def test_bert_padding_is_masked() -> None:
    """Changing tokens under a zero mask must not change the unpadded positions."""
    feeds = models.example_inputs("bert_tiny", batch_size=4, seq_len=32)
    row = int(np.argmin(feeds["attention_mask"].sum(axis=1)))
    length = int(feeds["attention_mask"][row].sum())
    assert length < 32
    changed = {k: v.copy() for k, v in feeds.items()}
    changed["input_ids"][row, length:] = (changed["input_ids"][row, length:] + 1) % 1000
    sess = _session(models.build("bert_tiny"))
    base, other = sess.run(None, feeds)[0], sess.run(None, changed)[0]
    np.testing.assert_allclose(base[row, :length], other[row, :length], atol=1e-6)
    assert not np.allclose(base[row, length:], other[row, length:])


def test_options_change_the_graph() -> None:
    model = models.build("mlp_chain", layers=3, width=8)
    assert [n.op_type for n in model.graph.node] == ["Gemm", "Relu"] * 3
    _check_against_ort("mlp_chain", batch=5, layers=3, width=8)
    _check_against_ort("bert_tiny", batch=2, layers=1, hidden=64, heads=4, seq_len=8)


def test_nonzero_sits_between_compute_nodes() -> None:
    graph = models.build("nonzero_mid").graph
    ops = [n.op_type for n in graph.node]
    position = ops.index("NonZero")
    assert ops.count("NonZero") == 1
    assert {"Gemm", "Relu"} <= set(ops[:position])
    # follow data dependencies forward from NonZero
    tainted = set(graph.node[position].output)
    dependants = []
    for node in graph.node[position + 1 :]:
        if tainted & set(node.input):
            tainted.update(node.output)
            dependants.append(node.op_type)
    assert {"Gather", "ReduceSum", "Add", "Gemm"} <= set(dependants)
    assert graph.output[0].name in tainted
