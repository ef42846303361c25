"""TrainingSession: forward + backward in one engine run, then optimizer tasks.

Parameters are mutable state owned by the session: every step feeds them to
the executor as graph inputs, and the optimizer updates them in place in
engine tasks pushed after the step's segments. Each parameter (and each
BatchNorm running statistic) has its own engine ``Var``: every segment that
reads it, directly or through a view, declares a read, and its update task
declares a write. So an update starts as soon as its gradient exists and the
step's readers are done, and the next step's forward waits for it.

>>> sess = segflow.TrainingSession(model, loss=CrossEntropyLoss(labels="y"),
...                                optimizer=segflow.optim.SGD(lr=0.1, momentum=0.9))
>>> result = sess.step({"x": images, "y": labels})           # doctest: +SKIP
>>> result.loss, sess.gradients()["conv1.weight"].shape      # doctest: +SKIP
"""

from __future__ import annotations

import copy
import enum
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
import torch

from segflow.distributed.buckets import GradientGroup
from segflow.distributed.data_parallel import DataParallel, DataParallelOptions, model_fingerprint
from segflow.engine import make_engine
from segflow.engine.base import Var
from segflow.errors import InvalidInput, InvalidModel
from segflow.frontend.onnx_import import import_model, load_model
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import Device, DeviceKind
from segflow.ops import default_registry
from segflow.ops.registry import OpDef, OpRegistry, ViewOfInput
from segflow.optim import Optimizer, ParamState
from segflow.passes.attach_loss import CrossEntropyLoss, attach_loss
from segflow.passes.autodiff import Differentiated, differentiate
from segflow.passes.lift_state import lift_state
from segflow.passes.pipeline import OptimizeOptions, run_pipeline
from segflow.passes.segment import Phase
from segflow.passes.training_mode import training_mode
from segflow.runtime.executor import Executor
from segflow.runtime.explain import format_plan
from segflow.runtime.feeds import FeedValidator
from segflow.runtime.host_memory import HostMemory, apply_host_memory
from segflow.runtime.plan import make_plan
from segflow.runtime.stats import RunStats
from segflow.runtime.training_plan import TrainingExecutor, Update, make_training_plan
from segflow.settings import BulkSettings, engine_for_plan, resolve_engine

Tensor = torch.Tensor
ModelSource = str | os.PathLike[str] | bytes | onnx.ModelProto | Graph



class GradReq(enum.Enum):
    """What happens to a parameter's gradient each step (as MXNet's ``grad_req``)."""

    WRITE = "write"  # the buffer holds this step's gradient
    ADD = "add"      # the buffer accumulates gradients until ``zero_grad``
    NULL = "null"    # no gradient, no update (a frozen parameter)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one training step returns."""

    loss: float
    outputs: dict[str, np.ndarray]
    stats: RunStats


