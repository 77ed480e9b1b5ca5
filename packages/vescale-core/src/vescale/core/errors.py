"""The exception hierarchy every vescale package derives from.

Catch :class:`VescaleError` to catch anything vescale raises on purpose. Each subclass also derives from the
built-in exception a caller would naturally expect (``ValueError`` for bad input, ``TimeoutError`` for a hang), so
existing ``except ValueError`` code keeps working.
"""

from __future__ import annotations

__all__ = [
    "VescaleError",
    "MeshError",
    "PlanError",
    "RankError",
    "RankTimeoutError",
    "CollectiveTimeoutError",
]


class VescaleError(Exception):
    """Base class of every error vescale raises deliberately."""


class MeshError(VescaleError, ValueError):
    """A device mesh description does not fit the world size or names an unknown dimension."""


class PlanError(VescaleError, ValueError):
    """A plan (a dict of FQN patterns to values) is malformed or has entries that match nothing."""


class RankError(VescaleError, RuntimeError):
    """A rank of a multi-process run raised, or its process died.

    ``rank`` is the failing rank and ``remote_traceback`` the traceback text printed on that rank
    (empty when the process died without one).
    """

    def __init__(self, message: str, *, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class RankTimeoutError(VescaleError, TimeoutError):
    """Some ranks of a multi-process run did not finish in time; ``ranks`` lists them."""

    def __init__(self, message: str, *, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class CollectiveTimeoutError(VescaleError, TimeoutError):
    """A collective waited longer than the collective timeout (raised by :mod:`vescale.core.watchdog`).

    ``missing_ranks``: the ranks that did not enter the collective the most ranks wait in (all disagreeing ranks
    when there is no majority); ``collective`` (its ``torch.distributed`` name), ``mesh_dim`` (None when its group
    is no mesh dimension), ``call_site`` (``file:line in function``) and ``seq`` (its index among the collectives on
    its group) describe that collective; ``reports`` is every reporting rank's account ``{rank: dict}``.
    """

    def __init__(self, message: str, *, missing_ranks: list[int], collective: str | None = None,
                 mesh_dim: str | None = None, call_site: str | None = None, seq: int | None = None,
                 reports: dict | None = None) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
        self.collective = collective
        self.mesh_dim = mesh_dim
        self.call_site = call_site
        self.seq = seq
        self.reports = reports or {}
