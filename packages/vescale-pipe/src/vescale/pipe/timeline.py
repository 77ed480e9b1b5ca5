"""nD timeline: spans recorded on every rank on an aligned clock, exported as one Chrome/Perfetto trace and a PNG.

Use it around any torch.distributed program, pipelined or not::

    from vescale.pipe import timeline
    with timeline.Timeline(mesh) as tl:          # every rank enters together (a barrier aligns the clocks)
        for step in range(3):
            with timeline.span("data", cat="data"):
                batch = next(loader)
            loss = engine.step(batch, target)     # the engine records F/BI/BW/B per microbatch, sends, receives
            opt.step()                            # recorded through torch's global optimizer hooks
    tl.export("trace.json")                      # collective: every rank calls it; rank 0 writes trace.json + .png

While a timeline is active it records: spans opened with :func:`span` (the pipeline engine opens one per compute op
and per communication batch), calls of the ``torch.distributed`` collectives made through the module namespace
(``dist.all_reduce(...)``; category ``collective``), and every optimizer step (``torch.optim`` global hooks). Times
are host wall-clock: on GPU an asynchronous kernel is recorded when launched, not when it runs. Clocks: ranks on the
same host as rank 0 share its monotonic clock and its zero, so their spans are exactly comparable; ranks on other
hosts take their zero right after a barrier on entry, so they agree to within the barrier's exit skew.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Timeline", "span", "active", "bubble", "COMPUTE_CATEGORIES"]

#: Span categories that count as useful work when measuring pipeline bubbles.
COMPUTE_CATEGORIES = ("forward", "backward", "backward_input", "backward_weight")
_LANES = {"forward": 0, "backward": 0, "backward_input": 0, "backward_weight": 0, "p2p": 1, "collective": 2,
          "optimizer": 3}
# one distinct colour per legend entry (a Gantt chart whose entries share a colour cannot be read)
_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "backward_input": "#64B5CD", "backward_weight": "#DD8452",
           "p2p": "#8C8C8C", "collective": "#C44E52", "optimizer": "#8172B3"}
_OTHER_COLOR = "#937860"  # any other category: user spans (``span(..., cat="user")``)


def _legend() -> dict[str, str]:
    """The PNG legend, label -> colour: every category the chart colours, then the one colour of all others."""
    return {**_COLORS, "other": _OTHER_COLOR}
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter")

_ACTIVE: Timeline | None = None


def active() -> Timeline | None:
    """The timeline recording on this process, if any."""
    return _ACTIVE


@contextlib.contextmanager
def span(name: str, cat: str = "user", **args: Any) -> Iterator[None]:
    """Record ``name`` on the active timeline for the duration of the ``with`` block; free when none is active."""
    tl = _ACTIVE
    if tl is None:
        yield
        return
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        tl.add(name, cat, start, time.perf_counter_ns(), **args)


class Timeline:
    """Per-rank span recorder; a context manager that every rank of ``group`` (default: world) enters together.

    ``mesh`` (a named DeviceMesh) labels each rank's process in the trace with its coordinates. Entering is a
    collective (a barrier) when torch.distributed is initialised; so is :meth:`export`.
    """

    def __init__(self, mesh: Any = None, *, group: Any = None, record_collectives: bool = True,
                 record_optimizer: bool = True) -> None:
        self.mesh, self.group = mesh, group
        self.record_collectives, self.record_optimizer = record_collectives, record_optimizer
        self.events: list[dict] = []
        self._t0 = 0
        self._patched: dict[str, Any] = {}
        self._hooks: list = []
        self._opt_start: dict[int, int] = {}
        self._in_collective = False

    def _dist(self):
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None

    def __enter__(self) -> Timeline:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a vescale.pipe Timeline is already active on this process")
        dist = self._dist()
        self._t0 = time.perf_counter_ns()
        if dist is not None:
            self._t0 = self._aligned_zero(dist)
        _ACTIVE = self
        if self.record_collectives and dist is not None:
            self._patch(dist)
        if self.record_optimizer:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._hooks = [register_optimizer_step_pre_hook(self._opt_pre),
                           register_optimizer_step_post_hook(self._opt_post)]
        return self

    def _aligned_zero(self, dist: Any) -> int:
        """Common time zero: rank 0's clock reading for ranks on its host (one monotonic clock), else local."""
        import socket

        dist.barrier(group=self.group)
        here = (socket.gethostname(), time.perf_counter_ns())
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, here, group=self.group)
        host0, zero0 = everyone[0]
        return zero0 if host0 == here[0] else here[1]

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        _ACTIVE = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._unpatch()

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """Record a finished span (``time.perf_counter_ns`` stamps)."""
        self.events.append({"name": name, "cat": cat, "ts": (start_ns - self._t0) / 1e3,
                            "dur": (end_ns - start_ns) / 1e3, "args": args})

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._opt_start[id(opt)] = time.perf_counter_ns()

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        start = self._opt_start.pop(id(opt), None)
        if start is not None:
            self.add(f"{type(opt).__name__}.step", "optimizer", start, time.perf_counter_ns())

    def _patch(self, dist: Any) -> None:
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def recorded(*args: Any, __original=original, __name=name, **kwargs: Any) -> Any:
                if self._in_collective:
                    return __original(*args, **kwargs)
                self._in_collective = True
                start = time.perf_counter_ns()
                try:
                    return __original(*args, **kwargs)
                finally:
                    self._in_collective = False
                    self.add(__name, "collective", start, time.perf_counter_ns())

            self._patched[name] = original
            setattr(dist, name, recorded)

    def _unpatch(self) -> None:
        if not self._patched:
            return
        import torch.distributed as dist

        for name, original in self._patched.items():
            setattr(dist, name, original)
        self._patched = {}

    def _label(self, rank: int) -> str:
        if self.mesh is None:
            return f"rank {rank}"
        names = list(self.mesh.mesh_dim_names or [])
        coords = (self.mesh.mesh == rank).nonzero()
        if not names or coords.numel() == 0:
            return f"rank {rank}"
        coord = coords[0].tolist()
        return f"rank {rank} (" + ", ".join(f"{n}={c}" for n, c in zip(names, coord)) + ")"

    def export(self, path: str | os.PathLike, *, png: bool = True) -> dict | None:
        """Write one Chrome/Perfetto trace JSON for all ranks to ``path`` (rank 0), plus ``path`` with ``.png``.

        Collective over ``group`` when torch.distributed is initialised: every rank must call it (outside or after
        the ``with`` block). Returns the trace dict on the writing rank, ``None`` elsewhere. The PNG needs
        matplotlib; without it the PNG is skipped with a printed message.
        """
        dist = self._dist()
        if dist is not None:
            rank, world = dist.get_rank(), dist.get_world_size(self.group)
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, (rank, self.events), group=self.group)
        else:
            rank, everyone = 0, [(0, self.events)]
        if rank != (min(r for r, _ in everyone)):
            return None
        trace = _chrome_trace(everyone, self._label)
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(trace, f)
        if png:
            _gantt_png(trace, os.path.splitext(path)[0] + ".png")
        return trace