class TrainingSession:
    """Train a model: forward + backward + optimizer step per :meth:`step`.

    Args:
        model: ONNX path/bytes/``ModelProto`` (initializers become parameters) or a
            :class:`Graph` (e.g. from :class:`segflow.frontend.builder.GraphBuilder`).
        loss: name of a scalar value in the graph, or :class:`CrossEntropyLoss`.
        optimizer: e.g. ``segflow.optim.SGD(lr=0.1, momentum=0.9)``; None: gradients only.
        params: names of the trainable initializers (default: every float initializer
            of rank >= 1 that is not a BatchNorm running statistic).
        grad_req: ``"write"``, ``"add"`` or ``"null"``, for all or per parameter name.
        bulk, max_nodes_fwd, max_nodes_bwd: segmentation settings (None: environment
            ``SEGFLOW_BULK_TRAIN``, ``SEGFLOW_BULK_MAX_NODES_FWD/BWD``, then defaults).
        train_mode: BatchNorm normalizes with batch statistics (and updates its running
            ones) and Dropout drops; False keeps the model's inference behaviour.
        host_memory: ``"retain"`` or ``"system"``, as for
            :class:`segflow.InferenceSession` (None: ``SEGFLOW_HOST_MEMORY``, default retain).
        distributed: train data-parallel under the initialized ``torch.distributed``
            process group: True, or :class:`segflow.distributed.DataParallelOptions`
            (bucket size, averaging, timeout). Each rank steps on its own batch; the
            gradients are all-reduced while the backward segments run.
    """

    def __init__(self, model: ModelSource, *, loss: str | CrossEntropyLoss | None = None,
                 optimizer: Optimizer | None = None, params: Sequence[str] | None = None,
                 grad_req: str | GradReq | Mapping[str, str | GradReq] = GradReq.WRITE,
                 device: str | Device = "cpu", engine: str | None = None,
                 bulk: bool | None = None, max_nodes_fwd: int | None = None,
                 max_nodes_bwd: int | None = None, train_mode: bool = True,
                 registry: OpRegistry | None = None, host_memory: str | None = None,
                 distributed: bool | DataParallelOptions = False) -> None:
        self.device = Device.parse(device)
        memory_policy = apply_host_memory(HostMemory.resolve(host_memory), self.device)
        self.registry = registry or default_registry()
        self.settings = BulkSettings.resolve(train=bulk, max_nodes_fwd=max_nodes_fwd,
                                             max_nodes_bwd=max_nodes_bwd)
        self._optimizer = optimizer
        graph, initializer_names = _load(model, self.registry)
        buffers = _batchnorm_statistics(graph)
        names = list(params) if params is not None else [
            n for n in initializer_names if n not in buffers and _trainable(graph, n)]
        _check_params(graph, names)
        self.param_names = tuple(names)
        self.buffer_names = tuple(n for n in buffers if n not in names)
        self.grad_req = _grad_reqs(grad_req, self.param_names)
        state_names = [*self.param_names, *self.buffer_names]
        self.state: dict[str, Tensor] = {
            name: graph.initializers[name].const.to(self.device.torch)  # type: ignore[union-attr]
            for name in state_names}
        self._vars = {name: Var(name) for name in state_names}
        inference = clone_graph(graph)

        # The training rewrites (passes/), then the pipeline's rows that run for
        # training, then the gradients.
        attached = attach_loss(graph, loss)
        assert attached.loss is not None
        loss_value = attached.loss
        self.loss_name = loss_value.name
        self.data_inputs = [v.name for v in graph.inputs]
        lifted = lift_state(graph, state_names)
        modes = training_mode(graph) if train_mode else None
        running = dict(modes.running) if modes is not None else {}
        pipeline = run_pipeline(graph, OptimizeOptions.resolve(), registry=self.registry,
                                device=self.device, training=True)
        wrt = [graph_input(graph, n) for n in self.param_names
               if self.grad_req[n] is not GradReq.NULL]
        self.differentiated: Differentiated = differentiate(graph, loss_value, wrt, self.registry)
        self.unreachable = tuple(v.name for v in self.differentiated.unreachable)
        pass_log = (*attached.log, *lifted.log,
                    *(modes.log if modes is not None else ("training_mode: off",)),
                    *pipeline.log,
                    f"autodiff: {len(self.differentiated.backward_nodes)} backward nodes, "
                    f"{len(self.differentiated.gradients)} gradients")
        grads = {w.name: g for w, g in self.differentiated.gradients.items()}
        user_outputs = list(graph.outputs)
        extra = [loss_value, *grads.values(), *running.values()]
        graph.outputs = list(dict.fromkeys([*user_outputs, *extra]))
        self.output_names = [v.name for v in user_outputs]
        self.plan = make_training_plan(graph, self.registry, self.settings, self.device,
                                       frozenset(self.differentiated.backward_nodes),
                                       frozenset(grads.values()), pass_log)
        parallel = DataParallelOptions.resolve(distributed)
        self.engine_name = engine_for_plan(resolve_engine(engine),
                                           {s.device for s in self.plan.segments},
                                           communicates=parallel is not None)
        self._engine = make_engine(self.engine_name)
        record: dict[str, object] = {"device": str(self.device), **self.settings.as_dict(),
                                     "host_memory": memory_policy.value}
        aliases = _state_aliases(graph, {graph_input(graph, n): self._vars[n]
                                         for n in state_names}, self.plan.opdefs)
        self._executor = TrainingExecutor(self.plan, self.registry, self._engine, record,
                                          aliases)
        self.graph = graph
        self._grads: dict[str, Tensor] = {}
        self._opt_state = {name: ParamState() for name in self.param_names}
        self._gradient_values = grads
        self._running = running
        self._aliased_outputs = {v.name for v in user_outputs if v in aliases}
        self._inference_graph = inference
        self._inference: Executor | None = None
        self._check_feeds = FeedValidator([v for v in graph.inputs if v.name not in self.state])
        self._check_predict_feeds: FeedValidator | None = None
        self._update_tasks: dict[bool, list[Update]] = {}  # built once per mode
        self._data_parallel: DataParallel | None = None
        if parallel is not None:
            groups = [GradientGroup(task, tuple(n for n, _ in group),
                                    tuple(self._executor.slots[v] for _, v in group),
                                    tuple(tuple(self.state[n].shape) for n, _ in group),
                                    self.state[group[0][0]].dtype)
                      for task, group in self._gradient_groups().items()]
            self._data_parallel = DataParallel(
                self.state, groups, model_fingerprint([n.op_type for n in graph.nodes]),
                parallel, self._engine, self.device)
        self.last_run_stats: RunStats | None = None

    @property
    def optimizer(self) -> Optimizer | None:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Optimizer | None) -> None:
        """Swap the optimizer (its per-parameter state is kept)."""
        self._engine.wait_all()
        self._optimizer = optimizer
        self._update_tasks.clear()  # their closures hold the old optimizer

    # -- description -------------------------------------------------------------------
    def explain(self) -> str:
        """Forward and backward segments with boundary reasons, then the update tasks."""
        lines = [format_plan(self.plan)]
        counts = self._executor.phase_counts
        lines.append(f"training: {counts[Phase.FORWARD]} forward segments, "
                     f"{counts[Phase.BACKWARD]} backward segments, "
                     f"{len(self.differentiated.backward_nodes)} backward nodes")
        opt = self.optimizer
        trained = [n for n in self.param_names if n in self._gradient_values]
        lines.append(f"updates: {len(self._updates(True))} tasks after the segments "
                     f"({len(trained)} parameters, optimizer "
                     f"{opt.name + f' lr={opt.lr:g}' if opt else 'none'}, "
                     f"{len(self._running)} running statistics)")
        if self._data_parallel is not None:
            lines.append(self._data_parallel.describe())
        if self.unreachable:
            lines.append(f"no gradient path from the loss to: {', '.join(self.unreachable)}")
        return "\n".join(lines)

    def parameters(self) -> dict[str, Tensor]:
        """The live parameter tensors (updated in place by each step)."""
        self._engine.wait_all()
        return {name: self.state[name] for name in self.param_names}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of every parameter and running statistic."""
        self._engine.wait_all()
        return {name: t.detach().cpu().numpy().copy() for name, t in self.state.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._engine.wait_all()
        for name, data in state.items():
            if name not in self.state:
                raise InvalidInput(f"unknown parameter {name!r}")
            tensor = torch.as_tensor(np.asarray(data))
            if tuple(tensor.shape) != tuple(self.state[name].shape):
                raise InvalidInput(f"parameter {name!r} has shape {list(self.state[name].shape)}, "
                                   f"got {list(tensor.shape)}")
            self.state[name].copy_(tensor)

    def gradients(self) -> dict[str, Tensor]:
        """The gradient buffers (write: last step's; add: accumulated since zero_grad)."""
        self._engine.wait_all()
        return dict(self._grads)

    def grad(self, name: str) -> Tensor | None:
        return self.gradients().get(name)

    def zero_grad(self) -> None:
        """Clear the gradient buffers (what ``grad_req="add"`` accumulates into)."""
        self._engine.wait_all()
        self._grads.clear()

    def set_learning_rate(self, lr: float) -> None:
        if self.optimizer is None:
            raise ValueError("this session has no optimizer")
        self.optimizer = replace(self.optimizer, lr=lr)  # type: ignore[type-var]

    # -- running -----------------------------------------------------------------------
    def step(self, feeds: Mapping[str, Any], *, update: bool = True) -> StepResult:
        """One forward + backward (+ optimizer update unless ``update=False``).

        Distributed, the gradients are those of every rank's batch, averaged."""
        parallel = self._data_parallel
        if parallel is not None:
            parallel.check_step(update)
        tensors = self._feeds(feeds) + [self.state[n] for n in self._state_order()]
        updates = self._update_tasks.get(update)
        if updates is None:
            updates = self._update_tasks[update] = self._updates(update)
        outputs, stats = self._executor.run_step(
            tensors, updates, parallel.communicate if parallel is not None else None)
        if parallel is not None:
            stats = parallel.finish_step(stats)
        self.last_run_stats = stats
        if self._aliased_outputs:
            self._engine.wait_all()
        by_name = {v.name: t for v, t in zip(self.graph.outputs, outputs)}
        results = {name: _to_numpy(by_name[name]) for name in self.output_names}
        loss = float(by_name[self.loss_name].detach().double().sum())
        return StepResult(loss, results, stats)

    def predict(self, feeds: Mapping[str, Any],
                output_names: Sequence[str] | None = None) -> list[np.ndarray]:
        """Run the model for inference (BatchNorm uses running statistics) with the
        current parameters."""
        if self._inference is None:
            self._inference = self._build_inference()
        graph = self._inference.plan.graph
        if self._check_predict_feeds is None:
            self._check_predict_feeds = FeedValidator(
                [v for v in graph.inputs if v.name not in self.state])
        tensors = self._on_device(self._check_predict_feeds(feeds)[0])
        tensors += [self.state[v.name] for v in graph.inputs if v.name in self.state]
        self._engine.wait_all()
        outputs, stats = self._inference.run(tensors)
        self.last_run_stats = stats
        names = [v.name for v in graph.outputs]
        wanted = names if output_names is None else list(output_names)
        for name in wanted:
            if name not in names:
                raise InvalidInput(f"unknown output name {name!r}; the model's outputs are "
                                   f"{', '.join(names)}")
        return [_to_numpy(outputs[names.index(n)]) for n in wanted]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Distributed: steps in the block (``update=False``) accumulate gradients locally;
        the next step outside it all-reduces their sum (as DDP's ``no_sync``)."""
        if self._data_parallel is None:
            raise InvalidInput("no_sync() is for sessions made with distributed=True")
        with self._data_parallel.no_sync():
            yield

    def close(self) -> None:
        self._engine.close()

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------
    def _state_order(self) -> list[str]:
        return [v.name for v in self.graph.inputs if v.name in self.state]

    def _feeds(self, feeds: Mapping[str, Any]) -> list[Tensor]:
        """The data feeds checked as inference checks them, on the session's device."""
        return self._on_device(self._check_feeds(feeds)[0])

    def _on_device(self, tensors: list[Tensor]) -> list[Tensor]:
        if self.device.kind is DeviceKind.CPU:
            return tensors
        return [t.to(self.device.torch) for t in tensors]

    def _gradient_groups(self) -> dict[int | None, list[tuple[str, Value]]]:
        """The gradients by the plan task that produces them (None: no task)."""
        executor = self._executor
        by_task: dict[int | None, list[tuple[str, Value]]] = {}
        for name, value in self._gradient_values.items():
            task = executor.task_of.get(value.producer) if value.producer else None
            by_task.setdefault(task, []).append((name, value))
        return by_task

    def _updates(self, apply: bool) -> list[Update]:
        """Update tasks, one per task that produces gradients or running statistics."""
        executor = self._executor
        slots = executor.slots
        updates = []
        for task, group in self._gradient_groups().items():
            names = tuple(n for n, _ in group)
            update = Update(task, tuple(slots[v] for _, v in group),
                            self._apply_fn(names, apply), tuple(self._vars[n] for n in names),
                            f"update {', '.join(names)}")
            if self._data_parallel is not None:
                update = self._data_parallel.route(update)
            updates.append(update)
        stats: dict[int | None, list[tuple[str, Value]]] = {}
        for name, value in self._running.items():
            task = executor.task_of.get(value.producer) if value.producer else None
            stats.setdefault(task, []).append((name, value))
        for task, group in stats.items():
            names = tuple(n for n, _ in group)
            targets = [self.state[n] for n in names]
            updates.append(Update(task, tuple(slots[v] for _, v in group),
                                   _copy_into(targets), tuple(self._vars[n] for n in names),
                                   f"running stats {', '.join(names)}"))
        return updates

    def _apply_fn(self, names: tuple[str, ...], apply: bool) -> Callable[[list[Tensor]], None]:
        grads = self._grads
        reqs = [self.grad_req[n] for n in names]
        params = [self.state[n] for n in names]
        states = [self._opt_state[n] for n in names]
        optimizer = self.optimizer if apply else None

        def run(values: list[Tensor]) -> None:
            for name, req, g in zip(names, reqs, values):
                held = grads.get(name)
                if req is GradReq.ADD and held is not None:
                    held.add_(g)
                else:
                    grads[name] = g.clone() if req is GradReq.ADD else g
            if optimizer is not None:
                optimizer.update(params, [grads[n] for n in names], states)
        return run

    def _build_inference(self) -> Executor:
        graph = self._inference_graph
        lift_state(graph, list(self.state))
        plan = make_plan(graph, self.registry, BulkSettings.resolve(), self.device)
        return Executor(plan, self.registry, self._engine, {"device": str(self.device)})


# -- graph preparation --------------------------------------------------------------------
def _load(model: ModelSource, registry: OpRegistry) -> tuple[Graph, list[str]]:
    """The graph and the names of its initializers (not Constant nodes) in file order."""
    if isinstance(model, Graph):
        graph = clone_graph(model)  # the session updates weights in place
        return graph, list(graph.initializers)
    proto = load_model(model)
    return import_model(proto, registry), [t.name for t in proto.graph.initializer]


def clone_graph(graph: Graph) -> Graph:
    """A copy of ``graph`` with its own Values, Nodes and constant data.

    Iterative (``copy.deepcopy`` recurses along the producer/use chain and
    overflows the stack on deep networks); subgraphs are deep-copied.
    """
    values: dict[Value, Value] = {}

    def value(old: Value | None) -> Value | None:
        if old is None:
            return None
        new = values.get(old)
        if new is None:
            const = None if old.const is None else old.const.clone()
            new = values[old] = Value(old.name, old.spec, const=const)
        return new

    out = Graph(graph.name, parent=graph.parent)
    out.opsets = dict(graph.opsets)
    for v in graph.inputs:
        out.add_input(value(v))  # type: ignore[arg-type]
    for v in graph.initializers.values():
        out.add_initializer(value(v))  # type: ignore[arg-type]
    for node in graph.nodes:
        memo: dict[int, Any] = {id(graph): out}
        memo.update({id(old): new for old, new in values.items()})
        subgraphs = {k: copy.deepcopy(sub, memo) for k, sub in node.subgraphs.items()}
        copied = Node(node.op_type, [value(v) for v in node.inputs],
                      [value(v) for v in node.outputs], dict(node.attrs),  # type: ignore[misc]
                      name=node.name, domain=node.domain, opset=node.opset, subgraphs=subgraphs)
        copied.device = node.device
        out.append(copied)
    out.outputs = [value(v) for v in graph.outputs]  # type: ignore[misc]
    return out


def _batchnorm_statistics(graph: Graph) -> list[str]:
    names: dict[str, None] = {}
    for node in graph.nodes:
        if node.op_type == "BatchNormalization" and node.domain == "":
            for value in node.inputs[3:5]:
                if value is not None and value.name in graph.initializers:
                    names[value.name] = None
    return list(names)


def _trainable(graph: Graph, name: str) -> bool:
    value = graph.initializers.get(name)
    return (value is not None and value.const is not None and value.const.is_floating_point()
            and value.const.dim() >= 1)


def _check_params(graph: Graph, names: Sequence[str]) -> None:
    for name in names:
        value = graph.initializers.get(name)
        if value is None or value.const is None:
            known = ", ".join(list(graph.initializers)[:10])
            raise InvalidModel(f"parameter {name!r} is not an initializer of the model "
                               f"(initializers: {known} ...)")
        if not value.const.is_floating_point():
            raise InvalidModel(f"parameter {name!r} has dtype {value.const.dtype}; only "
                               "floating-point initializers can be trained")


def _grad_reqs(spec: str | GradReq | Mapping[str, str | GradReq],
               names: Sequence[str]) -> dict[str, GradReq]:
    def parse(value: str | GradReq) -> GradReq:
        try:
            return GradReq(value) if not isinstance(value, GradReq) else value
        except ValueError:
            raise ValueError(f"grad_req {value!r}: expected write, add or null") from None

    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(f"grad_req names unknown parameters: {', '.join(unknown)}")
        return {n: parse(spec.get(n, GradReq.WRITE)) for n in names}
    req = parse(spec)
    return dict.fromkeys(names, req)


def graph_input(graph: Graph, name: str) -> Value:
    for value in graph.inputs:
        if value.name == name:
            return value
    raise KeyError(name)


def _state_aliases(graph: Graph, state: Mapping[Value, Var], opdefs: Mapping[Node, OpDef]
                   ) -> dict[Value, frozenset[Var]]:
    """For every value that may be (a view of) a state tensor, the Vars it aliases: through
    the ops whose rows say their output may share their first input's storage."""
    aliases: dict[Value, frozenset[Var]] = {v: frozenset([var]) for v, var in state.items()}
    for node in graph.nodes:
        if opdefs[node].view_of_input is not ViewOfInput.NONE and node.inputs \
                and node.inputs[0] in aliases:
            source = aliases[node.inputs[0]]  # type: ignore[index]
            for value in node.outputs:
                aliases[value] = source
    return aliases


def _copy_into(targets: list[Tensor]) -> Callable[[list[Tensor]], None]:
    def run(values: list[Tensor]) -> None:
        for target, value in zip(targets, values):
            target.copy_(value)
    return run


# -- feeds and outputs --------------------------------------------------------------------
def _to_numpy(tensor: Tensor) -> np.ndarray:
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return np.array(t.cpu().numpy(), copy=True)
