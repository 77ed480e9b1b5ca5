"""``auto_parallelize``: choose pp x dp x tp, the ZeRO stage and the pipeline split with the cost model; apply it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vescale.core.errors import PlanError
from vescale.plan.auto_plan import AutoPlan, auto_plan, plan_from_trace
from vescale.plan.cost import CostEstimate, HardwareModel, estimate
from vescale.plan.pipeline import PipelineSplit, _blocks, build_pipeline, pipeline_split
from vescale.plan.trace import ModelTrace, TraceError, trace_model

__all__ = ["ParallelReport", "ParallelResult", "choose_parallelism", "auto_parallelize", "language_model_loss"]


@dataclass
class ParallelReport:
    """The choice and its alternatives: ``candidates`` (every mesh/ZeRO combination estimated, best first),
    ``chosen``, the TP/SP ``plan`` and pipeline ``split`` for it, and whether it was ``applied`` to the model."""

    chosen: CostEstimate
    candidates: list[CostEstimate]
    split: PipelineSplit | None = None
    plan: AutoPlan | None = None
    applied: bool = False
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"{'pp':>3} {'dp':>3} {'tp':>3} {'zero':>4} {'step ms':>10} {'mem GB':>9} {'tp MB':>9} {'dp MB':>9} " \
               f"{'pp MB':>8} fits"
        lines = ["candidates (best first; * = chosen)", head]
        for c in self.candidates:
            mark = "*" if c is self.chosen else " "
            lines.append(f"{c.pp:>3} {c.dp:>3} {c.tp:>3} {c.zero_stage:>4} {c.step_s * 1e3:>10.2f} "
                         f"{c.memory_gb:>9.2f} {c.tp_bytes / 1e6:>9.1f} {c.dp_bytes / 1e6:>9.1f} "
                         f"{c.pp_bytes / 1e6:>8.1f} {'yes' if c.fits else 'no'}{mark}")
        if self.split is not None:
            lines.append(f"pipeline split points: {self.split.split_points} (imbalance {self.split.imbalance:.3f})")
        lines.extend(self.notes)
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_parallelism(model: nn.Module, world_size: int, *, memory_budget_gb: float | None = None,
                       batch_size: int = 8, seq_len: int = 2048, fixed: dict[str, int] | None = None,
                       max_tp: int = 8, param_bytes: int = 4, act_bytes: int = 4,
                       hw: HardwareModel | None = None, sequence_parallel: bool = False,
                       example_args: tuple | None = None, example_kwargs: dict | None = None,
                       trace: ModelTrace | None = None, zero_stages: tuple[int, ...] = (0, 1, 2)) -> ParallelReport:
    """Estimate every ``pp x dp x tp = world_size`` (``fixed`` pins some of them) and ZeRO stage in ``zero_stages``;
    pick the fastest that fits ``memory_budget_gb`` (the smallest memory if none fits). ``zero_stages`` apply where
    ``dp > 1`` and ``pp == 1``; every other candidate is ZeRO 0 (no dp to shard over, or pipeline stages, which the
    ZeRO optimizer does not wrap). Pure: no collectives, no weights."""
    bad = [z for z in zero_stages if z not in (0, 1, 2)]
    if bad or not zero_stages:
        raise PlanError(f"zero_stages must be a non-empty subset of (0, 1, 2), got {tuple(zero_stages)}")
    hw = hw or HardwareModel()
    if trace is None:
        trace = trace_model(model, example_args, example_kwargs)
    _, blocks = _blocks(model)
    layers = len(blocks)
    vocab = next((trace.shapes[e.param][0] for e in trace.events if e.kind == "embedding"), 0)
    fixed = dict(fixed or {})
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
        for pp in _divisors(world_size // tp):
            dp = world_size // tp // pp
            if pp > layers or fixed.get("pp", pp) != pp or fixed.get("dp", dp) != dp or batch_size % dp:
                continue
            for zero in sorted(set(zero_stages)) if dp > 1 and pp == 1 else (0,):
                cands.append(estimate(trace, pp=pp, dp=dp, tp=tp, zero_stage=zero, tp_sharded=sharded, pairs=rows,
                                      layers=layers, batch_size=batch_size, seq_len=seq_len, param_bytes=param_bytes,
                                      act_bytes=act_bytes, memory_budget_gb=memory_budget_gb, hw=hw,
                                      sequence_parallel=sequence_parallel, vocab=vocab if heads else 0))
    if not cands:
        raise PlanError(f"no pp x dp x tp factorisation of world size {world_size} fits the constraints "
                        f"(fixed={fixed}, batch_size={batch_size}, {layers} blocks, max_tp={max_tp}, "
                        f"zero_stages={tuple(zero_stages)})")
    # prefer less ZeRO (less complexity, same step time) on ties; fitting candidates first
    cands.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.memory_gb, c.zero_stage))
    report = ParallelReport(cands[0], cands)
    if not cands[0].fits:
        report.notes.append(f"no candidate fits {memory_budget_gb} GB per rank; chose the smallest memory")
    if cands[0].pp > 1:
        report.split = pipeline_split(model, trace, cands[0].pp)
    return report


def language_model_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (a tensor, or an output with ``.logits`` / ``["logits"]``)."""
    logits = output.logits if hasattr(output, "logits") else output["logits"] if isinstance(output, dict) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class ParallelResult:
    """What :func:`auto_parallelize` built on this rank.

    ``model``: the (tensor-parallelized) model when ``pp == 1``, else ``None``; ``ddp``: the
    :class:`vescale.parallel.DistributedDataParallel` around it when ``dp > 1`` and ``pp == 1``; ``engine``: the
    :class:`vescale.pipe.PipeEngine` when ``pp > 1`` (its ``step(batch, target)`` runs forward and backward of this
    dp rank's batch); ``mesh``: the pp/dp/tp mesh (``None`` on one rank); ``report``: the choice.
    Unpacks as ``(module, report)`` for the older two-value form.
    """

    report: ParallelReport
    mesh: Any = None
    model: nn.Module | None = None
    ddp: nn.Module | None = None
    engine: Any = None
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def module(self) -> nn.Module | None:
        """The module to call for ``pp == 1`` (the DDP wrapper when there is one); ``None`` with a pipeline."""
        return self.ddp if self.ddp is not None else self.model

    def __iter__(self):
        return iter((self.module if self.engine is None else self.engine, self.report))

    def shard_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This dp rank's slice (dim 0) of a global batch: what it feeds ``module`` or ``engine.step``."""
        if batch.shape[0] % self.dp_size:
            raise PlanError(f"global batch of {batch.shape[0]} does not divide over dp={self.dp_size}")
        return batch.chunk(self.dp_size)[self.dp_rank]

    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters this rank holds (the pipeline stages' or the model's)."""
        if self.engine is not None:
            return self.engine.parameters()
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self, optimizer_cls: type, **kw: Any):
        """Build the optimizer the choice calls for: ``optimizer_cls(**kw)`` wrapped in
        :class:`vescale.parallel.DistributedOptimizer` at the chosen ZeRO stage (1 or 2), else a plain
        ``optimizer_cls(self.parameters(), **kw)``. ``DistributedOptimizer`` needs an elementwise optimizer."""
        zero = self.report.chosen.zero_stage
        if zero and self.ddp is not None:
            from vescale.parallel import DistributedOptimizer

            return DistributedOptimizer(self.ddp, optimizer_cls, zero_stage=zero, **kw)
        return optimizer_cls(self.parameters(), **kw)


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
                     zero_stages: tuple[int, ...] = (0, 1, 2), schedule: str = "1f1b",
                     num_microbatches: int | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                     **kw) -> ParallelResult:
    """Choose a parallelization of ``model`` with the cost model and build it; return a :class:`ParallelResult`.

    ``mesh`` (dims named among pp/dp/tp) pins the mesh shape, otherwise ``world_size`` (default: the process group's)
    is factorised by :func:`choose_parallelism`, restricted by ``fixed`` (e.g. ``{"pp": 2, "tp": 2}``) and
    ``zero_stages``; ``**kw`` go to it (hardware model, ``max_tp``, ...). ``batch_size`` is the global batch in
    sequences. Every rank must build ``model`` with the same weights (DDP broadcasts from dp rank 0 anyway).

    With ``apply=True`` the whole choice is built on a ``pp x dp x tp`` mesh (dims of size 1 left out):

    * ``pp == 1``: :func:`auto_plan` on the tp sub-mesh parallelizes ``model`` in place (sequence parallel if asked);
      for ``dp > 1`` it is wrapped in ``DistributedDataParallel(model, dp_mesh, zero_stage=chosen)``. Each rank
      feeds ``result.module`` its dp slice (``result.shard_batch``) and calls backward on its mean loss; build the
      optimizer with ``result.make_optimizer(torch.optim.AdamW, lr=...)`` (a ``DistributedOptimizer`` for ZeRO 1/2).
    * ``pp > 1``: ``vescale.pipe.split`` cuts ``model`` at the report's split points, captured on one microbatch of
      the example inputs (dim 0 set to ``batch_size // dp // num_microbatches``; default token ids
      ``[mb, seq_len]``); with ``tp > 1`` each of this rank's stages is sharded by the plan's parameter entries
      (``vescale.parallel.parallelize_stage``, embeddings replicated); a ``PipeEngine`` over the pp sub-mesh (dp
      averages gradients over stage replicas) runs ``schedule`` with ``num_microbatches`` (default ``2 * pp``) and
      ``loss_fn(output, target)`` (default: token cross-entropy of the logits). ``result.engine.step(inputs,
      targets)`` takes this rank's dp slice of the batch.

    Raises :class:`PlanError` on every rank, before any collective, when the batch does not divide into dp ranks and
    microbatches or the model cannot be traced.
    """
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh

    pinned = None
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in ("pp", "dp", "tp")]
        if unknown or len(names) != mesh.ndim:
            raise PlanError(f"auto_parallelize understands mesh dims pp, dp, tp; {mesh} has {unknown or names}")
        pinned = {n: 1 for n in ("pp", "dp", "tp")} | dict(zip(names, mesh.shape))
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
    result = ParallelResult(report, model=model if c.pp == 1 else None)
    if not apply:
        return result
    microbatches = num_microbatches or 2 * c.pp
    if c.pp > 1 and batch_size % (c.dp * microbatches):
        raise PlanError(f"batch_size {batch_size} does not divide into dp={c.dp} x {microbatches} microbatches "
                        f"for pp={c.pp}")
    if world_size > 1 and mesh is None:
        mesh = init_mesh({n: s for n, s in (("pp", c.pp), ("dp", c.dp), ("tp", c.tp)) if s > 1})
    result.mesh = mesh
    dims = tuple(mesh.mesh_dim_names) if mesh is not None else ()
    sub = {dims[0]: mesh} if len(dims) == 1 else {n: mesh[n] for n in dims}
    tp_mesh = sub.get("tp") if c.tp > 1 else None
    if c.dp > 1:
        result.dp_size, result.dp_rank = c.dp, sub["dp"].get_local_rank()
    if c.pp == 1:
        if tp_mesh is not None:
            from vescale.parallel import parallelize_module

            report.plan = auto_plan(model, tp_mesh, sequence_parallel=sequence_parallel, example_args=example_args,
                                    example_kwargs=example_kwargs, trace=trace)
            parallelize_module(model, tp_mesh, report.plan)
        if c.dp > 1:
            from vescale.parallel import DistributedDataParallel

            result.ddp = DistributedDataParallel(model, sub["dp"], zero_stage=c.zero_stage)
            report.notes.append(f"DistributedDataParallel over dp={c.dp}, zero_stage={c.zero_stage}; build the "
                                "optimizer with result.make_optimizer(cls, **kw)")
    else:
        if tp_mesh is not None:  # parameter entries only: a captured stage has no module boundaries; no SP
            report.plan = auto_plan(model, tp_mesh, sequence_parallel=False, example_args=example_args,
                                    example_kwargs=example_kwargs, trace=trace)
        result.engine = build_pipeline(
            model, sub["pp"], split_points=report.split.split_points, schedule=schedule,
            num_microbatches=microbatches, loss_fn=loss_fn or language_model_loss, tp_mesh=tp_mesh, plan=report.plan,
            example_inputs=_microbatch_example(example_args, example_kwargs, batch_size // c.dp // microbatches,
                                               seq_len),
            dp_group=sub["dp"].get_group() if "dp" in sub else None)
        report.notes.append(f"pipeline: {result.engine.num_stages} stages at {report.split.split_points}, "
                            f"schedule {schedule!r}, {microbatches} microbatches")
    report.applied = True
    return result
