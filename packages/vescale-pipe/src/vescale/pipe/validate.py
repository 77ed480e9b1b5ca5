"""Simulate a pipeline schedule: reject deadlocks and missing dependencies, report the bubble fraction.

The model is the runtime's: each rank runs its instructions in order; compute takes ``F=1, BI=1, BW=1, B=2`` time
units (override with ``costs``); a send completes at once (the message is buffered); a receive waits until its
matching send has been issued. A dependency a rank's own program can never satisfy (a forward before the receive of
its input, a ``BW`` before its ``BI``) is a *missing dependency*; ranks all waiting on receives that no rank will
ever reach is a *deadlock*. Both raise :class:`ScheduleError` naming the ranks and instructions involved.
"""

from __future__ import annotations

from dataclasses import dataclass

from vescale.pipe.errors import ScheduleError
from vescale.pipe.schedule import COMM_OPS, Action, PipeSchedule

__all__ = ["ScheduleReport", "validate_schedule", "DEFAULT_COSTS"]

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0}


@dataclass(frozen=True)
class ScheduleReport:
    """Result of a simulation: ``makespan`` in cost units, per-rank busy time, and the bubble.

    ``bubble_fraction`` is idle time over total rank-time (``1 - busy / (P * makespan)``); ``bubble_ratio`` is idle
    over busy, the quantity the classic ``(P-1)/M`` formula for 1F1B describes.
    """

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    bubble_ratio: float


def _match_of(a: Action) -> Action:
    """The communication action on the peer rank that pairs with ``a``."""
    if a.op == "SEND_F":
        return Action("RECV_F", a.stage + 1, a.mb)
    if a.op == "RECV_F":
        return Action("SEND_F", a.stage - 1, a.mb)
    if a.op == "SEND_B":
        return Action("RECV_B", a.stage - 1, a.mb)
    return Action("SEND_B", a.stage + 1, a.mb)


def _peer_stage(a: Action) -> int:
    return {"SEND_F": a.stage + 1, "RECV_F": a.stage - 1, "SEND_B": a.stage - 1, "RECV_B": a.stage + 1}[a.op]


def _static_checks(sched: PipeSchedule) -> None:
    S, M, P = sched.num_stages, sched.num_microbatches, sched.num_ranks
    if any(not 0 <= r < P for r in sched.stage_to_rank):
        raise ScheduleError(f"schedule {sched.name!r}: stage_to_rank {sched.stage_to_rank} names a rank outside "
                            f"0..{P - 1}")
    where: dict[Action, int] = {}
    for r, acts in enumerate(sched.actions):
        for a in acts:
            if not 0 <= a.stage < S or not 0 <= a.mb < M:
                raise ScheduleError(f"schedule {sched.name!r}, rank {r}: {a} is outside {S} stages x {M} microbatches")
            if sched.stage_to_rank[a.stage] != r:
                raise ScheduleError(f"schedule {sched.name!r}, rank {r}: {a} runs stage {a.stage}, which is placed on "
                                    f"rank {sched.stage_to_rank[a.stage]}")
            if a in where:
                raise ScheduleError(f"schedule {sched.name!r}, rank {r}: {a} appears twice")
            where[a] = r
            if a.op in COMM_OPS:
                peer = _peer_stage(a)
                if not 0 <= peer < S:
                    raise ScheduleError(f"schedule {sched.name!r}, rank {r}: {a} has no peer stage {peer}")
                if sched.stage_to_rank[peer] == r:
                    raise ScheduleError(f"schedule {sched.name!r}, rank {r}: {a} talks to stage {peer} on the same "
                                        "rank; same-rank stages hand tensors over without messages")
    for a, r in where.items():
        if a.op in COMM_OPS and _match_of(a) not in where:
            raise ScheduleError(f"schedule {sched.name!r}, rank {r}: {a} has no matching {_match_of(a)} on rank "
                                f"{sched.stage_to_rank[_peer_stage(a)]}")
    for s in range(S):
        for m in range(M):
            if Action("F", s, m) not in where:
                raise ScheduleError(f"schedule {sched.name!r}: F(s{s},m{m}) is missing "
                                    f"(rank {sched.stage_to_rank[s]})")
            full, bi, bw = (Action(op, s, m) in where for op in ("B", "BI", "BW"))
            if not (full and not bi and not bw) and not (bi and bw and not full):
                raise ScheduleError(f"schedule {sched.name!r}, rank {sched.stage_to_rank[s]}: stage {s} microbatch "
                                    f"{m} needs exactly one B, or one BI and one BW")


