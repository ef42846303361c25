"""RNN / GRU / LSTM against onnxruntime over their attributes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper
from ort_compare import assert_matches_ort, make_model, run_both

import segflow

SEQ, BATCH, INPUT, HIDDEN = 4, 3, 5, 6
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _case(op: str, *, direction: str = "forward", layout: int = 0, seq_lens: bool = False,
          initial: bool = False, peepholes: bool = False, seed: int = 0,
          **attrs: Any) -> tuple[Any, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    g = GATES[op]

    def rand(*shape: int) -> np.ndarray:
        return rng.uniform(-0.5, 0.5, shape).astype(np.float32)

    x_shape = (BATCH, SEQ, INPUT) if layout else (SEQ, BATCH, INPUT)
    state_shape = (BATCH, dirs, HIDDEN) if layout else (dirs, BATCH, HIDDEN)
    feeds = {"X": rand(*x_shape), "W": rand(dirs, g * HIDDEN, INPUT),
             "R": rand(dirs, g * HIDDEN, HIDDEN), "B": rand(dirs, 2 * g * HIDDEN)}
    names = ["X", "W", "R", "B", "", ""]
    if seq_lens:
        feeds["L"] = np.array([SEQ, 1, SEQ - 1][:BATCH], np.int32)
        names[4] = "L"
    if initial:
        feeds["H0"] = rand(*state_shape)
        names[5] = "H0"
    if op == "LSTM":
        names += ["", ""]
        if initial:
            feeds["C0"] = rand(*state_shape)
            names[6] = "C0"
        if peepholes:
            feeds["P"] = rand(dirs, 3 * HIDDEN)
            names[7] = "P"
    while names and names[-1] == "":
        names.pop()
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outputs, hidden_size=HIDDEN, direction=direction,
                            layout=layout, **attrs)
    return make_model([node], feeds, outputs, 14), feeds


CASES = [
    ("RNN", {}),
    ("RNN", {"direction": "bidirectional", "seq_lens": True, "initial": True}),
    ("RNN", {"direction": "reverse", "activations": ["Relu"], "clip": 0.7}),
    ("RNN", {"activations": ["LeakyRelu"], "activation_alpha": [0.2], "layout": 1}),
    ("GRU", {}),
    ("GRU", {"linear_before_reset": 1, "initial": True}),
    ("GRU", {"direction": "reverse", "seq_lens": True}),
    ("GRU", {"direction": "bidirectional", "layout": 1, "initial": True, "seq_lens": True}),
    ("GRU", {"activations": ["HardSigmoid", "ScaledTanh"], "activation_alpha": [0.3, 0.9],
             "activation_beta": [0.4, 1.1]}),
    ("LSTM", {}),
    ("LSTM", {"peepholes": True, "initial": True}),
    ("LSTM", {"direction": "bidirectional", "seq_lens": True, "peepholes": True,
              "initial": True}),
    ("LSTM", {"direction": "reverse", "layout": 1, "clip": 0.4}),
    ("LSTM", {"input_forget": 1, "peepholes": True}),
    ("LSTM", {"activations": ["Sigmoid", "Softsign", "Affine"], "activation_alpha": [0.5],
              "activation_beta": [0.1]}),
]


@pytest.mark.parametrize(("op", "options"), CASES,
                         ids=[f"{op}-{'-'.join(o) or 'defaults'}" for op, o in CASES])
def test_recurrent_matches_onnxruntime(op: str, options: dict[str, Any]) -> None:
    if options.get("layout"):
        _check_batch_first(op, options)
        return
    model, feeds = _case(op, **options)
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-5)


def _check_batch_first(op: str, options: dict[str, Any]) -> None:
    """onnxruntime lacks layout=1: compare with its layout=0 run on transposed data."""
    model, feeds = _case(op, **options)
    seq_first = {**options, "layout": 0}
    model0, feeds0 = _case(op, **seq_first)
    feeds0 = {k: (np.swapaxes(feeds[k], 0, 1) if k in ("X", "H0", "C0") else feeds[k])
              for k in feeds0}
    expected, _ = run_both(model0, feeds0)
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)
    want = [np.transpose(expected[0], (2, 0, 1, 3))] + [np.swapaxes(e, 0, 1)
                                                        for e in expected[1:]]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_only_y_h_requested() -> None:
    # Y omitted (empty output name): Y_h must still come out right.
    model, feeds = _case("GRU", initial=True)
    model.graph.node[0].output[0] = ""
    del model.graph.output[0]
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-5)
