"""The onnxruntime calls of :class:`segflow.InferenceSession` beyond loading and running:
providers, model metadata, session options, profiling, OrtValue and IOBinding runs,
and writing the optimized model. :class:`OrtSessionApi` holds them; the session
derives from it, so these calls read as onnxruntime's and session.py keeps its own.

>>> sess = segflow.InferenceSession("m.onnx", providers=["CPUExecutionProvider"])  # doctest: +SKIP
>>> sess.get_providers()                                                         # doctest: +SKIP
['CPUExecutionProvider']
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import onnx
import torch

from segflow.errors import ExecutionError, InvalidSetting
from segflow.frontend.model_info import ModelInfo, ModelMetadata
from segflow.frontend.onnx_export import export_model
from segflow.ir.graph import Graph, Value
from segflow.ir.types import Device, DType, OptionalSpec, SequenceSpec, TensorSpec
from segflow.kernels.target import CpuTarget
from segflow.ops.registry import OpRegistry
from segflow.passes.fuse import RULE_NAMES
from segflow.passes.pack_weights import PackStore
from segflow.passes.pipeline import OptimizeOptions, PipelineResult, run_pipeline
from segflow.profiler.ort_profile import SessionProfile
from segflow.profiler.sink import EventSink
from segflow.runtime.io_binding import IOBinding, OrtValue
from segflow.runtime.ort_api import (
    BASIC_FUSE_RULES,
    RunOptions,
    SessionOptions,
    merge_keywords,
)
from segflow.runtime.providers import (
    ProviderChoice,
    ProviderSpec,
    get_available_providers,
    providers_for,
    resolve_providers,
)


@dataclass(frozen=True, slots=True)
class NodeArg:
    """An input or output description, like onnxruntime's NodeArg."""

    name: str
    type: str
    shape: list[int | str | None]
    dtype: DType | None


class OrtSessionApi:
    """onnxruntime's session calls over what :class:`segflow.InferenceSession` holds."""

    # Set by InferenceSession.__init__.
    device: Device
    graph: Graph
    registry: OpRegistry
    options: OptimizeOptions
    target: CpuTarget
    model_info: ModelInfo
    _providers: ProviderChoice
    _sess_options: SessionOptions
    _profile: SessionProfile | None
    _profile_sink: EventSink | None
    _output_names: list[str]
    _source: tuple[Any, SessionOptions | None, dict[str, Any]]

    def _setup(self, model: Any, sess_options: SessionOptions | None,
               providers: Sequence[ProviderSpec] | None,
               provider_options: Sequence[Mapping[str, Any]] | None,
               explicit: Mapping[str, Any], others: Mapping[str, Any], load_start: int
               ) -> tuple[dict[str, Any], SessionProfile | None]:
        """Resolve onnxruntime's arguments at load: the keywords ``sess_options`` and the
        ``explicit`` ones make (:func:`merge_keywords`), the providers and the device
        (``others["device"]``), and the profile when ``enable_profiling`` is set."""
        # What set_providers needs to build the session again on other providers.
        self._source = (model, sess_options, {**explicit, **others})
        config = merge_keywords(sess_options, explicit)
        self._sess_options = sess_options if sess_options is not None else SessionOptions()
        self._providers = session_providers(others["device"],
                                            resolve_providers(providers, provider_options))
        self.device = self._providers.device
        profile = (SessionProfile(self._sess_options.profile_file_prefix,
                                  self._providers.providers[0], load_start)
                   if self._sess_options.enable_profiling else None)
        return config, profile

    # The session's own calls these build on.
    def run_tensors(self, feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _rebuild(self, providers: Sequence[ProviderSpec],
                 provider_options: Sequence[Mapping[str, Any]] | None) -> None:
        raise NotImplementedError

    def _output_indices(self, names: Sequence[str] | None) -> Sequence[int]:
        raise NotImplementedError

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Initializers the model also lists as graph inputs (onnxruntime lets a run
        override them; segflow folds them as the constants they hold, so a feed naming
        one is refused as an unknown input)."""
        return [NodeArg(name, f"tensor({DType.from_onnx(code).onnx_name})", list(dims),
                        DType.from_onnx(code))
                for name, code, dims in self.model_info.overridable]

    def get_modelmeta(self) -> ModelMetadata:
        """The model's metadata; ``custom_metadata_map`` is a fresh dict (onnxruntime's is)."""
        meta = self.model_info.metadata
        return replace(meta, custom_metadata_map=dict(meta.custom_metadata_map))

    def get_providers(self) -> list[str]:
        """The providers in use, the CPU last (as onnxruntime reports them)."""
        return list(self._providers.providers)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {name: dict(options) for name, options in self._providers.options.items()}

    def get_session_options(self) -> SessionOptions:
        return self._sess_options

    def set_providers(self, providers: Sequence[ProviderSpec] | None = None,
                      provider_options: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Build the session again on ``providers`` (None: every available one), as
        onnxruntime does; the model is loaded again from what the session was given."""
        self.close()
        self._rebuild(providers if providers is not None else get_available_providers(),
                      provider_options)

    def get_profiling_start_time_ns(self) -> int:
        """When profiling started (system clock, ns); 0 when it is off."""
        return self._profile.start_time_ns if self._profile is not None else 0

    def end_profiling(self) -> str:
        """Write the onnxruntime-format profile (``SessionOptions.enable_profiling``) and
        return its file name; later runs are not profiled. "" when profiling is off."""
        profile, self._profile, self._profile_sink = self._profile, None, None
        return profile.write() if profile is not None else ""


    def run_with_ort_values(self, output_names: Sequence[str] | None,
                            input_dict_ort_values: Mapping[str, OrtValue],
                            run_options: RunOptions | None = None) -> list[OrtValue]:
        """:meth:`run` over :class:`segflow.OrtValue` feeds; returns OrtValues (left on
        the session's device)."""
        if run_options is not None:
            check_run(run_options)
        feeds = {name: v.tensor if isinstance(v, OrtValue) else v
                 for name, v in input_dict_ort_values.items()}
        outputs = self.run_tensors(feeds)
        return [OrtValue(outputs[i]) for i in self._output_indices(output_names)]

    def io_binding(self) -> IOBinding:
        """An :class:`segflow.IOBinding` for :meth:`run_with_iobinding`."""
        return IOBinding(self._output_names, self.device.torch)

    def run_with_iobinding(self, iobinding: IOBinding,
                           run_options: RunOptions | None = None) -> None:
        """Run on the binding's inputs; its outputs are then in ``iobinding.get_outputs()``."""
        if run_options is not None:
            check_run(run_options)
        iobinding.execute(self.run_tensors)

    def _run_passes(self, device: Device | None, dims: Mapping[str, int] | None = None,
                    packs: PackStore | None = None
                    ) -> tuple[PipelineResult, tuple[str, ...]]:
        """The session's pipeline, and where ``optimized_model_filepath`` is set, first the
        passes whose results are standard ONNX (constant folding and the basic fusions, as
        far as the session's options have them on), their graph written to that path
        (onnxruntime writes its file at load too); returns the pipeline's result and the
        first passes' log lines. Where the session's passes then go further, a warning
        says the file holds the graph before them."""
        path = self._sess_options.optimized_model_filepath
        log: tuple[str, ...] = ()
        if path:
            options = self.options
            expressible = replace(options, dense_chain=False, layout=False, plan_memory=False,
                                  fuse_off=options.fuse_off | (set(RULE_NAMES)
                                                               - set(BASIC_FUSE_RULES)))
            specs = {v.name: v.spec for v in [*self.graph.inputs, *self.graph.outputs]}
            first = run_pipeline(self.graph, expressible, registry=self.registry,
                                 device=device, target=self.target, dims=dims)
            onnx.save(export_model(self.graph, self.model_info, specs), path)
            log = tuple(f"{line} (written to {path})" for line in first.log
                        if line.startswith(("fold_constants", "fuse")))
        before = [(n.domain, n.op_type) for n in self.graph.nodes]
        result = run_pipeline(self.graph, self.options, registry=self.registry, device=device,
                              target=self.target, dims=dims, packs=packs)
        if path and (len(result.choices)
                     or before != [(n.domain, n.op_type) for n in self.graph.nodes]):
            warnings.warn(f"optimized_model_filepath: {path} holds the graph after constant "
                          "folding and the basic fusions; segflow's further passes make fused "
                          "ops and packed weights that have no ONNX form", stacklevel=3)
        return result, log


