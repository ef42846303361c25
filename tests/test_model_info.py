"""What a session keeps of the ModelProto (frontend/model_info.py)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from segflow.frontend.model_info import describe_model


def test_metadata_declared_dims_and_overridable_initializers() -> None:
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["o"])], "body", [],
                             [helper.make_tensor_value_info("o", TensorProto.FLOAT, ["inner"])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body)], "main",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch"]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("bias", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
        initializer=[numpy_helper.from_array(np.zeros(3, np.float32), "bias")],
        doc_string="graph doc")
    model = helper.make_model(graph, producer_name="p", domain="d", model_version=2,
                              doc_string="model doc")
    helper.set_model_props(model, {"a": "b"})
    info = describe_model(model)
    meta = info.metadata
    assert (meta.producer_name, meta.graph_name, meta.domain, meta.description,
            meta.graph_description, meta.version) == ("p", "main", "d", "model doc",
                                                      "graph doc", 2)
    assert dict(meta.custom_metadata_map) == {"a": "b"}
    assert info.declared_dims == {"batch", "inner"}
    assert info.overridable == (("bias", TensorProto.FLOAT, (3,)),)
    assert [info.reported_dim(d) for d in ("batch", "unk__0", 4, None)] == ["batch", None, 4,
                                                                            None]
