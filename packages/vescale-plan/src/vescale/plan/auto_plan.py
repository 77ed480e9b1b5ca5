"""``auto_plan``: a tensor/sequence-parallel plan for an unmodified model, derived from its traced structure.

The model is traced on the meta device (:mod:`.trace`); the data flow between matmuls then names the roles:

* **column / row pairs** (Megatron): a matmul ``R`` whose activation input comes only from matmuls ``C1..Ck`` whose
  outputs go nowhere but ``R`` - attention (q, k, v -> o), MLPs (gate, up -> down), GPT-2's fused ``c_attn`` ->
  ``c_proj``. The ``Ci`` are sharded on their output dim (``InterleavedShard`` when their output is split into equal
  parts: fused qkv / gate_up), ``R`` on its input dim; the pair needs one reduction of ``R``'s output.
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
from vescale.plan.trace import MatmulEvent, ModelTrace, ModuleCall, TraceError, trace_model

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
    carries the :class:`Decision` list behind it (``decisions``) and the mesh it was made for (``mesh_desc``)."""

    def __init__(self, plan: dict, decisions: list[Decision], mesh_desc: str) -> None:
        super().__init__(plan)
        self.decisions = decisions
        self.mesh_desc = mesh_desc


def auto_plan(model: nn.Module, mesh, *, sequence_parallel: bool = True, loss_parallel: bool = False,
              tp: str = "tp", dp: str | None = "dp", example_args: tuple | None = None,
              example_kwargs: dict | None = None, trace: ModelTrace | None = None) -> AutoPlan:
    """A plan for ``model`` on ``mesh`` (a ``DeviceMesh`` with named dims), from the model's structure.

    ``tp`` names the mesh dim that shards weights; ``dp`` (if the mesh has it) batch-shards activations and the
    root's tensor inputs/outputs (each data-parallel rank passes its own batch). Other mesh dims replicate.
    ``example_args``/``example_kwargs`` describe one call of ``model`` (default: token ids ``[2, 8]``, positional);
    the root's input entry follows the same form. Pure and deterministic: every rank computes the same plan with no
    communication. If the model cannot be traced on meta, the module tree alone is used (:func:`_tree_trace`).
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
    return plan_from_trace(trace, names, sizes, tp=tp, dp=dp, sequence_parallel=sequence_parallel,
                           loss_parallel=loss_parallel, mesh_desc=mesh_desc,
                           module_fqns=[f for f, _ in model.named_modules()])


def _tree_trace(model: nn.Module, why: str, example_args: tuple | None, example_kwargs: dict | None) -> ModelTrace:
    """A stand-in trace built from the module tree when ``forward`` cannot run on meta.

    Within each module, its ``nn.Linear`` children in registration order form a group: the last child whose output
    size is the hidden size ``H`` is row-parallel and the children before it that read ``H`` are column-parallel
    (attention q/k/v -> o, MLP gate/up -> down). ``nn.Embedding`` children are token embeddings; a Linear producing
    the embedding's vocabulary is the head. ``H`` is the embedding width (else the most common weight dim). Layout
    boundaries sit on those modules themselves (each column Linear gathers its own input: more collectives than a
    traced plan); the root's output structure is unknown, so the root returns full tensors.
    """
    aliases: dict[str, list[str]] = {}
    canonical: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(canonical.setdefault(id(p), fqn), []).append(fqn)
    trace = ModelTrace(aliases=aliases, shapes={f: tuple(p.shape) for f, p in model.named_parameters()})
    trace.opaque[""] = why
    ids = iter(range(-1, -10**9, -1))  # fake tensor ids, disjoint from real ones
    fake = {}
    for key in [*range(len(example_args or ((),))), *(example_kwargs or {})]:
        fake[key] = next(ids)
        trace.shape_of[fake[key]] = (2, 8)
    trace.root_args = fake
    embeds = [(f, m) for f, m in model.named_modules() if isinstance(m, nn.Embedding)]
    dims: dict[int, int] = {}
    for shape in trace.shapes.values():
        for d in shape[-2:] if len(shape) >= 2 else ():
            dims[d] = dims.get(d, 0) + 1
    hidden = embeds[0][1].embedding_dim if embeds else max(dims, key=dims.get, default=0)
    vocab = embeds[0][1].num_embeddings if embeds else None

    def name(mod: nn.Module, fqn: str) -> str:
        return canonical[id(mod.weight)] if id(mod.weight) in canonical else f"{fqn}.weight"

    def bias(mod: nn.Module) -> str | None:
        return canonical.get(id(mod.bias)) if getattr(mod, "bias", None) is not None else None

    def note(fqn: str, kind: str, param: str, in_dim, out_dim, b, producers, size: int, x: int | None = None) -> int:
        """A synthetic matmul event plus the call of the module that does it (its argument 0 in, output 0 out)."""
        x, out = (next(ids) if x is None else x), next(ids)
        trace.events.append(MatmulEvent(kind, param, in_dim, out_dim, b, x, out, producers, (2, 8, size)))
        trace.calls.append(ModuleCall(fqn, {0: x}, {0: out}, frozenset([0]) if kind == "linear" else frozenset()))
        trace.shape_of[out] = (2, 8, size)
        trace.taint[out] = frozenset([param if kind == "linear" else f"{param}@embedding"])
        return out

    for fqn, mod in embeds:
        note(fqn, "embedding", name(mod, fqn), None, 0, None, frozenset(), hidden, fake.get(0))
    for parent_fqn, parent in model.named_modules():
        kids = [(f"{parent_fqn}.{n}" if parent_fqn else n, m) for n, m in parent.named_children()
                if isinstance(m, nn.Linear)]
        rows = [i for i, (_, m) in enumerate(kids) if m.out_features == hidden and m.in_features != 0]
        if not rows:
            for f, m in kids:
                if vocab is not None and m.out_features == vocab:
                    trace.root_outputs = {"logits": note(f, "linear", name(m, f), 1, 0, bias(m), frozenset(), vocab)}
            continue
        r = rows[-1]
        cols = [(f, m) for f, m in kids[:r] if m.in_features == hidden]
        if not cols:
            continue
        for f, m in cols:
            note(f, "linear", name(m, f), 1, 0, bias(m), frozenset(), m.out_features)
        f, m = kids[r]
        note(f, "linear", name(m, f), 1, 0, bias(m), frozenset(name(c, cf) for cf, c in cols), hidden)
    return trace


# ---------------------------------------------------------------------------------------------------------------


class _Planner:
    def __init__(self, t: ModelTrace, names, sizes, tp, dp, sp, lp, module_fqns) -> None:
        self.t, self.names, self.sizes = t, names, sizes
        self.tp = tp if tp in names else None
        self.n = sizes.get(tp, 1)
        self.dp = dp if dp in names else None
        self.sp, self.lp = sp, lp
        self.module_fqns = module_fqns
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

    def divides(self, fqn: str, size: int, parts: int, what: str) -> str | None:
        heads = self.t.heads.get(fqn)
        if size % (parts * self.n):
            return f"{what} size {size} / {parts} part(s) does not divide by {self.tp}={self.n}"
        if heads is not None and heads % self.n:
            return f"{heads} heads (per part) do not divide by {self.tp}={self.n}"
        return None

    def plan_pair(self, row: str, cols: list[str]) -> None:
        sharded = []
        for c in cols:
            e = self.first[c]
            size = self.t.shapes[c][e.out_dim]
            parts = self.t.fused.get(c, 1)
            why = self.divides(c, size, parts, "output")
            if why:
                self.set_param(c, Replicate(), "replicated", f"column-parallel candidate for {row}: {why}")
                if e.bias:
                    self.set_param(e.bias, Replicate(), "replicated", f"bias of {c}, which is replicated")
                continue
            pl = InterleavedShard(e.out_dim, parts) if parts > 1 else Shard(e.out_dim)
            desc = f"column-parallel (output dim {e.out_dim}" + (f", fused {parts} parts" if parts > 1 else "")
            heads = self.t.heads.get(c)
            desc += (f", {heads} heads" if heads else "") + f") feeding row-parallel {row}"
            self.set_param(c, pl, "column", desc)
            if e.bias:
                bpl = InterleavedShard(0, parts) if parts > 1 else Shard(0)
                self.set_param(e.bias, bpl, "column", f"bias of column-parallel {c}")
            sharded.append(c)
        e = self.first[row]
        if not sharded:
            self.set_param(row, Replicate(), "replicated", f"all of its inputs {cols} are replicated")
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
                    module_fqns: list[str] | None = None) -> AutoPlan:
    """The plan for an existing :class:`ModelTrace` on a mesh given by dim ``names`` and ``sizes`` (no mesh object
    needed: this is what the cost model and the planning benchmark use)."""
    pl = _Planner(trace, tuple(names), dict(sizes), tp, dp, sequence_parallel, loss_parallel, module_fqns or [])
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
    return AutoPlan({"parameter": _compress(params, universe), "forward": forward}, decisions, mesh_desc)


def _default_reason(trace: ModelTrace, fqn: str, pl: _Planner) -> str:
    if pl.tp is None or pl.n == 1:
        return "no tensor parallelism on this mesh"
    if len(trace.shapes[fqn]) == 1:
        return "1-D scale/bias: replicated" + (" (runs on the sequence shard)" if pl.sp else "")
    if fqn not in pl.first:
        return "not used by any traced matmul"
    return "not part of a column/row pair or output head (e.g. a router): replicated"
