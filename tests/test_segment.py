"""The segmentation policy on hand-built node sequences (DESIGN.md, "Segmentation policy")."""

from __future__ import annotations

import pytest

from segflow.engine.base import ExecType
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import Device
from segflow.passes.segment import Boundary, Phase, segment_nodes
from segflow.settings import BulkSettings


def chain(ops: list[str], device: str = "cpu") -> Graph:
    graph = Graph("chain")
    x = graph.add_input(Value("x"))
    for i, op in enumerate(ops):
        y = Value(f"v{i}")
        node = graph.append(Node(op, [x], [y], name=f"n{i}"))
        node.device = Device.parse(device)
        x = y
    graph.outputs.append(x)
    return graph


def kinds(local: set[str]):
    return lambda node: ExecType.LOCAL if node.op_type in local else ExecType.SYNC


def sizes(segments) -> list[int]:
    return [len(s.nodes) for s in segments]


def test_inference_bulks_whole_graph():
    g = chain(["Relu"] * 40)
    segs = segment_nodes(g.nodes, kinds(set()), BulkSettings())
    assert sizes(segs) == [40]
    assert segs[0].reason == Boundary.END


def test_inference_ignores_max_nodes():
    g = chain(["Relu"] * 40)
    segs = segment_nodes(g.nodes, kinds(set()), BulkSettings(max_nodes_fwd=3, max_nodes_bwd=3))
    assert sizes(segs) == [40]


def test_non_sync_node_is_its_own_task_and_named_in_reason():
    g = chain(["Relu", "Relu", "NonZero", "Relu"])
    segs = segment_nodes(g.nodes, kinds({"NonZero"}), BulkSettings())
    assert sizes(segs) == [2, 1, 1]
    assert [s.exec_type for s in segs] == [ExecType.SYNC, ExecType.LOCAL, ExecType.SYNC]
    assert "NonZero" in segs[0].reason and "NonZero" in segs[1].reason
    assert segs[2].reason == Boundary.END


def test_consecutive_non_sync_nodes():
    g = chain(["NonZero", "NonZero", "Relu"])
    segs = segment_nodes(g.nodes, kinds({"NonZero"}), BulkSettings())
    assert sizes(segs) == [1, 1, 1]


def test_bulking_disabled_gives_one_task_per_node():
    g = chain(["Relu"] * 7)
    segs = segment_nodes(g.nodes, kinds(set()), BulkSettings(inference=False))
    assert sizes(segs) == [1] * 7
    assert all(s.reason == Boundary.DISABLED for s in segs)


def test_device_change_splits():
    g = chain(["Relu"] * 4)
    g.nodes[2].device = Device.parse("cpu:1")
    g.nodes[3].device = Device.parse("cpu:1")
    segs = segment_nodes(g.nodes, kinds(set()), BulkSettings())
    assert sizes(segs) == [2, 2]
    assert segs[0].reason == Boundary.DEVICE


def _training(n_fwd: int, n_bwd: int):
    g = chain(["Relu"] * (n_fwd + n_bwd))
    fwd = set(g.nodes[:n_fwd])
    return g, (lambda node: Phase.FORWARD if node in fwd else Phase.BACKWARD)


def test_training_max_nodes_forward_and_backward_separately():
    g, phase_of = _training(10, 7)
    settings = BulkSettings(max_nodes_fwd=4, max_nodes_bwd=3)
    segs = segment_nodes(g.nodes, kinds(set()), settings, phase_of=phase_of)
    assert sizes(segs) == [4, 4, 2, 3, 3, 1]
    assert [s.phase for s in segs] == [Phase.FORWARD] * 3 + [Phase.BACKWARD] * 3
    assert segs[0].reason == Boundary.MAX_NODES
    assert segs[2].reason == Boundary.PHASE
    assert segs[-1].reason == Boundary.END


def test_training_gradient_output_ends_segment():
    g, phase_of = _training(3, 8)
    grads = frozenset({g.nodes[4].outputs[0], g.nodes[8].outputs[0]})
    segs = segment_nodes(g.nodes, kinds(set()), BulkSettings(), phase_of=phase_of,
                         gradient_outputs=grads)
    assert sizes(segs) == [3, 2, 4, 2]
    assert segs[1].reason == Boundary.GRADIENT and segs[2].reason == Boundary.GRADIENT


def test_training_bulk_off():
    g, phase_of = _training(3, 3)
    segs = segment_nodes(g.nodes, kinds(set()), BulkSettings(train=False), phase_of=phase_of)
    assert sizes(segs) == [1] * 6


def test_training_non_sync_boundary():
    g = chain(["Relu", "Relu", "NonZero", "Relu", "Relu"])
    segs = segment_nodes(g.nodes, kinds({"NonZero"}), BulkSettings(),
                         phase_of=lambda n: Phase.FORWARD)
    assert sizes(segs) == [2, 1, 2]


@pytest.mark.parametrize("env,field,value", [
    ({"SEGFLOW_BULK_INFERENCE": "0"}, "inference", False),
    ({"SEGFLOW_BULK_TRAIN": "0"}, "train", False),
    ({"SEGFLOW_BULK_MAX_NODES_FWD": "7"}, "max_nodes_fwd", 7),
    ({"SEGFLOW_BULK_MAX_NODES_BWD": "9"}, "max_nodes_bwd", 9),
])
def test_settings_read_environment(env, field, value):
    settings = BulkSettings.resolve(env=env)
    assert getattr(settings, field) == value


def test_api_beats_environment():
    settings = BulkSettings.resolve(inference=True, env={"SEGFLOW_BULK_INFERENCE": "0"})
    assert settings.inference is True


@pytest.mark.parametrize("env", [{"SEGFLOW_BULK_INFERENCE": "maybe"},
                                 {"SEGFLOW_BULK_MAX_NODES_FWD": "0"}])
def test_bad_environment_values_are_rejected(env):
    with pytest.raises(ValueError, match="SEGFLOW_BULK"):
        BulkSettings.resolve(env=env)
