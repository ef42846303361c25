"""The kernel choice is the one place that says which kernel runs a node."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import segflow
from segflow import models
from segflow.kernels.choice import REFERENCE, KernelChoice, KernelChoices, KernelKind
from segflow.kernels.onednn.library import Library
from segflow.kernels.onednn.op import DirectKernel
from segflow.kernels.registry import KERNELS
from segflow.runtime.executor import Executor

needs_libdnnl = pytest.mark.skipif(Library.load() is None,
                                   reason=f"libdnnl {Library.probe()[1]}")


def test_every_kind_but_the_reference_has_one_row():
    assert set(KERNELS) == set(KernelKind) - {KernelKind.REFERENCE}
    assert KernelChoices()[object()] is REFERENCE   # type: ignore[index]
    assert not REFERENCE.calls_libdnnl and not REFERENCE.prepacked


def _rebound(sess: segflow.InferenceSession, forced: dict[object, KernelChoice]) -> Executor:
    """``sess``'s plan bound again with some choices replaced (interpreted)."""
    choices = dict(sess.plan.choices.by_node)
    choices.update(forced)  # type: ignore[arg-type]
    plan = dataclasses.replace(sess.plan, choices=KernelChoices.of_mapping(choices))
    return Executor(plan, sess.registry, sess._engine, target=sess.target)


def _kernels(executor: Executor) -> dict[object, object]:
    return {step.node: step.kernel for task in executor.tasks for step in task.steps}


@needs_libdnnl
def test_a_choice_forced_to_another_kind_binds_that_kernel_and_nothing_else():
    model = models.build("resnet18", num_classes=10, image_size=32)
    feeds = models.example_inputs("resnet18", batch_size=1, num_classes=10, image_size=32)
    sess = segflow.InferenceSession(model, compile="none")
    choices = sess.plan.choices
    pool = next(n for n in sess.graph.nodes if n.op_type == "MaxPool")
    conv = next(n for n in sess.graph.nodes
                if choices.kind(n) is KernelKind.DIRECT_CONV and choices[n].libdnnl_packed)
    assert choices.kind(pool) is KernelKind.DIRECT_POOL
    bound = _kernels(sess._executor)
    assert isinstance(bound[pool], DirectKernel) and isinstance(bound[conv], DirectKernel)
    # The pooling forced to the reference binds its OpDef row's kernel; the convolution
    # forced to torch's oneDNN op runs that op over torch's packing of libdnnl's bytes.
    forced = _rebound(sess, {pool: REFERENCE,
                             conv: dataclasses.replace(choices[conv],
                                                       kind=KernelKind.ONEDNN_CONV)})
    kernels = _kernels(forced)
    assert not isinstance(kernels[pool], DirectKernel)
    assert not isinstance(kernels[conv], DirectKernel)
    others = [n for n in sess.graph.nodes if n not in (pool, conv)]
    assert all(isinstance(kernels[n], DirectKernel) == isinstance(bound[n], DirectKernel)
               for n in others)
    want = sess.run(None, feeds)[0]
    got = forced.run([torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values()])
    np.testing.assert_allclose(got[0][0].numpy(), want, atol=1e-4, rtol=1e-4)


def test_selection_changes_nothing_off_the_cpu_and_chooses_on_it():
    from segflow.frontend.onnx_import import import_model
    from segflow.ir.types import Device, DeviceKind
    from segflow.kernels.target import CpuTarget
    from segflow.passes.fuse import RULE_NAMES, run_rules
    from segflow.passes.select_kernels import select_kernels

    graph = import_model(models.build("resnet18", num_classes=10, image_size=32))
    run_rules(graph, list(RULE_NAMES))
    target = CpuTarget.detect()
    weights = dict(graph.initializers)
    off = select_kernels(graph, Device(DeviceKind.CUDA, 0), target)
    assert not off.modified and len(off.choices) == 0 and graph.initializers == weights
    if not target.onednn_ops:
        pytest.skip("this torch has no oneDNN ops")
    on = select_kernels(graph, Device(DeviceKind.CPU, 0), target)
    convs = [n for n in graph.nodes if n.op_type == "FusedConv"]
    assert on.modified and all(on.choices[n].prepacked for n in convs)
    assert not any("onednn" in key or "winograd" in key for n in graph.nodes for key in n.attrs)


def test_fused_ops_choose_their_native_kernel_on_cpu_and_the_reference_runs_the_same():
    from segflow.kernels.report import OpKernel

    model = models.build("bert_tiny")
    feeds = models.example_inputs("bert_tiny", batch_size=2, seq_len=16)
    sess = segflow.InferenceSession(model, compile="none")
    fused = {n: n.op_type for n in sess.graph.nodes if n.op_type in ("Attention", "AddLayerNorm")}
    assert sorted(set(fused.values())) == ["AddLayerNorm", "Attention"]
    want_kind = {"Attention": KernelKind.NATIVE_ATTENTION,
                 "AddLayerNorm": KernelKind.NATIVE_ADD_LAYER_NORM}
    assert all(sess.plan.choices.kind(n) is want_kind[t] for n, t in fused.items())
    bound = _kernels(sess._executor)
    assert all(isinstance(bound[n], OpKernel) for n in fused)
    # Forced to the reference: the OpDef rows' torch kernels, the same results.
    forced = _rebound(sess, dict.fromkeys(fused, REFERENCE))
    kernels = _kernels(forced)
    assert not any(isinstance(kernels[n], OpKernel) for n in fused)
    want = sess.run(None, feeds)
    got = forced.run([torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values()])
    for g, w in zip(got[0], want, strict=True):
        np.testing.assert_allclose(g.numpy(), w, atol=1e-4, rtol=1e-4)


def test_a_dense_chain_chooses_the_native_chain_and_its_reference_matches():
    from segflow.kernels.dense_chain import DenseChainKernel

    model = models.build("mlp_chain", layers=4, width=16)
    feeds = models.example_inputs("mlp_chain", layers=4, width=16)
    sess = segflow.InferenceSession(model, compile="none")
    (chain,) = [n for n in sess.graph.nodes if n.op_type == "DenseChain"]
    assert sess.plan.choices.kind(chain) is KernelKind.NATIVE_DENSE_CHAIN
    assert isinstance(_kernels(sess._executor)[chain], DenseChainKernel)
    forced = _rebound(sess, {chain: REFERENCE})
    assert not isinstance(_kernels(forced)[chain], DenseChainKernel)
    want = sess.run(None, feeds)[0]
    got = forced.run([torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values()])
    np.testing.assert_allclose(got[0][0].numpy(), want, atol=1e-5, rtol=1e-5)
