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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
import torch

from segflow.engine import make_engine
from segflow.engine.base import Engine, ExecType, Var
from segflow.errors import InvalidInput, InvalidModel
from segflow.frontend.onnx_import import import_model, load_model
from segflow.ir.graph import Graph, Node, Value
from segflow.ir.types import Device, DType, TensorSpec
from segflow.ops import default_registry
from segflow.ops.registry import OpDef, OpRegistry, ViewOfInput
from segflow.optim import Optimizer, ParamState
from segflow.passes.autodiff import Differentiated, differentiate
from segflow.passes.place import place
from segflow.passes.segment import Phase, segment_nodes
from segflow.profiler.sink import active_sink
from segflow.runtime.executor import Executor
from segflow.runtime.explain import format_plan
from segflow.runtime.host_memory import HostMemory, apply_host_memory
from segflow.runtime.plan import Plan, make_plan, resolve_opdefs
from segflow.runtime.stats import RunStats
from segflow.settings import BulkSettings, engine_for_plan, resolve_engine

Tensor = torch.Tensor
ModelSource = str | os.PathLike[str] | bytes | onnx.ModelProto | Graph



class GradReq(enum.Enum):
    """What happens to a parameter's gradient each step (as MXNet's ``grad_req``)."""

    WRITE = "write"  # the buffer holds this step's gradient
    ADD = "add"      # the buffer accumulates gradients until ``zero_grad``
    NULL = "null"    # no gradient, no update (a frozen parameter)


@dataclass(frozen=True, slots=True)
class CrossEntropyLoss:
    """Append ``SoftmaxCrossEntropyLoss(logits, labels)`` to a model that outputs class scores.

    ``logits`` names the graph output (default: the only output); ``labels``
    becomes a new int64 graph input.
    """

    labels: str = "labels"
    logits: str | None = None
    reduction: str = "mean"
    name: str = "loss"


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one training step returns."""

    loss: float
    outputs: dict[str, np.ndarray]
    stats: RunStats


@dataclass(frozen=True, slots=True)
class _Update:
    """An engine task pushed after the step's segments (gradient store, optimizer, stats)."""

    after: int | None                 # the task producing what it reads (None: nothing)
    slots: tuple[int, ...]            # env slots it reads
    apply: Callable[[list[Tensor]], None]
    writes: tuple[Var, ...]
    name: str


def make_training_plan(graph: Graph, registry: OpRegistry, settings: BulkSettings,
                       device: Device, backward: frozenset[Node],
                       gradient_outputs: frozenset[Value]) -> Plan:
    """Segment a forward+backward graph with the training policy (see DESIGN.md)."""
    graph.validate()
    place(graph, device, None)
    opdefs = resolve_opdefs(graph, registry)

    def exec_type_of(node: Node) -> ExecType:
        return opdefs[node].exec_type_of(node)

    def phase_of(node: Node) -> Phase:
        return Phase.BACKWARD if node in backward else Phase.FORWARD

    segments = segment_nodes(graph.nodes, exec_type_of, settings, phase_of=phase_of,
                             gradient_outputs=gradient_outputs)
    return Plan(graph, tuple(segments), opdefs, settings, device, ("autodiff",))


class TrainingExecutor(Executor):
    """An Executor whose tasks also read state Vars, followed by update tasks."""

    def __init__(self, plan: Plan, registry: OpRegistry, engine: Engine,
                 settings_record: dict[str, object], aliases: Mapping[Value, frozenset[Var]]
                 ) -> None:
        super().__init__(plan, registry, engine, settings_record)
        self.task_of: dict[Node, int] = {}
        for index, task in enumerate(self.tasks):
            found: set[Var] = set()
            for step in task.steps:
                self.task_of[step.node] = index
                for value in step.node.inputs:
                    if value is not None:
                        found.update(aliases.get(value, ()))
            self.extra_reads[index] = tuple(sorted(found, key=lambda v: v.name))
        self._direct = None  # runs order against parameter updates through the engine's Vars
        self.phase_counts = {phase: sum(1 for s in plan.segments if s.phase is phase)
                             for phase in (Phase.FORWARD, Phase.BACKWARD)}

    def run_step(self, feeds: Sequence[Tensor], updates: Sequence[_Update]
                 ) -> tuple[list[Tensor], RunStats]:
        """One forward+backward run, with ``updates`` pushed after the plan's tasks."""
        engine, device = self.engine, self.plan.default_device

        def push_updates(run_vars: list[Var], env: list[Tensor | None]) -> int:
            for update in updates:
                reads = [] if update.after is None else [run_vars[update.after]]
                engine.push(_update_fn(update, env), reads, update.writes, ExecType.SYNC,
                            device, update.name)
            return len(updates)

        outputs, stats = self.run(feeds, active_sink(), after_tasks=push_updates)
        return outputs, replace(stats, forward_segments=self.phase_counts[Phase.FORWARD],
                                backward_segments=self.phase_counts[Phase.BACKWARD],
                                updates=len(updates))


