"""InferenceSession: numerics against onnxruntime, the API surface, and bad input."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import segflow
from segflow import models
from segflow.ops import default_registry
from segflow.ops.registry import OpDef, OpRegistry

ATOL, RTOL = 1e-4, 1e-3


def ort_run(model: onnx.ModelProto, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("name,options,batch", [
    ("resnet50", {}, 1),
    ("resnet18", {"image_size": 64}, 2),
    ("mobilenet_v2", {}, 1),
    ("bert_base", {"seq_len": 32}, 1),
    ("bert_tiny", {"seq_len": 16}, 3),
    ("mlp_chain", {}, 4),
    ("nonzero_mid", {}, 2),
])
def test_builtin_models_match_onnxruntime(name, options, batch):
    build_opts = {k: v for k, v in options.items() if k != "seq_len"}
    model = models.build(name, **build_opts)
    feeds = models.example_inputs(name, batch_size=batch, **options)
    expected = ort_run(model, feeds)
    got = segflow.InferenceSession(model).run(None, feeds)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL)


def test_symbolic_dims_run_at_any_shape():
    model = models.build("bert_tiny")
    sess = segflow.InferenceSession(model)
    for batch, seq in [(1, 5), (2, 17), (3, 64)]:
        feeds = models.example_inputs("bert_tiny", batch_size=batch, seq_len=seq)
        out = sess.run(["last_hidden_state"], feeds)[0]
        assert out.shape == (batch, seq, 128)
        np.testing.assert_allclose(out, ort_run(model, feeds)[0], atol=ATOL, rtol=RTOL)


def test_inputs_outputs_and_output_selection():
    model = models.build("bert_tiny")
    sess = segflow.InferenceSession(model)
    inputs = sess.get_inputs()
    assert [i.name for i in inputs] == ["input_ids", "attention_mask"]
    assert inputs[0].type == "tensor(int64)" and inputs[0].shape == ["batch", "seq"]
    assert [o.name for o in sess.get_outputs()] == ["last_hidden_state", "pooler_output"]
    feeds = models.example_inputs("bert_tiny", seq_len=8)
    pooled = sess.run(["pooler_output"], feeds)
    assert len(pooled) == 1 and pooled[0].shape == (1, 128)


def test_model_from_path_and_bytes(tmp_path):
    model = models.build("mlp_chain", layers=3)
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    feeds = models.example_inputs("mlp_chain", layers=3)
    a = segflow.InferenceSession(str(path)).run(None, feeds)[0]
    b = segflow.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_array_equal(a, b)


def test_external_data(tmp_path):
    model = models.build("mlp_chain", layers=3)
    path = tmp_path / "ext.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").exists()
    feeds = models.example_inputs("mlp_chain", layers=3)
    out = segflow.InferenceSession(str(path)).run(None, feeds)[0]
    # onnx.save rewrote `model` to point at the external file: compare with a fresh build.
    reference = ort_run(models.build("mlp_chain", layers=3), feeds)[0]
    np.testing.assert_allclose(out, reference, atol=ATOL, rtol=RTOL)


def test_outputs_do_not_alias_weights_or_feeds():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["w"], ["z"])],
        "alias", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
                       helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
        [helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = segflow.InferenceSession(model)
    feed = np.array([5.0, 6.0], np.float32)
    y, z = sess.run(None, {"x": feed})
    y[0] = -1
    z[0] = -1
    assert feed[0] == 5.0
    assert sess.run(None, {"x": feed})[1][0] == 1.0


def test_declared_output_shape_disagreement_warns_and_follows_data():
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "wrong_decl",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 7])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = segflow.InferenceSession(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sess.run(None, {"x": np.ones((2, 3), np.float32)})[0]
    assert out.shape == (2, 3)
    assert any("declares" in str(w.message) for w in caught)


# -- bad input ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert():
    return segflow.InferenceSession(models.build("bert_tiny"))


def good_feeds():
    return models.example_inputs("bert_tiny", seq_len=8)


def expect_invalid(sess, feeds, *fragments):
    with pytest.raises(segflow.InvalidInput) as info:
        sess.run(None, feeds)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_unknown_input_name(bert):
    feeds = good_feeds()
    feeds["input_idz"] = feeds.pop("input_ids")
    expect_invalid(bert, feeds, "input_idz", "input_ids")


def test_missing_input(bert):
    feeds = good_feeds()
    del feeds["attention_mask"]
    expect_invalid(bert, feeds, "missing input", "attention_mask")


def test_wrong_dtype(bert):
    feeds = good_feeds()
    feeds["input_ids"] = feeds["input_ids"].astype(np.int32)
    expect_invalid(bert, feeds, "input_ids", "int32", "int64")


def test_wrong_rank(bert):
    feeds = good_feeds()
    feeds["input_ids"] = feeds["input_ids"][0]
    expect_invalid(bert, feeds, "input_ids", "rank 1", "rank 2")


def test_fixed_dimension_mismatch():
    sess = segflow.InferenceSession(models.build("mlp_chain", layers=2))
    expect_invalid(sess, {"x": np.zeros((1, 63), np.float32)}, "'x'", "63", "64", "axis 1")


def test_symbolic_dimension_disagreement(bert):
    feeds = good_feeds()
    feeds["attention_mask"] = np.ones((1, 9), np.int64)
    expect_invalid(bert, feeds, "attention_mask", "'seq'")


def test_checks_hold_after_a_run_accepted_the_same_dtypes_and_shapes(bert):
    """numpy feeds with the dtypes and shapes the last checked run accepted skip the
    per-dim checks (a small model's fixed cost); anything else is checked in full."""
    expected = bert.run(None, good_feeds())
    assert bert._validate(good_feeds())[1] == {"batch": 1, "seq": 8}
    for got, want in zip(bert.run(None, good_feeds()), expected):
        np.testing.assert_array_equal(got, want)
    bad = good_feeds()
    bad["attention_mask"] = np.ones((1, 9), np.int64)
    expect_invalid(bert, bad, "attention_mask", "'seq'")
    bad = good_feeds()
    bad["input_ids"] = bad["input_ids"].astype(np.int32)
    expect_invalid(bert, bad, "input_ids", "int32", "int64")
    bad = good_feeds()
    del bad["attention_mask"]
    expect_invalid(bert, bad, "missing input", "attention_mask")
    bad = good_feeds()
    bad["input_idz"] = bad.pop("input_ids")
    expect_invalid(bert, bad, "input_idz")
    listed = good_feeds()
    listed["input_ids"] = listed["input_ids"].tolist()   # not an array: the full checks
    np.testing.assert_array_equal(bert.run(None, listed)[0], expected[0])
    longer = models.example_inputs("bert_tiny", seq_len=12)
    assert bert._validate(longer)[1] == {"batch": 1, "seq": 12}
    assert bert.run(None, longer)[0].shape[1] == 12
    assert bert._validate(good_feeds())[1] == {"batch": 1, "seq": 8}


def test_a_none_feed_is_named(bert):
    bad = good_feeds()
    bad["input_ids"] = None
    expect_invalid(bert, bad, "'input_ids' is None", "expected an array")


def test_an_empty_batch_runs_through_every_convolution_path():
    """Batch 0 is a valid ONNX input: onnxruntime returns empty outputs, and so must the
    direct, blocked and Winograd convolutions (Winograd has no tiles to transform)."""
    build = {"num_classes": 10, "image_size": 32}
    for name in ("resnet18", "mobilenet_v2"):
        model = models.build(name, **build)
        full = models.example_inputs(name, batch_size=2, **build)
        empty = {k: v[:0] for k, v in full.items()}
        sess = segflow.InferenceSession(model)
        for feeds in (empty, full, empty):
            for got, want in zip(sess.run(None, feeds), ort_run(model, feeds)):
                assert got.shape == want.shape
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_an_index_out_of_range_names_it(bert):
    """A token id past the vocabulary: one line naming the node, the index and the range
    (torch's own message says only 'index out of range in self')."""
    bad = good_feeds()
    bad["input_ids"][0, 2] = 10**6
    with pytest.raises(segflow.ExecutionError) as info:
        bert.run(None, bad)
    message = str(info.value)
    assert "embeddings.word_embeddings" in message and "\n" not in message
    assert "Gather index 1000000 is out of range for axis 0 of size 1000" in message
    assert "(1 of 8 indices outside [-1000, 1000))" in message
    good = bert.run(None, good_feeds())   # the session still runs
    assert good[0].shape[:2] == (1, 8)


def test_unknown_output_name(bert):
    with pytest.raises(segflow.InvalidInput, match="hidden"):
        bert.run(["hidden"], good_feeds())


def test_feeds_must_be_a_mapping(bert):
    with pytest.raises(segflow.InvalidInput, match="dict"):
        bert.run(None, [np.zeros(3)])


def test_missing_model_file(tmp_path):
    with pytest.raises(segflow.InvalidModel, match="not found") as info:
        segflow.InferenceSession(str(tmp_path / "nope.onnx"))
    assert "nope.onnx" in str(info.value)


def test_corrupt_model_file(tmp_path):
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(b"\x00\x01 this is not protobuf \xff" * 10)
    with pytest.raises(segflow.InvalidModel) as info:
        segflow.InferenceSession(str(path))
    assert "corrupt.onnx" in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_op_fails_at_load_naming_op_domain_opset_node():
    g = helper.make_graph([helper.make_node("FrobnicateV2", ["x"], ["y"], name="frob")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(segflow.UnsupportedOp) as info:
        segflow.InferenceSession(model)
    message = str(info.value)
    for fragment in ("FrobnicateV2", "ai.onnx", "17", "frob"):
        assert fragment in message


def test_unknown_domain_fails_at_load():
    g = helper.make_graph([helper.make_node("Foo", ["x"], ["y"], name="n", domain="com.acme")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("com.acme", 1)])
    with pytest.raises(segflow.UnsupportedOp, match="com.acme"):
        segflow.InferenceSession(model)


def test_undefined_value_is_invalid_model():
    g = helper.make_graph([helper.make_node("Relu", ["ghost"], ["y"], name="r")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(segflow.InvalidModel, match="ghost"):
        segflow.InferenceSession(model)


def test_read_only_and_reversed_feeds():
    model = models.build("mlp_chain", layers=2)
    sess = segflow.InferenceSession(model)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    expected = sess.run(None, {"x": x})[0]
    frozen = x.copy()
    frozen.flags.writeable = False
    np.testing.assert_array_equal(sess.run(None, {"x": frozen})[0], expected)
    reversed_rows = x[::-1].copy()[::-1]  # negative strides, same values as x
    np.testing.assert_array_equal(sess.run(None, {"x": reversed_rows})[0], expected)


def _mode_probe_model() -> tuple[onnx.ModelProto, OpRegistry, list[bool]]:
    """A model whose one test op records whether it ran under torch.inference_mode."""
    seen: list[bool] = []

    def bind(node, ctx):
        def kernel(inputs):
            seen.append(torch.is_inference_mode_enabled())
            return [inputs[0] * 2]
        return kernel

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Probe", ["x"], ["p"], name="probe", domain="test"),
             helper.make_node("Relu", ["p"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid("test", 1)])
    return model, default_registry().extend([OpDef("Probe", bind, domain="test")]), seen


@pytest.mark.parametrize("engine", ["inline", "threaded"])
def test_numpy_runs_skip_autograd_and_tensor_runs_return_ordinary_tensors(engine):
    model, registry, seen = _mode_probe_model()
    sess = segflow.InferenceSession(model, engine=engine, registry=registry)
    data = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    (out,) = sess.run(None, {"x": data})
    np.testing.assert_array_equal(out, np.maximum(2 * data, 0))
    # The inline engine runs the kernels in the calling thread, under inference_mode;
    # the threaded engine's workers run them outside it (the mode is thread-local).
    assert seen == [engine == "inline"]
    assert not torch.is_inference_mode_enabled()        # restored after the run
    (tensor,) = sess.run_tensors({"x": torch.from_numpy(data)})
    assert seen[-1] is False and not tensor.is_inference()
    tensor.requires_grad_()                              # usable with autograd
