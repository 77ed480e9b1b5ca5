"""Strict mode (no implicit redistribution) and a communication counter for tests and benchmarks."""

from __future__ import annotations

import os
import threading
from collections import Counter
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import ExplicitRedistributionContext
from torch.utils._python_dispatch import TorchDispatchMode

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


# c10d's in-place collectives (what torch.distributed.* dispatch to); functional collectives are every op of the
# _c10d_functional namespace but the bookkeeping ones (waiting on a result, wrapping one for autograd).
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
_C10D_COLLECTIVES = frozenset({"_allgather_base_", "_reduce_scatter_base_", "allgather_", "allgather_coalesced_",
                               "allgather_into_tensor_coalesced_", "allreduce_", "allreduce_coalesced_", "alltoall_",
                               "alltoall_base_", "broadcast_", "gather_", "scatter_", "reduce_", "reduce_scatter_",
                               "reduce_scatter_tensor_coalesced_"})


def _collective_name(func) -> str | None:
    """The torch.distributed name of the collective ``func`` (an ATen overload), or None if it is not one."""
    namespace, name = getattr(func, "namespace", ""), func._overloadpacket.__name__
    if namespace in ("_c10d_functional", "c10d_functional") and name not in _NOT_COLLECTIVES:
        return name
    if namespace == "c10d" and name in _C10D_COLLECTIVES:
        plain = name.strip("_")
        return _C10D_NAMES.get(plain, plain)
    return None


class _CountCollectives(TorchDispatchMode):
    """Counts collective ops as they reach the dispatcher. DTensor ops are let through first (NotImplemented), so
    the collectives they desugar into are seen. Unlike torch's ``CommDebugMode`` it tracks no modules: it installs
    no module hooks, so it cannot change how a model's forward or backward runs."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = _collective_name(func)
        if name is not None:
            self.counts[name] += 1
        return out


class CommCounter:
    """Counts the collectives issued inside a ``with`` block, forward and backward alike.

    ``counts`` maps a collective name (``all_gather_into_tensor``, ``all_reduce``, ``reduce_scatter_tensor``,
    ``all_to_all_single``, ``broadcast``, ...) to how many times it ran; ``total`` is their sum.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._mode = _CountCollectives(self.counts)

    def __enter__(self) -> CommCounter:
        self.counts.clear()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    @property
    def total(self) -> int:
        """Number of collectives counted."""
        return sum(self.counts.values())


def count_comms() -> CommCounter:
    """``with count_comms() as c: ...`` then read ``c.total`` / ``c.counts``."""
    return CommCounter()
