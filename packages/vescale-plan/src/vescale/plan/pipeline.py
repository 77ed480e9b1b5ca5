"""Pipeline stages: boundaries balanced by parameter count and estimated flops (from a meta-device trace), and the
:class:`vescale.pipe.PipeEngine` over this rank's stages of a split model (:func:`build_pipeline`)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vescale.core.blocks import find_blocks
from vescale.core.errors import PlanError
from vescale.plan.trace import ModelTrace

__all__ = ["PipelineSplit", "pipeline_split", "build_pipeline"]


@dataclass(frozen=True)
class PipelineSplit:
    """``split_points``: module FQNs that start stages 1..N-1 (what ``vescale.pipe.split`` takes);
    ``stage_params`` / ``stage_flops``: per stage; ``imbalance``: largest stage cost / mean stage cost."""

    split_points: list[str]
    stage_params: list[int]
    stage_flops: list[float]
    imbalance: float


def _blocks(model: nn.Module) -> tuple[str, list[str]]:
    blocks = [fqn for fqn, _ in find_blocks(model)]
    if not blocks:
        raise PlanError(f"{type(model).__name__} has no nn.ModuleList of blocks to place pipeline boundaries at")
    return blocks[0].rpartition(".")[0], blocks


def pipeline_split(model: nn.Module, trace: ModelTrace, num_stages: int, *, flops_weight: float = 0.5
                   ) -> PipelineSplit:
    """Cut the longest ``nn.ModuleList`` of ``model`` into ``num_stages`` contiguous runs of blocks.

    The cost of a block is ``flops_weight * flops share + (1 - flops_weight) * parameter share`` (forward matmul flops
    from ``trace``; opaque modules count 2 flops per parameter per token). Everything before the first block
    (embeddings) is charged to stage 0, everything after the last (final norm, head) to the last stage. The cut
    minimises the largest stage cost exactly (dynamic programming over block boundaries).
    """
    name, blocks = _blocks(model)
    if not 1 <= num_stages <= len(blocks):
        raise PlanError(f"cannot make {num_stages} pipeline stages from the {len(blocks)} blocks of {name!r}")
    tokens = _tokens(trace)
    params = {fqn: math.prod(shape) for fqn, shape in trace.shapes.items()}

    def under(prefix: str) -> tuple[int, float]:
        p = sum(n for f, n in params.items() if f.startswith(prefix + "."))
        fl = trace.flops_under(prefix) + sum(2.0 * tokens * n for f, n in params.items()
                                             if any(f.startswith(o + ".") and o.startswith(prefix + ".")
                                                    for o in trace.opaque))
        return p, fl

    per_block = [under(b) for b in blocks]
    total_p = sum(params.values()) or 1
    total_f = trace.flops_under("") or 1.0
    rest_p = total_p - sum(p for p, _ in per_block)
    rest_f = max(total_f - sum(f for _, f in per_block), 0.0)
    head = [f for f in params if not f.startswith(name + ".")]
    order = {f: i for i, f in enumerate(params)}
    first_block = min((order[f] for f in params if f.startswith(name + ".")), default=0)
    pre_p = sum(params[f] for f in head if order[f] < first_block)
    pre_share = pre_p / rest_p if rest_p else 0.5

    def cost(p: float, f: float) -> float:
        return flops_weight * f / total_f + (1 - flops_weight) * p / total_p

    costs = [cost(p, f) for p, f in per_block]
    costs[0] += cost(pre_p, rest_f * pre_share)
    costs[-1] += cost(rest_p - pre_p, rest_f * (1 - pre_share))
    cuts = _min_max_partition(costs, num_stages)
    bounds = [0, *cuts, len(blocks)]
    stage_p, stage_f = [], []
    for s in range(num_stages):
        ps = [per_block[i] for i in range(bounds[s], bounds[s + 1])]
        stage_p.append(sum(p for p, _ in ps) + (pre_p if s == 0 else 0) + (rest_p - pre_p if s == num_stages - 1
                                                                            else 0))
        stage_f.append(sum(f for _, f in ps) + (rest_f * pre_share if s == 0 else 0)
                       + (rest_f * (1 - pre_share) if s == num_stages - 1 else 0))
    stage_cost = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(num_stages)]
    imbalance = max(stage_cost) / (sum(stage_cost) / num_stages)
    return PipelineSplit([blocks[c] for c in cuts], stage_p, stage_f, imbalance)


def _tokens(trace: ModelTrace) -> int:
    for e in trace.events:
        if e.kind == "embedding":
            return math.prod(e.out_shape[:-1])
    return 1


def _min_max_partition(costs: list[float], k: int) -> list[int]:
    """Start indices of parts 1..k-1 of ``costs`` cut into ``k`` contiguous non-empty parts, minimising the max."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):
                v = max(best[j - 1][s], prefix[i] - prefix[s])
                if v < best[j][i]:
                    best[j][i], arg[j][i] = v, s
    cuts, i = [], n
    for j in range(k, 0, -1):
        i = arg[j][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def build_pipeline(model: nn.Module, pp_mesh, *, example_inputs: Any, num_microbatches: int,
                   loss_fn: Callable[[Any, Any], torch.Tensor], schedule: str = "1f1b",
                   split_points: Sequence[str] | None = None, tp_mesh=None, plan: dict | None = None,
                   dp_group=None, device: torch.device | str | None = None, compile: bool = False):
    """Split ``model`` into pipeline stages, build only this rank's, and return the ``PipeEngine`` that runs them.

    The split (``vescale.pipe.split``) is captured on ``example_inputs``, one microbatch; it starts stages at
    ``split_points`` (module FQNs), or without them makes one stage per rank of the 1-D ``pp_mesh`` balanced by
    parameter count. ``schedule`` (a registered name) with ``num_microbatches`` decides which stages are this rank's;
    the others are never materialised, sharded or moved. Then, for each stage of this rank:

    * a model built by ``vescale.dtensor.deferred_init`` is captured through a CPU shadow of uninitialised tensors
      (``to_empty``: address space, no page written) rather than on the meta device, because model code may branch
      on ``device.type`` (Mixtral's ``histc``) and must trace a real path; the stage then adopts the model's meta
      tensors by their FQNs and materialises only them, bitwise the single-device values. When ``device`` is not the
      CPU, the captured graph's factory ops that name the CPU are moved to ``device``;
    * with ``tp_mesh``, the stage is sharded by the parameter entries of ``plan`` (``parallelize_stage``; a captured
      stage has no module boundaries), embeddings replicated; a deferred stage is materialised straight into shards;
    * with ``device``, the stage is moved there (constants the capture lifted out of ``forward`` are on the CPU);
    * with ``compile``, its forward is compiled (``vescale.parallel.compile_forward``).

    The engine runs ``schedule`` over ``pp_mesh``, applies ``loss_fn(output, target)`` to the last stage's output
    and averages gradients over ``dp_group`` (stage replicas) when given. Collectives: none here but the engine's.
    """
    from torch.fx.node import map_aggregate

    from vescale.dtensor import adopt_deferred, is_deferred, materialize
    from vescale.parallel import compile_forward, parallelize_stage
    from vescale.pipe import PipeEngine, build_schedule, capture, split

    deferred = is_deferred(model)
    traced = copy.deepcopy(model).to_empty(device="cpu") if deferred else model
    if deferred:
        example_inputs = map_aggregate(example_inputs, lambda v: v.cpu() if isinstance(v, torch.Tensor) else v)
    exported = capture(traced, example_inputs)
    if deferred and device is not None and torch.device(device).type != "cpu":
        _move_graph_device(exported.graph, torch.device("cpu"), torch.device(device))
    how = {"split_points": list(split_points)} if split_points is not None else {"num_stages": pp_mesh.size()}
    stages: list[nn.Module | None] = list(split(traced, example_inputs=example_inputs, exported=exported, **how))
    sched = build_schedule(schedule, pp_mesh.size(), num_microbatches, len(stages))
    mine = set(sched.stages_of(pp_mesh.get_local_rank()))
    embeddings = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    for i, stage in enumerate(stages):
        if i not in mine:
            stages[i] = None
            continue
        if deferred:
            adopt_deferred(stage, model)  # the model's meta tensors by FQN, and its init record to replay
        if tp_mesh is not None:
            stage = parallelize_stage(stage, tp_mesh, plan, embeddings)
        elif deferred:
            materialize(stage, device=device)
        if device is not None and not _all_on(stage, torch.device(device)):
            stage.to(device)  # (only when needed: moving swaps DTensor parameters, which drops their grad hooks)
        stages[i] = compile_forward(stage) if compile else stage
    return PipeEngine(stages, pp_mesh, schedule=sched, num_microbatches=num_microbatches, loss_fn=loss_fn,
                      dp_group=dp_group)


def _all_on(module: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``module`` already lives on ``device`` (``cuda`` means the current one)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return all(t.device == device for t in (*module.parameters(), *module.buffers()))


def _move_graph_device(graph: torch.fx.Graph, old: torch.device, new: torch.device) -> None:
    """Rewrite every ``device=old`` argument of ``graph``'s nodes (factories, ``to``) to ``new``, in place."""
    from torch.fx.node import map_aggregate

    def swap(value: Any) -> Any:
        return new if isinstance(value, torch.device) and value == old else value

    for node in graph.nodes:
        args, kwargs = map_aggregate(node.args, swap), map_aggregate(node.kwargs, swap)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
