"""The fast path's run-time state: one :class:`FastPathContext` per parallelized model, and the on/off switch.

``parallelize_module`` makes one context per call and hands it to the plan's hooks and to every fast block, layer
and model it installs; nothing else reads or writes it. :func:`fast_path` is a context-local switch
(``contextvars``), like a grad mode: inside ``fast_path(False)`` every fast object runs its module's own forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["FastPathContext", "fast_path", "fast_path_enabled"]

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("vescale_fast_path", default=True)


class FastPathContext:
    """One parallelized model's fast-path state.

    ``depth`` > 0 while one of its fast blocks runs on local tensors: the plan's input/output hooks of modules inside
    it then do nothing (the block applies its row-parallel projection's output entry itself, to the wrapped result).
    ``layer_group`` is the tensor-parallel process group while one of its fast layers or models runs (None
    otherwise): its blocks then take and give this rank's replicated local activation.
    """

    __slots__ = ("depth", "layer_group")

    def __init__(self) -> None:
        self.depth = 0
        self.layer_group = None


def fast_path_enabled() -> bool:
    """Whether the fast path may run here (see :func:`fast_path`)."""
    return _ENABLED.get()


@contextlib.contextmanager
def fast_path(enabled: bool) -> Iterator[None]:
    """Inside, recognised blocks run on local tensors (``True``, the default) or always take the DTensor path
    (``False``): for comparing the two, and for the benchmark."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)
