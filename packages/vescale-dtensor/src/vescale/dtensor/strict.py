"""Strict mode (no implicit redistribution) and a communication counter for tests and benchmarks."""

from __future__ import annotations

import os
import threading
from collections import Counter
from contextlib import contextmanager

from torch.distributed.tensor._utils import ExplicitRedistributionContext
from torch.distributed.tensor.debug import CommDebugMode

from vescale.dtensor.errors import StrictRedistributeError

__all__ = ["strict", "is_strict", "CommCounter", "count_comms", "STRICT_ENV"]

#: Environment variable that turns strict mode on for the whole process when set to ``1``.
STRICT_ENV = "VESCALE_DTENSOR_STRICT"

_state = threading.local()
_torch_observe = ExplicitRedistributionContext.observe_redistribution


def is_strict() -> bool:
    """Whether strict mode is on in this thread (innermost :func:`strict` context, else ``VESCALE_DTENSOR_STRICT``)."""
    stack = getattr(_state, "stack", None)
    if stack:
        return stack[-1]
    return os.environ.get(STRICT_ENV, "0") not in ("", "0", "false", "False")


def _observe(cls, src_spec, dst_spec, redistribution_msg):
    if is_strict():
        op = str(redistribution_msg).replace("Implicit redistribution occurred for ", "")
        op = op.split(" while ExplicitRedistributionContext")[0]
        raise StrictRedistributeError(
            f"strict mode: {op} would implicitly redistribute an input from placements "
            f"{tuple(src_spec.placements)} to {tuple(dst_spec.placements)} (global shape {tuple(src_spec.shape)}) on "
            f"mesh {tuple(src_spec.mesh.shape)} with dims {src_spec.mesh.mesh_dim_names}; call .redistribute() "
            f"explicitly or leave vescale.dtensor.strict()")
    return _torch_observe.__func__(cls, src_spec, dst_spec, redistribution_msg)


# torch calls this hook for every redistribution its op dispatcher decides on (never for explicit .redistribute());
# wrapping it is the one place vescale hooks into torch's dispatch for strict mode.
ExplicitRedistributionContext.observe_redistribution = classmethod(_observe)


@contextmanager
def strict(enabled: bool = True):
    """Inside, a DTensor op that would redistribute an input implicitly raises :class:`StrictRedistributeError`
    naming the op, the input placements, the target placements and the mesh. ``DTensor.redistribute`` and
    :func:`vescale.dtensor.redistribute` still work. ``strict(False)`` turns it off inside a strict region.
    ``VESCALE_DTENSOR_STRICT=1`` makes strict the default outside any context. Per thread; covers the forward and
    backward ops dispatched while it is active.
    """
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(bool(enabled))
    try:
        yield
    finally:
        stack.pop()


# c10d's op names for what torch.distributed calls them
_C10D_NAMES = {"allgather_base": "all_gather_into_tensor", "allgather": "all_gather", "allreduce": "all_reduce",
               "reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter": "reduce_scatter",
               "alltoall_base": "all_to_all_single", "alltoall": "all_to_all", "allreduce_coalesced": "all_reduce"}


class CommCounter:
    """Counts the collectives issued inside a ``with`` block (torch's ``CommDebugMode`` underneath).

    ``counts`` maps a collective name (``all_gather_into_tensor``, ``all_reduce``, ``reduce_scatter_tensor``,
    ``all_to_all``, ``broadcast``, ...) to how many times it ran; ``total`` is their sum.
    """

    def __init__(self) -> None:
        self._mode = CommDebugMode()
        self.counts: Counter[str] = Counter()

    def __enter__(self) -> CommCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.counts = Counter()
        for op, n in self._mode.get_comm_counts().items():
            name = getattr(op, "__name__", str(op)).split(".")[0].strip("_")
            self.counts[_C10D_NAMES.get(name, name)] += n

    @property
    def total(self) -> int:
        """Number of collectives counted."""
        return sum(self.counts.values())


def count_comms() -> CommCounter:
    """``with count_comms() as c: ...`` then read ``c.total`` / ``c.counts``."""
    return CommCounter()
