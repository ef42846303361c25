"""``explain()`` lines for a session's direct libdnnl kernels."""

from __future__ import annotations

from collections.abc import Sequence

from segflow.kernels.onednn.conv import DirectConv
from segflow.kernels.onednn.op import DirectOp


def describe_direct(ops: Sequence[tuple[str, DirectOp]], limit: int = 8) -> list[str]:
    """``explain()`` lines for a session's direct ops (``(node label, op)``): how many,
    the input layouts built through libdnnl, and each fallback with its reason."""
    if not ops:
        return []
    kinds: dict[str, int] = {}
    for _, op in ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    what = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in kinds.items())
    built = sum(op.direct_layouts for _, op in ops)
    fallbacks = [(label, key, why) for label, op in ops for key, why in op.why_not.items()]
    if not built and not fallbacks:
        return [f"direct kernels (libdnnl): {what}; no input layout built yet (each is built "
                "at its first run)", *_describe_winograd(ops, limit), *_describe_stems(ops, limit)]
    lines = [f"direct kernels (libdnnl): {what}; {built} input layout{'s' if built != 1 else ''}"
             f" built, {len(fallbacks)} fell back to torch"]
    for label, key, why in fallbacks[:limit]:
        shape, dtype = key[0], key[2]   # the input's sizes and dtype (the layout key)
        lines.append(f"  fallback: {label} at {list(shape)} {dtype}: {why}")  # type: ignore[call-overload]
    if len(fallbacks) > limit:
        lines.append(f"  ... and {len(fallbacks) - limit} more")
    lines.extend(_describe_winograd(ops, limit))
    lines.extend(_describe_stems(ops, limit))
    return lines


def _describe_stems(ops: Sequence[tuple[str, DirectOp]], limit: int) -> list[str]:
    """The convolutions marked to run the native stem kernel: the input layouts it runs,
    and those it declined (staged for libdnnl instead), with why."""
    marked = [(label, op) for label, op in ops
              if isinstance(op, DirectConv) and op.stem is not None]
    if not marked:
        return []
    layouts = sum(1 for _, op in marked for call in op.calls.values()
                  if call is not None and call.impl.startswith("native stem"))
    return [f"  native stem (NCHW image read in place): {len(marked)} convolution"
            f"{'s' if len(marked) != 1 else ''}, {layouts} input "
            f"layout{'s' if layouts != 1 else ''} built",
            *declined("the native stem", [(label, op.stem_not) for label, op in marked],
                       limit)]


def declined(what: str, reasons: Sequence[tuple[str, dict[tuple[object, ...], str]]],
              limit: int) -> list[str]:
    """A line per input layout a native kernel declined (``reasons``: per op, its node
    label and why it declined each layout key), ``limit`` at most."""
    declined = [(label, key, why) for label, of in reasons for key, why in of.items()]
    return [f"  not {what}: {label} at {list(key[0])}: {why}"  # type: ignore[call-overload]
            for label, key, why in declined[:limit]]


def _describe_winograd(ops: Sequence[tuple[str, DirectOp]], limit: int) -> list[str]:
    """The convolutions marked for Winograd: what runs so, what it holds, what declined."""
    marked = [(label, op) for label, op in ops
              if isinstance(op, DirectConv) and op.winograd is not None]
    if not marked:
        return []
    layouts = sum(1 for _, op in marked for call in op.calls.values()
                  if call is not None and call.run is not None)
    builders = [op.winograd for _, op in marked if op.winograd is not None]
    weights = sum(w.weight_bytes for w in builders)
    spaces = {id(w.workspace): w.workspace.nbytes for w in builders}
    return [f"  winograd F(4x4,3x3): {len(marked)} convolutions, {layouts} input "
            f"layout{'s' if layouts != 1 else ''} built; transformed weights "
            f"{weights / 2**20:.1f} MiB (the weights themselves), workspace "
            f"{sum(spaces.values()) / 2**20:.1f} MiB",
            *declined("winograd", [(label, op.winograd_not) for label, op in marked], limit)]
