"""ai.onnx.ml ops against onnxruntime: Binarizer, ArrayFeatureExtractor, and tree
ensembles fitted by scikit-learn, written as TreeEnsembleRegressor/Classifier (ml opset 3,
the attributes scikit-learn converters write) and as TreeEnsemble (ml opset 5)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from ort_compare import assert_matches_ort, make_model, run_both
from sklearn.ensemble import (
    GradientBoostingClassifier,
    RandomForestClassifier,
    RandomForestRegressor,
)
from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

import segflow
from segflow.errors import InvalidModel, UnsupportedOp

RNG = np.random.default_rng(0)
ML = "ai.onnx.ml"


def _ml_model(node: onnx.NodeProto, feeds: dict[str, np.ndarray], outputs: list[str],
              ml_opset: int = 3) -> onnx.ModelProto:
    return make_model([node], feeds, outputs, 18, domains={ML: ml_opset})


# -- Binarizer, ArrayFeatureExtractor -------------------------------------------------------

def test_binarizer() -> None:
    feeds = {"x": RNG.standard_normal((4, 5)).astype(np.float32)}
    node = helper.make_node("Binarizer", ["x"], ["y"], domain=ML, threshold=0.3)
    got = assert_matches_ort(_ml_model(node, feeds, ["y"], 1), feeds, rtol=0, atol=0)
    assert set(np.unique(got[0])) <= {0.0, 1.0}


def test_binarizer_float64_matches_reference() -> None:
    # onnxruntime implements Binarizer for float32 only.
    feeds = {"x": RNG.standard_normal((4, 5))}
    node = helper.make_node("Binarizer", ["x"], ["y"], domain=ML, threshold=-0.2)
    model = _ml_model(node, feeds, ["y"], 1)
    got = segflow.InferenceSession(model, engine="inline").run(None, feeds)[0]
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, feeds)[0])


@pytest.mark.parametrize(("shape", "indices"), [((3, 5), [[0, 4, 2]]), ((2, 3, 4), [1, 1, 3]),
                                                ((6,), [5, 0])])
def test_array_feature_extractor(shape: tuple[int, ...], indices: list[Any]) -> None:
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32),
             "i": np.array(indices, np.int64)}
    node = helper.make_node("ArrayFeatureExtractor", ["x", "i"], ["y"], domain=ML)
    assert_matches_ort(_ml_model(node, feeds, ["y"], 1), feeds, rtol=0, atol=0)


def test_array_feature_extractor_index_out_of_range() -> None:
    feeds = {"x": np.zeros((2, 3), np.float32), "i": np.array([3], np.int64)}
    node = helper.make_node("ArrayFeatureExtractor", ["x", "i"], ["y"], domain=ML)
    sess = segflow.InferenceSession(_ml_model(node, feeds, ["y"], 1), engine="inline")
    with pytest.raises(Exception, match="outside 0..2"):
        sess.run(None, feeds)


# -- scikit-learn trees as ONNX attributes ---------------------------------------------------

def _v3_nodes(trees: list[Any]) -> tuple[dict[str, list[Any]], list[tuple[int, int, Any]]]:
    """nodes_* attributes of fitted sklearn trees, and (tree, node, leaf value) per leaf."""
    attrs: dict[str, list[Any]] = {k: [] for k in (
        "nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_values", "nodes_modes",
        "nodes_truenodeids", "nodes_falsenodeids")}
    leaves = []
    for t, est in enumerate(trees):
        tree = est.tree_
        for i in range(tree.node_count):
            leaf = tree.children_left[i] == -1
            attrs["nodes_treeids"].append(t)
            attrs["nodes_nodeids"].append(i)
            attrs["nodes_featureids"].append(0 if leaf else int(tree.feature[i]))
            attrs["nodes_values"].append(0.0 if leaf else float(np.float32(tree.threshold[i])))
            attrs["nodes_modes"].append("LEAF" if leaf else "BRANCH_LEQ")
            attrs["nodes_truenodeids"].append(0 if leaf else int(tree.children_left[i]))
            attrs["nodes_falsenodeids"].append(0 if leaf else int(tree.children_right[i]))
            if leaf:
                leaves.append((t, i, tree.value[i]))
    return attrs, leaves


def _regressor_node(trees: list[Any], scale: float, **extra: Any) -> onnx.NodeProto:
    attrs, leaves = _v3_nodes(trees)
    targets = leaves[0][2].shape[0]
    votes: dict[str, list[Any]] = {"target_treeids": [], "target_nodeids": [],
                                   "target_ids": [], "target_weights": []}
    for t, i, value in leaves:
        for k in range(targets):
            votes["target_treeids"].append(t)
            votes["target_nodeids"].append(i)
            votes["target_ids"].append(k)
            votes["target_weights"].append(float(value[k, 0]) * scale)
    return helper.make_node("TreeEnsembleRegressor", ["x"], ["y"], domain=ML,
                            n_targets=targets, **attrs, **votes, **extra)


def _classifier_node(trees: list[Any], scale: float, classes: list[int],
                     only_class: int | None = None, **extra: Any) -> onnx.NodeProto:
    attrs, leaves = _v3_nodes(trees)
    votes: dict[str, list[Any]] = {"class_treeids": [], "class_nodeids": [], "class_ids": [],
                                   "class_weights": []}
    for t, i, value in leaves:
        probs = value[0] / value[0].sum()
        for k in range(len(classes)):
            if only_class is not None and k != only_class:
                continue
            votes["class_treeids"].append(t)
            votes["class_nodeids"].append(i)
            votes["class_ids"].append(k)
            votes["class_weights"].append(float(probs[k]) * scale)
    return helper.make_node("TreeEnsembleClassifier", ["x"], ["label", "probabilities"],
                            domain=ML, classlabels_int64s=classes, **attrs, **votes, **extra)


def _data(n: int = 120, features: int = 5) -> np.ndarray:
    return RNG.standard_normal((n, features)).astype(np.float32)


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_forest_regressor_matches_ort(aggregate: str) -> None:
    x = _data()
    y = x[:, 0] * 2 + np.sin(x[:, 1]) + 0.1 * RNG.standard_normal(len(x))
    forest = RandomForestRegressor(n_estimators=7, max_depth=5, random_state=0).fit(x, y)
    node = _regressor_node(list(forest.estimators_), 1.0, aggregate_function=aggregate,
                           base_values=[0.25])
    feeds = {"x": _data(40)}
    got = assert_matches_ort(_ml_model(node, feeds, ["y"]), feeds, rtol=1e-6, atol=1e-6)
    if aggregate == "AVERAGE":
        np.testing.assert_allclose(got[0][:, 0], forest.predict(feeds["x"]) + 0.25, rtol=1e-5)


@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO"])
def test_multi_target_regressor_matches_ort(post: str) -> None:
    x = _data()
    y = np.stack([x[:, 0], x[:, 1] * x[:, 2], -x[:, 3]], axis=1)
    tree = DecisionTreeRegressor(max_depth=6, random_state=0).fit(x, y)
    node = _regressor_node([tree], 1.0, post_transform=post, base_values=[0.1, -0.2, 0.3])
    feeds = {"x": _data(50)}
    assert_matches_ort(_ml_model(node, feeds, ["y"]), feeds, rtol=1e-5, atol=1e-6)


def test_regressor_double_input_and_nan_matches_ort() -> None:
    x = _data()
    tree = DecisionTreeRegressor(max_depth=4, random_state=0).fit(x, x[:, 2])
    node = _regressor_node([tree], 1.0, nodes_missing_value_tracks_true=[1] * tree.tree_.node_count)
    feeds = {"x": _data(30).astype(np.float64)}
    feeds["x"][::3, :] = np.nan
    assert_matches_ort(_ml_model(node, feeds, ["y"]), feeds, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "LOGISTIC"])
def test_multiclass_forest_classifier_matches_ort(post: str) -> None:
    x = _data(200)
    labels = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5).astype(int) * 2
    forest = RandomForestClassifier(n_estimators=5, max_depth=4, random_state=0).fit(x, labels)
    node = _classifier_node(list(forest.estimators_), 1 / 5, [10, 11, 12, 13],
                            post_transform=post)
    feeds = {"x": _data(60)}
    got = assert_matches_ort(_ml_model(node, feeds, ["label", "probabilities"]), feeds,
                             rtol=1e-5, atol=1e-6)
    if post == "NONE":
        np.testing.assert_allclose(got[1], forest.predict_proba(feeds["x"]), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_array_equal(got[0], forest.predict(feeds["x"]) + 10)


@pytest.mark.parametrize("only_class", [None, 1])
def test_binary_tree_classifier_matches_ort(only_class: int | None) -> None:
    x = _data(200)
    labels = (x[:, 0] + x[:, 1] > 0).astype(int)
    tree = DecisionTreeClassifier(max_depth=4, random_state=0).fit(x, labels)
    node = _classifier_node([tree], 1.0, [0, 1], only_class=only_class)
    feeds = {"x": _data(80)}
    got = assert_matches_ort(_ml_model(node, feeds, ["label", "probabilities"]), feeds,
                             rtol=1e-6, atol=1e-6)
    if only_class == 1:
        # One class's votes: the label is the class whose probability passes 0.5.
        np.testing.assert_array_equal(got[0], tree.predict(feeds["x"]))


def test_binary_boosting_classifier_matches_ort() -> None:
    # Gradient boosting: one class's raw margins (of either sign), LOGISTIC.
    x = _data(200)
    labels = (x[:, 0] * x[:, 1] > 0).astype(int)
    model = GradientBoostingClassifier(n_estimators=6, max_depth=3, random_state=0)
    model.fit(x, labels)
    trees = [est[0] for est in model.estimators_]
    attrs, leaves = _v3_nodes(trees)
    votes = {"class_treeids": [t for t, _, _ in leaves], "class_nodeids": [i for _, i, _ in leaves],
             "class_ids": [1] * len(leaves),
             "class_weights": [float(v[0, 0]) * model.learning_rate for _, _, v in leaves]}
    node = helper.make_node("TreeEnsembleClassifier", ["x"], ["label", "probabilities"],
                            domain=ML, classlabels_int64s=[0, 1], post_transform="LOGISTIC",
                            **attrs, **votes)
    feeds = {"x": _data(60)}
    assert_matches_ort(_ml_model(node, feeds, ["label", "probabilities"]), feeds,
                       rtol=1e-5, atol=1e-6)


# -- TreeEnsemble (ml opset 5) ---------------------------------------------------------------

def _v5_node(trees: list[Any], aggregate: int, post: int = 0) -> onnx.NodeProto:
    """Fitted sklearn regression trees in TreeEnsemble's encoding."""
    splits, features, true_ids, false_ids, true_leaf, false_leaf = [], [], [], [], [], []
    leaf_targets, leaf_weights, roots = [], [], []
    for est in trees:
        tree = est.tree_
        interior = [i for i in range(tree.node_count) if tree.children_left[i] != -1]
        leaves = [i for i in range(tree.node_count) if tree.children_left[i] == -1]
        node_at = {n: len(splits) + k for k, n in enumerate(interior)}
        leaf_at = {n: len(leaf_weights) + k for k, n in enumerate(leaves)}
        roots.append(node_at[0])
        for n in interior:
            splits.append(float(np.float32(tree.threshold[n])))
            features.append(int(tree.feature[n]))
            for child, ids, is_leaf in ((tree.children_left[n], true_ids, true_leaf),
                                        (tree.children_right[n], false_ids, false_leaf)):
                leaf = tree.children_left[child] == -1
                ids.append(leaf_at[child] if leaf else node_at[child])
                is_leaf.append(int(leaf))
        for n in leaves:
            leaf_targets.append(0)
            leaf_weights.append(float(tree.value[n][0, 0]))
    return helper.make_node(
        "TreeEnsemble", ["x"], ["y"], domain=ML, n_targets=1, aggregate_function=aggregate,
        post_transform=post, tree_roots=roots, nodes_featureids=features,
        nodes_truenodeids=true_ids, nodes_falsenodeids=false_ids, nodes_trueleafs=true_leaf,
        nodes_falseleafs=false_leaf, leaf_targetids=leaf_targets,
        nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [len(splits)], [0] * len(splits)),
        nodes_splits=helper.make_tensor("s", TensorProto.FLOAT, [len(splits)], splits),
        leaf_weights=helper.make_tensor("w", TensorProto.FLOAT, [len(leaf_weights)],
                                        leaf_weights))


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
def test_tree_ensemble_v5_forest_matches_ort(aggregate: int) -> None:
    x = _data()
    forest = RandomForestRegressor(n_estimators=4, max_depth=4, random_state=1)
    forest.fit(x, x[:, 0] - x[:, 3])
    node = _v5_node(list(forest.estimators_), aggregate)
    feeds = {"x": _data(40)}
    model = _ml_model(node, feeds, ["y"], 5)
    expected, got = run_both(model, feeds)
    assert got[0].dtype == np.float32 and got[0].shape == (40, 1)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6, atol=1e-6)
    if aggregate == 0:
        np.testing.assert_allclose(got[0][:, 0], forest.predict(feeds["x"]), rtol=1e-5)


