"""Scratch memory that the kernels of one binding share, one kernel at a time.

A kernel that needs room only while it runs (the Winograd convolution's
transformed tiles, ``kernels/winograd.py``) would otherwise hold its own buffer
between runs, one per such convolution in a model. Instead a session's kernels share
one buffer, as large as the largest of them asks for, and hold
:attr:`Workspace.lock` while they use it. Native code reads the buffer's
address through :attr:`Workspace.slot` at every call, so growing it (under the
lock) is seen by every kernel that was built earlier.
"""

from __future__ import annotations

import ctypes
import threading

import torch


class Workspace:
    """A growable float32 buffer and the lock that its users hold while they use it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # The buffer's address, read by native code at each call (ctypes.addressof(slot)).
        self.slot = ctypes.c_void_p(0)
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 until a kernel reserves some)."""
        return 0 if self._buffer is None else self._buffer.numel() * 4

    def reserve(self, floats: int) -> None:
        """Make the buffer hold at least ``floats`` float32 values."""
        with self.lock:
            if self._buffer is not None and self._buffer.numel() >= floats:
                return
            self._buffer = torch.empty(floats, dtype=torch.float32)
            self.slot.value = self._buffer.data_ptr()
