"""The errors segflow raises to users. Each carries a one-line message naming the culprit."""

from __future__ import annotations


class SegflowError(Exception):
    """Base class of every error segflow raises on purpose."""


class InvalidModel(SegflowError):
    """The model file is missing, unreadable, malformed or structurally inconsistent."""


class UnsupportedOp(InvalidModel):
    """The model uses an operator (or opset version) segflow does not implement."""


class InvalidSetting(SegflowError, ValueError):
    """A session option or ``SEGFLOW_*`` variable has a value segflow does not accept."""


class InvalidInput(SegflowError, ValueError):
    """A feed does not match the model: unknown or missing name, wrong dtype, rank or dim."""


class ExecutionError(SegflowError, RuntimeError):
    """A kernel failed at run time; the message names the node (``While executing ...``)."""


class CommunicationError(SegflowError, RuntimeError):
    """Data-parallel communication failed: a rank failed, was killed or did not answer in
    time; the message names the rank and the collective."""


class SegflowWarning(UserWarning):
    """Base class of every warning segflow issues: ``-W error::segflow.SegflowWarning``
    (or ``warnings.filterwarnings``) selects them all."""


class NativeKernelsUnavailable(SegflowWarning):
    """segflow's native kernels could not be built or loaded, so the kernels that use them
    run through torch (slower, same results within tolerance). Issued once per process,
    naming why and what falls back; ``SEGFLOW_NATIVE=0`` turns the kernels off without it.
    """


def node_failed(label: str, exc: BaseException) -> ExecutionError:
    """The error for ``exc`` raised while running the node ``label`` (``Node.label``):
    ``While executing <label>: <type>: <first line>``. Raise it ``from exc``; an
    ``ExecutionError`` names its node already and is re-raised as it is instead."""
    return ExecutionError(f"While executing {label}: {_first_line(exc)}")


def bind_failed(label: str, exc: BaseException) -> InvalidModel:
    """The error for ``exc`` raised while binding the node ``label``'s kernel at load (its
    attributes or inputs are not what the op takes): ``Cannot run <label>: <type>: <first
    line>``. Raise it ``from exc``; a ``SegflowError`` is re-raised as it is instead."""
    return InvalidModel(f"Cannot run {label}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    """``<type>: <first line of the message>``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"