def node_args(values: Sequence[Value], info: ModelInfo) -> list[NodeArg]:
    """onnxruntime's descriptions of ``values``: a dim name the model does not declare
    (one shape inference invented) is None."""
    args = []
    for value in values:
        # onnxruntime's shape of an optional tensor is the tensor's; a sequence has none.
        held = value.container.elem if isinstance(value.container, OptionalSpec) \
            else value.container
        spec = held if isinstance(held, TensorSpec) else value.spec
        type_name = _type_name(value.container if value.container is not None else spec)
        shape = [info.reported_dim(d) for d in spec.shape] if spec.shape is not None else []
        args.append(NodeArg(value.name, type_name, shape, spec.dtype))
    return args


def _type_name(spec: TensorSpec | SequenceSpec | OptionalSpec) -> str:
    """onnxruntime's name of a type: ``tensor(float)``, ``seq(tensor(float))``,
    ``optional(seq(tensor(int64)))``."""
    if isinstance(spec, SequenceSpec):
        return f"seq({_type_name(spec.elem)})"
    if isinstance(spec, OptionalSpec):
        return f"optional({_type_name(spec.elem)})"
    return f"tensor({spec.dtype.onnx_name})" if spec.dtype else "tensor(unknown)"


def session_providers(device: str | Device | None, chosen: ProviderChoice | None) -> ProviderChoice:
    """The providers a session reports: those ``providers`` chose, or those standing for
    ``device=`` (the CPU when neither is given); both given, they must agree."""
    if device is None:
        return chosen if chosen is not None else providers_for(Device.parse("cpu"))
    try:
        parsed = Device.parse(device)
    except ValueError as exc:
        raise InvalidSetting(f"device: {exc}") from None
    if chosen is not None and chosen.device.kind is not parsed.kind:
        raise InvalidSetting(f"device={str(device)!r} and providers "
                             f"{list(chosen.providers)} name different devices; give one")
    return providers_for(parsed)


def check_run(options: RunOptions) -> None:
    if not isinstance(options, RunOptions):
        raise InvalidSetting(f"run_options: expected a segflow.RunOptions, got "
                             f"{type(options).__name__}")
    if options.terminate:
        raise ExecutionError("Exiting due to terminate flag being set to true.")
