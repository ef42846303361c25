"""Training: name the loss, appending a loss node where the model outputs class scores."""

from __future__ import annotations

from dataclasses import dataclass

from segflow.errors import InvalidModel
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import DType, TensorSpec
from segflow.passes.result import PassResult


@dataclass(frozen=True, slots=True)
class CrossEntropyLoss:
    """Append ``SoftmaxCrossEntropyLoss(logits, labels)`` to a model that outputs class scores.

    ``logits`` names the graph output (default: the only output); ``labels``
    becomes a new int64 graph input.
    """

    labels: str = "labels"
    logits: str | None = None
    reduction: str = "mean"
    name: str = "loss"


@dataclass(frozen=True, slots=True)
class LossAttached(PassResult):
    """What :func:`attach_loss` returns: also the scalar value the gradients start from."""

    loss: Value | None = None


def attach_loss(graph: Graph, loss: str | CrossEntropyLoss | None) -> LossAttached:
    """The loss value of ``graph``: the value named ``loss``, the only scalar output
    (``loss=None``), or a ``SoftmaxCrossEntropyLoss`` appended over the class scores.

    >>> attach_loss(graph, CrossEntropyLoss(labels="y")).loss.name    # doctest: +SKIP
    'loss'
    """
    if isinstance(loss, str):
        found = find_value(graph, loss)
        return LossAttached(graph, False, (f"attach_loss: {found.name!r}",), loss=found)
    if loss is None:
        scalars = [v for v in graph.outputs if v.spec.shape == ()]
        if len(scalars) == 1:
            return LossAttached(graph, False, (f"attach_loss: {scalars[0].name!r}",),
                                loss=scalars[0])
        raise InvalidModel("say which value is the loss: loss='name' or "
                           "loss=CrossEntropyLoss(labels=...)")
    if loss.logits is not None:
        logits = find_value(graph, loss.logits)
    elif len(graph.outputs) == 1:
        logits = graph.outputs[0]
    else:
        raise InvalidModel(f"the model has {len(graph.outputs)} outputs; name the class "
                           "scores with CrossEntropyLoss(logits=...)")
    shape = logits.spec.shape
    label_shape = (shape[0], *shape[2:]) if shape is not None and len(shape) >= 2 else None
    labels = graph.add_input(Value(loss.labels, TensorSpec(DType.INT64, label_shape)))
    out = Value(loss.name, TensorSpec(logits.spec.dtype, ()))
    opset = max(graph.opsets.get("", 17), 13)
    graph.append(Node("SoftmaxCrossEntropyLoss", [logits, labels], [out],
                      {"reduction": loss.reduction}, name=loss.name, opset=opset))
    return LossAttached(graph, True, (f"attach_loss: SoftmaxCrossEntropyLoss({logits.name}, "
                                      f"{labels.name}) -> {out.name!r}",), loss=out)


def find_value(graph: Graph, name: str) -> Value:
    """The value of ``graph`` named ``name`` (InvalidModel naming the outputs if none)."""
    for value in graph.values():
        if value.name == name:
            return value
    raise InvalidModel(f"the model has no value named {name!r}; its outputs are "
                       f"{', '.join(v.name for v in graph.outputs)}")
