"""Slow ranks: each rank's step times and the time it spent waiting in collectives, gathered into one table, and the
ranks that are consistently slower than the median named.

In a synchronous job every rank's step takes as long as the slowest rank's: a fast rank spends the difference
waiting in a collective (DDP's gradient reduction, the step's agreement all-reduce). So the figure that tells a
straggler is a rank's *busy* time, its step time less its collective waits: :class:`CollectiveWaitClock` measures the
waits on the main thread (the eager ``torch.distributed`` collectives and every ``Work.wait()``: DDP, ZeRO, the
bad-step guard, the loss average). DTensor's functional collectives (tensor parallel) wait inside the dispatcher and
are not counted. A checkpoint's background writes run on another thread and are not counted either.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import Any

import torch

__all__ = ["CollectiveWaitClock", "percentiles", "rank_row", "per_rank_table", "slow_ranks"]

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
                "all_gather_object", "broadcast_object_list")


class CollectiveWaitClock:
    """Inside ``with``: the seconds this process's main thread spends in ``torch.distributed`` collective calls and
    in ``Work.wait()`` (a collective inside another is counted once). :meth:`take` returns the seconds since the
    last call. The patches are undone on exit (a pooled test rank lives on)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._taken = 0.0
        self._inside = False
        self._main = threading.main_thread()
        self._undo: list[tuple[Any, str, Any]] = []

    def _timed(self, original):
        @functools.wraps(original)
        def timed(*args, **kwargs):
            if self._inside or threading.current_thread() is not self._main:
                return original(*args, **kwargs)
            self._inside, t0 = True, time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False
                self.total_s += time.perf_counter() - t0
        return timed

    def __enter__(self) -> CollectiveWaitClock:
        import torch.distributed as dist

        targets = [(dist, name) for name in _COLLECTIVES if hasattr(dist, name)]
        targets.append((dist.Work, "wait"))  # async ops (DDP buckets) wait here
        for owner, name in targets:
            original = getattr(owner, name)
            self._undo.append((owner, name, original))
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def take(self) -> float:
        """Seconds waited in collectives since the previous ``take``."""
        now, self._taken = self.total_s - self._taken, self.total_s
        return now


def percentiles(values: list[float]) -> list[float]:
    """``[p50, p90, max]`` of ``values`` (nearest rank; zeros when empty)."""
    if not values:
        return [0.0, 0.0, 0.0]
    s = sorted(values)
    return [s[max(0, math.ceil(0.5 * len(s)) - 1)], s[max(0, math.ceil(0.9 * len(s)) - 1)], s[-1]]


def per_rank_table(rows: torch.Tensor) -> list[dict]:
    """The gathered ``[world, 7]`` rows of :func:`rank_row` as one dict per rank (seconds)."""
    table = []
    for rank, r in enumerate(rows.tolist()):
        table.append({"rank": rank, "step_s": dict(zip(("p50", "p90", "max"), r[0:3])),
                      "collective_wait_s": {"p50": r[3], "total": r[4]}, "busy_s": {"p50": r[5], "max": r[6]}})
    return table


def rank_row(step_s: list[float], wait_s: list[float]) -> list[float]:
    """This rank's figures over its steps (the first step of the run left out when there are more: it warms up):
    step time p50/p90/max, collective wait p50 and total, busy time (step less wait) p50 and max."""
    if len(step_s) > 1:
        step_s, wait_s = step_s[1:], wait_s[1:]
    busy = [s - w for s, w in zip(step_s, wait_s)]
    b = percentiles(busy)
    return [*percentiles(step_s), percentiles(wait_s)[0], sum(wait_s), b[0], b[2]]


def slow_ranks(table: list[dict], ratio: float) -> list[int]:
    """Ranks whose median busy step time is at least ``ratio`` times the median over ranks (none when ``ratio`` is 0
    or there is one rank)."""
    if ratio <= 0 or len(table) < 2:
        return []
    busy = sorted(r["busy_s"]["p50"] for r in table)
    median = busy[len(busy) // 2] if len(busy) % 2 else (busy[len(busy) // 2 - 1] + busy[len(busy) // 2]) / 2
    return [r["rank"] for r in table if median > 0 and r["busy_s"]["p50"] >= ratio * median]
