"""``auto_parallelize``: choose pp x dp x cp x ep x tp, the ZeRO stage and the pipeline split with the cost model;
apply it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vescale.core.errors import PlanError
from vescale.plan.activations import ModelShape, model_shape
from vescale.plan.auto_plan import AutoPlan, plan_from_trace
from vescale.plan.cost import CostEstimate, HardwareModel, estimate
from vescale.plan.pipeline import PipelineSplit, _blocks, pipeline_split
from vescale.plan.trace import ModelTrace, TraceError, trace_model

#: The mesh dims auto_parallelize chooses, in canonical order.
MESH_DIMS = ("pp", "dp", "cp", "ep", "tp")

__all__ = ["ParallelReport", "choose_parallelism", "auto_parallelize", "language_model_loss"]


@dataclass
class ParallelReport:
    """The choice and its alternatives: ``candidates`` (every mesh/ZeRO combination estimated, best first),
    ``chosen``, the TP/SP ``plan`` and pipeline ``split`` for it, whether it was ``applied`` to the model, the model
    ``shape`` the memory terms used, and the ``seq_len`` / ``budget_gb`` it was chosen for. ``str(report)`` is the
    candidate table followed by :func:`vescale.plan.explain_choice` (why cp, ep and the ZeRO stage, with numbers)."""

    chosen: CostEstimate
    candidates: list[CostEstimate]
    split: PipelineSplit | None = None
    plan: AutoPlan | None = None
    applied: bool = False
    notes: list[str] = field(default_factory=list)
    shape: ModelShape | None = None
    seq_len: int = 0
    budget_gb: float | None = None

    def spec(self, *, schedule: str = "1f1b", microbatches: int = 0, sequence_parallel: bool = False):
        """The chosen candidate as a :class:`vescale.plan.ParallelSpec` (``tp_plan="auto"``, the pipeline split at
        :attr:`split`'s points): what :func:`vescale.plan.build` and ``tools/train.py --spec`` take."""
        from vescale.plan.spec import ParallelSpec

        c = self.chosen
        return ParallelSpec(mesh=c.dims, zero=c.zero_stage, tp_plan="auto", sequence_parallel=sequence_parallel,
                            schedule=schedule, microbatches=microbatches,
                            split_points=list(self.split.split_points) if self.split is not None else None)

    def __str__(self) -> str:
        from vescale.plan.explain import explain_choice

        head = f"{'pp':>3} {'dp':>3} {'cp':>3} {'ep':>3} {'tp':>3} {'zero':>4} {'step ms':>10} {'mem GB':>9} " \
               f"{'act GB':>8} {'tp MB':>9} {'dp MB':>9} {'cp MB':>8} {'ep MB':>8} {'pp MB':>8} fits"
        lines = ["candidates (best first; * = chosen)", head]
        for c in self.candidates:
            mark = "*" if c is self.chosen else " "
            lines.append(f"{c.pp:>3} {c.dp:>3} {c.cp:>3} {c.ep:>3} {c.tp:>3} {c.zero_stage:>4} "
                         f"{c.step_s * 1e3:>10.2f} {c.memory_gb:>9.2f} {c.activations_gb:>8.2f} "
                         f"{c.tp_bytes / 1e6:>9.1f} {c.dp_bytes / 1e6:>9.1f} {c.cp_bytes / 1e6:>8.1f} "
                         f"{c.ep_bytes / 1e6:>8.1f} {c.pp_bytes / 1e6:>8.1f} {'yes' if c.fits else 'no'}{mark}")
        if self.split is not None:
            lines.append(f"pipeline split points: {self.split.split_points} (imbalance {self.split.imbalance:.3f})")
        lines.append(explain_choice(self))
        lines.extend(self.notes)
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _block_params(trace: ModelTrace, blocks: list[str]) -> float:
    """Parameter elements of the largest block (what ZeRO-3 gathers whole at a time)."""
    sizes = [sum(math.prod(s) for f, s in trace.shapes.items() if f.startswith(b + ".")) for b in blocks]
    return float(max(sizes, default=0))


def choose_parallelism(model: nn.Module, world_size: int, *, memory_budget_gb: float | None = None,
                       batch_size: int = 8, seq_len: int = 2048, fixed: dict[str, int] | None = None,
                       max_tp: int = 8, max_cp: int = 8, max_ep: int = 64, param_bytes: int = 4, act_bytes: int = 4,
                       hw: HardwareModel | None = None, sequence_parallel: bool = False,
                       example_args: tuple | None = None, example_kwargs: dict | None = None,
                       trace: ModelTrace | None = None, zero_stages: tuple[int, ...] = (0, 1, 2, 3),
                       microbatch_size: int | None = None) -> ParallelReport:
    """Estimate every ``pp x dp x cp x ep x tp = world_size`` (``fixed`` pins some of them) and ZeRO stage in
    ``zero_stages``; pick the fastest that fits ``memory_budget_gb`` (the smallest memory if none fits).

    What is a candidate (what :func:`auto_parallelize` can build and has tested):

    * ``cp > 1`` only for a model :func:`vescale.parallel.context_parallel` takes (a transformers model with sdpa or
      eager attention, or one with ``causal_attention`` hooks), ``pp == 1``, ``ep == 1``, ``seq_len`` divisible by
      ``2 cp``; ZeRO 0/1/2 over the dp x cp ranks;
    * ``ep > 1`` only for a model with experts (found by structure, :func:`vescale.parallel.find_experts`), ``ep``
      dividing their number, ``pp == tp == cp == 1``, ZeRO 0 (the dense gradients are reduced by DTensor over dp x ep);
    * ZeRO 1/2 where the dp (x cp) ranks are more than one (with ``pp > 1`` per stage); ZeRO 3 (FSDP2 per block) where
      ``dp > 1``,
      ``pp == 1`` and ``cp == ep == 1``; every other candidate is ZeRO 0.

    ``microbatch_size`` (sequences per pipeline microbatch): a pipeline candidate runs ``batch_size / (dp x ep) /
    microbatch_size`` microbatches (``CostEstimate.microbatches``; skipped when that does not divide); default: two
    per pp rank, as ``ParallelSpec`` does.

    Pure: no collectives, no weights. ``report.shape`` is the model shape the memory terms used and
    ``report.reasons`` (what :func:`vescale.plan.explain_choice` prints) why cp, ep or ZeRO-3 was or was not chosen.
    """
    bad = [z for z in zero_stages if z not in (0, 1, 2, 3)]
    if bad or not zero_stages:
        raise PlanError(f"zero_stages must be a non-empty subset of (0, 1, 2, 3), got {tuple(zero_stages)}")
    hw = hw or HardwareModel()
    if trace is None:
        trace = trace_model(model, example_args, example_kwargs)
    _, blocks = _blocks(model)
    layers = len(blocks)
    vocab = next((trace.shapes[e.param][0] for e in trace.events if e.kind == "embedding"), 0)
    shape = model_shape(model, trace)
    largest_block = _block_params(trace, blocks)
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(MESH_DIMS))
    if unknown:
        raise PlanError(f"fixed={fixed}: auto_parallelize chooses the mesh dims {list(MESH_DIMS)}, not {unknown}")
    cands: list[CostEstimate] = []
    plans: dict[int, tuple[set[str], int, int]] = {}
    for tp in _divisors(world_size):
        if tp > max_tp or fixed.get("tp", tp) != tp:
            continue
        if tp not in plans:
            plan = plan_from_trace(trace, ["tp"], {"tp": tp}, sequence_parallel=sequence_parallel)
            sharded = {d.fqn for d in plan.decisions if d.kind == "parameter" and d.role != "replicated"}
            rows = sum(1 for d in plan.decisions if d.kind == "parameter" and d.role == "row")
            plans[tp] = (sharded, rows, sum(1 for d in plan.decisions if d.role == "head"))
        sharded, rows, heads = plans[tp]
        if tp > 1 and not rows:
            continue  # nothing to shard: tp would only replicate work
        for pp, cp, ep in _pp_cp_ep(world_size // tp, shape, layers, seq_len, max_cp, max_ep, tp):
            dp = world_size // (tp * pp * cp * ep)
            if any(fixed.get(n, v) != v for n, v in (("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep))):
                continue
            if batch_size % (dp * ep) or (pp > 1 and batch_size // dp < pp):
                continue  # every data rank needs whole sequences; a pipeline at least one per stage
            mbs = None
            if pp > 1 and microbatch_size:
                if (batch_size // (dp * ep)) % microbatch_size:
                    continue
                mbs = batch_size // (dp * ep) // microbatch_size
            for zero in _zero_stages(zero_stages, pp=pp, dp=dp, cp=cp, ep=ep):
                cands.append(estimate(trace, pp=pp, dp=dp, tp=tp, zero_stage=zero, tp_sharded=sharded, pairs=rows,
                                      layers=layers, batch_size=batch_size, seq_len=seq_len, param_bytes=param_bytes,
                                      act_bytes=act_bytes, memory_budget_gb=memory_budget_gb, hw=hw,
                                      sequence_parallel=sequence_parallel, vocab=vocab if heads else 0, cp=cp,
                                      ep=ep, shape=shape, largest_block=largest_block, microbatches=mbs))
    if not cands:
        raise PlanError(f"no pp x dp x cp x ep x tp factorisation of world size {world_size} fits the constraints "
                        f"(fixed={fixed}, batch_size={batch_size}, {layers} blocks, max_tp={max_tp}, "
                        f"zero_stages={tuple(zero_stages)})")
    # prefer fewer mechanisms (less ZeRO, no cp / ep) on ties; fitting candidates first
    cands.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.memory_gb, c.zero_stage, c.cp, c.ep))
    report = ParallelReport(cands[0], cands, shape=shape, seq_len=seq_len, budget_gb=memory_budget_gb)
    if not cands[0].fits:
        report.notes.append(f"no candidate fits {memory_budget_gb} GB per rank; chose the smallest memory")
    if cands[0].pp > 1:
        report.split = pipeline_split(model, trace, cands[0].pp)
    return report


def _pp_cp_ep(rest: int, shape: ModelShape, layers: int, seq_len: int, max_cp: int, max_ep: int, tp: int):
    """``(pp, cp, ep)`` with ``pp x cp x ep`` dividing ``rest`` that can be built (see :func:`choose_parallelism`)."""
    for pp in _divisors(rest):
        if pp > layers:
            continue
        for cp in _divisors(rest // pp):
            if cp > 1 and (pp > 1 or cp > max_cp or not shape.cp_capable or seq_len % (2 * cp)):
                continue
            for ep in _divisors(rest // pp // cp):
                if ep > 1 and (pp > 1 or cp > 1 or tp > 1 or ep > max_ep or not shape.experts
                               or shape.experts % ep):
                    continue
                yield pp, cp, ep


def _zero_stages(stages: tuple[int, ...], *, pp: int, dp: int, cp: int, ep: int) -> list[int]:
    allowed = {0}
    if ep == 1 and dp * cp > 1:  # (with pp: each stage's DDP and DistributedOptimizer, as vescale.plan.build does)
        allowed |= {1, 2}
    if pp == 1 and ep == 1 and cp == 1 and dp > 1:
        allowed.add(3)
    out = sorted(set(stages) & allowed)
    return out or [0]


def language_model_loss(output: Any, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of logits (a tensor, or an output with ``.logits`` / ``["logits"]``): the mean (or
    with ``reduction="sum"`` the sum) over the target positions that are not -100 (ignored)."""
    logits = output.logits if hasattr(output, "logits") else output["logits"] if isinstance(output, dict) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


def _microbatch_example(example_args: tuple | None, example_kwargs: dict | None, mb: int, seq_len: int) -> Any:
    """One microbatch of the example inputs (dim 0 of every tensor set to ``mb``), or token ids ``[mb, seq_len]``."""
    def resize(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return v[:1].expand(mb, *v.shape[1:]).contiguous()
        return v

    if example_kwargs:
        return {k: resize(v) for k, v in example_kwargs.items()}
    if example_args:
        return tuple(resize(a) for a in example_args)
    return (torch.zeros(mb, seq_len, dtype=torch.long),)


def auto_parallelize(model: nn.Module, *, world_size: int | None = None, mesh=None,
                     memory_budget_gb: float | None = None, batch_size: int = 8, seq_len: int = 2048,
                     apply: bool = True, sequence_parallel: bool = False, example_args: tuple | None = None,
                     example_kwargs: dict | None = None, fixed: dict[str, int] | None = None,
                     zero_stages: tuple[int, ...] = (0, 1, 2, 3), schedule: str = "1f1b",
                     num_microbatches: int | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                     **kw):
    """Choose a parallelization of ``model`` with the cost model (:func:`choose_parallelism`) and build it with
    :func:`vescale.plan.build`: the one composition the main job runs too. Returns the
    :class:`vescale.plan.Parallelized` (``result.report`` the choice, ``result.spec`` the spec it built, which
    ``result.report.spec()`` also gives as JSON-able data for ``tools/train.py --spec``).

    ``mesh`` (dims named among pp/dp/cp/ep/tp) pins the mesh shape, otherwise ``world_size`` (default: the process
    group's) is factorised, restricted by ``fixed`` (e.g. ``{"pp": 2, "tp": 2}``) and ``zero_stages``; ``**kw`` go to
    :func:`choose_parallelism` (hardware model, ``max_tp``, ...). ``batch_size`` is the global batch in sequences.
    The tp plan is :func:`auto_plan`'s on the chosen tp mesh; ``schedule`` and ``num_microbatches`` (default two per
    pp rank) drive a pipeline, split at the report's points and captured on one microbatch of the example inputs;
    ``loss_fn(output, target)`` is the mean loss of a batch (default: token cross-entropy of the logits).

    Each rank feeds ``result.forward_backward`` (or ``result.module`` / ``result.engine.step`` by hand, backward of
    the mean loss times ``result.loss_scale``) its rows, ``result.shard_batch(global_batch)``, and builds the
    optimizer with ``result.make_optimizer(torch.optim.AdamW, lr=...)`` (a ``DistributedOptimizer`` for ZeRO 1/2).
    With ``apply=False`` nothing is built: the result holds the report and the spec only.

    Raises :class:`PlanError` on every rank, before any collective, when the batch does not divide into the data
    ranks and microbatches or the model cannot be traced.
    """
    import torch.distributed as dist

    from vescale.core.mesh import MeshRoles
    from vescale.plan.build import Parallelized, build

    pinned = None
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in MESH_DIMS]
        if unknown or len(names) != mesh.ndim:
            raise PlanError(f"auto_parallelize understands mesh dims {', '.join(MESH_DIMS)}; {mesh} has "
                            f"{unknown or names}")
        pinned = {n: 1 for n in MESH_DIMS} | dict(zip(names, mesh.shape))
        clash = {k: v for k, v in (fixed or {}).items() if pinned.get(k, v) != v}
        if clash:
            raise PlanError(f"fixed={fixed} contradicts the mesh {dict(zip(names, mesh.shape))}")
        world_size = mesh.size()
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    try:
        trace = trace_model(model, example_args, example_kwargs)
    except TraceError as exc:
        raise PlanError(f"auto_parallelize needs a meta-device trace for its cost model: {exc}") from exc
    report = choose_parallelism(model, world_size, memory_budget_gb=memory_budget_gb, batch_size=batch_size,
                                seq_len=seq_len, fixed=pinned or fixed, sequence_parallel=sequence_parallel,
                                trace=trace, zero_stages=zero_stages, **kw)
    c = report.chosen
    spec = report.spec(schedule=schedule, microbatches=num_microbatches or 0, sequence_parallel=sequence_parallel)
    microbatches = spec.pipeline_microbatches
    if c.pp > 1 and batch_size % (c.dp * c.ep * microbatches):
        raise PlanError(f"batch_size {batch_size} does not divide into dp={c.dp} x {microbatches} microbatches "
                        f"for pp={c.pp}")
    if not apply:
        return Parallelized(spec, MeshRoles.of(None), [model], report=report)
    example = None
    if c.pp > 1:
        example = _microbatch_example(example_args, example_kwargs, batch_size // (c.dp * c.ep) // microbatches,
                                      seq_len)
    result = build(model, spec, mesh, loss_fn=loss_fn, batch_size=batch_size, seq_len=seq_len,
                   example_inputs=example)
    result.report, report.plan, report.applied = report, result.plan, True
    if result.engine is not None:
        report.notes.append(f"pipeline: {result.engine.num_stages} stages at {report.split.split_points}, "
                            f"schedule {schedule!r}, {microbatches} microbatches")
    return result
