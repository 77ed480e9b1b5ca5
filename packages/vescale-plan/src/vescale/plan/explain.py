"""``explain``: a plan as a readable table of FQN -> placements -> role -> reason."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vescale.core.placement_format import format_placements
from vescale.parallel.plan_grammar import BOUNDARY_SECTIONS, check_plan

__all__ = ["explain"]


def explain(plan: Mapping[str, Mapping[str, Any]], *, replicated: bool = True) -> str:
    """A fixed-width table of every decision in ``plan``.

    For an :class:`~vescale.plan.AutoPlan` the rows are its decisions (one per parameter FQN, including tied
    aliases and replicated ones - ``replicated=False`` hides those - then module boundaries and notes), each with its
    role and the reason it was taken. Any other plan dict (hand-written) is checked against the plan grammar
    (:func:`vescale.parallel.check_plan`, raising :class:`~vescale.core.errors.PlanError`) and listed section by
    section, pattern by pattern, with the reason ``"given"``.
    """
    decisions = getattr(plan, "decisions", None)
    rows: list[tuple[str, str, str, str, str]] = []
    if decisions is not None:
        for d in decisions:
            if not replicated and d.kind == "parameter" and d.role == "replicated":
                continue
            rows.append((d.kind, d.fqn or "<root>", d.placements, d.role, d.reason))
        title = f"auto plan on {getattr(plan, 'mesh_desc', '') or 'the mesh'}"
    else:
        checked = check_plan(plan)
        for key, value in checked.parameter.items():
            rows.append(("parameter", key, format_placements(value), "-", "given"))
        for kind in BOUNDARY_SECTIONS:
            for pattern, value in getattr(checked, kind).items():
                rows.append((kind, pattern or "<root>", format_placements(value), "boundary", "given"))
        title = "hand-written plan"
    head = ("kind", "fqn", "placements", "role", "reason")
    widths = [min(60, max(len(r[i]) for r in [head, *rows])) for i in range(4)]
    lines = [title]
    for row in [head, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    return "\n".join(lines)
