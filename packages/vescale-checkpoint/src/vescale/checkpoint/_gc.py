"""Python's cyclic garbage collector held off during a checkpoint call.

A load or save makes tens of thousands of short-lived Python objects (parsed metadata, requests, plans). While
they are alive, the collector's allocation counters trigger collections that promote them, and every few calls a
full collection walks every object of the process (the model's modules and tensors included): 0.2 s each time
with a 2 GiB model here, a quarter of a load. With the collector held off, those objects die by reference
counting when the call ends, so the collections are not just deferred but never needed. Only the calling thread's
synchronous work is covered: an async save's background thread leaves the collector alone.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def collector_paused(fn: F) -> F:
    """Run ``fn`` with automatic garbage collection disabled, restoring it after (if it was enabled)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return wrapper  # type: ignore[return-value]