def _chrome_trace(per_rank: list, label: Any) -> dict:
    events: list[dict] = []
    lane_names = {v: k for k, v in reversed(list(_LANES.items()))}
    lane_names.update({0: "compute", 4: "other"})
    for rank, spans in sorted(per_rank, key=lambda item: item[0]):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label(rank)}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for lane, lname in lane_names.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": lane, "args": {"name": lname}})
        for ev in spans:
            events.append({"ph": "X", "pid": rank, "tid": _LANES.get(ev["cat"], 4), **ev})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _gantt_png(trace: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"vescale.pipe.timeline: matplotlib is not installed; skipped the Gantt chart {path} "
              "(the JSON trace was written)")
        return
    fig = _gantt_figure(trace)
    # bbox_inches="tight" grows the canvas to hold the legend outside the axes
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _gantt_figure(trace: dict):
    """The Gantt chart of ``trace`` (a matplotlib figure): a row per rank, a lane per kind of span, the legend to the
    right of the axes, clear of the ``ms`` label below them."""
    import matplotlib.pyplot as plt

    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    ranks = sorted(names)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.8))
    for e in spans:
        y = ranks.index(e["pid"]) + 0.25 * _LANES.get(e["cat"], 4) / 4
        ax.barh(y, e["dur"] / 1e3, left=e["ts"] / 1e3, height=0.2 if e["cat"] in COMPUTE_CATEGORIES else 0.1,
                color=_COLORS.get(e["cat"], _OTHER_COLOR))
    ax.set_yticks(range(len(ranks)), [names[r] for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    legend = _legend()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in legend.values()]
    ax.legend(handles, list(legend), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
              borderaxespad=0.0)
    fig.tight_layout()
    return fig


def bubble(trace: dict, *, name_filter: str | None = None) -> dict[str, float]:
    """Measured bubble of the compute spans in ``trace`` (as :meth:`Timeline.export` returns it).

    The window runs from the earliest compute span to the latest one over all ranks that have compute spans;
    ``fraction`` is idle over rank-time in that window, ``ratio`` idle over busy (the ``(P-1)/M`` quantity). Only
    spans whose ``args['step']`` equals ``name_filter`` count when it is given.
    """
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in COMPUTE_CATEGORIES
             and (name_filter is None or e["args"].get("step") == name_filter)]
    if not spans:
        raise ValueError("the trace has no compute spans")
    ranks = {e["pid"] for e in spans}
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    busy = sum(e["dur"] for e in spans)
    total = len(ranks) * (end - start)
    idle = total - busy
    return {"fraction": idle / total, "ratio": idle / busy, "window_ms": (end - start) / 1e3}
