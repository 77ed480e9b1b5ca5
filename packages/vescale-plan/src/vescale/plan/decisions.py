"""What :func:`~vescale.plan.auto_plan` returns: the plan, and every decision behind it with its reason."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement

from vescale.plan.verify import PairCheck

__all__ = ["Decision", "AutoPlan"]


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
    """A plan (``{"parameter": {...}, "input": {...}, "output": {...}, "local": {...}}``, in the grammar of
    :mod:`vescale.parallel.plan_grammar`: exactly what ``parallelize_module`` takes) that also
    carries the :class:`Decision` list behind it (``decisions``), the mesh it was made for (``mesh_desc``), the
    column/row pairs it found (``pairs``: ``(row, cols)`` FQNs), each planned parameter's placement on the tp dim
    (``tp_placements``) and, from :func:`auto_plan`, the numerical checks of its pairs (``checks``:
    :class:`vescale.plan.verify.PairCheck` list; empty when not verified)."""

    def __init__(self, plan: dict, decisions: list[Decision], mesh_desc: str,
                 pairs: list[tuple[str, list[str]]] | None = None,
                 tp_placements: dict[str, Placement] | None = None) -> None:
        super().__init__(plan)
        self.decisions = decisions
        self.mesh_desc = mesh_desc
        self.pairs = pairs or []
        self.tp_placements = tp_placements or {}
        self.checks: list[PairCheck] = []
