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
parallelism (``sequence_parallel=True``; off by default, as in the hand plans of :mod:`vescale.parallel.plans`) keeps
the residual stream sharded on its sequence dim between pairs (reduce-scatter after each pair, all-gather before it).
Divisibility of heads, kv heads, fused parts, vocabulary and hidden sizes is checked per parameter; a parameter that
does not divide is replicated, with the reason, which DTensor keeps correct. Every decision is kept in
:attr:`AutoPlan.decisions` for :func:`vescale.plan.explain`.

The pieces: :mod:`.planner` finds the roles and boundaries in a trace, :mod:`.from_trace` writes them as a plan in the
grammar of :mod:`vescale.parallel.plan_grammar`, :mod:`.decisions` holds the result types; this module traces the
model and checks the pairs numerically.
"""

from __future__ import annotations

from torch import nn

from vescale.core.errors import MeshError
from vescale.plan.decisions import AutoPlan, Decision
from vescale.plan.from_trace import plan_from_trace
from vescale.plan.trace import ModelTrace, TraceError, _tree_trace, trace_model
from vescale.plan.verify import PairCheck, verify_pairs

__all__ = ["auto_plan", "AutoPlan", "Decision", "plan_from_trace"]


def auto_plan(model: nn.Module, mesh, *, sequence_parallel: bool = False, loss_parallel: bool = False,
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

    A LoRA (``peft``) model is planned as the model it wraps with its adapters off, then keyed by its own names with
    each adapter laid out from its base layer (:func:`vescale.plan.lora.lora_plan`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_plan expects an nn.Module, got {type(model).__name__}")
    from vescale.plan.lora import base_view, is_lora_model, lora_plan

    kw = dict(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, tp=tp, dp=dp,
              example_args=example_args, example_kwargs=example_kwargs, trace=trace, verify=verify)
    if is_lora_model(model):  # a peft model: the plan of the model it wraps, the adapters derived from it
        with base_view(model) as inner:
            plan = _auto_plan(inner, mesh, **kw)
        return lora_plan(model, plan, mesh)
    return _auto_plan(model, mesh, **kw)


def _auto_plan(model: nn.Module, mesh, *, sequence_parallel: bool, loss_parallel: bool, tp: str, dp: str | None,
               example_args: tuple | None, example_kwargs: dict | None, trace: ModelTrace | None,
               verify: bool) -> AutoPlan:
    """:func:`auto_plan` of a model that is not a LoRA model (or one whose adapters are off)."""
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
