"""Human-readable plan tables for ``explain()`` and ``segflow explain``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from segflow.engine.base import ExecType

if TYPE_CHECKING:
    from segflow.runtime.plan import Plan


def plan_rows(plan: Plan) -> list[dict[str, object]]:
    rows = []
    for seg in plan.segments:
        kinds = sorted({plan.opdefs[n].exec_type_of(n).value for n in seg.nodes})
        rows.append({
            "index": seg.index,
            "first": seg.first.name,
            "last": seg.last.name,
            "nodes": len(seg.nodes),
            "exec": "+".join(kinds),
            "device": str(seg.device) if seg.device else "-",
            "phase": seg.phase.value,
            "reason": seg.reason,
        })
    return rows


def format_plan(plan: Plan) -> str:
    rows = plan_rows(plan)
    headers = ["#", "first .. last", "nodes", "exec", "device", "phase", "boundary reason"]
    table = [[str(r["index"]),
              str(r["first"]) if r["first"] == r["last"] else f"{r['first']} .. {r['last']}",
              str(r["nodes"]), str(r["exec"]), str(r["device"]), str(r["phase"]),
              str(r["reason"])] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    bulk = sum(1 for s in plan.segments if s.exec_type is ExecType.SYNC)
    settings = plan.settings
    lines.append("")
    lines.append(f"{len(plan.segments)} tasks ({bulk} bulk segments, "
                 f"{len(plan.segments) - bulk} non-sync tasks) over {plan.compute_nodes} "
                 f"compute nodes, {plan.copy_tasks} copies")
    lines.append(f"bulk settings: inference={int(settings.inference)} "
                 f"train={int(settings.train)} max_nodes_fwd={settings.max_nodes_fwd} "
                 f"max_nodes_bwd={settings.max_nodes_bwd}")
    for entry in plan.pass_log:
        lines.append(f"pass: {entry}")
    return "\n".join(lines)
