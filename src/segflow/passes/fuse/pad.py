"""Rule ``pad``: a zero constant Pad of a convolution's spatial dims becomes the
convolution's own padding.

Exporters write TensorFlow-style "same" padding (ports of TensorFlow models) as an
explicit ``Pad`` before each ``Conv``, its amounts computed
from the feature map's size (folded to constants once the shapes are known). A Pad
read only by a ``Conv`` (``auto_pad`` NOTSET, or VALID: no padding of its own),
padding with zeros, in ``constant`` mode, by non-negative amounts on the spatial
dims only, is added to the Conv's
``pads`` (which may then differ between a dim's two ends); a Pad of nothing at all is
dropped whatever reads it. The results are the same numbers: a convolution's padding
is zeros.
"""

from __future__ import annotations

from segflow.ir.graph import Graph, Node
from segflow.ops._common import ints, pads_over_axes
from segflow.passes._rewrite import bypass, can_bypass, const_scalar
from segflow.passes.fuse._match import const_tensor, is_op, live_nodes, only_consumer


def fuse_pad(graph: Graph) -> int:
    count = 0
    for pad in live_nodes(graph, "Pad"):
        amounts = _zero_pad_amounts(pad)
        if amounts is None:
            continue
        x = pad.inputs[0]
        assert x is not None
        if not any(amounts) and can_bypass(graph, pad, x):
            bypass(graph, pad, x)
            count += 1
            continue
        conv = only_consumer(graph, pad.outputs[0])
        if not is_op(conv, "Conv") or conv is None or conv.inputs[0] is not pad.outputs[0]:
            continue
        merged = _merged_pads(conv, amounts)
        if merged is None:
            continue
        conv.attrs["pads"] = merged
        conv.attrs["auto_pad"] = "NOTSET"
        graph.set_input(conv, 0, x)
        graph.remove(pad)
        count += 1
    return count


def _zero_pad_amounts(pad: Node) -> list[int] | None:
    """The Pad's amounts over all of its input's dims (begins, then ends) where it pads
    with zeros in constant mode by constant non-negative amounts; else None."""
    if pad.attrs.get("mode", "constant") != "constant" or not pad.inputs or pad.inputs[0] is None:
        return None
    x = pad.inputs[0]
    rank = x.spec.rank
    if rank is None:
        return None
    if pad.opset < 11:
        raw = pad.attrs.get("pads")
        if raw is None or float(pad.attrs.get("value", 0.0)) != 0.0:
            return None
        amounts = [int(p) for p in raw]
    else:
        pads = const_tensor(pad.inputs[1]) if len(pad.inputs) > 1 else None
        value = pad.inputs[2] if len(pad.inputs) > 2 else None
        if pads is None or (value is not None and const_scalar(value) != 0.0):
            return None
        amounts = ints(pads)
        axes_value = pad.inputs[3] if len(pad.inputs) > 3 else None
        if axes_value is not None:
            axes = const_tensor(axes_value)
            if axes is None or len(amounts) != 2 * axes.numel() \
                    or any(not -rank <= a < rank for a in ints(axes)):
                return None
            amounts = pads_over_axes(amounts, ints(axes), rank)
    if len(amounts) != 2 * rank or any(a < 0 for a in amounts):
        return None
    return amounts


def _merged_pads(conv: Node, amounts: list[int]) -> list[int] | None:
    """The Conv's pads with the Pad's spatial amounts added; None where the Pad touches
    the batch or channel dim or the Conv pads by ``auto_pad`` SAME_*."""
    rank = len(amounts) // 2
    spatial = rank - 2
    if spatial < 1 or any(amounts[d] or amounts[rank + d] for d in (0, 1)):
        return None
    auto_pad = conv.attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("VALID", b"VALID"):
        # No padding of its own: the export's explicit Pad is all of it (TensorFlow's
        # "same" written as Pad + VALID), so the Conv becomes NOTSET with the Pad's.
        own = [0] * (2 * spatial)
    elif auto_pad in ("NOTSET", b"NOTSET"):
        own = [int(p) for p in conv.attrs.get("pads", [0] * (2 * spatial))]
    else:
        return None
    if len(own) != 2 * spatial:
        return None
    return [own[i] + amounts[2 + i] for i in range(spatial)] + \
        [own[spatial + i] + amounts[rank + 2 + i] for i in range(spatial)]
