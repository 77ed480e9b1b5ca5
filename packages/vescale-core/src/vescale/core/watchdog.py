"""Hang diagnosis: a collective that waits past the collective timeout fails on every waiting rank with one message
naming the missing rank(s), the collective, its mesh dim and its call site, instead of hanging.

Use::

    with watch_collectives(timeout=60) as watch:      # or VESCALE_COLLECTIVE_TIMEOUT=60; default 300 s
        mesh = init_mesh("dp=2,tp=2")
        watch.add_mesh(mesh)                           # names groups by mesh dim, sets their timeout
        train(...)                                     # raises CollectiveTimeoutError on a hang

What it does, on each rank:

1. **Records** the last ``ring_size`` collectives in a ring (:class:`CollectiveRing`): the ``torch.distributed`` name,
   the process group and its mesh dim, the collective's index among the collectives on that group (``seq``; equal on
   every rank of the group while their programs agree), the bytes this rank hands in, and the call site: the
   innermost frame outside torch, vescale and the standard library (for a collective issued in backward, the line
   that called ``backward``). It records through the collective interception of :mod:`vescale.core.comm` (a
   dispatch mode, so it sees DTensor's functional collectives and eager ``torch.distributed`` calls alike) plus
   ``barrier``; point-to-point sends and receives are not recorded.
2. **Sets the timeout** of every process group it sees (the default group on entry, each group of an added mesh,
   any other group on its first collective, before that collective runs), so gloo (and NCCL with
   ``TORCH_NCCL_BLOCKING_WAIT``) raise instead of waiting for torch's 30-minute default.
3. **Diagnoses** a collective failure (a timeout, or a peer that closed its connection) escaping the block: the rank
   posts its account (last collective, last collective per group) to the default group's store, which still works
   when the process group does not, waits up to ``report_wait`` seconds for the other ranks' accounts, and raises
   :class:`~vescale.core.errors.CollectiveTimeoutError`. Every rank that fails computes the message from the same
   accounts, so every rank prints the same diagnosis.

The diagnosis. The stuck collective is the ``(group, seq)`` most failing ranks are in, and in it the
(collective, call site) most of them called. A rank of that group is *missing* when it is in the same ``(group,
seq)`` with another collective or call site (its program skipped or added a collective: gloo matches collectives by
their index on the group, so the ranks meet in different collectives and time out), is elsewhere (in another
group's collective, or behind: it never reached that index), or posted nothing within ``report_wait`` (it waits in
no watched collective: computing, sleeping, finished or dead). With no majority (two ranks each in a different
collective) every disagreeing rank is named: which of them skipped and which added a collective is not knowable
from the two accounts.

What is not detected: a skipped collective that the next collective of the same kind and size on the same group
silently pairs with (gloo exchanges the data; the ranks only fail later, at a collective that no longer matches,
and that is the one reported); a skipped collective whose rank's next collective on the group has another size:
gloo pairs them and aborts the receiving process in C++ ("Received data size doesn't match expected size", SIGABRT),
before any Python can run, so there is no diagnosis and no dump; a rank that never enters another collective does not
raise itself (the others name it as not reporting). With NCCL, torch's watchdog thread aborts the process at the
timeout unless ``TORCH_NCCL_BLOCKING_WAIT=1`` (then the waiting call raises and this module diagnoses it); torch's
flight recorder (``TORCH_FR_BUFFER_SIZE``, NCCL and gloo alike) is the per-rank record for that case, see
:func:`flight_recorder`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from vescale.core.errors import CollectiveTimeoutError

__all__ = ["ENV_VAR", "DEFAULT_TIMEOUT_S", "collective_timeout", "set_collective_timeout", "CollectiveRecord",
           "CollectiveRing", "watch_collectives", "is_collective_failure", "diagnose", "describe", "call_site",
           "user_frame",
           "flight_recorder"]

#: The environment variable that sets the collective timeout in seconds where no argument does.
ENV_VAR = "VESCALE_COLLECTIVE_TIMEOUT"
#: The collective timeout without argument or environment variable: long enough for a slow first step (compiling,
#: loading a checkpoint) and far shorter than torch's 30-minute default.
DEFAULT_TIMEOUT_S = 300.0

# The messages torch's backends raise a collective failure with: gloo's "Timed out waiting 3000ms for recv
# operation", a peer gone ("Connection closed by peer", "Connection reset"), NCCL's blocking-wait timeout.
_FAILURE = re.compile(r"timed out|timeout|connection closed|connection reset|broken pipe", re.IGNORECASE)
_KEY = "vescale/watchdog"
_watches = 0  # watches entered by this process: the n-th watch of every rank posts under the same store keys


def collective_timeout(seconds: float | None = None) -> float:
    """The collective timeout in seconds: ``seconds`` if given, else ``$VESCALE_COLLECTIVE_TIMEOUT``, else 300.

    Raises ``ValueError`` naming the source when the value is not a positive number.
    """
    source = "collective_timeout"
    if seconds is None:
        text = os.environ.get(ENV_VAR)
        if text is None:
            return DEFAULT_TIMEOUT_S
        source = f"${ENV_VAR}"
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{source}={text!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{source}={seconds!r} must be a positive number of seconds")
    return float(seconds)


def set_collective_timeout(seconds: float | None = None, groups: Any = ()) -> float:
    """Make the default process group and each of ``groups`` (``ProcessGroup``s or group names) time out
    collectives issued from now on after :func:`collective_timeout` ``(seconds)``; return that timeout."""
    import torch.distributed as dist

    from vescale.core.torch_internals import set_group_timeout

    seconds = collective_timeout(seconds)
    for group in (dist.group.WORLD, *groups):
        set_group_timeout(group, seconds)
    return seconds


@dataclass
class CollectiveRecord:
    """One collective as this rank entered it. ``seq`` counts the collectives on ``group`` before it (from 0, since
    the watch began); ``group`` is the process group's name; ``bytes`` what this rank hands in; ``site`` is
    ``file:line in function``; ``time`` the wall clock (seconds since the epoch) when it was entered."""

    seq: int
    op: str
    group: str
    bytes: int
    site: str
    time: float


class CollectiveRing:
    """This rank's last ``size`` collectives (:class:`CollectiveRecord`, oldest first) and what it knows of their
    process groups (name -> mesh dim and ranks). Filled by :class:`watch_collectives`; readable at any time."""

    def __init__(self, size: int = 64, timeout: float | None = None) -> None:
        if size < 1:
            raise ValueError(f"ring size must be >= 1, got {size}")
        self.records: deque[CollectiveRecord] = deque(maxlen=size)
        self.last_by_group: dict[str, CollectiveRecord] = {}
        self.groups: dict[str, dict] = {}  # name -> {"dim": str | None, "ranks": list[int]}
        self.timeout = timeout
        self._seq: dict[str, int] = {}

    def add_group(self, group: Any, dim: str | None = None) -> str:
        """Know ``group`` (a ``ProcessGroup``) by name, with its ranks and mesh dim; set its timeout."""
        import torch.distributed as dist

        name = group.group_name
        entry = self.groups.setdefault(name, {"dim": None, "ranks": dist.get_process_group_ranks(group)})
        entry["dim"] = dim or entry["dim"]
        if self.timeout is not None:
            from vescale.core.torch_internals import set_group_timeout

            set_group_timeout(group, self.timeout)
        return name

    def _record(self, op: str, size: int, group: Any) -> None:
        """Called by :mod:`vescale.core.comm`'s interception just before the collective runs."""
        name = group if isinstance(group, str) else "?"
        if name not in self.groups and name != "?":
            self._first_sight(name)
        seq = self._seq.get(name, 0)
        self._seq[name] = seq + 1
        record = CollectiveRecord(seq, op, name, size, call_site(), time.time())
        self.records.append(record)
        self.last_by_group[name] = record

    def _first_sight(self, name: str) -> None:
        import torch.distributed as dist

        from vescale.core.torch_internals import set_group_timeout

        ranks = None
        if self.timeout is not None:  # before the collective runs: its work takes the timeout when issued
            ranks = dist.get_process_group_ranks(set_group_timeout(name, self.timeout))
        self.groups[name] = {"dim": None, "ranks": ranks}

    @property
    def last(self) -> CollectiveRecord | None:
        """The collective this rank entered last (the one it waits in when it hangs)."""
        return self.records[-1] if self.records else None

    def describe(self, record: CollectiveRecord | dict) -> str:
        """``all_reduce #3 on mesh dim 'dp' (group '0', ranks [0, 1]) at train.py:120 in step``."""
        return describe(record if isinstance(record, dict) else asdict(record), self.groups)

    def to_dict(self) -> dict:
        """The ring as JSON-ready data: ``{"timeout_s", "groups", "collectives": [record dicts, oldest first]}``."""
        return {"timeout_s": self.timeout, "groups": self.groups,
                "collectives": [asdict(r) for r in self.records]}


