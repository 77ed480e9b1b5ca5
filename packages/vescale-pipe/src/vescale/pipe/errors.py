"""Errors raised by vescale.pipe; all derive from :class:`vescale.core.errors.VescaleError`."""

from __future__ import annotations

from vescale.core.errors import VescaleError

__all__ = ["PipeError", "ScheduleError", "SplitError"]


class PipeError(VescaleError, ValueError):
    """Bad input to the pipeline runtime (stages, mesh, batch shape, microbatch count)."""


class ScheduleError(PipeError):
    """A schedule is malformed, deadlocks, misses a dependency, or needs more microbatches than given."""


class SplitError(PipeError):
    """A model cannot be split as asked (unknown split point, graph capture failed, too few candidate boundaries)."""
