"""Op family: indexing. (Rows are added as the family grows.)"""

from __future__ import annotations

from segflow.ops.registry import OpDef

OPS: list[OpDef] = []
