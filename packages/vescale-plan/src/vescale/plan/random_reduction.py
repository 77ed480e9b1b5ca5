"""Reduce partial sums before random ops: where a planned partial value (a row-parallel output, a vocab-parallel
lookup, an opaque module's local result) would reach a random op (dropout, ``bernoulli``, ``rand_like``, ...) still
unreduced, add the boundary that reduces it first.

vescale's counter RNG (:mod:`vescale.dtensor.random`) gives a random op on a DTensor of any ``Shard``/``Replicate``
layout bitwise the values of one device, but it cannot fill a ``Partial`` tensor: the mask of a partial sum's summand
is not defined by the sum's layout (``bernoulli: cannot fill a DTensor with a Partial placement``). OPT's decoder
layer is the case that needs it: its MLP runs on the sequence flattened to 2-D, so no module returns ``fc2``'s output
in the residual stream's shape, the planner leaves its reduction to DTensor propagation (the residual add), and the
residual dropout between ``fc2`` and that add meets the partial sum.

The trace records every random op with the matmul outputs that reach its input (:class:`~vescale.plan.trace.RandomOp`).
A partial value counts as reduced before a random op when a planned output boundary of a module that returned it (or
a view of it) completed before the op, or an enclosing module's planned input boundary reduced an argument carrying it.
Otherwise the last module call before the op that returned it gets an output boundary (the stream layout for a
stream-shaped output, else full): one all-reduce (reduce-scatter under sequence parallelism), as the pair needs
anyway. Where no module returns it, the random op's own module (an ``nn.Dropout``) gets an input boundary; where there
is none either, the pair is refused (replicated, with the reason). A random op no plan can make equal one device
(inside an opaque module, which runs on local plain tensors) raises :class:`~vescale.core.errors.PlanError` naming
it. Random ops the counter RNG does not draw (``multinomial``, ``poisson``, ...) are refused by the counter RNG itself
when they reach a DTensor (:class:`vescale.dtensor.UndrawnRandomError`), whichever plan produced the layout.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Partial, Replicate

from vescale.core.errors import PlanError
from vescale.plan.decisions import Decision
from vescale.plan.planner import Planner
from vescale.plan.trace import ModelTrace, RandomOp

__all__ = ["reduce_before_random"]


def _reduces(placements: Any) -> bool:
    return isinstance(placements, list) and not any(isinstance(p, Partial) for p in placements)


def _partial_sources(t: ModelTrace, pl: Planner) -> dict[str, str]:
    """Data-flow node -> what it is, for every node whose planned value is a partial sum on the tp dim."""
    out = {row: "row" for row, _ in pl.pairs if pl.params.get(row, (None, ""))[1] == "row"}
    out.update({node: "embedding" for node in pl.sharded_embeddings})
    for fqn in t.opaque:
        spec = pl.outputs.get(fqn, {}).get(0)
        if isinstance(spec, list) and any(isinstance(p, Partial) for p in spec):
            out[fqn] = "opaque"
    return out


def _reduced_before(t: ModelTrace, pl: Planner, node: str, src: int, r: RandomOp) -> bool:
    for call in t.calls[:r.calls_done]:
        for key, tid in call.outputs.items():
            if _reduces(pl.outputs.get(call.fqn, {}).get(key)) and src in pl.lineage(tid):
                return True
    for fqn in r.stack:  # an enclosing call is still running: it completes at or after calls_done
        call = next((c for c in t.calls[r.calls_done:] if c.fqn == fqn), None)
        if call is None:
            continue
        for key, tid in call.args.items():
            if _reduces(pl.inputs.get(fqn, {}).get(key)) and node in t.taint.get(tid, frozenset()):
                return True
    return False


def _refuse_opaque(t: ModelTrace) -> None:
    """Raise :class:`PlanError` for a random op whose values no plan can make equal to one device's: one inside a
    module that runs on local shards as plain tensors (an opaque module: torch's generator, not the counter RNG, and
    local element indices). Pure: every rank raises it, before any collective."""
    for r in t.random_ops:
        if not r.active:  # a dropout in eval mode: nothing is drawn
            continue
        opaque = next((f for f in r.stack if f and f in t.opaque), None)
        if opaque is not None:
            why = (f"it runs inside {opaque}, which cannot be traced on meta ({t.opaque[opaque]}) and so runs on "
                   "local shards as plain tensors, outside vescale's counter RNG")
            raise PlanError(f"auto_plan: the random op {r.op} in {r.stack[-1] or '<root>'} would not draw the values "
                            f"one device draws under tensor parallelism: {why}. Turn that randomness off where the "
                            "model allows it, or train this model without tensor parallelism (eval-mode plans, "
                            "which do not run it, are unaffected)")


def reduce_before_random(t: ModelTrace, pl: Planner) -> dict[str, str]:
    """Add to ``pl``'s boundaries a reduction of every partial value before each random op that would meet it (see
    the module docstring). Returns ``{parameter FQN: reason}`` for the column/row pairs that must be replicated
    instead (no module boundary can reduce them first); the caller plans again with them refused."""
    if pl.tp is None or pl.n == 1 or not t.random_ops:
        return {}
    _refuse_opaque(t)
    sources = _partial_sources(t, pl)
    pair_of = dict(pl.pairs)
    refused: dict[str, str] = {}
    for r in t.random_ops:
        for node in sorted(r.producers & sources.keys()):
            src = pl.source_id(node)
            if src is None or _reduced_before(t, pl, node, src, r):
                continue
            where = f"{r.op} in {r.stack[-1] or '<root>'}"
            returning = [(c, key) for c in t.calls[:r.calls_done] for key, tid in c.outputs.items()
                         if src in pl.lineage(tid) and c.fqn and c.fqn not in t.opaque and c.fqn not in pl.local
                         and pl.outputs.get(c.fqn, {}).get(key) is None]
            if returning:
                call, key = returning[-1]  # the last one before the op: the partial sum lives as long as it can
                shape = t.shape_of.get(call.outputs[key], ())
                placements = pl.stream() if len(shape) == pl.stream_ndim else pl.act(Replicate())
                pl.add(pl.outputs, call.fqn, key, placements, f"reduce {node}'s partial sums before the random op "
                       f"{where} (the counter RNG cannot fill a partial sum)")
                continue
            mod = next((c for c in t.calls[r.calls_done:] if c.fqn == r.stack[-1]), None) if r.stack[-1] else None
            arg = next((k for k, tid in mod.args.items() if tid == r.input_id), None) if mod is not None else None
            if arg is not None and mod.fqn not in t.opaque and mod.fqn not in pl.local \
                    and pl.inputs.get(mod.fqn, {}).get(arg) is None:
                ndim = len(t.shape_of.get(r.input_id, ()))
                pl.add(pl.inputs, mod.fqn, arg, pl.stream() if ndim == pl.stream_ndim else pl.act(Replicate()),
                       f"reduce {node}'s partial sums before the random op {where}")
                continue
            why = (f"its partial sums reach the random op {where} and no module boundary lies between them to "
                   "reduce them first: replicated")
            if sources[node] == "row":
                for m in [node, *pair_of[node]]:
                    refused.setdefault(m, why)
            else:
                pl.notes.append(Decision("output", node, "-", "boundary", f"{sources[node]} {node}: {why[4:]} "
                                         "(not planned around: the forward refuses it)"))
    return refused
