"""ai.onnx.ml ops over numeric tensors: Binarizer, ArrayFeatureExtractor, TreeEnsemble
(opset 5), and TreeEnsembleRegressor / TreeEnsembleClassifier (opsets 1-3, what
scikit-learn converters write).

The tree ops parse their attributes once into a flat forest (``_trees.py``) and follow
onnxruntime, their oracle: thresholds compare in float64 (exact for float32 inputs and
float32 thresholds), votes aggregate in float64, and scores round once to the output
type. String class labels are refused: segflow's tensors are numeric.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.errors import InvalidModel, UnsupportedOp
from segflow.ir.graph import Node
from segflow.ops import _trees
from segflow.ops._trees import Aggregate, PostTransform
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor
DOMAIN = "ai.onnx.ml"


def _binarizer(node: Node, ctx: BindContext) -> Kernel:
    threshold = float(node.attrs.get("threshold", 0.0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        return [(x > threshold).to(x.dtype)]
    return kernel


def _array_feature_extractor(node: Node, ctx: BindContext) -> Kernel:
    """The last axis of X gathered at the flattened indices; a 1-D X reads as one row
    (onnxruntime's and the reference's shapes)."""

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x, indices = inputs[0], inputs[1]
        assert x is not None and indices is not None
        flat = indices.reshape(-1).to(torch.int64)
        size = x.shape[-1]
        if flat.numel() == 0:
            raise ValueError("ArrayFeatureExtractor: the indices are empty")
        if bool(((flat < 0) | (flat >= size)).any()):
            raise ValueError(f"ArrayFeatureExtractor: an index is outside 0..{size - 1}")
        rows = x.reshape(1, -1) if x.dim() == 1 else x
        return [rows.index_select(-1, flat.to(x.device))]
    return kernel


def _rows(x: Tensor, forest: _trees.Forest, label: str) -> Tensor:
    """X as float64 [N, F] (a 1-D X is one sample), its features checked."""
    rows = x.reshape(1, -1) if x.dim() == 1 else x.reshape(x.shape[0], -1)
    if rows.shape[1] <= forest.max_feature:
        raise ValueError(f"{label}: the trees read feature {forest.max_feature}, but X has "
                         f"{rows.shape[1]} features")
    return rows.to(torch.float64)


def _tree_ensemble(node: Node, ctx: BindContext) -> Kernel:
    label = node.label
    forest = _trees.forest_v5(label, node.attrs)
    aggregate = _trees.parse_aggregate(label, node.attrs.get("aggregate_function", 1))
    post = _trees.parse_post_transform(label, node.attrs.get("post_transform", 0))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        total, _ = _trees.scores(forest, _rows(x, forest, label), aggregate)
        return [_trees.post_transform(total, post).to(x.dtype)]
    return kernel


def _base_values(node: Node) -> list[float]:
    value = node.attrs.get("base_values_as_tensor", node.attrs.get("base_values"))
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [float(v) for v in value.reshape(-1).tolist()]
    return [float(v) for v in value]


def _regressor(node: Node, ctx: BindContext) -> Kernel:
    label = node.label
    targets = int(node.attrs.get("n_targets", 1))
    if targets < 1:
        raise InvalidModel(f"{label}: n_targets must be positive, got {targets}")
    forest = _trees.forest_v1(label, node.attrs, "target", targets)
    aggregate = _trees.parse_aggregate(label, node.attrs.get("aggregate_function", "SUM"))
    post = _trees.parse_post_transform(label, node.attrs.get("post_transform", "NONE"))
    base = _base_values(node)
    if base and len(base) not in (1, targets):
        raise InvalidModel(f"{label}: base_values has {len(base)} values for {targets} targets")

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        total, hit = _trees.scores(forest, _rows(x, forest, label), aggregate)
        if targets == 1:
            # One target: every tree's vote counts, the base value is added as is, and
            # only PROBIT transforms (onnxruntime's single-score path).
            z = total + (base[0] if base else 0.0)
            return [(_trees.probit(z) if post is PostTransform.PROBIT else z).to(torch.float32)]
        if len(base) == targets:
            total = total + torch.tensor(base, dtype=total.dtype, device=total.device)
        # A target no tree voted for stays 0, base value or not.
        z = torch.where(hit, total, torch.zeros_like(total))
        return [_trees.post_transform(z, post).to(torch.float32)]
    return kernel


def _classifier(node: Node, ctx: BindContext) -> Kernel:
    label = node.label
    if node.attrs.get("classlabels_strings"):
        raise UnsupportedOp(f"{label}: TreeEnsembleClassifier with string class labels "
                            "(segflow's tensors are numeric; use classlabels_int64s)")
    labels = [int(v) for v in node.attrs.get("classlabels_int64s") or []]
    if len(labels) < 2:
        raise UnsupportedOp(f"{label}: TreeEnsembleClassifier with {len(labels)} class "
                            "label(s); two or more are supported")
    classes = len(labels)
    forest = _trees.forest_v1(label, node.attrs, "class", classes)
    post = _trees.parse_post_transform(label, node.attrs.get("post_transform", "NONE"))
    base = _base_values(node)
    if base and len(base) != classes:
        raise UnsupportedOp(f"{label}: base_values with {len(base)} values for {classes} "
                            "classes")
    voted_classes = {int(c) for c in forest.voted.any(dim=0).nonzero().reshape(-1).tolist()}
    binary = classes == 2
    if binary and base:
        raise UnsupportedOp(f"{label}: a two-class TreeEnsembleClassifier with base_values")
    if binary and post is PostTransform.PROBIT:
        raise UnsupportedOp(f"{label}: a two-class TreeEnsembleClassifier with PROBIT")
    one_class = binary and len(voted_classes) == 1
    positive = bool((forest.weights >= 0).all())
    label_table = torch.tensor(labels, dtype=torch.int64)

    def multiclass(total: Tensor, hit: Tensor) -> tuple[Tensor, Tensor]:
        if base:
            total = total + torch.tensor(base, dtype=total.dtype, device=total.device)
            hit = torch.ones_like(hit)
        # The first class with the highest score among those that have one.
        best = torch.where(hit, total, -torch.inf).argmax(dim=-1)
        z = torch.where(hit, total, torch.zeros_like(total))
        return best, _trees.post_transform(z, post)

    def two_classes(total: Tensor, hit: Tensor) -> tuple[Tensor, Tensor]:
        s0 = torch.where(hit[:, 0], total[:, 0], torch.zeros_like(total[:, 0]))
        s1 = total[:, 1]
        has1 = hit[:, 1]
        weight = torch.where(has1, s1, s0)
        if one_class:
            # One class carries every vote: its score is the positive class's.
            chosen = weight > (0.5 if positive else 0.0)
        else:
            chosen = weight > 0
        # Rows where class 1 has a score keep both scores; the others get a second score
        # made from their single one.
        if one_class and positive:
            pair = torch.stack([1 - weight, weight], dim=-1)
        elif post is PostTransform.LOGISTIC:
            pair = torch.stack([_trees.logistic(-weight), _trees.logistic(weight)], dim=-1)
        else:
            pair = torch.stack([-weight, weight], dim=-1)
        both = _trees.post_transform(torch.stack([s0, torch.where(has1, s1, 0.0)], dim=-1), post)
        return chosen.to(torch.int64), torch.where(has1.unsqueeze(-1), both, pair)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        x = inputs[0]
        assert x is not None
        total, hit = _trees.scores(forest, _rows(x, forest, label), Aggregate.SUM)
        best, z = (two_classes if binary else multiclass)(total, hit)
        return [label_table.to(x.device)[best], z.to(torch.float32)]
    return kernel


OPS: list[OpDef] = [
    OpDef("Binarizer", _binarizer, domain=DOMAIN),
    OpDef("ArrayFeatureExtractor", _array_feature_extractor, domain=DOMAIN),
    OpDef("TreeEnsemble", _tree_ensemble, domain=DOMAIN, since=5),
    OpDef("TreeEnsembleRegressor", _regressor, domain=DOMAIN, until=4),
    OpDef("TreeEnsembleClassifier", _classifier, domain=DOMAIN, until=4),
]
