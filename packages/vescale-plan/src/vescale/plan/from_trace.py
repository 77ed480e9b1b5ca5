"""``plan_from_trace``: run the :class:`~vescale.plan.planner.Planner` on a trace and write its findings as a plan
(in the grammar of :mod:`vescale.parallel.plan_grammar`), per-layer entries folded into ``\\d+`` patterns."""

from __future__ import annotations

import re
from typing import Any

from torch.distributed.tensor import Replicate

from vescale.core.placement_format import format_placements
from vescale.parallel.plan_grammar import check_plan
from vescale.plan.decisions import AutoPlan, Decision
from vescale.plan.planner import Planner
from vescale.plan.random_reduction import reduce_before_random
from vescale.plan.trace import ModelTrace

__all__ = ["plan_from_trace"]


def _spec(entries: dict[Any, list]) -> list | dict:
    if all(isinstance(k, int) for k in entries):
        return [entries.get(i) for i in range(max(entries) + 1)]
    return {str(k): v for k, v in entries.items() if not isinstance(k, int)}


def _generalize(fqn: str) -> str:
    return re.sub(r"(?<=\\\.)\d+(?=\\\.|$)", r"\\d+", re.escape(fqn))


def _compress(entries: dict[str, Any], universe: list[str]) -> dict[str, Any]:
    """Exact-FQN entries as regex patterns, folding layer indices into ``\\d+`` where every match agrees."""
    groups: dict[str, list[str]] = {}
    for f in universe:
        groups.setdefault(_generalize(f), []).append(f)
    out: dict[str, Any] = {}
    done: set[str] = set()
    for fqn, value in entries.items():
        if fqn in done:
            continue
        g = _generalize(fqn)
        members = groups.get(g, [fqn])
        if len(members) > 1 and all(m in entries and repr(entries[m]) == repr(value) for m in members):
            out[g] = value
            done.update(members)
        else:
            out[re.escape(fqn)] = value
            done.add(fqn)
    return out


def plan_from_trace(trace: ModelTrace, names, sizes, *, tp: str = "tp", dp: str | None = "dp",
                    sequence_parallel: bool = False, loss_parallel: bool = False, mesh_desc: str = "",
                    module_fqns: list[str] | None = None, refused: dict[str, str] | None = None) -> AutoPlan:
    """The plan for an existing :class:`ModelTrace` on a mesh given by dim ``names`` and ``sizes`` (no mesh object
    needed: this is what the cost model and the planning benchmark use). Evidence only: no numerical check (that
    needs the model: :func:`auto_plan`). ``refused`` maps parameter FQNs to a reason; their whole column/row pair is
    replicated with that reason. Partial sums are reduced before any random op of the trace meets them
    (:mod:`.random_reduction`). The plan has all four sections of the grammar (``parameter``, ``input``,
    ``output``, ``local``; ``""`` is the root module)."""
    refused = dict(refused or {})
    while True:
        pl = Planner(trace, tuple(names), dict(sizes), tp, dp, sequence_parallel, loss_parallel, module_fqns or [],
                     refused)
        pl.run()
        # a partial sum must be reduced before a random op meets it; pairs no boundary can reduce are replicated
        more = {m: why for m, why in reduce_before_random(trace, pl).items() if m not in refused}
        if not more:
            break
        refused.update(more)
    decisions: list[Decision] = []
    params: dict[str, list] = {}
    for fqn in trace.shapes:
        placement, role, reason = pl.params.get(fqn, (Replicate(), "replicated", _default_reason(trace, fqn, pl)))
        for alias in trace.aliases.get(fqn, [fqn]):
            decisions.append(Decision("parameter", alias, format_placements(pl.param(placement)), role, reason))
            if not isinstance(placement, Replicate):
                params[alias] = pl.param(placement)
    universe = [a for f in trace.shapes for a in trace.aliases.get(f, [f])]
    plan: dict[str, dict[str, Any]] = {"parameter": _compress(params, universe)}
    mods = module_fqns or sorted({c.fqn for c in trace.calls})
    for kind, table in (("input", pl.inputs), ("output", pl.outputs), ("local", pl.local)):
        root = table.pop("", None)
        specs = {f: _spec(e) for f, e in table.items()}
        for f, s in specs.items():
            decisions.append(Decision(kind, f, str(s), "boundary", pl.why.get((id(table), f), "")))
        plan[kind] = _compress(specs, [m for m in mods if m])
        if root is not None:
            plan[kind][""] = _spec(root)
            decisions.append(Decision(kind, "", str(plan[kind][""]), "boundary", "batch on the dp dim, full on tp"))
    decisions.extend(pl.notes)
    check_plan(plan)  # what the planner writes is in the grammar (a bug here must not reach parallelize_module)
    return AutoPlan(plan, decisions, mesh_desc, pairs=pl.pairs, tp_placements={f: v[0] for f, v in pl.params.items()})


def _default_reason(trace: ModelTrace, fqn: str, pl: Planner) -> str:
    if pl.tp is None or pl.n == 1:
        return "no tensor parallelism on this mesh"
    if len(trace.shapes[fqn]) == 1:
        return "1-D scale/bias: replicated" + (" (runs on the sequence shard)" if pl.sp else "")
    if fqn not in pl.first:
        return "not used by any traced matmul"
    return "not part of a column/row pair or output head (e.g. a router): replicated"
