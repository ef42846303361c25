"""Convolution geometry and channels-last strides shared by the libdnnl kernels."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class ConvGeometry:
    """What the primitive depends on besides the input layout."""

    out_channels: int
    weight_dims: tuple[int, ...]     # oneDNN's: (g, oc/g, ic/g, k...) when grouped
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    pads_begin: tuple[int, ...]      # top/left (front) padding, one per spatial dim
    pads_end: tuple[int, ...]        # bottom/right (back) padding
    dilations: tuple[int, ...]

    @property
    def symmetric(self) -> bool:
        """Whether each spatial dim is padded as much at its end as at its begin: what a
        kernel that takes one pad per dim (torch's oneDNN op) needs. TensorFlow's "same"
        padding of a strided convolution pads only the end of an even-sized input."""
        return self.pads_begin == self.pads_end

    def output_size(self, input_size: Sequence[int]) -> tuple[int, ...]:
        spatial = [(size + pb + pe - d * (k - 1) - 1) // s + 1 for size, pb, pe, d, k, s in
                   zip(input_size[2:], self.pads_begin, self.pads_end, self.dilations,
                       self.kernel, self.strides, strict=True)]
        return (int(input_size[0]), self.out_channels, *spatial)


def geometry(weight_shape: Sequence[int], strides: Sequence[int], pads: Sequence[int],
             dilations: Sequence[int], group: int) -> ConvGeometry:
    """The geometry of a convolution; ``pads`` is ONNX's ``[begin..., end...]`` (two per
    spatial dim) or one per spatial dim, padded alike at both ends.

    >>> geometry([32, 3, 3, 3], (2, 2), (0, 0, 1, 1), (1, 1), 1).output_size((1, 3, 224, 224))
    (1, 32, 112, 112)
    """
    oc, icg, *kernel = (int(d) for d in weight_shape)
    spatial = len(kernel)
    if len(pads) not in (spatial, 2 * spatial):
        raise ValueError(f"{len(pads)} pads for a {spatial}-D convolution")
    begin = tuple(int(p) for p in pads[:spatial])
    end = tuple(int(p) for p in pads[spatial:]) or begin
    dims = (oc, icg, *kernel) if group == 1 else (group, oc // group, icg, *kernel)
    return ConvGeometry(oc, dims, tuple(kernel), tuple(int(s) for s in strides), begin, end,
                        tuple(int(d) for d in dilations))


def channels_last_format(rank: int) -> torch.memory_format:
    return torch.channels_last if rank == 4 else torch.channels_last_3d


def channels_last_strides(sizes: Sequence[int]) -> list[int]:
    """Element strides of a dense ``[N, C, *spatial]`` tensor stored channels-last."""
    n, c, *spatial = sizes
    strides = [0] * len(sizes)
    strides[1] = 1
    step = c
    for dim in range(len(sizes) - 1, 1, -1):
        strides[dim] = step
        step *= sizes[dim]
    strides[0] = step
    return strides


def same_bytes(packed: Tensor, mine: Tensor) -> bool:
    """Whether torch's packed (``mkldnn``) tensor holds exactly the bytes of ``mine``."""
    size = mine.numel()
    if torch.ops.mkldnn._nbytes(packed) != size:
        return False
    theirs = (ctypes.c_uint8 * size).from_address(torch.ops.mkldnn.data_ptr(packed))
    # Compared 8 bytes at a time where the size allows: torch.equal on uint8 is several
    # times slower, and every packed weight is compared once at load.
    wide = torch.int64 if size % 8 == 0 else torch.int32 if size % 4 == 0 else torch.uint8
    return bool(torch.equal(mine.view(wide), torch.frombuffer(theirs, dtype=wide)))
