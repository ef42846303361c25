"""Decision-tree ensembles as flat tensors, evaluated for every sample and tree at once.

Both encodings ONNX has (``TreeEnsemble`` of ai.onnx.ml 5, and the ``nodes_*`` /
``target_*`` / ``class_*`` attributes of ``TreeEnsembleRegressor``/``Classifier`` 1-3)
are parsed once into a :class:`Forest`: one array entry per node of every tree, leaves
included, with each leaf pointing at itself. Evaluation walks all trees of all samples
in lock step for the forest's depth (tensor gathers, no host reads), then gathers each
reached leaf's row of weights. Scores aggregate and transform as onnxruntime's
``tree_ensemble_aggregator.h`` does, the oracle for these ops.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from segflow.errors import InvalidModel

Tensor = torch.Tensor

LEQ, LT, GTE, GT, EQ, NEQ, MEMBER, LEAF = range(8)
_MODE_NAMES = {"BRANCH_LEQ": LEQ, "BRANCH_LT": LT, "BRANCH_GTE": GTE, "BRANCH_GT": GT,
               "BRANCH_EQ": EQ, "BRANCH_NEQ": NEQ, "LEAF": LEAF}


class Aggregate(enum.Enum):
    AVERAGE = 0
    SUM = 1
    MIN = 2
    MAX = 3


class PostTransform(enum.Enum):
    NONE = 0
    SOFTMAX = 1
    LOGISTIC = 2
    SOFTMAX_ZERO = 3
    PROBIT = 4


@dataclass(frozen=True, slots=True)
class Forest:
    """Every node of every tree; a leaf's two children are itself."""

    feature: Tensor        # int64 [M]
    threshold: Tensor      # float64 [M]
    mode: Tensor           # int64 [M], LEQ .. LEAF
    true_next: Tensor      # int64 [M]
    false_next: Tensor     # int64 [M]
    missing_true: Tensor   # bool [M]
    members: Tensor        # float64 [M, K]: a MEMBER node's set, NaN-padded (K >= 1)
    weights: Tensor        # float64 [M, targets]: a leaf's votes
    voted: Tensor          # bool [M, targets]: which targets a leaf votes for
    roots: Tensor          # int64 [trees]
    depth: int
    max_feature: int

    @property
    def targets(self) -> int:
        return int(self.weights.shape[1])


def _depth(true_next: np.ndarray, false_next: np.ndarray, roots: Sequence[int],
           label: str) -> int:
    """The longest root-to-leaf path (edges); a cycle is an invalid model."""
    depth = 0
    for root in roots:
        stack = [(int(root), 0, frozenset[int]())]
        while stack:
            at, d, seen = stack.pop()
            if true_next[at] == at and false_next[at] == at:
                depth = max(depth, d)
                continue
            if at in seen:
                raise InvalidModel(f"{label}: the tree from node {root} has a cycle")
            seen = seen | {at}
            stack += [(int(true_next[at]), d + 1, seen), (int(false_next[at]), d + 1, seen)]
    return depth


def _forest(label: str, feature: np.ndarray, threshold: np.ndarray, mode: np.ndarray,
            true_next: np.ndarray, false_next: np.ndarray, missing: np.ndarray,
            members: list[list[float]], weights: np.ndarray, voted: np.ndarray,
            roots: Sequence[int]) -> Forest:
    count = len(feature)
    for name, nxt in (("true", true_next), ("false", false_next)):
        if len(nxt) and (nxt.min() < 0 or nxt.max() >= count):
            raise InvalidModel(f"{label}: a node's {name} branch names no node")
    if not roots:
        raise InvalidModel(f"{label}: the ensemble has no trees")
    if np.any(feature[mode != LEAF] < 0):
        raise InvalidModel(f"{label}: a negative feature id")
    width = max([1, *(len(m) for m in members)])
    table = np.full((count, width), np.nan)
    for i, values in enumerate(members):
        table[i, :len(values)] = values
    depth = _depth(true_next, false_next, roots, label)
    branch = feature[mode != LEAF]
    return Forest(
        feature=torch.from_numpy(np.where(mode == LEAF, 0, feature).astype(np.int64)),
        threshold=torch.from_numpy(threshold.astype(np.float64)),
        mode=torch.from_numpy(mode.astype(np.int64)),
        true_next=torch.from_numpy(true_next.astype(np.int64)),
        false_next=torch.from_numpy(false_next.astype(np.int64)),
        missing_true=torch.from_numpy(missing.astype(bool)),
        members=torch.from_numpy(table), weights=torch.from_numpy(weights),
        voted=torch.from_numpy(voted), roots=torch.tensor(list(roots), dtype=torch.int64),
        depth=depth, max_feature=int(branch.max()) if len(branch) else -1)


