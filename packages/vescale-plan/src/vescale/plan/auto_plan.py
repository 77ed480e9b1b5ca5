"""``auto_plan``: a tensor/sequence-parallel plan for an unmodified model, derived from its traced structure.

The model is traced on the meta device (:mod:`.trace`); the data flow between matmuls then names the roles:

* **column / row pairs** (Megatron): a matmul ``R`` whose activation input comes only from matmuls ``C1..Ck`` whose
  outputs go nowhere but ``R`` - attention (q, k, v -> o), MLPs (gate, up -> down), GPT-2's fused ``c_attn`` ->
  ``c_proj``. The ``Ci`` are sharded on their output dim as their layout evidence allows (:mod:`.evidence`: plain
  ``Shard`` between whole heads/groups - GPT-NeoX's ``[heads, 3, d]`` too -, ``InterleavedShard`` inside equal fused
  parts such as GPT-2's ``[3, heads, d]`` or a fused gate/up, replicated when the trace does not settle it), ``R`` on
  its input dim; the pair needs one reduction of ``R``'s output. :func:`auto_plan` then checks every pair type
  numerically (:mod:`.verify`) and refuses (replicates) those whose sharded result differs from the plain one.
* **vocab-parallel embedding**: an embedding indexed by a model input (token ids), sharded on the vocabulary.
* **output head**: a matmul whose output is a model output and feeds no other matmul (the lm head, tied or not),
  sharded on the vocabulary; its logits are all-gathered at the root (or kept sharded, ``loss_parallel``).
* **opaque modules** (forward not traceable on meta, e.g. MoE experts with data-dependent routing): their weights are
  paired by shape (``[..., X, H]`` in-projections, ``[..., H, Y]`` out-projections, ``X = k * Y``).

Everything else (norms, routers, position embeddings, biases of row-parallel layers) is replicated. Sequence
parallelism keeps the residual stream sharded on its sequence dim between pairs (reduce-scatter after each pair,
all-gather before it). Divisibility of heads, kv heads, fused parts, vocabulary and hidden sizes is checked per
parameter; a parameter that does not divide is replicated, with the reason, which DTensor keeps correct. Every
decision is kept in :attr:`AutoPlan.decisions` for :func:`vescale.plan.explain`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from vescale.core.errors import MeshError
from vescale.dtensor import InterleavedShard
from vescale.plan.evidence import decide
from vescale.plan.trace import ModelTrace, TraceError, _tree_trace, trace_model
from vescale.plan.verify import PairCheck, verify_pairs

__all__ = ["auto_plan", "AutoPlan", "Decision", "plan_from_trace"]


@dataclass(frozen=True)
class Decision:
    """One planning decision: ``kind`` is ``"parameter"``, ``"input"`` or ``"output"``; ``fqn`` the parameter or
    module FQN (``""`` = root); ``placements`` as text; ``role`` (column, row, vocab, head, replicated, ...);
    ``reason`` in words."""

    kind: str
    fqn: str
    placements: str
    role: str
    reason: str


class AutoPlan(dict):
    """A plan (``{"parameter": {...}, "forward": {...}}``, exactly what ``parallelize_module`` takes) that also
    carries the :class:`Decision` list behind it (``decisions``), the mesh it was made for (``mesh_desc``), the
    column/row pairs it found (``pairs``: ``(row, cols)`` FQNs), each planned parameter's placement on the tp dim
    (``tp_placements``) and, from :func:`auto_plan`, the numerical checks of its pairs (``checks``:
    :class:`vescale.plan.verify.PairCheck` list; empty when not verified)."""

    def __init__(self, plan: dict, decisions: list[Decision], mesh_desc: str,
                 pairs: list[tuple[str, list[str]]] | None = None,
                 tp_placements: dict[str, Placement] | None = None) -> None:
        super().__init__(plan)
        self.decisions = decisions
        self.mesh_desc = mesh_desc
        self.pairs = pairs or []
        self.tp_placements = tp_placements or {}
        self.checks: list[PairCheck] = []


def auto_plan(model: nn.Module, mesh, *, sequence_parallel: bool = True, loss_parallel: bool = False,
              tp: str = "tp", dp: str | None = "dp", example_args: tuple | None = None,
              example_kwargs: dict | None = None, trace: ModelTrace | None = None, verify: bool = True) -> AutoPlan:
    """A plan for ``model`` on ``mesh`` (a ``DeviceMesh`` with named dims), from the model's structure.

    ``tp`` names the mesh dim that shards weights; ``dp`` (if the mesh has it) batch-shards activations and the
    root's tensor inputs/outputs (each data-parallel rank passes its own batch). Other mesh dims replicate.
    ``example_args``/``example_kwargs`` describe one call of ``model`` (default: token ids ``[2, 8]``, positional);
    the root's input entry follows the same form. Pure and deterministic: every rank computes the same plan with no
    communication. If the model cannot be traced on meta, the module tree alone is used (:func:`_tree_trace`).

    With ``verify`` (the default), before returning, every sharded column/row pair type is checked numerically on a
    simulated tp mesh in this process (:func:`vescale.plan.verify.verify_pairs`: one representative per type, random
    weights, on the model itself or a shrunken copy); a pair type whose sharded result differs from the plain one is
    refused - replicated, with the measured difference as the reason - and the plan is remade. The verdicts are in
    ``plan.checks`` and :func:`~vescale.plan.explain`. Pairs that cannot be run keep their evidence-based placement,
    marked unverified. Only the tp mesh size is used: no collective is issued.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_plan expects an nn.Module, got {type(model).__name__}")
    names = tuple(mesh.mesh_dim_names or (("tp",) if mesh.ndim == 1 else ()))
    if len(names) != mesh.ndim:
        raise MeshError(f"auto_plan needs a mesh with named dims (e.g. init_mesh({{'dp': 2, 'tp': 2}})), got {mesh}")
    sizes = dict(zip(names, mesh.shape))
    if trace is None:
        try:
            trace = trace_model(model, example_args, example_kwargs)
        except TraceError as exc:
            trace = _tree_trace(model, str(exc), example_args, example_kwargs)
    mesh_desc = "mesh(" + ", ".join(f"{n}={s}" for n, s in sizes.items()) + ")"
    kw = dict(tp=tp, dp=dp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, mesh_desc=mesh_desc,
              module_fqns=[f for f, _ in model.named_modules()])
    plan = plan_from_trace(trace, names, sizes, **kw)
    if not verify or sizes.get(tp, 1) <= 1:
        return plan
    if "" in trace.opaque:
        plan.decisions.append(Decision("verify", "", "unverified", "check", "module-tree fallback (forward does not "
                                       "run on meta): its pairs are not checked numerically"))
        return plan
    checks = verify_pairs(model, trace, plan.pairs, plan.tp_placements, sizes[tp], example_args=example_args,
                          example_kwargs=example_kwargs)
    pair_of = {row: cols for row, cols in plan.pairs}
    refused = {m: f"refused by the numerical check ({c.how}): {c.reason}"
               for c in checks if c.status == "refused" for row in c.members for m in [row, *pair_of[row]]}
    if refused:
        plan = plan_from_trace(trace, names, sizes, refused=refused, **kw)
    return _annotate(plan, checks, pair_of, trace)


