"""Gradient checks shared by the gradient test modules.

``loss = ReduceSum(op(params...) * R)`` for a fixed random R; parameters are fed to a
``TrainingSession`` as state (the graph inputs autodiff differentiates). :func:`check`
compares their gradients with torch.autograd of a torch reference on the same float64
data; :func:`check_numeric` compares them with central finite differences of segflow's
own forward (an ``InferenceSession`` over the same graph with the parameters as inputs),
for ops whose torch reference would be a reimplementation of the op.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import segflow
from segflow.frontend.builder import GraphBuilder, Sym
from segflow.ir.types import DType

RTOL, ATOL = 1e-7, 1e-9

Build = Callable[[GraphBuilder, dict[str, Sym]], Sym]
TorchFn = Callable[..., torch.Tensor]


def rand(seed: int, *shape: int, ties: bool = False) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal(shape)
    return np.round(data) if ties else data


def uniform(seed: int, low: float, high: float, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, shape)


def op(op_type: str, *names: str | None, outputs: int = 1, take: int = 0, domain: str = "",
       **attrs: object) -> Build:
    """A build of one ``op_type`` node over the named syms; ``take``: which output."""
    def build(b: GraphBuilder, s: dict[str, Sym]) -> Sym:
        out = b.op(op_type, *(s[n] if n else None for n in names), outputs=outputs,
                   domain=domain, **attrs)
        return out[take] if outputs > 1 else out
    return build


def ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _training(params: dict[str, np.ndarray], build: Build, weights: np.ndarray,
              consts: dict[str, np.ndarray], opset: int) -> segflow.TrainingSession:
    b = GraphBuilder("case", opset=opset)
    syms = {n: b.param(n, a) for n, a in params.items()}
    syms.update({n: b.const(a, name=n) for n, a in consts.items()})
    loss = b.op("ReduceSum", b.op("Mul", build(b, syms), b.const(weights)), keepdims=0)
    b.output(loss, "loss")
    sess = segflow.TrainingSession(b.to_model(), loss="loss", params=list(params),
                                   engine="inline")
    sess.step({})
    return sess


def _assert_backward(sess: segflow.TrainingSession, backward: str | None) -> None:
    if backward is not None:
        assert backward in {n.op_type for n in sess.differentiated.backward_nodes}


def check(params: dict[str, np.ndarray], build: Build, reference: TorchFn, *,
          consts: dict[str, np.ndarray] | None = None, opset: int = 18,
          tolerance: tuple[float, float] = (RTOL, ATOL), backward: str | None = None
          ) -> segflow.TrainingSession:
    """The gradients of sum(op(...) * R) w.r.t. every param agree with torch.autograd;
    ``backward``: the backward op the rule must have emitted."""
    consts = consts or {}
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    expected = reference(**leaves, **{n: torch.tensor(a) for n, a in consts.items()})
    weights = np.random.default_rng(7).standard_normal(tuple(expected.shape))
    weights = weights.astype(torch.empty((), dtype=expected.dtype).numpy().dtype)
    (expected * torch.tensor(weights)).sum().backward()
    sess = _training(params, build, weights, consts, opset)
    grads = sess.gradients()
    for name, leaf in leaves.items():
        assert leaf.grad is not None
        torch.testing.assert_close(grads[name], leaf.grad, rtol=tolerance[0], atol=tolerance[1],
                                   msg=lambda m, n=name: f"d/d{n}: {m}")
    _assert_backward(sess, backward)
    return sess


def check_numeric(params: dict[str, np.ndarray], build: Build, *,
                  consts: dict[str, np.ndarray] | None = None, opset: int = 18,
                  eps: float = 1e-6, tolerance: tuple[float, float] = (1e-6, 1e-8),
                  backward: str | None = None) -> segflow.TrainingSession:
    """The gradients of sum(op(...) * R) w.r.t. every (float64) param agree with central
    differences of the same loss run forward by an InferenceSession."""
    consts = consts or {}
    b = GraphBuilder("forward", opset=opset)
    syms = {n: b.input(n, DType.FLOAT64, a.shape) for n, a in params.items()}
    syms.update({n: b.const(a, name=n) for n, a in consts.items()})
    b.output(build(b, syms), "y")
    forward = segflow.InferenceSession(b.to_model(), engine="inline")
    feeds = {n: np.array(a, dtype=np.float64) for n, a in params.items()}
    y = forward.run(None, feeds)[0]
    weights = np.random.default_rng(7).standard_normal(y.shape).astype(y.dtype)

    def loss() -> float:
        return float((forward.run(None, feeds)[0] * weights).sum())

    sess = _training(params, build, weights, consts, opset)
    grads = sess.gradients()
    for name, array in feeds.items():
        numeric = np.zeros_like(array)
        flat, out = array.reshape(-1), numeric.reshape(-1)
        for i in range(flat.size):
            keep = flat[i]
            flat[i] = keep + eps
            up = loss()
            flat[i] = keep - eps
            down = loss()
            flat[i] = keep
            out[i] = (up - down) / (2 * eps)
        torch.testing.assert_close(grads[name], torch.from_numpy(numeric), rtol=tolerance[0],
                                   atol=tolerance[1], msg=lambda m, n=name: f"d/d{n}: {m}")
    _assert_backward(sess, backward)
    return sess
