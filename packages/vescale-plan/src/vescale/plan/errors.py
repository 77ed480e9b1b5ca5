"""The errors :mod:`vescale.plan` raises besides :class:`vescale.core.errors.PlanError` (bad plans, shared by every
package) and :class:`vescale.core.errors.MeshError` (meshes that cannot be planned for)."""

from __future__ import annotations

from vescale.core.errors import VescaleError

__all__ = ["TraceError"]


class TraceError(VescaleError, RuntimeError):
    """The model could not be traced on the meta device (the planner then falls back to the module tree)."""