def _annotate(plan: AutoPlan, checks: list[PairCheck], pair_of: dict[str, list[str]], trace: ModelTrace) -> AutoPlan:
    """Add each check's verdict to the reasons of the parameters it covers, and one ``verify`` row per pair type."""
    bias = {e.param: e.bias for e in trace.events if e.bias}
    verdict: dict[str, str] = {}
    for c in checks:
        tag = {"verified": "verified", "refused": "refused", "unverified": "not verified"}[c.status]
        for row in c.members:
            for m in [row, *pair_of[row]]:
                for f in [m, bias.get(m)]:
                    if f:
                        verdict.update({a: f"{tag}: {c.reason}" for a in trace.aliases.get(f, [f])})
    decisions = []
    for d in plan.decisions:
        if d.kind == "parameter" and d.fqn in verdict and d.role != "replicated":
            d = Decision(d.kind, d.fqn, d.placements, d.role, f"{d.reason} [{verdict[d.fqn]}]")
        decisions.append(d)
    for c in checks:
        decisions.append(Decision("verify", c.row, c.status, "check",
                                  f"{len(c.members)} pair(s) like {c.row} <- {c.cols}: {c.reason}"
                                  + (f" (ran {c.how})" if c.how else "")))
    plan.decisions = decisions
    plan.checks = checks
    return plan


