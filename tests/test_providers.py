"""onnxruntime provider lists as segflow devices (runtime/providers.py)."""

from __future__ import annotations

import pytest

import segflow
from segflow.errors import InvalidSetting
from segflow.ir.types import Device
from segflow.runtime.providers import resolve_providers

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"


def test_available_providers_end_with_the_cpu() -> None:
    providers = segflow.get_available_providers()
    assert providers[-1] == CPU
    assert segflow.get_device() == ("GPU" if CUDA in providers else "CPU")
    assert set(providers) <= set(segflow.get_all_providers())


def test_the_first_available_provider_wins() -> None:
    both = [CUDA, CPU]
    chosen = resolve_providers([(CUDA, {"device_id": 1}), CPU], available=both)
    assert chosen is not None and chosen.device == Device.parse("cuda:1")
    assert chosen.providers == (CUDA, CPU)
    assert chosen.options[CUDA]["device_id"] == "1"
    chosen = resolve_providers([CUDA, CPU], [{"device_id": "0"}, {}], available=both)
    assert chosen is not None and chosen.device == Device.parse("cuda:0")
    assert resolve_providers(None) is None


def test_unavailable_providers_warn_and_fall_back() -> None:
    with pytest.warns(UserWarning) as warned:
        chosen = resolve_providers(["TensorrtExecutionProvider", CUDA], available=[CPU])
    assert [str(w.message).split("'")[1] for w in warned] == ["TensorrtExecutionProvider", CUDA]
    assert chosen is not None and chosen.device == Device.parse("cpu")
    assert chosen.providers == (CPU,)


def test_bad_provider_lists() -> None:
    with pytest.raises(InvalidSetting, match="listed more than once"):
        resolve_providers([CPU, CPU], available=[CPU])
    with pytest.raises(InvalidSetting, match="2 providers"):
        resolve_providers([CPU, CUDA], [{}], available=[CPU])
    with pytest.raises(InvalidSetting, match="list of provider names"):
        resolve_providers(CPU, available=[CPU])  # type: ignore[arg-type]
    with pytest.raises(InvalidSetting, match="device_id"):
        resolve_providers([(CUDA, {"device_id": "x"})], available=[CUDA, CPU])


def test_device_keyword_and_providers_must_agree(tiny_model: object) -> None:
    with pytest.raises(InvalidSetting, match="name different devices"):
        segflow.InferenceSession(tiny_model, providers=[CPU],  # type: ignore[arg-type]
                                 device="cuda:0")
    sess = segflow.InferenceSession(tiny_model, device="cpu")  # type: ignore[arg-type]
    assert sess.get_providers() == [CPU]
    assert sess.get_provider_options() == {CPU: {}}


@pytest.fixture
def tiny_model() -> object:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
