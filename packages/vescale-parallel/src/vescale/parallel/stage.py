"""``parallelize_stage``: tensor-parallelize one graph-captured pipeline stage with the parameter entries of a plan."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from vescale.core.errors import PlanError

__all__ = ["parallelize_stage"]


def parallelize_stage(stage: nn.Module, mesh, plan: dict, replicated: Iterable[str] = ()) -> nn.Module:
    """Shard the parameters of ``stage`` (e.g. a ``vescale.pipe.split`` stage) over ``mesh`` (the tp mesh) by ``plan``.

    A captured stage has no submodules to hang boundary entries on, so only the ``"parameter"`` section of ``plan``
    is used (the entries that match some parameter of ``stage``; the others belong to other stages): activations
    enter and leave the stage replicated and DTensor propagates the shardings op by op inside (a column/row pair
    then issues the same collectives as Megatron's). Parameter FQNs in ``replicated`` stay replicated whatever the
    plan says: pass the embedding weights, since a vocab-parallel lookup needs the module-level ``output`` entry that a
    captured stage cannot carry. Returns ``stage``, parallelized in place by ``parallelize_module``.

    Raises :class:`PlanError` when ``plan`` does not follow the plan grammar or has no ``"parameter"`` section.
    """
    from torch.distributed.tensor import Replicate

    from vescale.core.fqn import match_plan
    from vescale.parallel.parallelize import parallelize_module
    from vescale.parallel.plan_grammar import check_plan

    check_plan(plan)
    params = plan.get("parameter")
    if params is None:
        raise PlanError(f"parallelize_stage needs a plan with a 'parameter' section, got sections {sorted(plan)}")
    names = [n for n, _ in stage.named_parameters()]
    section: dict = {re.escape(f): [Replicate()] for f in replicated if f in names}
    used = {m.pattern for m in match_plan(params, names, allow_unmatched=True).values()}
    section.update({k: v for k, v in params.items() if k in used and k not in section})
    return parallelize_module(stage, mesh, {"parameter": section})
