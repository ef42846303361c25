"""Plans per input shape: a session whose graph computes shapes at run time from symbolic
input dims (``passes/specialize.py``) keeps, for each input shape its runs bring, a
session over the same model with those dims bound, built on the first run at that shape.

Each such session shares the weights the session read at load (:class:`BoundModel`:
the model without its large initializers, and those tensors by name) and runs the whole
pipeline at its shape: the shape arithmetic folds into constants, the reshapes it fed
get static shapes, and the fuse rules match what they match on a fixed-shape export.
The layout pass packs each weight once for all of them (a :class:`PackStore` over the
weights as read): a plan takes the packing another made of the same weight the same
way. What each keeps of its own is what its shape changes: a convolution's packing
for another input size, its plan and its bound kernels.

At most ``cap`` shapes are specialized; runs at any other shape use the session's own
plan, as do shapes whose bound model does not import (a shape the exporter's arithmetic
cannot take: the own plan then raises what onnxruntime raises, at run time). Since the
runs below the cap never take it, the session makes its own plan when first needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx
import torch

from segflow.errors import InvalidModel, UnsupportedOp
from segflow.passes.pack_weights import PackStore
from segflow.passes.specialize import SPECIALIZE_CAP, bind_input_shapes

if TYPE_CHECKING:
    from segflow.runtime.session import InferenceSession

ShapeKey = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class BoundModel:
    """A model whose large initializers are given as tensors (by name) rather than read
    from ``proto``, which holds their dims only; a session accepts it as its model, and
    takes it for a model a session checked at load with only its inputs' dims bound
    since (``import_model``'s ``checked``).
    ``packs``: what other sessions packed from those tensors (its layout pass takes a
    weight's packing from there rather than packing it again); ``finite``: whether the
    tensors hold no NaN or infinity (the session that read them scanned them)."""

    proto: onnx.ModelProto
    tensors: Mapping[str, torch.Tensor]
    packs: PackStore | None = None
    finite: bool = True


class Specializations:
    """The sessions specialized so far, by the shapes of the feeds (in input order).

    >>> session = specializations.session_for(feeds)     # doctest: +SKIP
    """

    __slots__ = ("_skeleton", "_tensors", "_names", "_build", "cap", "_sessions",
                 "refused", "declined", "_lock", "_packs", "_finite")

    def __init__(self, skeleton: onnx.ModelProto, tensors: Mapping[str, torch.Tensor],
                 input_names: Sequence[str],
                 build: Callable[[BoundModel], InferenceSession],
                 cap: int = SPECIALIZE_CAP, packs: PackStore | None = None,
                 finite: bool = True) -> None:
        self._skeleton = skeleton
        self._tensors = tensors
        self._names = tuple(input_names)
        self._build = build
        self.cap = cap
        self._sessions: dict[ShapeKey, InferenceSession] = {}
        self.refused: dict[ShapeKey, str] = {}   # shapes whose bound model did not import
        self.declined = 0                        # runs past the cap, on the own plan
        self._lock = threading.Lock()
        self._packs = packs
        self._finite = finite

    def session_for(self, feeds: Sequence[torch.Tensor]) -> InferenceSession | None:
        """The session specialized for the feeds' shapes, built now if this is the first
        run at them; None: run the session's own plan (past the cap, or refused)."""
        key = tuple(tuple(t.shape) for t in feeds)
        session = self._sessions.get(key)
        if session is not None or key in self.refused:
            return session
        with self._lock:
            session = self._sessions.get(key)
            if session is not None or key in self.refused:
                return session
            if len(self._sessions) >= self.cap:
                self.declined += 1
                return None
            bound = bind_input_shapes(self._skeleton, dict(zip(self._names, key)))
            try:
                session = self._build(BoundModel(bound, self._tensors, self._packs, self._finite))
            except (InvalidModel, UnsupportedOp) as exc:
                self.refused[key] = str(exc).splitlines()[0]
                return None
            self._sessions[key] = session
            return session

    @property
    def sessions(self) -> dict[ShapeKey, InferenceSession]:
        """The specialized sessions by feed shapes (a copy)."""
        return dict(self._sessions)

    def describe(self) -> list[str]:
        """One line per specialized shape (its node count), and what ran unspecialized."""
        lines = []
        for key, session in self._sessions.items():
            shapes = ", ".join(f"{name}={'x'.join(map(str, dims)) or 'scalar'}"
                               for name, dims in zip(self._names, key))
            lines.append(f"specialized for {shapes}: {len(session.graph.nodes)} nodes, "
                         f"{len(session.plan.segments)} segments")
            # What its runs did (native calls, replays): the runs at that shape are its.
            lines += [f"  {line}" for line in session.kernel_report()]
        for key, why in self.refused.items():
            lines.append(f"not specialized for {key}: {why}")
        if self.declined:
            lines.append(f"specialization cap ({self.cap} shapes) reached: {self.declined} "
                         "runs used the session's own plan")
        return lines

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()
