"""The planner's collective counter is vescale's one counter, :class:`vescale.core.comm.CommCounter` (calls and bytes
per collective, per mesh dimension); re-exported here so ``from vescale.plan import CommCounter`` keeps working."""

from __future__ import annotations

from vescale.core.comm import CommCounter

__all__ = ["CommCounter"]
