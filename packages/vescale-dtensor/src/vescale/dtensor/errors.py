"""Errors raised by vescale.dtensor; each names the tensor, shape, placement or mesh dim involved."""

from __future__ import annotations

from vescale.core.errors import VescaleError

__all__ = ["PlacementError", "ViewRedistributeError", "StrictRedistributeError", "DeferredInitError",
           "CompiledRandomError", "CheckpointReplayError"]


class PlacementError(VescaleError, ValueError):
    """A placement does not fit the tensor or mesh it is used with (shape, dim, divisibility, local shape)."""


class ViewRedistributeError(PlacementError, RuntimeError):
    """A view op (``view`` and the ``flatten``/``unflatten``/``reshape`` calls that become one, ``squeeze``,
    ``unsqueeze``, ``permute``, ``transpose``, ``expand``) on a DTensor cannot be computed as a view of each rank's
    local tensor: it would need a redistribution, whose result is a copy, not an alias of the input. Raised on every
    rank during sharding propagation, before any collective. A ``RuntimeError`` like torch's own refusal of such views:
    ``view`` (and the calls that become one) raises it as this type, the other ops as torch's dispatcher re-raises
    errors of sharding rules, a plain ``RuntimeError`` whose ``__cause__`` it is."""


class StrictRedistributeError(VescaleError, RuntimeError):
    """Under :func:`vescale.dtensor.strict`, an op would have redistributed an input implicitly."""


class DeferredInitError(VescaleError, RuntimeError):
    """A deferred module cannot be materialised as asked (unknown FQN, bad placements, unsupported init op)."""


class CompiledRandomError(VescaleError, RuntimeError):
    """A DTensor random op (dropout, init) reached vescale's counter RNG while ``torch.compile`` was tracing."""


class CheckpointReplayError(VescaleError, RuntimeError):
    """A checkpointed region's recompute made a random call that its forward did not make (different control flow,
    ``p`` or ``training`` between forward and backward), so its values cannot be replayed."""


class UndrawnRandomError(VescaleError, NotImplementedError):
    """A random aten op that vescale's counter RNG does not draw (``multinomial``, ``rrelu_with_noise``, ...) reached a
    DTensor while the counter RNG is installed: torch's per-rank generator would give values no one device gives."""