# ---------------------------------------------------------------------------------------------------------------


class _Planner:
    def __init__(self, t: ModelTrace, names, sizes, tp, dp, sp, lp, module_fqns, refused=None) -> None:
        self.t, self.names, self.sizes = t, names, sizes
        self.tp = tp if tp in names else None
        self.n = sizes.get(tp, 1)
        self.dp = dp if dp in names else None
        self.sp, self.lp = sp, lp
        self.module_fqns = module_fqns
        self.refused: dict[str, str] = dict(refused or {})  # param -> why the numerical check refused its pair
        self.pairs: list[tuple[str, list[str]]] = []
        self.params: dict[str, tuple[Placement, str, str]] = {}  # canonical fqn -> (tp placement, role, reason)
        self.inputs: dict[str, dict[Any, list]] = {}
        self.outputs: dict[str, dict[Any, list]] = {}
        self.local: dict[str, dict[Any, list]] = {}
        self.sharded_embeddings: list[str] = []
        self.why: dict[tuple[int, str], str] = {}
        self.notes: list[Decision] = []
        self.first = {}
        for e in t.events:
            self.first.setdefault(e.param, e)

    def param(self, p: Placement) -> list[Placement]:
        return [p if n == self.tp else Replicate() for n in self.names]

    def act(self, p: Placement) -> list[Placement]:
        return [p if n == self.tp else Shard(0) if n == self.dp else Replicate() for n in self.names]

    def set_param(self, fqn: str, placement: Placement, role: str, reason: str) -> None:
        old = self.params.get(fqn)
        if old is not None and old[0] != placement:
            self.params[fqn] = (Replicate(), "replicated", f"conflicting uses ({old[1]} wants {old[0]}, {role} wants "
                                f"{placement}): replicated")
            return
        self.params[fqn] = (placement, role, reason)

    # -- roles ---------------------------------------------------------------------------------------------------

    def consumers(self) -> dict[str, set[str]]:
        cons: dict[str, set[str]] = {}
        for e in self.t.events:
            for p in e.producers:
                cons.setdefault(p, set()).add(e.param)
        for call in self.t.calls:
            if call.fqn in self.t.opaque:
                for i in call.args.values():
                    for p in self.t.taint.get(i, ()):
                        cons.setdefault(p, set()).add(call.fqn)
        return cons

    def run(self) -> None:
        t = self.t
        cons = self.consumers()
        out_taint = frozenset().union(*(t.taint.get(i, frozenset()) for i in t.root_outputs.values()))
        linear = {e.param for e in t.events if e.kind == "linear"}
        emb = [e for e in t.events if e.kind == "embedding"]
        self.hidden = emb[0].out_shape[-1] if emb else None
        self.stream_ndim = len(emb[0].out_shape) if emb else 3
        if self.tp is None or self.n == 1:
            self.notes.append(Decision("parameter", "*", "replicated", "replicated",
                                       f"no tensor-parallel mesh dim {self.tp!r} of size > 1"))
            self.boundaries_root(out_taint)
            return
        used_as: dict[str, set] = {}
        for e in t.events:
            used_as.setdefault(e.param, set()).add((e.kind, e.in_dim, e.out_dim))
        pairs: list[tuple[str, list[str]]] = []
        taken: set[str] = set()
        for e in t.events:
            if e.kind != "linear" or e.param in taken or not e.producers:
                continue
            cols = sorted(e.producers)
            if all(c in linear and c not in taken and c != e.param and cons.get(c) == {e.param}
                   and c not in out_taint and len(used_as[c]) == 1 for c in cols) and len(used_as[e.param]) == 1:
                pairs.append((e.param, cols))
                taken.update(cols)
                taken.add(e.param)
        self.pairs = pairs
        for row, cols in pairs:
            self.plan_pair(row, cols)
        for opaque in sorted(t.opaque):
            self.plan_opaque(opaque)
        for e in emb:
            if e.param not in self.params:
                self.plan_embedding(e)
        self.stream_start()
        for e in t.events:
            if e.kind == "linear" and e.param not in taken and e.param in out_taint and not cons.get(e.param) \
                    and self.params.get(e.param, (None, ""))[1] != "head":
                self.plan_head(e)
        self.boundaries_root(out_taint)

    def column_layout(self, c: str, row: str):
        """``(placement, description)`` for column ``c`` from its layout evidence, or ``(None, why replicated)``."""
        e = self.first[c]
        size = self.t.shapes[c][e.out_dim]
        ev = self.t.layouts.get(c)
        d = decide(ev, size)
        parts_seen = self.t.fused.get(c, 1)
        if d.kind == "shard" and parts_seen > 1 and ev is not None and not ev.splits and ev.lost:
            return None, (f"its output is split into {parts_seen} parts after an op the planner does not follow "
                          f"({ev.lost}): layout not settled by the trace")
        if d.kind == "unsettled":
            return None, f"layout not settled by the trace: {d.why}"
        if d.kind == "interleaved":
            part = size // d.parts
            if part % self.n:
                return None, f"output size {size} / {d.parts} part(s) does not divide by {self.tp}={self.n}"
            if d.units % self.n:
                return None, f"{d.units} heads (per part) do not divide by {self.tp}={self.n}"
            return (InterleavedShard(e.out_dim, d.parts),
                    f"column-parallel (output dim {e.out_dim}, fused {d.parts} parts, evidence {d.layout}: each part "
                    f"cut into {self.n}) feeding row-parallel {row}")
        if size % self.n or d.units % self.n:
            if d.units < size and size % self.n == 0:
                return None, (f"{d.units} heads (per part) do not divide by {self.tp}={self.n} (units of "
                              f"{size // d.units} outputs kept whole)")
            return None, f"output size {size} does not divide by {self.tp}={self.n}"
        whole = f"whole units of {size // d.units} per rank, " if d.units < size else ""
        return (Shard(e.out_dim), f"column-parallel (output dim {e.out_dim}, evidence {d.layout}: {whole}"
                f"contiguous cut) feeding row-parallel {row}")

    def plan_pair(self, row: str, cols: list[str]) -> None:
        refused = next((self.refused[m] for m in [row, *cols] if m in self.refused), None)
        sharded = []
        for c in cols:
            e = self.first[c]
            pl, desc = (None, refused) if refused else self.column_layout(c, row)
            if pl is None:
                self.set_param(c, Replicate(), "replicated", desc if refused else f"column-parallel candidate for "
                               f"{row}: {desc}")
                if e.bias:
                    self.set_param(e.bias, Replicate(), "replicated", f"bias of {c}, which is replicated")
                continue
            self.set_param(c, pl, "column", desc)
            if e.bias:
                bpl = InterleavedShard(0, pl.interleaved_size) if isinstance(pl, InterleavedShard) else Shard(0)
                self.set_param(e.bias, bpl, "column", f"bias of column-parallel {c}")
            sharded.append(c)
        e = self.first[row]
        if not sharded:
            self.set_param(row, Replicate(), "replicated", refused or f"all of its inputs {cols} are replicated")
            if refused and e.bias:
                self.set_param(e.bias, Replicate(), "replicated", f"bias of {row}, which is replicated")
            return
        if self.t.shapes[row][e.in_dim] % self.n:
            self.set_param(row, Replicate(), "replicated", f"input size {self.t.shapes[row][e.in_dim]} does not "
                           f"divide by {self.tp}={self.n}")
            return
        self.set_param(row, Shard(e.in_dim), "row", f"row-parallel (input dim {e.in_dim}) after {sharded}")
        if e.bias:
            self.set_param(e.bias, Replicate(), "replicated", f"bias of row-parallel {row}, added once after the "
                           "reduction")
        self.stream_output(row, f"reduce {row}'s partial sums into the residual stream")
        self.column_input(sharded, self.first[sharded[0]].input_id)

    def plan_embedding(self, e) -> None:
        from_input = self.lineage_hits(e.input_id, set(self.t.root_args.values()))
        if not from_input:
            self.set_param(e.param, Replicate(), "replicated", "embedding indexed by values computed inside the "
                           "model (e.g. positions): replicated, no reduction needed")
            return
        vocab = self.t.shapes[e.param][0]
        if vocab % self.n:
            self.set_param(e.param, Replicate(), "replicated", f"vocabulary {vocab} does not divide by "
                           f"{self.tp}={self.n}")
            return
        self.set_param(e.param, Shard(0), "vocab", f"vocab-parallel embedding ({vocab} rows)")
        self.sharded_embeddings.append(f"{e.param}@embedding")

    def stream_start(self) -> None:
        """Where the residual stream begins: the earliest module output that combines the most embeddings (the
        token embedding alone, or token + position embeddings after GPT-2's dropout). It takes the stream layout;
        a sharded embedding returning earlier gets reduced to a full (replicated) activation there."""
        nodes = {f"{e.param}@embedding" for e in self.t.events if e.kind == "embedding"}
        best = None
        for call in self.t.calls:  # in order of completion
            for key, i in call.outputs.items():
                taint = self.t.taint.get(i, frozenset())
                if taint and taint <= nodes and len(self.t.shape_of.get(i, ())) == self.stream_ndim:
                    if best is None or len(taint) > best[0]:
                        best = (len(taint), call.fqn, key)
        if best is None:
            return
        for node in self.sharded_embeddings:
            mod = self.innermost_output(node, self.stream_ndim)
            if mod is not None and mod[0] != best[1]:
                self.add(self.outputs, mod[0], mod[1], self.act(Replicate()),
                         "reduce the vocab-parallel lookup before it is combined with other embeddings")
        self.add(self.outputs, best[1], best[2], self.stream(), "the residual stream starts here"
                 + (" (sequence-sharded)" if self.sp else ""))

    def plan_head(self, e) -> None:
        size = self.t.shapes[e.param][e.out_dim]
        if size % self.n:
            self.set_param(e.param, Replicate(), "replicated", f"output head: size {size} does not divide by "
                           f"{self.tp}={self.n}")
            return
        self.set_param(e.param, Shard(e.out_dim), "head", f"output head sharded on its {size} outputs (vocab)")
        if e.bias:
            self.set_param(e.bias, Shard(0), "head", f"bias of output head {e.param}")
        self.column_input([e.param], e.input_id)
        mod = self.innermost_output(e.param)
        if mod is not None:
            self.add(self.outputs, mod[0], mod[1], self.act(Shard(-1)), "logits stay vocab-sharded up to the root")

    def plan_opaque(self, fqn: str) -> None:
        why = self.t.opaque[fqn]
        prefix = f"{fqn}." if fqn else ""
        mine = [p for p in self.t.shapes if p.startswith(prefix) and p not in self.first]
        H = self.hidden
        ins = [p for p in mine if H and len(self.t.shapes[p]) >= 2 and self.t.shapes[p][-1] == H
               and self.t.shapes[p][-2] != H]
        outs = [p for p in mine if H and len(self.t.shapes[p]) >= 2 and self.t.shapes[p][-2] == H
                and self.t.shapes[p][-1] != H]
        note = f"module {fqn or '<root>'} not traceable on meta ({why}); paired by shape"
        ys = {self.t.shapes[p][-1] for p in outs}
        ok = fqn != "" and len(ys) == 1 and ins and all(self.t.shapes[p][-2] % next(iter(ys)) == 0 for p in ins)
        y = next(iter(ys)) if ys else 0
        if not ok or y % self.n:
            for p in mine:
                self.set_param(p, Replicate(), "replicated", f"{note}: no unambiguous in/out projection pair"
                               if ok or not y else f"{note}: inner size {y} does not divide by {self.tp}={self.n}")
            return
        for p in ins:
            shape = self.t.shapes[p]
            k = shape[-2] // y
            self.set_param(p, InterleavedShard(len(shape) - 2, k) if k > 1 else Shard(len(shape) - 2), "column",
                           f"{note}: in-projection [.., {shape[-2]}, {H}]" + (f" fused {k} parts" if k > 1 else ""))
        for p in outs:
            self.set_param(p, Shard(len(self.t.shapes[p]) - 1), "row", f"{note}: out-projection [.., {H}, {y}]")
        for p in mine:
            if p not in self.params:
                self.set_param(p, Replicate(), "replicated", f"{note}: not a projection of the hidden size {H}")
        # DTensor cannot propagate through data-dependent code: run the module on local shards (``.local``), its
        # local result being a partial sum (row-parallel), and every floating-point argument's gradient too (each
        # feeds the sharded projections); integer arguments (routing indices) keep their own layout.
        call = next((c for c in self.t.calls if c.fqn == fqn), None)
        if call is None:
            return
        partial = self.act(Partial())
        for key in call.args:
            self.add(self.local, fqn, key, partial if key in call.float_args else None,
                     "data-dependent code: runs on local shards; float inputs get partial-sum gradients")
        self.add(self.outputs, fqn, 0, partial, "its local result is a partial sum (row-parallel)")
        self.stream_output(fqn, f"reduce opaque {fqn}'s partial sums into the residual stream")
        if 0 in call.args:
            self.column_input([fqn], call.args[0])

    # -- boundaries ----------------------------------------------------------------------------------------------

    def stream(self) -> list[Placement]:
        return self.act(Shard(self.stream_ndim - 2) if self.sp else Replicate())

    def add(self, table: dict, fqn: str, key: Any, placements: list | None, why: str = "") -> None:
        table.setdefault(fqn, {})[key] = placements
        if why:
            self.why[(id(table), fqn)] = why

    def source_id(self, node: str) -> int | None:
        """The id of the tensor a data-flow node produced (its first call)."""
        for e in self.t.events:
            if (e.param if e.kind == "linear" else f"{e.param}@embedding") == node:
                return e.output_id
        call = next((c for c in self.t.calls if c.fqn == node), None)
        return call.outputs.get(0) if call is not None else None

    def innermost_output(self, node: str, ndim: int | None = None, skip: str | None = None):
        """``(module fqn, output key)`` of the innermost module returning ``node``'s output (or a view of it)."""
        src = self.source_id(node)
        best = None
        for call in self.t.calls:
            for key, i in call.outputs.items():
                if src is None or src not in self.lineage(i):
                    continue
                if (ndim is not None and len(self.t.shape_of.get(i, ())) != ndim) or call.fqn == skip:
                    continue
                depth = call.fqn.count(".") + 1
                if best is None or depth > best[2]:
                    best = (call.fqn, key, depth)
        return best

    def stream_output(self, node: str, why: str) -> None:
        mod = self.innermost_output(node, self.stream_ndim, skip=node)
        if mod is None:
            self.notes.append(Decision("output", node, "-", "boundary", f"no module returns {node}'s output: "
                                       "left to DTensor propagation"))
            return
        self.add(self.outputs, mod[0], mod[1], self.stream(), why)

    def lineage(self, tid: int) -> list[int]:
        out = [tid]
        while out[-1] in self.t.view_parent:
            out.append(self.t.view_parent[out[-1]])
        return out

    def lineage_hits(self, tid: int, ids: set[int]) -> bool:
        return any(i in ids for i in self.lineage(tid))

    def column_input(self, members: list[str], tid: int) -> None:
        owners = [[m] if m in self.t.opaque else [a.rpartition(".")[0] for a in self.t.aliases.get(m, [m])]
                  for m in members]
        ids = set(self.lineage(tid))
        best = None
        for call in self.t.calls:
            if not all(any(o == call.fqn or o.startswith(call.fqn + ".") or call.fqn == "" for o in alts)
                       for alts in owners):
                continue
            for key, i in call.args.items():
                if i in ids:
                    depth = call.fqn.count(".")
                    if best is None or depth < best[2]:
                        best = (call.fqn, key, depth)
        if best is None and len(members) > 1:  # no common module: gather at each member (more collectives)
            for m in members:
                self.column_input([m], self.first[m].input_id if m in self.first else tid)
            return
        if best is None:
            self.notes.append(Decision("input", ",".join(members), "-", "boundary", "no module receives their input "
                                       "alone: left to DTensor propagation"))
            return
        self.add(self.inputs, best[0], best[1], self.act(Replicate()), f"full input for {', '.join(members)}"
                 + (" (all-gather of the sequence shards)" if self.sp else "") + "; reduces its gradient")

    def boundaries_root(self, out_taint) -> None:
        for key, i in self.t.root_args.items():
            if len(self.t.shape_of.get(i, ())) >= 1:
                self.add(self.inputs, "", key, self.act(Replicate()))
        heads = {e.param for e in self.t.events if self.params.get(e.param, (None, ""))[1] == "head"}
        if "" in self.t.opaque:  # module-tree fallback: the output structure is unknown, return full tensors
            return
        for key, i in self.t.root_outputs.items():
            if len(self.t.shape_of.get(i, ())) >= 1:
                sharded = bool(self.t.taint.get(i, frozenset()) & heads)
                self.add(self.outputs, "", key, None if (self.lp and sharded) else self.act(Replicate()))


