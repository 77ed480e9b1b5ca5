"""``auto_parallelize``: choose pp x dp x tp, the ZeRO stage and the pipeline split with the cost model; apply it."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from vescale.core.errors import PlanError
from vescale.plan.auto_plan import AutoPlan, auto_plan, plan_from_trace
from vescale.plan.cost import CostEstimate, HardwareModel, estimate
from vescale.plan.pipeline import PipelineSplit, _blocks, pipeline_split
from vescale.plan.trace import ModelTrace, TraceError, trace_model

__all__ = ["ParallelReport", "choose_parallelism", "auto_parallelize"]


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
                       hw: HardwareModel | None = None, sequence_parallel: bool = True,
                       example_args: tuple | None = None, example_kwargs: dict | None = None,
                       trace: ModelTrace | None = None) -> ParallelReport:
    """Estimate every ``pp x dp x tp = world_size`` (``fixed`` pins some of them) and ZeRO stage 0-2; pick the
    fastest that fits ``memory_budget_gb`` (the smallest memory if none fits). Pure: no collectives, no weights."""
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
            for zero in (0, 1, 2) if dp > 1 else (0,):
                cands.append(estimate(trace, pp=pp, dp=dp, tp=tp, zero_stage=zero, tp_sharded=sharded, pairs=rows,
                                      layers=layers, batch_size=batch_size, seq_len=seq_len, param_bytes=param_bytes,
                                      act_bytes=act_bytes, memory_budget_gb=memory_budget_gb, hw=hw,
                                      sequence_parallel=sequence_parallel, vocab=vocab if heads else 0))
    if not cands:
        raise PlanError(f"no pp x dp x tp factorisation of world size {world_size} fits the constraints "
                        f"(fixed={fixed}, batch_size={batch_size}, {layers} blocks, max_tp={max_tp})")
    # prefer less ZeRO (less complexity, same step time) on ties; fitting candidates first
    cands.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.memory_gb, c.zero_stage))
    report = ParallelReport(cands[0], cands)
    if not cands[0].fits:
        report.notes.append(f"no candidate fits {memory_budget_gb} GB per rank; chose the smallest memory")
    if cands[0].pp > 1:
        report.split = pipeline_split(model, trace, cands[0].pp)
    return report


def auto_parallelize(model: nn.Module, *, world_size: int | None = None, mesh=None,
                     memory_budget_gb: float | None = None, batch_size: int = 8, seq_len: int = 2048,
                     apply: bool = True, sequence_parallel: bool = True, example_args: tuple | None = None,
                     example_kwargs: dict | None = None, **kw) -> tuple[nn.Module, ParallelReport]:
    """Choose and apply a parallelization of ``model``; return ``(model, report)``.

    ``mesh`` (with dims named among pp/dp/tp) pins the mesh shape, otherwise ``world_size`` (default: the process
    group's) is factorised by :func:`choose_parallelism`; ``**kw`` go to it (hardware model, ``max_tp``, ...).
    With ``apply=True`` and a chosen ``pp == 1``, ``model`` is parallelized in place with :func:`auto_plan` on a
    ``dp x tp`` mesh (data parallelism through the plan's batch-sharded activations). The ZeRO stage is a
    recommendation in the report (wrap with ``vescale.parallel`` DDP/DistributedOptimizer yourself); for
    ``pp > 1`` the report carries the split points for ``vescale.pipe.split`` and nothing is applied.
    """
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_module

    fixed = None
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in ("pp", "dp", "tp")]
        if unknown:
            raise PlanError(f"auto_parallelize understands mesh dims pp, dp, tp; {mesh} has {unknown}")
        fixed = {n: 1 for n in ("pp", "dp", "tp")} | dict(zip(names, mesh.shape))
        world_size = mesh.size()
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    try:
        trace = trace_model(model, example_args, example_kwargs)
    except TraceError as exc:
        raise PlanError(f"auto_parallelize needs a meta-device trace for its cost model: {exc}") from exc
    report = choose_parallelism(model, world_size, memory_budget_gb=memory_budget_gb, batch_size=batch_size,
                                seq_len=seq_len, fixed=fixed, sequence_parallel=sequence_parallel, trace=trace, **kw)
    c = report.chosen
    if not apply or c.pp > 1:
        if c.pp > 1:
            report.notes.append("pp > 1: not applied; build stages with vescale.pipe.split(model, split_points)")
        return model, report
    if mesh is None or "pp" in (mesh.mesh_dim_names or ()):
        mesh = init_mesh({"dp": c.dp, "tp": c.tp})
    report.plan = auto_plan(model, mesh, sequence_parallel=sequence_parallel, example_args=example_args,
                            example_kwargs=example_kwargs, trace=trace)
    parallelize_module(model, mesh, report.plan)
    report.applied = True
    return model, report