def _update_fn(update: _Update, env: list[Tensor | None]) -> Callable[[], None]:
    def task() -> None:
        update.apply([env[s] for s in update.slots])  # type: ignore[misc]
    return task


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
    """

    def __init__(self, model: ModelSource, *, loss: str | CrossEntropyLoss | None = None,
                 optimizer: Optimizer | None = None, params: Sequence[str] | None = None,
                 grad_req: str | GradReq | Mapping[str, str | GradReq] = GradReq.WRITE,
                 device: str | Device = "cpu", engine: str | None = None,
                 bulk: bool | None = None, max_nodes_fwd: int | None = None,
                 max_nodes_bwd: int | None = None, train_mode: bool = True,
                 registry: OpRegistry | None = None, host_memory: str | None = None) -> None:
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

        loss_value = _attach_loss(graph, loss)
        self.loss_name = loss_value.name
        self.data_inputs = [v.name for v in graph.inputs]
        _lift_state(graph, state_names)
        running = _training_mode(graph) if train_mode else {}
        wrt = [graph_input(graph, n) for n in self.param_names
               if self.grad_req[n] is not GradReq.NULL]
        self.differentiated: Differentiated = differentiate(graph, loss_value, wrt, self.registry)
        self.unreachable = tuple(v.name for v in self.differentiated.unreachable)
        grads = {w.name: g for w, g in self.differentiated.gradients.items()}
        user_outputs = list(graph.outputs)
        extra = [loss_value, *grads.values(), *running.values()]
        graph.outputs = list(dict.fromkeys([*user_outputs, *extra]))
        self.output_names = [v.name for v in user_outputs]
        self.plan = make_training_plan(graph, self.registry, self.settings, self.device,
                                       frozenset(self.differentiated.backward_nodes),
                                       frozenset(grads.values()))
        self.engine_name = engine_for_plan(resolve_engine(engine),
                                           {s.device for s in self.plan.segments})
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
        self._update_tasks: dict[bool, list[_Update]] = {}  # built once per mode
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
        """One forward + backward (+ optimizer update unless ``update=False``)."""
        tensors = self._feeds(feeds) + [self.state[n] for n in self._state_order()]
        updates = self._update_tasks.get(update)
        if updates is None:
            updates = self._update_tasks[update] = self._updates(update)
        outputs, stats = self._executor.run_step(tensors, updates)
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
        data = [v for v in graph.inputs if v.name not in self.state]
        tensors = _feed_tensors(data, feeds, self.device)
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
        data = [v for v in self.graph.inputs if v.name not in self.state]
        return _feed_tensors(data, feeds, self.device)

    def _updates(self, apply: bool) -> list[_Update]:
        """Update tasks, one per task that produces gradients or running statistics."""
        executor = self._executor
        slots = executor.slots
        by_task: dict[int | None, list[tuple[str, Value]]] = {}
        for name, value in self._gradient_values.items():
            task = executor.task_of.get(value.producer) if value.producer else None
            by_task.setdefault(task, []).append((name, value))
        updates = []
        for task, group in by_task.items():
            names = tuple(n for n, _ in group)
            updates.append(_Update(task, tuple(slots[v] for _, v in group),
                                   self._apply_fn(names, apply),
                                   tuple(self._vars[n] for n in names),
                                   f"update {', '.join(names)}"))
        stats: dict[int | None, list[tuple[str, Value]]] = {}
        for name, value in self._running.items():
            task = executor.task_of.get(value.producer) if value.producer else None
            stats.setdefault(task, []).append((name, value))
        for task, group in stats.items():
            names = tuple(n for n, _ in group)
            targets = [self.state[n] for n in names]
            updates.append(_Update(task, tuple(slots[v] for _, v in group),
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
        _lift_state(graph, list(self.state))
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


def _find_value(graph: Graph, name: str) -> Value:
    for value in graph.values():
        if value.name == name:
            return value
    raise InvalidModel(f"the model has no value named {name!r}; its outputs are "
                       f"{', '.join(v.name for v in graph.outputs)}")


def _attach_loss(graph: Graph, loss: str | CrossEntropyLoss | None) -> Value:
    if isinstance(loss, str):
        return _find_value(graph, loss)
    if loss is None:
        scalars = [v for v in graph.outputs if v.spec.shape == ()]
        if len(scalars) == 1:
            return scalars[0]
        raise InvalidModel("say which value is the loss: loss='name' or "
                           "loss=CrossEntropyLoss(labels=...)")
    if loss.logits is not None:
        logits = _find_value(graph, loss.logits)
    elif len(graph.outputs) == 1:
        logits = graph.outputs[0]
    else:
        raise InvalidModel(f"the model has {len(graph.outputs)} outputs; name the class "
                           "scores with CrossEntropyLoss(logits=...)")
    shape = logits.spec.shape
    label_shape = (shape[0], *shape[2:]) if shape is not None and len(shape) >= 2 else None
    labels = graph.add_input(Value(loss.labels, TensorSpec(DType.INT64, label_shape)))
    out = Value(loss.name, TensorSpec(logits.spec.dtype, ()))
    opset = max(graph.opsets.get("", 17), 13)
    graph.append(Node("SoftmaxCrossEntropyLoss", [logits, labels], [out],
                      {"reduction": loss.reduction}, name=loss.name, opset=opset))
    return out


def _lift_state(graph: Graph, names: Sequence[str]) -> None:
    """Turn initializers into graph inputs the session feeds (its mutable state)."""
    for name in names:
        value = graph.initializers.pop(name, None)
        if value is None:
            continue
        value.const = None
        graph.add_input(value)


def _training_mode(graph: Graph) -> dict[str, Value]:
    """BatchNorm uses batch statistics and returns running ones; Dropout drops.

    Returns running-statistic name -> the value holding its update.
    """
    running: dict[str, Value] = {}
    for node in list(graph.nodes):
        if node.domain != "":
            continue
        if node.op_type == "BatchNormalization":
            node.attrs["training_mode"] = 1
            for index in (1, 2):
                out = _ensure_output(node, index)
                stat = node.inputs[2 + index]
                if stat is not None and stat in graph.inputs:
                    running[stat.name] = out
        elif node.op_type == "Dropout" and node.opset >= 12:
            flag = Value(f"{node.name}:training", TensorSpec(DType.BOOL, ()),
                         const=torch.tensor(True))
            graph.add_initializer(flag)
            if len(node.inputs) < 3:
                node.inputs = (*node.inputs, *([None] * (3 - len(node.inputs))))
            graph.set_input(node, 2, flag)
    return running


def _ensure_output(node: Node, index: int) -> Value:
    while len(node.outputs) <= index:
        value = Value(f"{node.name}:out{len(node.outputs)}")
        value.producer = node
        node.outputs = (*node.outputs, value)
    return node.outputs[index]


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
def _feed_tensors(inputs: Sequence[Value], feeds: Mapping[str, Any], device: Device
                  ) -> list[Tensor]:
    if not isinstance(feeds, Mapping):
        raise InvalidInput(f"feeds must be a dict of input name -> array, "
                           f"got {type(feeds).__name__}")
    expected = {v.name for v in inputs}
    for name in feeds:
        if name not in expected:
            raise InvalidInput(f"unknown input name {name!r}; the model's inputs are "
                               f"{', '.join(sorted(expected)) or '(none)'}")
    tensors = []
    for value in inputs:
        if value.name not in feeds:
            raise InvalidInput(f"missing input {value.name!r} (expected {value.spec.describe()})")
        data = feeds[value.name]
        tensor = data if isinstance(data, Tensor) else torch.from_numpy(
            np.ascontiguousarray(np.asarray(data)))
        spec = value.spec
        if spec.dtype is not None and DType.from_torch(tensor.dtype) is not spec.dtype:
            raise InvalidInput(f"input {value.name!r} has dtype {tensor.dtype}, expected "
                               f"{spec.describe()}")
        if spec.shape is not None and (
                len(spec.shape) != tensor.dim() or any(
                    isinstance(d, int) and d != s for d, s in zip(spec.shape, tensor.shape))):
            raise InvalidInput(f"input {value.name!r} has shape {list(tensor.shape)}, expected "
                               f"{spec.describe()}")
        tensors.append(tensor.to(device.torch) if device.kind.value != "cpu" else tensor)
    return tensors


def _to_numpy(tensor: Tensor) -> np.ndarray:
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return np.array(t.cpu().numpy(), copy=True)