def _floats(value: object) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().to(torch.float64).numpy().reshape(-1)
    return np.asarray(value if value is not None else [], dtype=np.float64).reshape(-1)


def _ints(value: object) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().to(torch.int64).numpy().reshape(-1)
    return np.asarray(value if value is not None else [], dtype=np.int64).reshape(-1)


def forest_v5(label: str, attrs: dict[str, object]) -> Forest:
    """TreeEnsemble (ai.onnx.ml 5): interior nodes 0..K-1, then leaves K..K+L-1."""
    splits = _floats(attrs.get("nodes_splits"))
    features = _ints(attrs.get("nodes_featureids"))
    modes = _ints(attrs.get("nodes_modes"))
    true_ids = _ints(attrs.get("nodes_truenodeids"))
    false_ids = _ints(attrs.get("nodes_falsenodeids"))
    true_leaf = _ints(attrs.get("nodes_trueleafs"))
    false_leaf = _ints(attrs.get("nodes_falseleafs"))
    leaf_targets = _ints(attrs.get("leaf_targetids"))
    leaf_weights = _floats(attrs.get("leaf_weights"))
    roots = _ints(attrs.get("tree_roots"))
    targets = int(attrs.get("n_targets", 0))  # type: ignore[call-overload]
    k, leaves = len(splits), len(leaf_weights)
    if any(len(a) != k for a in (features, modes, true_ids, false_ids, true_leaf, false_leaf)):
        raise InvalidModel(f"{label}: the nodes_* attributes differ in length")
    if len(leaf_targets) != leaves:
        raise InvalidModel(f"{label}: leaf_targetids and leaf_weights differ in length")
    if targets < 1 or (leaves and (leaf_targets.min() < 0 or leaf_targets.max() >= targets)):
        raise InvalidModel(f"{label}: n_targets must be positive and cover every leaf target")
    if np.any(modes > MEMBER) or np.any(modes < 0):
        raise InvalidModel(f"{label}: nodes_modes must be 0..6")
    missing = _ints(attrs.get("nodes_missing_value_tracks_true")) if \
        "nodes_missing_value_tracks_true" in attrs else np.zeros(k, np.int64)
    # Each MEMBER node, in node order, takes the next NaN-terminated run of values.
    runs: list[list[float]] = [[]]
    for v in _floats(attrs.get("membership_values")):
        if math.isnan(v):
            runs.append([])
        else:
            runs[-1].append(float(v))
    member_nodes = np.flatnonzero(modes == MEMBER)
    if len(member_nodes) > len(runs) - (1 if not runs[-1] else 0):
        raise InvalidModel(f"{label}: membership_values has fewer sets than MEMBER nodes")
    members: list[list[float]] = [[] for _ in range(k + leaves)]
    for node, run in zip(member_nodes, runs):
        members[node] = run
    count = k + leaves
    ids = np.arange(count)
    true_next = np.where(true_leaf.astype(bool), k + true_ids, true_ids)
    false_next = np.where(false_leaf.astype(bool), k + false_ids, false_ids)
    weights = np.zeros((count, targets))
    voted = np.zeros((count, targets), bool)
    weights[k + np.arange(leaves), leaf_targets] = leaf_weights
    voted[k + np.arange(leaves), leaf_targets] = True
    for r in roots:
        if not 0 <= r < k:
            raise InvalidModel(f"{label}: tree root {r} is not a node")
    # A one-leaf tree is a root whose two branches are the same leaf.
    tree_roots = [int(k + true_ids[r]) if true_leaf[r] and false_leaf[r]
                  and true_ids[r] == false_ids[r] else int(r) for r in roots]
    return _forest(label, np.concatenate([features, np.zeros(leaves, np.int64)]),
                   np.concatenate([splits, np.zeros(leaves)]),
                   np.concatenate([modes, np.full(leaves, LEAF)]),
                   np.concatenate([true_next, ids[k:]]), np.concatenate([false_next, ids[k:]]),
                   np.concatenate([missing, np.zeros(leaves, np.int64)]), members,
                   weights, voted, tree_roots)


