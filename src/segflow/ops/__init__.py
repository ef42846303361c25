"""The operator library: OpDef tables per op family, and the registry that looks them up.

Each family module exposes ``OPS: list[OpDef]``; :func:`default_registry`
collects them. To add an op, add one row to the family it belongs to.
"""

from segflow.ops import (
    backward,
    backward_select,
    contrib_fused,
    contrib_quant,
    control,
    copy,
    dense_chain,
    elementwise,
    fused,
    image,
    image_decoder,
    indexing,
    linalg,
    misc,
    ml,
    nn,
    optional,
    preview_training,
    qconv,
    quant,
    reduce,
    rnn,
    sequence,
    string_forms,
    strings,
    tensor,
)
from segflow.ops.registry import BindContext, Kernel, OpDef, OpRegistry

ALL_FAMILIES = (elementwise, nn, tensor, reduce, indexing, image, control, rnn, quant, linalg,
                misc, copy, backward, backward_select, fused, dense_chain, contrib_quant,
                contrib_fused, qconv, preview_training, ml, image_decoder, sequence,
                optional, strings)


def default_registry() -> OpRegistry:
    """A registry holding every op family segflow ships."""
    registry = OpRegistry()
    for family in ALL_FAMILIES:
        registry.extend(family.OPS)
    for row in (*strings.OPS, *string_forms.STRING_FORMS):
        registry.register_string_form(row)
    return registry


__all__ = ["ALL_FAMILIES", "BindContext", "Kernel", "OpDef", "OpRegistry", "default_registry"]