# -- refusals ---------------------------------------------------------------------------------

def test_string_class_labels_are_unsupported() -> None:
    tree = DecisionTreeClassifier(max_depth=2, random_state=0).fit(_data(), RNG.integers(0, 3, 120))
    node = _classifier_node([tree], 1.0, [0, 1, 2])
    del node.attribute[[a.name for a in node.attribute].index("classlabels_int64s")]
    node.attribute.append(helper.make_attribute("classlabels_strings", ["a", "b", "c"]))
    feeds = {"x": _data(3)}
    with pytest.raises(UnsupportedOp, match="TreeEnsembleClassifier over string tensors"):
        segflow.InferenceSession(_ml_model(node, feeds, ["label", "probabilities"]),
                                 engine="inline")


def test_branch_to_a_missing_node_is_invalid() -> None:
    tree = DecisionTreeRegressor(max_depth=2, random_state=0).fit(_data(), RNG.standard_normal(120))
    node = _regressor_node([tree], 1.0)
    falses = next(a for a in node.attribute if a.name == "nodes_falsenodeids")
    falses.ints[0] = 99
    feeds = {"x": _data(3)}
    with pytest.raises(InvalidModel, match="missing node 99"):
        segflow.InferenceSession(_ml_model(node, feeds, ["y"]), engine="inline")


def test_too_few_features_is_a_clear_error() -> None:
    tree = DecisionTreeRegressor(max_depth=3, random_state=0).fit(_data(), _data()[:, 4])
    node = _regressor_node([tree], 1.0)
    feeds = {"x": _data(3)}
    model = _ml_model(node, feeds, ["y"])
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "features"
    sess = segflow.InferenceSession(model, engine="inline")
    with pytest.raises(Exception, match="X has 2 features"):
        sess.run(None, {"x": feeds["x"][:, :2]})
