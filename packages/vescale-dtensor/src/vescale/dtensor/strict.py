"""Strict mode (no implicit redistribution).

``CommCounter`` / ``count_comms`` (the collective counter strict-mode tests use) live in :mod:`vescale.core.comm`
and are re-exported here under their old names.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

from vescale.core.comm import CommCounter, count_comms
from vescale.core.torch_internals import ExplicitRedistributionContext
from vescale.dtensor.errors import StrictRedistributeError

__all__ = ["strict", "is_strict", "install", "CommCounter", "count_comms", "STRICT_ENV"]

#: Environment variable that turns strict mode on for the whole process when set to ``1``.
STRICT_ENV = "VESCALE_DTENSOR_STRICT"

_state = threading.local()
_torch_observe = None  # torch's own hook, kept by install()


def install() -> None:
    """Put strict mode's check into torch's implicit-redistribution hook (idempotent; with strict mode off it defers
    to torch's). Installed on first use, never at import: by :func:`strict`, :func:`is_strict` and the entry points of
    :mod:`vescale.dtensor` (``distribute_tensor``, ``from_local``, ...), so ``VESCALE_DTENSOR_STRICT=1`` covers every
    DTensor made through vescale."""
    global _torch_observe
    if _torch_observe is None:
        _torch_observe = ExplicitRedistributionContext.observe_redistribution
        # torch calls this hook for every redistribution its op dispatcher decides on (never for explicit
        # .redistribute()); wrapping it is the one place vescale hooks into torch's dispatch for strict mode.
        ExplicitRedistributionContext.observe_redistribution = classmethod(_observe)


def is_strict() -> bool:
    """Whether strict mode is on in this thread (innermost :func:`strict` context, else ``VESCALE_DTENSOR_STRICT``)."""
    install()
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


@contextmanager
def strict(enabled: bool = True):
    """Inside, a DTensor op that would redistribute an input implicitly raises :class:`StrictRedistributeError`
    naming the op, the input placements, the target placements and the mesh. ``DTensor.redistribute`` and
    :func:`vescale.dtensor.redistribute` still work. ``strict(False)`` turns it off inside a strict region.
    ``VESCALE_DTENSOR_STRICT=1`` makes strict the default outside any context. Per thread; covers the forward and
    backward ops dispatched while it is active.
    """
    install()
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(bool(enabled))
    try:
        yield
    finally:
        stack.pop()
