"""What ``segflow bench`` measures by default: its models, segflow modes and peers.

Plain data, apart from the runner (which needs torch and onnx), so that the command
line can describe the choices in ``--help`` without importing either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MODELS = ("resnet50", "mobilenet_v2", "bert_base", "mlp_chain")
DEFAULT_MODES = ("bulk", "nobulk")
# openvino is opt-in (--peers onnxruntime,openvino,torch): it is an optional install, and
# by default every model's table would carry a "missing" row where it is absent; where it
# is present it would cost each model its compile and a quarter of the timed rounds in
# the fixed time budget, and the default variant set would differ between machines.
DEFAULT_PEERS = ("onnxruntime", "torch")
# The names of segflow.bench.peers.PEERS, for --help without importing torch (a test checks
# that they match).
PEER_NAMES = ("onnxruntime", "openvino", "openvino-default", "torch")


@dataclass(frozen=True, slots=True)
class ModeSpec:
    """A segflow configuration to benchmark. None fields follow the defaults/environment."""

    name: str
    bulk: bool | None
    engine: str | None
    doc: str


# "bulk" is deliberately the *default* configuration, not bulk=True: a change that
# turns bulking off by default (or SEGFLOW_BULK_INFERENCE=0) must show in its counters.
MODES: Mapping[str, ModeSpec] = {
    m.name: m for m in (
        ModeSpec("bulk", None, None, "default settings (bulk unless SEGFLOW_BULK_INFERENCE=0)"),
        ModeSpec("nobulk", False, None, "bulking off: one engine task per node"),
        ModeSpec("inline", None, "inline", "default settings on the inline engine"),
        ModeSpec("inline-nobulk", False, "inline", "bulking off on the inline engine"),
    )
}
