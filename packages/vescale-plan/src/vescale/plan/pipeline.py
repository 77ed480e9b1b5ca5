"""Pipeline stage boundaries balanced by parameter count and estimated flops, from a meta-device trace."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from vescale.core.errors import PlanError
from vescale.plan.trace import ModelTrace

__all__ = ["PipelineSplit", "pipeline_split"]


@dataclass(frozen=True)
class PipelineSplit:
    """``split_points``: module FQNs that start stages 1..N-1 (what ``vescale.pipe.split`` takes);
    ``stage_params`` / ``stage_flops``: per stage; ``imbalance``: largest stage cost / mean stage cost."""

    split_points: list[str]
    stage_params: list[int]
    stage_flops: list[float]
    imbalance: float


def _blocks(model: nn.Module) -> tuple[str, list[str]]:
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList)]
    if not lists:
        raise PlanError(f"{type(model).__name__} has no nn.ModuleList of blocks to place pipeline boundaries at")
    name, blocks = max(lists, key=lambda item: len(item[1]))
    return name, [f"{name}.{i}" if name else str(i) for i in range(len(blocks))]


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
