"""Tests for ChannelsLastStaging (kernels/staging.py, kernels/native/staging.c): an NCHW
input copied into a direct convolution's channels-last staging storage. A copy is
exact, so every check is bit for bit against torch's ``copy_``."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import segflow
from concurrency import on_one_and_more_threads
from replays import replays
from segflow import models
from segflow.kernels.native.build import NativeLibrary
from segflow.kernels.onednn.library import Library
from segflow.kernels.staging import ChannelsLastStaging

LIB, WHY = NativeLibrary.probe()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"native kernels {WHY}")


def _staging() -> ChannelsLastStaging:
    assert LIB is not None
    return ChannelsLastStaging(LIB)


@pytest.mark.parametrize("shape", [(1, 3, 224, 224), (2, 3, 17, 5), (1, 1, 64, 64),
                                   (3, 4, 9, 9), (1, 5, 40, 33), (1, 3, 1, 1)])
def test_copies_every_value_to_its_channels_last_place(shape):
    stage = _staging()
    x = torch.randn(shape)
    x.view(-1)[:: 7] = float("nan")       # NaN payloads and signs travel as bits
    x.view(-1)[1:: 11] = -0.0
    out = torch.empty(shape, memory_format=torch.channels_last)
    assert stage(x, out) is out
    want = x.contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert stage.native_calls == 1 and stage.torch_calls == 0


def test_the_split_between_threads_does_not_change_a_bit():
    stage = _staging()
    x = torch.randn(2, 3, 96, 96)

    def copy() -> torch.Tensor:
        return stage(x, torch.empty(x.shape, memory_format=torch.channels_last))
    one, many = on_one_and_more_threads(copy)
    assert torch.equal(one, many) and torch.equal(one, x)


def test_what_it_does_not_take_goes_through_copy():
    stage = _staging()
    x = torch.randn(1, 3, 8, 8)
    for source, out in (
            (x.to(torch.float64), torch.empty(1, 3, 8, 8, memory_format=torch.channels_last,
                                               dtype=torch.float64)),
            (x.transpose(2, 3), torch.empty(1, 3, 8, 8, memory_format=torch.channels_last)),
            (x, torch.empty(1, 3, 8, 8)),                   # a plain destination
            (x[0], torch.empty(3, 8, 8))):                  # not 4-D
        assert torch.equal(stage(source, out), source.to(out.dtype))
    assert stage.native_calls == 0 and stage.torch_calls == 4
    assert stage.why_torch == {"not a contiguous float32 NCHW input into channels-last "
                               "storage of its size": 4}


@pytest.mark.skipif(Library.load() is None, reason="libdnnl is not installed")
def test_a_session_stages_its_nchw_feed_natively():
    model = models.build("resnet18", image_size=64)
    # (Where the stem is the native stem kernel it reads the feed in place instead:
    # tests/test_native_stem.py.)
    sess = segflow.InferenceSession(model, compile="codegen",
                                    optimize={"layout.native_stem": False})
    # The replay's steps: the stem stages.
    stagings = [step.op.stage for replay in replays(sess) for step in replay.steps
                if getattr(step.op, "stage", None) is not None]
    assert len(stagings) == 1, "the stem convolution has no native staging"
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, {"input": x})[0],
                                   ref.run(None, {"input": x})[0], atol=1e-4, rtol=1e-4)
    assert stagings[0].native_calls >= 3 and stagings[0].torch_calls == 0
    (line,) = [line for line in sess.kernel_report() if line.startswith("NCHW input")]
    assert line == (f"NCHW input staged into channels-last: 1 node; "
                    f"{stagings[0].native_calls} calls native, 0 through torch")
