"""TrainingSession: optimizers vs torch.optim, grad_req, segmentation policy and its
environment variables, run counters, engines, prediction, a real training run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import segflow
from segflow import models
from segflow.errors import InvalidInput, InvalidModel
from segflow.frontend.builder import GraphBuilder
from segflow.ir import DType
from segflow.optim import SGD, Adam, Optimizer
from segflow.passes.segment import Boundary

WIDTHS = (4, 8, 8, 3)


def mlp_weights(seed: int = 0, dtype: type = np.float64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, (fin, fout) in enumerate(zip(WIDTHS, WIDTHS[1:]), start=1):
        out[f"fc{i}.weight"] = (rng.standard_normal((fout, fin)) / np.sqrt(fin)).astype(dtype)
        out[f"fc{i}.bias"] = (rng.standard_normal(fout) * 0.1).astype(dtype)
    return out


def mlp_model(dtype: DType = DType.FLOAT64, side_nonzero: bool = False):  # type: ignore[no-untyped-def]
    """x -> (Gemm -> Relu) x2 -> Gemm -> logits: 5 forward nodes (+ the loss)."""
    weights = mlp_weights(dtype=dtype.numpy.type)
    b = GraphBuilder("mlp")
    h = b.input("x", dtype, ["N", WIDTHS[0]])
    layers = len(WIDTHS) - 1
    for i in range(1, layers + 1):
        h = b.op("Gemm", h, b.param(f"fc{i}.weight", weights[f"fc{i}.weight"]),
                 b.param(f"fc{i}.bias", weights[f"fc{i}.bias"]), transB=1, name=f"fc{i}")
        if i < layers:
            h = b.op("Relu", h, name=f"relu{i}")
            if side_nonzero and i == 1:
                b.output(b.op("NonZero", h, name="nonzero"), "active")
    b.output(h, "logits")
    return b.to_model()


def torch_mlp() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i, (fin, fout) in enumerate(zip(WIDTHS, WIDTHS[1:]), start=1):
        layers.append(torch.nn.Linear(fin, fout).double())
        if i < len(WIDTHS) - 1:
            layers.append(torch.nn.ReLU())
    module = torch.nn.Sequential(*layers)
    weights = mlp_weights()
    with torch.no_grad():
        for i, index in enumerate(range(0, len(layers), 2), start=1):
            layers[index].weight.copy_(torch.tensor(weights[f"fc{i}.weight"]))  # type: ignore
            layers[index].bias.copy_(torch.tensor(weights[f"fc{i}.bias"]))  # type: ignore
    return module


def batches(count: int, size: int = 6, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, WIDTHS[0])), rng.integers(0, WIDTHS[-1], size))
            for _ in range(count)]


def session(**kwargs: object) -> segflow.TrainingSession:
    model = kwargs.pop("model", None) or mlp_model()
    return segflow.TrainingSession(model, loss=segflow.CrossEntropyLoss(labels="y"),
                                   **kwargs)  # type: ignore[arg-type]


# -- optimizers ---------------------------------------------------------------------------
OPTIMIZERS = [
    (SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
    (SGD(lr=0.05, momentum=0.8, nesterov=True),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True)),
    (SGD(lr=0.05, momentum=0.5, dampening=0.3),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.3)),
    (Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    (Adam(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
     lambda p: torch.optim.Adam(p, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
]


@pytest.mark.parametrize(("optimizer", "reference"), OPTIMIZERS,
                         ids=[f"{o.name}-{i}" for i, (o, _) in enumerate(OPTIMIZERS)])
@pytest.mark.parametrize("engine", ["inline", "threaded"])
def test_optimizer_matches_torch_optim(optimizer: Optimizer, reference, engine: str) -> None:  # type: ignore[no-untyped-def]
    sess = session(optimizer=optimizer, engine=engine)
    module = torch_mlp()
    opt = reference(module.parameters())
    names = [f"fc{i}.{kind}" for i in range(1, len(WIDTHS)) for kind in ("weight", "bias")]
    for x, y in batches(4):
        result = sess.step({"x": x, "y": y})
        opt.zero_grad()
        loss = F.cross_entropy(module(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        opt.step()
        assert result.loss == pytest.approx(loss.item(), rel=1e-12)
    params = sess.parameters()
    for name, tensor in zip(names, module.parameters()):
        torch.testing.assert_close(params[name], tensor.detach(), rtol=1e-10, atol=1e-12)


def test_grad_req_add_accumulates_until_zero_grad() -> None:
    data = batches(2)
    sess = session(grad_req="add", engine="threaded")
    ref = session(engine="inline")
    expected = {}
    for x, y in data:
        ref.step({"x": x, "y": y})
        for name, grad in ref.gradients().items():
            expected[name] = expected.get(name, 0) + grad.clone()
        sess.step({"x": x, "y": y}, update=False)
    for name, grad in sess.gradients().items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-12, atol=1e-14)
    sess.zero_grad()
    assert sess.gradients() == {}
    sess.step({"x": data[0][0], "y": data[0][1]}, update=False)
    ref.step({"x": data[0][0], "y": data[0][1]})
    torch.testing.assert_close(sess.grad("fc1.weight"), ref.grad("fc1.weight"))


def test_grad_req_null_freezes_a_parameter() -> None:
    sess = session(optimizer=SGD(lr=0.5), grad_req={"fc1.weight": "null", "fc1.bias": "null"},
                   engine="inline")
    before = sess.state_dict()
    x, y = batches(1)[0]
    sess.step({"x": x, "y": y})
    after = sess.state_dict()
    assert set(sess.gradients()) == {"fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"}
    np.testing.assert_array_equal(after["fc1.weight"], before["fc1.weight"])
    assert not np.array_equal(after["fc2.weight"], before["fc2.weight"])
    with pytest.raises(ValueError, match="grad_req"):
        session(grad_req="sometimes")


# -- segmentation policy ------------------------------------------------------------------
def reasons(sess: segflow.TrainingSession) -> list[tuple[str, int, str]]:
    return [(s.phase.value, len(s.nodes), s.reason) for s in sess.plan.segments]


def test_training_segments_end_after_gradient_outputs() -> None:
    sess = session(engine="inline")
    grad = Boundary.GRADIENT
    # forward: fc1 relu1 fc2 relu2 fc3 loss; backward: per layer (activation grad,) GemmGrad.
    assert reasons(sess) == [("forward", 6, Boundary.PHASE), ("backward", 2, grad),
                             ("backward", 2, grad), ("backward", 2, grad)]
    x, y = batches(1)[0]
    stats = sess.step({"x": x, "y": y}).stats
    assert (stats.segments, stats.forward_segments, stats.backward_segments) == (4, 1, 3)
    assert (stats.updates, stats.pushes, stats.syncs, stats.kernels) == (3, 7, 1, 12)


def test_training_segments_obey_max_nodes() -> None:
    sess = session(max_nodes_fwd=4, max_nodes_bwd=1, engine="inline")
    m, g = Boundary.MAX_NODES, Boundary.GRADIENT
    assert reasons(sess) == [("forward", 4, m), ("forward", 2, Boundary.PHASE),
                             ("backward", 1, m), ("backward", 1, g), ("backward", 1, m),
                             ("backward", 1, g), ("backward", 1, m), ("backward", 1, g)]
    unbulked = session(bulk=False)
    assert [r[1:] for r in reasons(unbulked)] == [(1, Boundary.DISABLED)] * 12


def test_training_segments_split_at_non_sync_ops() -> None:
    sess = segflow.TrainingSession(mlp_model(side_nonzero=True), engine="threaded",
                                   loss=segflow.CrossEntropyLoss(labels="y", logits="logits"))
    nonzero = next(n for n in sess.graph.nodes if n.op_type == "NonZero")
    local = Boundary.non_sync(nonzero, segflow.engine.ExecType.LOCAL)
    assert reasons(sess)[:3] == [("forward", 2, local), ("forward", 1, local),
                                 ("forward", 4, Boundary.PHASE)]
    x, y = batches(1)[0]
    result = sess.step({"x": x, "y": y})
    assert result.stats.syncs == 2  # the LOCAL op waits for its input, then the outputs
    assert result.outputs["active"].shape[0] == 2


@pytest.mark.parametrize(("env", "expected"), [
    ({"SEGFLOW_BULK_MAX_NODES_FWD": "2"}, (3, 3)),
    ({"SEGFLOW_BULK_MAX_NODES_BWD": "1"}, (1, 6)),
    ({"SEGFLOW_BULK_TRAIN": "0"}, (6, 6)),
    ({"SEGFLOW_BULK_TRAIN": "1", "SEGFLOW_BULK_MAX_NODES_FWD": "5",
      "SEGFLOW_BULK_MAX_NODES_BWD": "3"}, (2, 3)),
])
def test_environment_variables_are_obeyed(monkeypatch: pytest.MonkeyPatch,
                                          env: dict[str, str], expected: tuple[int, int]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sess = session(engine="inline")
    x, y = batches(1)[0]
    stats = sess.step({"x": x, "y": y}).stats
    assert (stats.forward_segments, stats.backward_segments) == expected
    settings = {"SEGFLOW_BULK_TRAIN": "train", "SEGFLOW_BULK_MAX_NODES_FWD": "max_nodes_fwd",
                "SEGFLOW_BULK_MAX_NODES_BWD": "max_nodes_bwd"}
    for name, value in env.items():
        assert int(stats.settings[settings[name]]) == int(value)


def test_api_settings_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEGFLOW_BULK_MAX_NODES_FWD", "1")
    sess = session(max_nodes_fwd=3, engine="inline")
    assert [r[1] for r in reasons(sess) if r[0] == "forward"] == [3, 3]


def test_explain_lists_both_phases_with_reasons() -> None:
    text = session(optimizer=SGD(lr=0.1)).explain()
    assert "forward/backward split" in text and "gradient output" in text
    assert "1 forward segments, 3 backward segments" in text
    assert "updates: 3 tasks" in text and "SGD lr=0.1" in text


# -- models, engines, prediction ----------------------------------------------------------
def test_threaded_and_inline_engines_train_identically() -> None:
    data = batches(3)
    states = []
    for engine in ("inline", "threaded"):
        sess = session(optimizer=SGD(lr=0.1, momentum=0.9), engine=engine)
        for x, y in data:
            sess.step({"x": x, "y": y})
        states.append(sess.state_dict())
    for name in states[0]:
        np.testing.assert_array_equal(states[0][name], states[1][name])


def test_onnx_resnet_trains_and_predicts_with_running_statistics() -> None:
    options = {"num_classes": 4, "image_size": 32}
    model = models.build("resnet18", **options)
    data = models.example_inputs("resnet18", batch_size=4, **options)["input"]
    labels = np.array([0, 1, 2, 3])
    sess = segflow.TrainingSession(model, loss=segflow.CrossEntropyLoss(labels="labels"),
                                   optimizer=SGD(lr=0.05, momentum=0.9))
    assert len(sess.param_names) == 62 and len(sess.buffer_names) == 40
    losses = [sess.step({"input": data, "labels": labels}).loss for _ in range(4)]
    assert losses[-1] < losses[0]
    stats = sess.last_run_stats
    assert stats is not None and stats.backward_segments >= 41  # one per gradient producer
    # predict = an InferenceSession on the same weights (BatchNorm in inference mode).
    state = sess.state_dict()
    module = models.torch_module("resnet18", **options)
    module.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    logits, = sess.predict({"input": data})
    with torch.no_grad():
        expected = module(input=torch.tensor(data)).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_bad_feeds_and_models_fail_clearly() -> None:
    sess = session()
    x, y = batches(1)[0]
    with pytest.raises(InvalidInput, match="missing input 'y'"):
        sess.step({"x": x})
    with pytest.raises(InvalidInput, match="dtype"):
        sess.step({"x": x.astype(np.float32), "y": y})
    with pytest.raises(InvalidModel, match="no value named"):
        segflow.TrainingSession(mlp_model(), loss="nope")
    with pytest.raises(InvalidModel, match="not an initializer"):
        session(params=["x"])


def test_state_dict_roundtrip_and_learning_rate() -> None:
    sess = session(optimizer=SGD(lr=0.1))
    state = sess.state_dict()
    x, y = batches(1)[0]
    sess.step({"x": x, "y": y})
    sess.load_state_dict(state)
    np.testing.assert_array_equal(sess.state_dict()["fc1.weight"], state["fc1.weight"])
    sess.set_learning_rate(0.0)
    sess.step({"x": x, "y": y})
    np.testing.assert_array_equal(sess.state_dict()["fc1.weight"], state["fc1.weight"])


def test_builder_graph_trains_directly() -> None:
    """A Graph (not a ModelProto) from the builder; the caller's graph is not modified."""
    b = GraphBuilder()
    x = b.input("x", DType.FLOAT64, ["N", 3])
    w = b.param("w", np.zeros((3, 1)))
    b.output(b.op("ReduceMean", b.op("Mul", b.op("MatMul", x, w), b.const(np.array(-1.0))),
                  keepdims=0), "loss")
    graph = b.to_graph()
    sess = segflow.TrainingSession(graph, loss="loss", optimizer=SGD(lr=1.0))
    sess.step({"x": np.ones((2, 3))})
    np.testing.assert_allclose(sess.parameters()["w"].numpy(), np.ones((3, 1)))
    assert graph.initializers["w"].const is not None
    assert float(graph.initializers["w"].const.abs().sum()) == 0.0


def test_digits_cnn_reaches_95_percent() -> None:
    pytest.importorskip("sklearn")
    from segflow.training_demo import train

    # Time is reported by `segflow train-demo`, never asserted (DESIGN.md: no timed tests).
    result = train(epochs=5, progress=False)
    assert result.test_accuracy >= 0.95, [r.test_accuracy for r in result.epochs]
    assert result.epochs[-1].loss < result.epochs[0].loss