def forest_v1(label: str, attrs: dict[str, object], prefix: str, targets: int) -> Forest:
    """TreeEnsembleRegressor/Classifier (1-3): nodes named by (tree id, node id); votes in
    ``{prefix}_treeids/_nodeids/_ids/_weights`` (prefix ``target`` or ``class``)."""
    trees, nodes = _ints(attrs.get("nodes_treeids")), _ints(attrs.get("nodes_nodeids"))
    features = _ints(attrs.get("nodes_featureids"))
    values = _floats(attrs.get("nodes_values_as_tensor", attrs.get("nodes_values")))
    names = [str(n) for n in attrs.get("nodes_modes") or []]  # type: ignore[attr-defined]
    true_ids = _ints(attrs.get("nodes_truenodeids"))
    false_ids = _ints(attrs.get("nodes_falsenodeids"))
    count = len(nodes)
    if any(len(a) != count for a in (trees, features, values, names, true_ids, false_ids)):
        raise InvalidModel(f"{label}: the nodes_* attributes differ in length")
    try:
        modes = np.array([_MODE_NAMES[n] for n in names], np.int64)
    except KeyError as exc:
        raise InvalidModel(f"{label}: unknown node mode {exc.args[0]!r}") from None
    missing = _ints(attrs.get("nodes_missing_value_tracks_true")) if \
        attrs.get("nodes_missing_value_tracks_true") else np.zeros(count, np.int64)
    index = {(int(t), int(n)): i for i, (t, n) in enumerate(zip(trees, nodes))}
    if len(index) != count:
        raise InvalidModel(f"{label}: a (tree id, node id) pair appears twice")

    def child(i: int, ids: np.ndarray) -> int:
        if modes[i] == LEAF:
            return i
        found = index.get((int(trees[i]), int(ids[i])))
        if found is None:
            raise InvalidModel(f"{label}: node {nodes[i]} of tree {trees[i]} branches to "
                               f"missing node {ids[i]}")
        return found
    true_next = np.array([child(i, true_ids) for i in range(count)], np.int64)
    false_next = np.array([child(i, false_ids) for i in range(count)], np.int64)
    children = {int(c) for i in range(count) if modes[i] != LEAF
                for c in (true_next[i], false_next[i])}
    roots = [i for i in range(count) if i not in children]
    if len(roots) != len(set(trees.tolist())):
        raise InvalidModel(f"{label}: every tree needs exactly one root")
    vote_trees = _ints(attrs.get(f"{prefix}_treeids"))
    vote_nodes = _ints(attrs.get(f"{prefix}_nodeids"))
    vote_ids = _ints(attrs.get(f"{prefix}_ids"))
    vote_weights = _floats(attrs.get(f"{prefix}_weights_as_tensor",
                                     attrs.get(f"{prefix}_weights")))
    if not len(vote_ids) == len(vote_trees) == len(vote_nodes) == len(vote_weights):
        raise InvalidModel(f"{label}: the {prefix}_* attributes differ in length")
    if len(vote_ids) and (vote_ids.min() < 0 or vote_ids.max() >= targets):
        raise InvalidModel(f"{label}: a {prefix}_ids entry is out of range (0..{targets - 1})")
    weights = np.zeros((count, targets))
    voted = np.zeros((count, targets), bool)
    for t, n, target, w in zip(vote_trees, vote_nodes, vote_ids, vote_weights):
        at = index.get((int(t), int(n)))
        if at is None:
            raise InvalidModel(f"{label}: a vote names missing node {n} of tree {t}")
        weights[at, target] += w
        voted[at, target] = True
    return _forest(label, features, values, modes, true_next, false_next, missing,
                   [[] for _ in range(count)], weights, voted, roots)


