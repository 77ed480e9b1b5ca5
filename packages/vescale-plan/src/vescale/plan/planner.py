"""The planner: find column/row pairs, vocab-parallel embeddings, output heads and opaque modules in a
:class:`~vescale.plan.trace.ModelTrace`, and the module boundaries where activations change layout."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from vescale.dtensor import InterleavedShard
from vescale.plan.decisions import Decision
from vescale.plan.evidence import decide
from vescale.plan.trace import ModelTrace

__all__ = ["Planner"]


class Planner:
    """The role and boundary finder behind :func:`~vescale.plan.plan_from_trace` (see :mod:`vescale.plan.auto_plan`
    for the roles). ``run()`` fills ``params`` (canonical FQN -> (tp placement, role, reason)), ``inputs`` /
    ``outputs`` / ``local`` (module FQN -> {argument key: placements}), ``pairs`` and ``notes``; pure, no mesh."""

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
        self.whole: set[str] = set()  # modules planned to run whole on plain tensors (_run_whole_locally)
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
        mixers = self.sequence_mixers(emb[0].out_shape if emb else None)
        for row, cols in pairs:
            mixer = next((m for m in mixers if any(x.startswith(m + ".") for x in [row, *cols])), None)
            if mixer is not None:
                self.refused.setdefault(row, f"inside {mixer}, which mixes along the sequence outside attention "
                                             f"({mixers[mixer]}): kept replicated, run on the whole sequence")
            self.plan_pair(row, cols)
        for mixer, op in mixers.items():
            self.whole_sequence(mixer, op)
        local_runs = self.local_runs()
        claims = {opaque: self.plan_opaque(opaque) for opaque in sorted(t.opaque)}
        self.settle_opaque_claims(claims)
        for opaque, claim in claims.items():
            if claim:
                self.run_on_shards(opaque)
            else:
                self._run_whole_locally(opaque, local_runs, {o for o, c in claims.items() if c})
        for e in emb:
            if e.param not in self.params:
                self.plan_embedding(e)
        self.stream_start()
        for e in t.events:
            if e.kind == "linear" and e.param not in taken and e.param in out_taint and not cons.get(e.param) \
                    and self.params.get(e.param, (None, ""))[1] != "head":
                self.plan_head(e)
        self.boundaries_root(out_taint)

    def local_runs(self) -> set[str]:
        """The modules that would run on local tensors, each opaque module planned on its own: every traced opaque
        module but the root, on shards (a projection pair) or whole (:meth:`_run_whole_locally`). Read from the trace
        alone, before any is planned, so that the run-whole decision sees every module it could nest with."""
        called = {c.fqn for c in self.t.calls}
        return {f for f in self.t.opaque if f and f in called}

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
        if e.param in self.t.transformed_lookups:
            self.set_param(e.param, Replicate(), "replicated", f"{self.t.transformed_lookups[e.param]} (forward not "
                           "traced): vocab-parallel partial sums could not be reduced first; replicated")
            return
        if self.innermost_output(f"{e.param}@embedding", self.stream_ndim) is None:
            # the lookup is transformed (a norm, a scale by a tensor) before any module returns it: a vocab-parallel
            # lookup's partial sums would go through it unreduced (Inkling's embedding normalises inside forward)
            self.set_param(e.param, Replicate(), "replicated", "no module returns the lookup itself (it is "
                           "transformed inside the module that calls it): vocab-parallel partial sums could not be "
                           "reduced first; replicated")
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

    def plan_opaque(self, fqn: str) -> dict[str, Placement]:
        """Pair opaque module ``fqn``'s weights by shape: in-projections ``[.., k * Y, H]`` column-parallel,
        out-projections ``[.., H, Y]`` row-parallel, its other untraced weights replicated. Returns the claim
        ``{projection FQN: placement asked}`` (empty: no unambiguous pair, everything replicated). Parameters only:
        the module's boundaries wait for :meth:`settle_opaque_claims` (a nested opaque module may replicate the same
        weights)."""
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
                self.set_param(p, Replicate(), "replicated", f"{note}: inner size {y} does not divide by "
                               f"{self.tp}={self.n}" if ok else f"{note}: no unambiguous in/out projection pair")
            return {}
        claim: dict[str, Placement] = {}
        for p in ins:
            shape = self.t.shapes[p]
            k = shape[-2] // y
            claim[p] = InterleavedShard(len(shape) - 2, k) if k > 1 else Shard(len(shape) - 2)
            self.set_param(p, claim[p], "column", f"{note}: in-projection [.., {shape[-2]}, {H}]"
                           + (f" fused {k} parts" if k > 1 else ""))
        for p in outs:
            claim[p] = Shard(len(self.t.shapes[p]) - 1)
            self.set_param(p, claim[p], "row", f"{note}: out-projection [.., {H}, {y}]")
        for p in mine:
            if p not in self.params:
                self.set_param(p, Replicate(), "replicated", f"{note}: not a projection of the hidden size {H}")
        return claim

    def settle_opaque_claims(self, claims: dict[str, dict[str, Placement]]) -> None:
        """Keep an opaque module's claim only if every projection it shards ended with the placement it asked for.

        Its local result is a partial sum only when all its in-projections are column- and all its out-projections
        row-parallel; a weight another opaque module also planned (an enclosing one that found no pair, JetMoE's
        decoder layer around its mixture-of-attention) ends replicated, and replicated projections run on local
        tensors would each compute the whole result: a ``Partial`` output would sum ``tp`` copies of it. Such a
        module's projections are all replicated (a half-sharded pair is wrong too) and its claim dropped, until no
        claim changes (dropping one may break another that shares its weights)."""
        changed = True
        while changed:
            changed = False
            for fqn, claim in claims.items():
                lost = next((p for p, want in claim.items() if self.params[p][0] != want), None)
                if lost is None:
                    continue
                why = (f"module {fqn} not traceable on meta; paired by shape, but its projection {lost} is "
                       f"replicated ({self.params[lost][2]}): the whole pair stays replicated")
                for p in claim:
                    if self.params[p][0] != Replicate():
                        self.params[p] = (Replicate(), "replicated", why)
                self.notes.append(Decision("local", fqn, "-", "boundary", f"not run on local shards: {why}"))
                claims[fqn] = {}
                changed = True

    def run_on_shards(self, fqn: str) -> None:
        """The boundaries of opaque module ``fqn`` whose projections are sharded (:meth:`plan_opaque`, settled)."""
        # DTensor cannot propagate through data-dependent code: run the module on local shards (``local``), its
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
        self._full_main_input(fqn, call)

    def _run_whole_locally(self, fqn: str, local_runs: set[str], on_shards: set[str]) -> None:
        """An opaque module with every parameter replicated runs whole on every rank as plain tensors (its input full,
        its result replicated): code DTensor cannot follow (data-dependent loops, a ``to_local()`` of its own weight
        as Ergo's expert norm makes) then computes exactly one device's values; gradients stay replicated.

        Not when it contains, or lies inside, another module of ``local_runs``: that would mix plain tensors and
        DTensors (the inner one wraps its results as DTensors in code that runs on plain tensors, or runs on DTensors
        the outer one made plain; JetMoE). It keeps its DTensor run instead, with no entry of its own, and a
        data-dependent read there is refused by name at run time. ``on_shards``: the opaque modules whose settled
        projection pairs run on local shards (named first in the note)."""
        call = next((c for c in self.t.calls if c.fqn == fqn), None)
        if not fqn or call is None:
            return
        nests = sorted(o for o in local_runs if o != fqn and (o.startswith(fqn + ".") or fqn.startswith(o + ".")))
        if nests:
            other = next((o for o in nests if o in on_shards), nests[0])
            how = "also runs on local tensors" if other in on_shards else \
                "is not traceable on meta either (only one of two nested modules could run whole)"
            self.notes.append(Decision("local", fqn, "-", "boundary", f"all parameters replicated, but it nests with "
                                       f"{other}, which {how}: keeps its DTensor run"))
            return
        self.whole.add(fqn)
        for key in call.args:
            self.add(self.local, fqn, key, None, "data-dependent code, all parameters replicated: runs whole on "
                     "plain tensors")
        self.add(self.outputs, fqn, 0, self.act(Replicate()), "its local result is the whole result")
        self._full_main_input(fqn, call)

    def _full_main_input(self, fqn: str, call) -> None:
        """A module run on local tensors gets its main input full (all-gathered under sequence parallelism: its code
        sees the whole sequence): the positional argument 0, else its first floating-point argument (a module called
        by keyword, as JetMoE's attention is)."""
        key = 0 if 0 in call.args else next((k for k in call.args if k in call.float_args), None)
        if key is not None:
            self.column_input([fqn], call.args[key])

    def sequence_mixers(self, stream_shape) -> dict[str, str]:
        """``{module fqn: op}``: for each module whose own code mixes along the sequence outside attention (a
        convolution over time or a scan: state-space and linear-attention mixers, see ``ModelTrace.seq_mixing``), the
        innermost module around it that takes the residual stream (an argument shaped like the embeddings' output).
        Its projections are not planned (their layouts are not read by the evidence) and it gets the whole
        sequence."""
        if stream_shape is None:
            return {}
        takes_stream = {c.fqn: c for c in self.t.calls
                        if any(self.t.shape_of.get(i) == tuple(stream_shape) for i in c.args.values())}
        found: dict[str, str] = {}
        for fqn, op in self.t.seq_mixing.items():
            parts = fqn.split(".") if fqn else []
            for k in range(len(parts), 0, -1):
                owner = ".".join(parts[:k])
                if owner in takes_stream:
                    found.setdefault(owner, op)
                    break
        return found

    def whole_sequence(self, fqn: str, op: str) -> None:
        """Module ``fqn`` computes on the whole sequence: its stream argument is gathered (when the stream is
        sequence-sharded) and its stream-shaped outputs return to the stream layout."""
        self.notes.append(Decision("parameter", f"{fqn}.*", "replicated", "replicated",
                                   f"{fqn} mixes along the sequence outside attention ({op}): its projections stay "
                                   "replicated and it runs on the whole sequence"))
        if not self.sp:
            return
        call = next((c for c in self.t.calls if c.fqn == fqn), None)
        if call is None:
            return
        ndim = self.stream_ndim
        for key, i in call.args.items():
            if key in call.float_args and len(self.t.shape_of.get(i, ())) == ndim:
                self.add(self.inputs, fqn, key, self.act(Replicate()),
                         f"{op} along the sequence: the whole sequence (all-gather of the sequence shards)")
        for key, i in call.outputs.items():
            if len(self.t.shape_of.get(i, ())) == ndim:
                self.add(self.outputs, fqn, key, self.stream(), "back to the sequence-sharded stream")

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
