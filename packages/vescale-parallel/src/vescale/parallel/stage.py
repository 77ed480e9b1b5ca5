"""``parallelize_stage``: tensor-parallelize one graph-captured pipeline stage with the parameter entries of a plan."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from vescale.core.errors import PlanError

__all__ = ["parallelize_stage"]


def parallelize_stage(stage: nn.Module, tp_mesh, plan: dict, replicated: Iterable[str] = ()) -> nn.Module:
    """Shard the parameters of ``stage`` (e.g. a ``vescale.pipe.split`` stage) over ``tp_mesh`` by ``plan``.

    A captured stage has no submodules to hang forward entries on, so only the ``"parameter"`` section of ``plan``
    is used (the entries that match some parameter of ``stage``; the others belong to other stages): activations
    enter and leave the stage replicated and DTensor propagates the shardings op by op inside (a column/row pair
    then issues the same collectives as Megatron's). Parameter FQNs in ``replicated`` stay replicated whatever the
    plan says: pass the embedding weights, since a vocab-parallel lookup needs the module-level output entry that a
    captured stage cannot carry. Returns ``stage``, parallelized in place by ``parallelize_module``.

    Raises :class:`PlanError` when ``plan`` has no ``"parameter"`` section.
    """
    from torch.distributed.tensor import Replicate

    from vescale.core.fqn import match_plan
    from vescale.parallel.parallelize import parallelize_module

    params = plan.get("parameter") if isinstance(plan, dict) else None
    if params is None:
        raise PlanError(f"parallelize_stage needs a plan with a 'parameter' section, got keys "
                        f"{sorted(plan) if isinstance(plan, dict) else type(plan).__name__}")
    names = [n for n, _ in stage.named_parameters()]
    section: dict = {re.escape(f): [Replicate()] for f in replicated if f in names}
    used = {m.pattern for m in match_plan(params, names, allow_unmatched=True).values()}
    section.update({k: v for k, v in params.items() if k in used and k not in section})
    return parallelize_module(stage, tp_mesh, {"parameter": section})
