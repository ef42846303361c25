"""Tests for the KernelReport protocol (kernels/report.py): every kernel op class in
kernels/ implements it, each family describes itself once, and explain() finds the
ops through one list of the executor."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import segflow
import segflow.kernels
from segflow.kernels.report import (
    KernelReport,
    ReportFamily,
    describe_families,
    reporting_ops,
    short_label,
)


def _kernel_classes() -> list[type]:
    """The classes defined in kernels/** that carry the family marker (``family``)."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(segflow.kernels.__path__, "segflow.kernels."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and isinstance(
                    getattr(cls, "family", None), ReportFamily):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(found.values())


EXPECTED = {"DirectOp", "DirectConv", "DirectPool", "DirectLinear", "NativeLinear",
            "AddLayerNorm", "ScaledDotAttention", "ChannelsLastStaging", "DenseChain",
            "NativeReplay", "DirectReplay"}


def test_every_kernel_op_class_implements_the_protocol():
    classes = _kernel_classes()
    assert EXPECTED <= {cls.__name__ for cls in classes}
    for cls in classes:
        # An instance without its state: the runtime check reads the class's members.
        assert isinstance(object.__new__(cls), KernelReport), cls
        assert inspect.ismethod(cls.describe_all), f"{cls}: describe_all is a classmethod"


def test_each_family_describes_itself_in_one_place():
    by_family: dict[ReportFamily, set[object]] = {}
    for cls in _kernel_classes():
        by_family.setdefault(cls.family, set()).add(cls.describe_all.__func__)
    assert all(len(fns) == 1 for fns in by_family.values()), by_family
    assert set(by_family) == set(ReportFamily)     # every family has its kernel


def test_reporting_ops_follows_the_kernels_op_and_its_parts():
    class Op:
        family = ReportFamily.ADD_LAYER_NORM

        def __init__(self, parts=()):
            self._parts = parts

        @classmethod
        def describe_all(cls, ops, limit=8):
            return [f"{cls.family.value}: {[label for label, _ in ops]}"]

        def counters(self):
            return {"calls": 1}

        def parts(self):
            return self._parts

    class Kernel:
        def __init__(self, op):
            self.op = op

    class Staging(Op):
        family = ReportFamily.STAGING

    inner = Staging()
    ops = reporting_ops([("a", Kernel(Op((inner,)))), ("b", Kernel(object())), ("c", Op())])
    assert [(label, type(op)) for label, op in ops] == [("a", Op), ("a", Staging)]
    described = describe_families(ops)
    # In the families' order: staging before add + layer norm.
    assert [family for family, _ in described] == [ReportFamily.STAGING,
                                                   ReportFamily.ADD_LAYER_NORM]
    assert described[1][1] == ["add + layer norm: ['a']"]


def _gemm_chain_model():
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 16)).astype(np.float32)
    b = np.zeros(16, np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b"], ["y"])]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
         numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_sessions_kernel_ops_report_their_counters():
    sess = segflow.InferenceSession(_gemm_chain_model().SerializeToString())
    sess.run(None, {"x": np.ones((1, 16), np.float32)})
    ops = sess._executor.kernel_ops
    if not ops:
        pytest.skip("no reporting kernel bound for this model here")
    for _, op in ops:
        counters = op.counters()
        assert counters and all(isinstance(n, int) for n in counters.values())
    report = sess.kernel_report()
    for family, lines in describe_families(ops):
        assert lines[0] in report, family


def test_a_report_line_names_a_node_by_its_name_not_its_ir():
    assert short_label("%y = DenseChain(%x, %w0, %b0, %w1, %b1) [fc1..fc2]") == \
        "fc1..fc2 (DenseChain)"
    assert short_label("%y = Relu(%x)") == "%y (Relu)"
    assert short_label("%a, %b = Split(%x, None) [split]") == "split (Split)"
    assert short_label("not a label") == "not a label"