# ------------------------------------------------------------------------------------------------------ call sites


@functools.lru_cache(maxsize=1)
def _internal_dirs() -> tuple[str, ...]:
    import torch

    import vescale

    dirs = [os.path.dirname(torch.__file__), os.path.dirname(os.__file__)]
    dirs += [str(p) for p in vescale.__path__]  # every installed vescale package's src/vescale (a namespace)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


@functools.lru_cache(maxsize=4096)
def _user_file(filename: str) -> str | None:
    """``filename`` as a call site shows it (relative to the working directory when under it), or None when it is
    inside torch, vescale or the standard library, or not a file (``<frozen ...>``). Cached: a frame walk per
    collective must not stat every path."""
    if filename.startswith("<"):
        return None
    file = os.path.realpath(filename)
    if file.startswith(_internal_dirs()):
        return None
    rel = os.path.relpath(file)
    return file if rel.startswith("..") else rel


def user_frame() -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the innermost frame on this thread outside torch, vescale and the standard
    library (None when there is none); ``file`` relative to the working directory when under it."""
    frame = sys._getframe(1)
    while frame is not None:
        shown = _user_file(frame.f_code.co_filename)
        if shown is not None:
            return shown, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


def call_site() -> str:
    """``file:line in function`` of :func:`user_frame` (``?`` when there is none)."""
    where = user_frame()
    return "?" if where is None else f"{where[0]}:{where[1]} in {where[2]}"


# ------------------------------------------------------------------------------------------------------ the watch


def _ring_name_of(func: Any) -> str | None:
    from vescale.core.comm import collective_name

    name = collective_name(func)
    if name is None and getattr(func, "namespace", "") == "c10d" and func.overloadpacket.__name__ == "barrier":
        return "barrier"
    return name


class watch_collectives:  # noqa: N801 - used as a context manager, like torch's no_grad
    """``with watch_collectives(mesh, timeout=...) as watch:``: record this rank's collectives in ``watch.ring``,
    apply the collective timeout, and turn a collective failure escaping the block into
    :class:`~vescale.core.errors.CollectiveTimeoutError` (see the module docstring). Every rank must enter it at the
    same point of its program (``seq`` counts from there; the n-th watch of each rank meets the others' n-th).

    ``timeout``: seconds (see :func:`collective_timeout`); ``set_timeout=False`` leaves the groups' timeouts alone.
    ``report_wait``: seconds to wait for the other ranks' accounts (default: the timeout, at most 60).
    ``record=False`` keeps no ring (no dispatch mode: ``torch.compile`` falls back to eager under any dispatch mode;
    groups other than the default one and the added meshes' keep their timeout) and diagnoses from torch's flight
    recorder where it recorded (``TORCH_FR_BUFFER_SIZE`` set before the groups were created), without call sites.
    """

    def __init__(self, mesh: Any = None, *, timeout: float | None = None, ring_size: int = 64,
                 report_wait: float | None = None, set_timeout: bool = True, record: bool = True) -> None:
        self.timeout = collective_timeout(timeout)
        self.report_wait = min(self.timeout, 60.0) if report_wait is None else float(report_wait)
        self.ring = CollectiveRing(ring_size, self.timeout if set_timeout else None)
        self.record = record
        self._mesh = mesh
        self._mode: Any = None
        self._id = 0  # set on entry

    def add_mesh(self, mesh: Any) -> None:
        """Name ``mesh``'s process groups by mesh dim in the ring and the diagnosis, and set their timeout."""
        if mesh.get_coordinate() is None:
            return
        names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
        for d in range(mesh.ndim):
            self.ring.add_group(mesh.get_group(d), names[d])

    def __enter__(self) -> watch_collectives:
        import torch.distributed as dist

        from vescale.core.comm import _CountCollectives

        global _watches
        _watches += 1
        self._id = _watches
        self.ring.add_group(dist.group.WORLD)
        if self._mesh is not None:
            self.add_mesh(self._mesh)
        if self.record:
            self._mode = _CountCollectives(self.ring, name_of=_ring_name_of)
            self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._mode is not None:
            self._mode.__exit__(exc_type, exc, tb)
            self._mode = None
        if exc is not None and is_collective_failure(exc) and not isinstance(exc, CollectiveTimeoutError):
            raise self.diagnose(exc) from exc

    def dump(self, path: str | os.PathLike, exc: BaseException | None = None) -> None:
        """Write this rank's record of a failure to ``path`` (JSON): ``{"rank", "error", "ring"`` (see
        :meth:`CollectiveRing.to_dict`), ``"reports"`` (every rank's account, when ``exc`` is a
        :class:`CollectiveTimeoutError`), ``"flight_recorder"`` (torch's, or null; see :func:`flight_recorder`)``}``."""
        import torch.distributed as dist

        reports = getattr(exc, "reports", {})
        data = {"rank": dist.get_rank(), "error": None if exc is None else str(exc), "ring": self.ring.to_dict(),
                "reports": {str(r): rep for r, rep in reports.items()}, "flight_recorder": flight_recorder()}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)

    def report(self, exc: BaseException | None = None) -> dict:
        """This rank's account of a failure: JSON-ready ``{"rank", "last", "last_by_group", "groups", "error"}``."""
        import torch.distributed as dist

        last = self.ring.last
        if last is None:  # no ring (record=False): torch's flight recorder, where it recorded, without call sites
            last_fr, by_group = _flight_recorder_accounts()
            return {"rank": dist.get_rank(), "last": last_fr, "last_by_group": by_group, "groups": self.ring.groups,
                    "error": _first_line(exc)}
        return {"rank": dist.get_rank(), "last": asdict(last),
                "last_by_group": {g: asdict(r) for g, r in self.ring.last_by_group.items()},
                "groups": self.ring.groups, "error": _first_line(exc)}

    def diagnose(self, exc: BaseException | None = None) -> CollectiveTimeoutError:
        """Post this rank's account to the store, gather the others' (waiting up to ``report_wait``), and return
        the :class:`CollectiveTimeoutError` describing the hang (the caller raises it)."""
        import torch.distributed as dist

        from vescale.core.torch_internals import default_store

        rank, world = dist.get_rank(), dist.get_world_size()
        store, prefix = default_store(), f"{_KEY}/{self._id}"
        store.set(f"{prefix}/{rank}", json.dumps(self.report(exc)))
        reports: dict[int, dict] = {}
        deadline = time.monotonic() + self.report_wait
        while True:
            for r in range(world):
                if r not in reports and store.check([f"{prefix}/{r}"]):
                    reports[r] = json.loads(store.get(f"{prefix}/{r}"))
            if len(reports) == world or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return diagnose(reports, world, timeout=self.timeout, report_wait=self.report_wait, rank=rank)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is how torch's backends fail a collective that waited too long or lost a peer."""
    return isinstance(exc, (RuntimeError, TimeoutError)) and bool(_FAILURE.search(str(exc)))


def _first_line(exc: BaseException | None) -> str | None:
    return None if exc is None else (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


# ------------------------------------------------------------------------------------------------- the diagnosis


def describe(record: dict, groups: dict) -> str:
    """One collective record as text: op, ``#seq``, the mesh dim or group (with its ranks), the call site."""
    info = groups.get(record["group"], {})
    where = f"mesh dim {info['dim']!r}" if info.get("dim") else f"process group {record['group']!r}"
    ranks = f", ranks {info['ranks']}" if info.get("ranks") is not None else ""
    return f"{record['op']} #{record['seq']} on {where} (group {record['group']!r}{ranks}) at {record['site']}"


def _majority(items: Iterator[tuple[Any, int]]) -> tuple[Any, list[int], bool]:
    """The most common key of ``(key, rank)`` pairs, its ranks, and whether it is a strict majority winner."""
    by_key: dict[Any, list[int]] = {}
    for key, rank in items:
        by_key.setdefault(key, []).append(rank)
    ordered = sorted(by_key.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    unique = len(ordered) == 1 or len(ordered[0][1]) > len(ordered[1][1])
    return ordered[0][0], sorted(ordered[0][1]), unique


def diagnose(reports: dict[int, dict], world_size: int, *, timeout: float, report_wait: float,
             rank: int | None = None) -> CollectiveTimeoutError:
    """The :class:`CollectiveTimeoutError` the accounts ``reports`` (``{rank: watch.report()}``, any subset of the
    ranks) describe; a pure function of them, so every rank that has the same accounts raises the same message."""
    groups: dict[str, dict] = {}
    for r in sorted(reports):
        for name, info in reports[r]["groups"].items():
            known = groups.setdefault(name, dict(info))
            known["dim"] = known.get("dim") or info.get("dim")
            if known.get("ranks") is None:
                known["ranks"] = info.get("ranks")
    stuck = [(r, rep["last"]) for r, rep in sorted(reports.items()) if rep["last"] is not None]
    head = f"collective timeout ({timeout:g} s)"
    me = f" [raised on rank {rank}]" if rank is not None else ""
    if not stuck:
        silent = sorted(set(range(world_size)) - set(reports))
        return CollectiveTimeoutError(
            f"{head}: no rank recorded a collective (recording off or none issued since the watch began); "
            f"rank(s) {silent} did not report within {report_wait:g} s; first error: "
            f"{next((rep['error'] for rep in reports.values() if rep['error']), None)}{me}",
            missing_ranks=silent, reports=reports)
    # The stuck point: the (group, seq) most ranks are in (the earliest on a tie), then its majority collective.
    (group, seq), _, unique_point = _majority(((rec["group"], rec["seq"]), r) for r, rec in stuck)
    at_point = [(r, rec) for r, rec in stuck if (rec["group"], rec["seq"]) == (group, seq)]
    (op, site), waiting, unique_call = _majority(((rec["op"], rec["site"]), r) for r, rec in at_point)
    unique = unique_point and unique_call
    reference = next(rec for r, rec in at_point if (rec["op"], rec["site"]) == (op, site))
    members = groups.get(group, {}).get("ranks")
    if members is None:  # a group known by name only: its members are the ranks that used it
        members = sorted(r for r, rep in reports.items() if group in rep["last_by_group"])
    lines, missing = [], []
    for r in members:
        if r in waiting and unique:
            continue
        rep = reports.get(r)
        if rep is None:
            missing.append(r)
            lines.append(f"rank {r}: did not report within {report_wait:g} s (it waits in no watched collective: "
                         f"busy, sleeping, finished or dead)")
            continue
        rec = rep["last"]
        if (rec["group"], rec["seq"]) == (group, seq):
            missing.append(r)
            lines.append(f"rank {r}: waits in {describe(rec, groups)}")
            continue
        missing.append(r)
        on_group = rep["last_by_group"].get(group)
        if on_group is not None and on_group["seq"] > seq:
            where = f"already past it: its last collective on this group is {describe(on_group, groups)}"
        elif on_group is not None:
            where = f"never entered it: its last collective on this group is {describe(on_group, groups)}"
        else:
            where = "never entered it: it issued no collective on this group"
        lines.append(f"rank {r}: {where}; it waits in {describe(rec, groups)}")
    info = groups.get(group, {})
    if unique:
        summary = (f"{head}: rank(s) {missing} missing from {describe(reference, groups)}; "
                   f"rank(s) {waiting} wait in it")
    else:
        summary = (f"{head}: the ranks disagree on collective #{seq} of "
                   f"{'mesh dim ' + repr(info['dim']) if info.get('dim') else 'process group ' + repr(group)} "
                   f"(no majority: one of them skipped a collective or issued an extra one)")
    return CollectiveTimeoutError(
        "\n  ".join([summary + me, *lines]), missing_ranks=missing, collective=op, mesh_dim=info.get("dim"),
        call_site=site, seq=seq, reports=reports)


def _flight_recorder_accounts() -> tuple[dict | None, dict[str, dict]]:
    """(last collective, {group: last collective}) as record dicts from torch's flight recorder; ``seq`` is torch's
    per-group collective sequence id (the same on every rank of a group) and ``site`` is unknown (``?``)."""
    data = flight_recorder() or {}
    last, by_group = None, {}
    for entry in sorted(data.get("entries", []), key=lambda e: e.get("record_id", 0)):
        if entry.get("is_p2p"):
            continue
        group = str(entry.get("process_group", ["?"])[0])
        record = {"seq": entry.get("collective_seq_id", -1), "op": entry.get("profiling_name", "?").split(":")[-1],
                  "group": group, "bytes": 0, "site": "? (flight recorder)",
                  "time": entry.get("time_created_ns", 0) / 1e9}
        last = by_group[group] = record
    return last, by_group


def flight_recorder() -> dict | None:
    """torch's flight recorder for this rank, parsed (``entries``: its last collectives per process group), or None
    when it recorded nothing (``TORCH_FR_BUFFER_SIZE`` unset when the group was created) or is unavailable."""
    from vescale.core.torch_internals import flight_recorder_json

    try:
        data = json.loads(flight_recorder_json())
    except Exception:  # noqa: BLE001 - a diagnostic aid: absent rather than a second failure
        return None
    return data if data.get("entries") else None
