"""Control flow: If, Loop and Scan.

All three are LOCAL: they run their bound subgraphs on the scheduling thread
and decide at run time which branch runs or how many iterations happen. A
kernel receives its explicit inputs followed by the outer values its
subgraphs capture (``ctx.captured(node)`` order) and hands those to every
subgraph call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segflow.engine.base import ExecType
from segflow.ir.graph import Node, Value
from segflow.ops._common import ints, normalize_axis
from segflow.ops.registry import BindContext, Kernel, OpDef

Tensor = torch.Tensor


def _truth(t: Tensor) -> bool:
    """A boolean condition tensor (scalar or one element) as a Python bool."""
    return bool(t.reshape(-1)[0])


def _empty_scan_output(value: Value, device: torch.device) -> Tensor:
    """A zero-iteration scan output: shape [0, *per-iteration shape] when that is known."""
    spec = value.spec
    dtype = spec.dtype.torch if spec.dtype is not None else torch.float32
    if spec.shape is not None and all(isinstance(d, int) for d in spec.shape):
        dims = [int(d) for d in spec.shape]  # type: ignore[arg-type]
        return torch.empty([0, *dims], dtype=dtype, device=device)
    return torch.empty([0], dtype=dtype, device=device)


def _if(node: Node, ctx: BindContext) -> Kernel:
    then_run = ctx.subgraph(node.subgraphs["then_branch"])
    else_run = ctx.subgraph(node.subgraphs["else_branch"])
    captured = ctx.captured(node)
    n_explicit = len(node.inputs)

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        cond = inputs[0]
        assert cond is not None
        outer = dict(zip(captured, inputs[n_explicit:]))
        branch = then_run if _truth(cond) else else_run
        return branch([], outer)
    return kernel


def _loop(node: Node, ctx: BindContext) -> Kernel:
    body = node.subgraphs["body"]
    run = ctx.subgraph(body)
    captured = ctx.captured(node)
    n_explicit = len(node.inputs)
    n_carried = n_explicit - 2
    n_scan = len(body.outputs) - 1 - n_carried
    scan_values = body.outputs[1 + n_carried:]
    device = ctx.device

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        outer = dict(zip(captured, inputs[n_explicit:]))
        trip, cond_in = inputs[0], inputs[1] if n_explicit > 1 else None
        max_trip = int(trip.reshape(-1)[0]) if trip is not None else None
        # The spec calls the body's cond output "ignored" without a cond input, but
        # onnxruntime and ONNX's reference both stop on it, so segflow does too.
        keep = _truth(cond_in) if cond_in is not None else True
        carried: list[Tensor | None] = list(inputs[2:n_explicit])
        scans: list[list[Tensor]] = [[] for _ in range(n_scan)]
        i = 0
        while (max_trip is None or i < max_trip) and keep:
            iteration = torch.tensor(i, dtype=torch.int64, device=device)
            cond = torch.tensor(keep, dtype=torch.bool, device=device)
            outs = run([iteration, cond, *carried], outer)
            keep = _truth(outs[0])
            carried = list(outs[1:1 + n_carried])
            for acc, t in zip(scans, outs[1 + n_carried:]):
                acc.append(t)
            i += 1
        results = [t for t in carried]
        for acc, value in zip(scans, scan_values):
            results.append(torch.stack(acc) if acc else _empty_scan_output(value, device))
        return results  # type: ignore[return-value]
    return kernel


def _scan(node: Node, ctx: BindContext) -> Kernel:
    """Scan opset 9+: no batch axis; per-input/output axes and directions."""
    body = node.subgraphs["body"]
    run = ctx.subgraph(body)
    captured = ctx.captured(node)
    n_explicit = len(node.inputs)
    n_scan_in = int(node.attrs["num_scan_inputs"])
    n_state = n_explicit - n_scan_in
    n_scan_out = len(body.outputs) - n_state
    in_axes = list(node.attrs.get("scan_input_axes", [0] * n_scan_in))
    in_dirs = list(node.attrs.get("scan_input_directions", [0] * n_scan_in))
    out_axes = list(node.attrs.get("scan_output_axes", [0] * n_scan_out))
    out_dirs = list(node.attrs.get("scan_output_directions", [0] * n_scan_out))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        outer = dict(zip(captured, inputs[n_explicit:]))
        states = list(inputs[:n_state])
        xs = [t for t in inputs[n_state:n_explicit]]
        axes = [normalize_axis(a, x.dim()) for a, x in zip(in_axes, xs)]  # type: ignore[union-attr]
        length = xs[0].shape[axes[0]] if xs else 0  # type: ignore[union-attr]
        scans: list[list[Tensor]] = [[] for _ in range(n_scan_out)]
        for t in range(length):
            slices = [x.select(a, length - 1 - t if d else t)  # type: ignore[union-attr]
                      for x, a, d in zip(xs, axes, in_dirs)]
            outs = run([*states, *slices], outer)
            states = list(outs[:n_state])
            for acc, y in zip(scans, outs[n_state:]):
                acc.append(y)
        results = list(states)
        for acc, axis, direction in zip(scans, out_axes, out_dirs):
            if direction:
                acc.reverse()
            rank = acc[0].dim() + 1 if acc else 1
            results.append(torch.stack(acc, dim=normalize_axis(axis, rank)) if acc
                           else torch.empty([0]))
        return results  # type: ignore[return-value]
    return kernel


def _scan8(node: Node, ctx: BindContext) -> Kernel:
    """Scan opset 8: a leading batch axis, optional per-batch sequence lengths."""
    body = node.subgraphs["body"]
    run = ctx.subgraph(body)
    captured = ctx.captured(node)
    n_explicit = len(node.inputs)
    n_scan_in = int(node.attrs["num_scan_inputs"])
    n_state = n_explicit - 1 - n_scan_in
    n_scan_out = len(body.outputs) - n_state
    dirs = list(node.attrs.get("directions", [0] * n_scan_in))

    def kernel(inputs: Sequence[Tensor | None]) -> list[Tensor]:
        outer = dict(zip(captured, inputs[n_explicit:]))
        lens_t = inputs[0]
        states_in = list(inputs[1:1 + n_state])
        xs = [t for t in inputs[1 + n_state:n_explicit]]
        assert all(x is not None for x in xs)
        batch = xs[0].shape[0]  # type: ignore[union-attr]
        max_len = xs[0].shape[1]  # type: ignore[union-attr]
        lengths = ints(lens_t) if lens_t is not None else [max_len] * batch
        final_states: list[list[Tensor]] = [[] for _ in range(n_state)]
        scans: list[list[Tensor | None]] = [[] for _ in range(n_scan_out)]
        for b in range(batch):
            states = [s[b] for s in states_in]  # type: ignore[index]
            steps: list[list[Tensor]] = [[] for _ in range(n_scan_out)]
            length = lengths[b]
            for t in range(length):
                slices = [x[b, length - 1 - t if d else t]  # type: ignore[index]
                          for x, d in zip(xs, dirs)]
                outs = run([*states, *slices], outer)
                states = list(outs[:n_state])
                for acc, y in zip(steps, outs[n_state:]):
                    acc.append(y)
            for final, state in zip(final_states, states):
                final.append(state)  # type: ignore[arg-type]
            for per_batch, per_step in zip(scans, steps):
                if not per_step:
                    per_batch.append(None)  # an empty sequence: all zeros, shaped like the others
                    continue
                stacked = torch.stack(per_step)
                if length < max_len:  # pad short sequences with zeros
                    pad = stacked.new_zeros([max_len - length, *stacked.shape[1:]])
                    stacked = torch.cat([stacked, pad])
                per_batch.append(stacked)
        outputs = [torch.stack(final) for final in final_states]
        for per_batch in scans:
            like = next((t for t in per_batch if t is not None), None)
            if like is None:
                outputs.append(torch.empty([batch, max_len, 0]))
                continue
            outputs.append(torch.stack([torch.zeros_like(like) if t is None else t
                                        for t in per_batch]))
        return outputs
    return kernel


OPS: list[OpDef] = [
    OpDef("If", _if, exec_type=ExecType.LOCAL, doc="runs one of two subgraphs"),
    OpDef("Loop", _loop, exec_type=ExecType.LOCAL, doc="data-dependent iteration count"),
    OpDef("Scan", _scan8, since=8, until=8, exec_type=ExecType.LOCAL,
          doc="opset 8: batch axis and sequence_lens"),
    OpDef("Scan", _scan, since=9, exec_type=ExecType.LOCAL,
          doc="opset 9+: scan axes and directions per input/output"),
]
