"""Tests for the direct per-channel scale (kernels/onednn/binary.py, ``DIRECT_BINARY``).

A squeeze-excitation block, ``x * sigmoid(conv(silu(conv(GlobalAveragePool(x)))))``,
between direct convolutions is compared with onnxruntime (atol 1e-4, rtol 1e-3, as
the other direct-kernel tests), NaN and infinities in the feed included; the op
itself is compared bit for bit with torch's product in both layouts the direct path
writes (channels-last, and nChw8c, the blocked region's). The replayed runs are
counted exactly: the whole block is one run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import segflow
from replays import replays
from segflow.kernels.choice import KernelKind
from segflow.kernels.onednn.binary import DirectBinary, per_channel
from segflow.kernels.onednn.library import BINARY_MUL, Library
from targets import as_cpu, count

LIB = Library.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"libdnnl {Library.probe()[1]}")
ATOL, RTOL = 1e-4, 1e-3
RNG = np.random.default_rng(7)
C = 16


def _rand(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _silu(x: str, out: str) -> list[Any]:
    return [helper.make_node("Sigmoid", [x], [f"{out}.s"]),
            helper.make_node("Mul", [x, f"{out}.s"], [out])]


def _block(pool: str = "GlobalAveragePool", swap: bool = False, scale_channels: int = C,
           scale_spatial: bool = False) -> Any:
    """conv3x3 + SiLU, the squeeze-excitation scale of its output, a 1x1 conv after.

    ``pool``: GlobalAveragePool or ReduceMean (axes 2, 3, as the dynamo exporter writes
    it); ``swap``: the Mul reads the scale first. ``scale_spatial``: the "scale" is a
    1x1 convolution of the feature map to ``scale_channels`` channels instead, the same
    ``[N, c, H, W]`` size (not a per-channel broadcast)."""
    inits = {"w0": _rand(C, 8, 3, 3, scale=0.3), "b0": _rand(C),
             "w1": _rand(4, C, 1, 1, scale=0.5), "b1": _rand(4),
             "w2": _rand(scale_channels, 4, 1, 1, scale=0.5), "b2": _rand(scale_channels),
             "w3": _rand(8, C, 1, 1, scale=0.3), "b3": _rand(8),
             "ws": _rand(scale_channels, C, 1, 1, scale=0.3), "axes": np.array([2, 3], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
             *_silu("c0", "a0")]
    if scale_spatial:
        nodes.append(helper.make_node("Conv", ["a0", "ws", "b2"], ["c2"]))
    else:
        pooled = [helper.make_node("GlobalAveragePool", ["a0"], ["p"])] \
            if pool == "GlobalAveragePool" else \
            [helper.make_node("ReduceMean", ["a0", "axes"], ["p"], keepdims=1)]
        nodes += [*pooled, helper.make_node("Conv", ["p", "w1", "b1"], ["c1"]),
                  *_silu("c1", "a1"), helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"])]
    nodes += [helper.make_node("Sigmoid", ["c2"], ["s"]),
              helper.make_node("Mul", ["s", "a0"] if swap else ["a0", "s"], ["m"]),
              helper.make_node("Conv", ["m", "w3", "b3"], ["out"])]
    graph = helper.make_graph(
        nodes, "se",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 10, 10])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()
                     if any(n in node.input for node in nodes)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _poisoned(batch: int, value: float, channels: int = 8) -> dict[str, np.ndarray]:
    """A feed with ``value`` (NaN or an infinity) at two places of its first image; the
    other images finite."""
    x = _rand(batch, channels, 10, 10, scale=2.0)
    x[0, 2, 4, 5] = value
    x[0, 0, 0, 0] = value
    return {"x": x}


def _compare(model: Any, sess: segflow.InferenceSession, feeds: dict[str, np.ndarray]) -> None:
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want, got = ref.run(None, feeds)[0], sess.run(None, feeds)[0]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("pool", ["GlobalAveragePool", "ReduceMean"])
@pytest.mark.parametrize("swap", [False, True], ids=["scale_second", "scale_first"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_squeeze_excitation_block_matches_onnxruntime(pool, swap, batch):
    model = _block(pool, swap)
    sess = segflow.InferenceSession(model, compile="codegen")
    assert count(sess, KernelKind.DIRECT_BINARY) == 1
    assert count(sess, KernelKind.DIRECT_POOL) == 1
    for _ in range(3):      # recorded at the second run, replayed from the third
        _compare(model, sess, {"x": _rand(batch, 8, 10, 10, scale=2.0)})
    for value in (np.nan, np.inf, -np.inf):
        _compare(model, sess, _poisoned(batch, value))
    (replay,) = replays(sess)
    assert replay.replays >= 1
    # The scale ran through libdnnl, not its fallback.
    (op,) = [s.op for s in replay.steps if isinstance(s.op, DirectBinary)]
    assert op.direct_layouts >= 1 and not op.why_not


def test_the_block_is_one_replayed_run_built_at_load():
    sess = segflow.InferenceSession(_block("ReduceMean"), compile="codegen")
    (replay,) = replays(sess)
    # conv, pooling, conv, conv, scale, conv: every node of the block.
    assert len(replay.steps) == 6
    assert sum(isinstance(s.op, DirectBinary) for s in replay.steps) == 1
    assert "prebuilt: 6 input layouts built while loading" in sess.explain()
    feeds = {"x": _rand(1, 8, 10, 10)}
    for _ in range(3):
        sess.run(None, feeds)
    # Every primitive built at load: recorded by the first run, replayed from the second.
    assert replay.replays == 2
    # Replayed: the pooling, both 1x1 convolutions and the scale (over its big input, in
    # place); the first convolution stages its NCHW input (run as before inside the
    # replay), and the last writes the graph output (a new tensor, after it).
    (line,) = [s for s in sess.explain().splitlines() if s.startswith("  6 nodes:")]
    assert line.startswith("  6 nodes: 4 replayed"), line
    assert line.endswith("1 run as before inside the replay, the last 1 after it"), line


def test_without_the_global_pool_rule_a_reduce_mean_cuts_the_run():
    sess = segflow.InferenceSession(_block("ReduceMean"), compile="codegen",
                                    optimize={"fuse.global_pool": False})
    # The ReduceMean runs in torch: [conv] | ReduceMean | [conv, conv, scale, conv].
    assert [len(r.steps) for r in replays(sess)] == [4]
    assert count(sess, KernelKind.DIRECT_POOL) == 0
    assert count(sess, KernelKind.DIRECT_BINARY) == 1


@pytest.mark.parametrize("scale_channels", [C, 1], ids=["same_size", "channel_broadcast"])
def test_a_mul_that_is_not_a_per_channel_scale_stays_as_it_was(scale_channels):
    model = _block(scale_channels=scale_channels, scale_spatial=True)
    sess = segflow.InferenceSession(model, compile="codegen")
    (mul,) = [n for n in sess.plan.graph.nodes if n.op_type == "Mul"]
    assert sess.plan.choices.kind(mul) is KernelKind.REFERENCE
    assert count(sess, KernelKind.DIRECT_BINARY) == 0
    # [conv, conv] | Mul | [conv]: the Mul ends the run, the last conv runs alone.
    assert [len(r.steps) for r in replays(sess)] == [2]
    for batch in (1, 3):
        _compare(model, sess, {"x": _rand(batch, 8, 10, 10)})


def test_the_choice_switched_off_with_the_direct_path():
    model = _block()
    sess = segflow.InferenceSession(model, compile="codegen", optimize={"layout.direct": False})
    assert count(sess, KernelKind.DIRECT_BINARY) == 0
    _compare(model, sess, {"x": _rand(2, 8, 10, 10)})


def _depthwise_block() -> Any:
    """A 3x3 stem over the RGB image, a depthwise 3x3 conv (both + SiLU), the squeeze-excitation
    scale of its output, a 1x1 conv and a global pooling: a region the layout pass may
    run on nChw8c activations, the scale inside it."""
    inits = {"we": _rand(C, 3, 3, 3, scale=0.4), "be": _rand(C),
             "wd": _rand(C, 1, 3, 3, scale=0.4), "bd": _rand(C),
             "w1": _rand(8, C, 1, 1, scale=0.5), "b1": _rand(8),
             "w2": _rand(C, 8, 1, 1, scale=0.5), "b2": _rand(C),
             "w3": _rand(C, C, 1, 1, scale=0.3), "b3": _rand(C)}
    nodes = [helper.make_node("Conv", ["x", "we", "be"], ["ce"], pads=[1, 1, 1, 1]),
             *_silu("ce", "ae"),
             helper.make_node("Conv", ["ae", "wd", "bd"], ["cd"], pads=[1, 1, 1, 1], group=C),
             *_silu("cd", "ad"),
             helper.make_node("GlobalAveragePool", ["ad"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["c1"]), *_silu("c1", "a1"),
             helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"]),
             helper.make_node("Sigmoid", ["c2"], ["s"]),
             helper.make_node("Mul", ["ad", "s"], ["m"]),
             helper.make_node("Conv", ["m", "w3", "b3"], ["c3"]),
             helper.make_node("GlobalAveragePool", ["c3"], ["out"])]
    graph = helper.make_graph(
        nodes, "se_dw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 10, 10])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("batch", [1, 3])
def test_the_scale_runs_inside_the_blocked_region(monkeypatch, batch):
    as_cpu(monkeypatch, avx512=False)      # where the region is preferred (8-float vectors)
    model = _depthwise_block()
    sess = segflow.InferenceSession(model, compile="codegen")
    nodes = sess.plan.graph.nodes
    (mul,) = [n for n in nodes if n.op_type == "Mul"]
    choices = sess.plan.choices
    if not any(choices[n].blocked for n in nodes):
        pytest.skip("this libdnnl has no nChw8c depthwise kernel on this CPU")
    assert choices.kind(mul) is KernelKind.DIRECT_BINARY and choices[mul].blocked_input
    convs = [n for n in nodes if n.op_type == "FusedConv"]
    # The expansion, depthwise and last conv in the region; the two on the pooled map not.
    assert [choices[n].blocked for n in convs] == [True, True, False, False, True]
    assert choices[convs[-1]].blocked_input
    pools = [n for n in nodes if n.op_type == "GlobalAveragePool"]
    assert [choices[p].blocked_input for p in pools] == [True, True]
    for _ in range(3):
        _compare(model, sess, {"x": _rand(batch, 3, 10, 10, scale=2.0)})
    for value in (np.nan, np.inf, -np.inf):
        _compare(model, sess, _poisoned(batch, value, channels=3))


def test_a_scale_whose_output_leaves_the_region_takes_it_off(monkeypatch):
    as_cpu(monkeypatch, avx512=False)
    model = _block()     # the scale's output goes to a conv whose output is the graph's
    sess = segflow.InferenceSession(model, compile="codegen")
    nodes = sess.plan.graph.nodes
    assert not any(sess.plan.choices[n].blocked or sess.plan.choices[n].blocked_input
                   for n in nodes)
    _compare(model, sess, {"x": _rand(2, 8, 10, 10)})


# -- the op -------------------------------------------------------------------------------
def _op(broadcast_input: int = 1, blocked: bool = False) -> DirectBinary:
    assert LIB is not None
    return DirectBinary(LIB, BINARY_MUL, broadcast_input, lambda a, b: a * b, 8, None, blocked)


def _operands(n: int, scale_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 24, 7, 5).contiguous(memory_format=torch.channels_last)
    s = torch.rand(scale_n, 24, 1, 1)
    x[0, 3, 2, 1], x[0, 4, 0, 0], x[-1, 5, 6, 4] = float("nan"), float("inf"), float("-inf")
    s[0, 6, 0, 0], s[0, 7, 0, 0] = float("nan"), float("inf")
    s[0, 4, 0, 0] = 0.0          # inf * 0: NaN
    return x, s


@pytest.mark.parametrize("blocked", [False, True], ids=["channels_last", "nChw8c"])
@pytest.mark.parametrize("broadcast_input", [1, 0])
@pytest.mark.parametrize(("n", "scale_n"), [(1, 1), (3, 3), (3, 1)])
def test_the_op_is_torch_product_bit_for_bit(blocked, broadcast_input, n, scale_n):
    assert LIB is not None
    op = _op(broadcast_input, blocked)
    x, s = _operands(n, scale_n)
    big = LIB.to_layout(x, blocked=True) if blocked else x
    y = op(*((big, s) if broadcast_input == 1 else (s, big)))
    if blocked:
        y = LIB.to_layout(y, blocked=False)
    else:
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert op.direct_layouts == 1, op.why_not
    torch.testing.assert_close(y, x * s, rtol=0, atol=0, equal_nan=True)


def test_the_op_falls_back_where_the_scale_is_not_per_channel():
    op = _op()
    x = torch.randn(2, 24, 4, 4).contiguous(memory_format=torch.channels_last)
    s = torch.randn(2, 24, 4, 1)
    torch.testing.assert_close(op(x, s), x * s, rtol=0, atol=0)
    assert op.direct_layouts == 0
    assert "is not a per-channel scale" in next(iter(op.why_not.values()))
    plain = x.contiguous()
    s1 = torch.rand(2, 24, 1, 1)
    torch.testing.assert_close(op(plain, s1), plain * s1, rtol=0, atol=0)
    assert "not a channels-last input" in list(op.why_not.values())[-1]


def test_per_channel():
    assert per_channel((2, 8, 5, 5), (2, 8, 1, 1))
    assert per_channel((2, 8, 5, 5), (1, 8, 1, 1))
    assert per_channel((2, 8, 3, 5, 5), (2, 8, 1, 1, 1))
    assert not per_channel((2, 8, 5, 5), (2, 1, 1, 1))
    assert not per_channel((2, 8, 5, 5), (2, 8, 5, 1))
    assert not per_channel((2, 8, 5, 5), (8, 1, 1))