def leaves(forest: Forest, x: Tensor) -> Tensor:
    """The leaf each tree reaches for each row of ``x`` [N, F]: int64 [N, trees]."""
    f = {name: getattr(forest, name).to(x.device) for name in
         ("feature", "threshold", "mode", "true_next", "false_next", "missing_true", "members")}
    n = x.shape[0]
    at = forest.roots.to(x.device).expand(n, -1)
    for _ in range(forest.depth):
        value = torch.gather(x, 1, f["feature"][at])
        split = f["threshold"][at]
        members = f["members"][at]
        tests = torch.stack([value <= split, value < split, value >= split, value > split,
                             value == split, value != split,
                             (value.unsqueeze(-1) == members).any(-1),
                             torch.ones_like(value, dtype=torch.bool)], dim=-1)
        go = torch.gather(tests, -1, f["mode"][at].unsqueeze(-1)).squeeze(-1)
        go = go | (f["missing_true"][at] & torch.isnan(value))
        at = torch.where(go, f["true_next"][at], f["false_next"][at])
    return at


def scores(forest: Forest, x: Tensor, aggregate: Aggregate) -> tuple[Tensor, Tensor]:
    """Aggregated votes [N, targets] (float64) and whether any tree voted for each."""
    reached = leaves(forest, x)
    weights = forest.weights.to(x.device)[reached]          # [N, trees, targets]
    voted = forest.voted.to(x.device)[reached]
    hit = voted.any(dim=1)
    if aggregate is Aggregate.SUM:
        total = weights.sum(dim=1)
    elif aggregate is Aggregate.AVERAGE:
        total = weights.sum(dim=1) / reached.shape[1]
    elif aggregate is Aggregate.MIN:
        total = torch.where(voted, weights, math.inf).amin(dim=1)
    else:
        total = torch.where(voted, weights, -math.inf).amax(dim=1)
    # A target no tree voted for scores 0 (onnxruntime's ScoreValue without a score).
    return torch.where(hit, total, torch.zeros_like(total)), hit


def probit(z: Tensor) -> Tensor:
    return math.sqrt(2) * torch.erfinv(2 * z - 1)


def logistic(z: Tensor) -> Tensor:
    return torch.sigmoid(z)


def post_transform(z: Tensor, how: PostTransform) -> Tensor:
    """onnxruntime's ``write_scores`` for two or more scores per row."""
    if how is PostTransform.PROBIT:
        return probit(z)
    if how is PostTransform.LOGISTIC:
        return logistic(z)
    if how is PostTransform.SOFTMAX:
        return torch.softmax(z, dim=-1)
    if how is PostTransform.SOFTMAX_ZERO:
        # Scores within 1e-7 of zero stay (as good as) zero and are left out of the sum.
        nonzero = z.abs() > 1e-7
        top = z.amax(dim=-1, keepdim=True)
        e = torch.where(nonzero, torch.exp(z - top), z * torch.exp(-top))
        return e / torch.where(nonzero, e, torch.zeros_like(e)).sum(dim=-1, keepdim=True)
    return z


def parse_post_transform(label: str, value: object) -> PostTransform:
    try:
        if isinstance(value, str):
            return PostTransform[value]
        return PostTransform(int(value))  # type: ignore[call-overload]
    except (KeyError, ValueError):
        raise InvalidModel(f"{label}: unknown post_transform {value!r}") from None


def parse_aggregate(label: str, value: object) -> Aggregate:
    try:
        if isinstance(value, str):
            return Aggregate[value]
        return Aggregate(int(value))  # type: ignore[call-overload]
    except (KeyError, ValueError):
        raise InvalidModel(f"{label}: unknown aggregate_function {value!r}") from None