def validate_schedule(sched: PipeSchedule, costs: dict[str, float] | None = None) -> ScheduleReport:
    """Check ``sched`` statically and by simulation; return its :class:`ScheduleReport` or raise ScheduleError."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    _static_checks(sched)
    S, P = sched.num_stages, sched.num_ranks
    place = sched.stage_to_rank
    done: dict[Action, float] = {}      # action -> time its effect is available on its rank
    sent: dict[Action, float] = {}      # send action -> issue time
    pc = [0] * P
    clock = [0.0] * P
    busy = [0.0] * P

    def need(r: int, a: Action) -> list[tuple[Action, str]]:
        """Local prerequisites of ``a`` on rank ``r``: (action that must be done, description)."""
        s, m = a.stage, a.mb
        if a.op == "F" and s > 0:
            src = Action("F", s - 1, m) if place[s - 1] == r else Action("RECV_F", s, m)
            return [(src, "its input")]
        if a.op in ("B", "BI"):
            reqs = [(Action("F", s, m), "its forward")]
            if s < S - 1:
                if place[s + 1] == r:
                    nxt = Action("BI", s + 1, m)
                    if Action("B", s + 1, m) in index[r]:
                        nxt = Action("B", s + 1, m)
                    reqs.append((nxt, "its output gradient"))
                else:
                    reqs.append((Action("RECV_B", s, m), "its output gradient"))
            return reqs
        if a.op == "BW":
            return [(Action("BI", s, m), "its input-gradient backward")]
        if a.op == "SEND_F":
            return [(Action("F", s, m), "the forward that produces it")]
        if a.op == "SEND_B":
            grad = Action("B", s, m) if Action("B", s, m) in index[r] else Action("BI", s, m)
            return [(grad, "the backward that produces it")]
        return []

    index = [set(acts) for acts in sched.actions]
    total = sum(len(a) for a in sched.actions)
    finished = 0
    while finished < total:
        progressed = False
        for r in range(P):
            while pc[r] < len(sched.actions[r]):
                a = sched.actions[r][pc[r]]
                start = clock[r]
                for req, what in need(r, a):
                    if req not in done:
                        raise ScheduleError(
                            f"schedule {sched.name!r}, rank {r}, instruction {pc[r]}: {a} needs {what} from {req}, "
                            f"which rank {r} has not run before it (missing dependency)")
                    start = max(start, done[req])
                if a.op in ("RECV_F", "RECV_B"):
                    src = _match_of(a)
                    if src not in sent:
                        break  # blocked until the peer issues the send
                    start = max(start, sent[src])
                    done[a] = start
                elif a.op in ("SEND_F", "SEND_B"):
                    sent[a] = start
                    done[a] = start
                else:
                    cost = costs[a.op]
                    done[a] = start + cost
                    busy[r] += cost
                    start += cost
                clock[r] = start
                pc[r] += 1
                finished += 1
                progressed = True
        if not progressed:
            blocked = [f"rank {r} waits at {sched.actions[r][pc[r]]} for {_match_of(sched.actions[r][pc[r]])} "
                       f"(rank {place[_peer_stage(sched.actions[r][pc[r]])]})"
                       for r in range(P) if pc[r] < len(sched.actions[r])]
            raise ScheduleError(f"schedule {sched.name!r} deadlocks: " + "; ".join(blocked))
    makespan = max(clock) if clock else 0.0
    work = sum(busy)
    idle = P * makespan - work
    return ScheduleReport(makespan=makespan, busy=tuple(busy),
                          bubble_fraction=idle / (P * makespan) if makespan else 0.0,
                          bubble_ratio=idle / work if work else 0.0)
