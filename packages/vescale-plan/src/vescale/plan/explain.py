"""``explain``: a plan as a readable table of FQN -> placements -> role -> reason; ``explain_choice``: why
``choose_parallelism`` / ``auto_parallelize`` chose its mesh (cp, ep, the ZeRO stage), with the cost model's numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vescale.core.placement_format import format_placements
from vescale.parallel.plan_grammar import BOUNDARY_SECTIONS, check_plan

__all__ = ["explain", "explain_choice"]


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


def _best(cands, keep):
    """The best candidate (the report's order) that ``keep`` accepts, or None."""
    return next((c for c in cands if keep(c)), None)


def _mesh(c) -> str:
    dims = " x ".join(f"{n}{s}" for n, s in c.dims.items()) or "one rank"
    return f"{dims}, ZeRO {c.zero_stage}"


def _mem(c) -> str:
    return (f"{c.memory_gb:.2f} GB/rank (states {c.params_gb:.2f}, activations {c.activations_gb:.2f}, of which "
            f"attention S^2 / gathered k,v {c.attention_gb:.2f})")


def explain_choice(report: Any) -> str:
    """Why ``report`` (a :class:`~vescale.plan.ParallelReport`) chose its mesh, in lines of text with the numbers:
    the attention kind assumed for the activation memory (and why), then for each of cp, ep and ZeRO-3 whether it was
    chosen and what the best candidate without (or with) it would have cost in memory per rank and step time."""
    c, cands, shape = report.chosen, report.candidates, report.shape
    budget = report.budget_gb
    lines = [f"chosen: {_mesh(c)}: {_mem(c)}; step {c.step_s * 1e3:.2f} ms"
             + (f"; budget {budget} GB" if budget is not None else "")]
    if shape is None:
        return "\n".join(lines)
    lines.append(f"attention: {shape.attention}: {shape.attention_reason}")

    def alt(label, other) -> str:
        if other is None:
            return f"{label}: none"
        fits = "fits" if other.fits else "does not fit"
        return f"{label}: {_mesh(other)}: {_mem(other)}, step {other.step_s * 1e3:.2f} ms ({fits})"

    # cp
    if not shape.cp_capable:
        lines.append("cp: not considered: vescale.parallel.context_parallel does not take this model (it needs a "
                     "transformers model with sdpa/eager attention or causal_attention hooks)")
    elif c.cp > 1:
        lines.append(f"cp={c.cp}: sequence {report.seq_len}: each rank keeps {report.seq_len // c.cp} tokens of every "
                     "sequence (blockwise attention: no S^2 term) plus the gathered keys/values; "
                     + alt("best without cp", _best(cands, lambda o: o.cp == 1)))
    else:
        lines.append("cp: not chosen; " + alt("best with cp", _best(cands, lambda o: o.cp > 1)))
    # ep
    if not shape.experts:
        lines.append("ep: not considered: no experts module (parameters stacked per expert beside a router)")
    else:
        lines.append(f"experts: {shape.experts} per layer in {shape.moe_layers} layers, top-{shape.top_k}, "
                     f"{shape.expert_params / 1e6:.1f} M expert parameters")
        if c.ep > 1:
            lines.append(f"ep={c.ep}: {shape.experts // c.ep} experts per rank; all-to-all {c.ep_bytes / 1e6:.1f} MB "
                         "per step per rank; " + alt("best without ep", _best(cands, lambda o: o.ep == 1)))
        else:
            lines.append("ep: not chosen; " + alt("best with ep", _best(cands, lambda o: o.ep > 1)))
    # ZeRO
    if c.zero_stage == 3:
        lines.append("ZeRO-3: parameters, gradients and optimizer states sharded over dp; "
                     + alt("best with ZeRO 0-2", _best(cands, lambda o: o.zero_stage < 3)))
    elif any(o.zero_stage == 3 for o in cands):
        lines.append(f"ZeRO {c.zero_stage} (not 3): "
                     + alt("best with ZeRO-3", _best(cands, lambda o: o.zero_stage == 3)))
    return "\n".join(lines)