def _fmt(pl) -> str:
    return "None" if pl is None else "[" + ", ".join(str(p) for p in pl) + "]"


def _spec(entries: dict[Any, list]) -> list | dict:
    if all(isinstance(k, int) for k in entries):
        return [entries.get(i) for i in range(max(entries) + 1)]
    return {str(k): v for k, v in entries.items() if not isinstance(k, int)}


def _generalize(fqn: str) -> str:
    return re.sub(r"(?<=\\\.)\d+(?=\\\.|$)", r"\\d+", re.escape(fqn))


def _compress(entries: dict[str, Any], universe: list[str], suffix: str = "") -> dict[str, Any]:
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
            out[g + suffix] = value
            done.update(members)
        else:
            out[re.escape(fqn) + suffix] = value
            done.add(fqn)
    return out


def plan_from_trace(trace: ModelTrace, names, sizes, *, tp: str = "tp", dp: str | None = "dp",
                    sequence_parallel: bool = True, loss_parallel: bool = False, mesh_desc: str = "",
                    module_fqns: list[str] | None = None, refused: dict[str, str] | None = None) -> AutoPlan:
    """The plan for an existing :class:`ModelTrace` on a mesh given by dim ``names`` and ``sizes`` (no mesh object
    needed: this is what the cost model and the planning benchmark use). Evidence only: no numerical check (that
    needs the model: :func:`auto_plan`). ``refused`` maps parameter FQNs to a reason; their whole column/row pair is
    replicated with that reason."""
    pl = _Planner(trace, tuple(names), dict(sizes), tp, dp, sequence_parallel, loss_parallel, module_fqns or [],
                  refused)
    pl.run()
    decisions: list[Decision] = []
    params: dict[str, list] = {}
    for fqn in trace.shapes:
        placement, role, reason = pl.params.get(fqn, (Replicate(), "replicated", _default_reason(trace, fqn, pl)))
        for alias in trace.aliases.get(fqn, [fqn]):
            decisions.append(Decision("parameter", alias, _fmt(pl.param(placement)), role, reason))
            if not isinstance(placement, Replicate):
                params[alias] = pl.param(placement)
    universe = [a for f in trace.shapes for a in trace.aliases.get(f, [f])]
    forward: dict[str, Any] = {}
    mods = module_fqns or sorted({c.fqn for c in trace.calls})
    for kind, table in (("input", pl.inputs), ("output", pl.outputs), ("local", pl.local)):
        root = table.pop("", None)
        specs = {f: _spec(e) for f, e in table.items()}
        for f, s in specs.items():
            decisions.append(Decision(kind, f, str(s), "boundary", pl.why.get((id(table), f), "")))
        forward.update(_compress(specs, [m for m in mods if m], "." + kind))
        if root is not None:
            forward[kind] = _spec(root)
            decisions.append(Decision(kind, "", str(forward[kind]), "boundary", "batch on the dp dim, full on tp"))
    decisions.extend(pl.notes)
    return AutoPlan({"parameter": _compress(params, universe), "forward": forward}, decisions, mesh_desc,
                    pairs=pl.pairs, tp_placements={f: v[0] for f, v in pl.params.items()})


def _default_reason(trace: ModelTrace, fqn: str, pl: _Planner) -> str:
    if pl.tp is None or pl.n == 1:
        return "no tensor parallelism on this mesh"
    if len(trace.shapes[fqn]) == 1:
        return "1-D scale/bias: replicated" + (" (runs on the sequence shard)" if pl.sp else "")
    if fqn not in pl.first:
        return "not used by any traced matmul"
    return "not part of a column/row pair or output head (e.g. a router): replicated"
