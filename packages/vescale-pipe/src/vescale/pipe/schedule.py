"""Pipeline schedules as data: one list of instructions per pipeline rank, plus the stage-to-rank placement.

An instruction is an :class:`Action` ``(op, stage, microbatch)``. Compute ops: ``F`` (forward), ``B`` (full backward),
``BI`` (backward for the stage inputs only), ``BW`` (backward for the stage weights, after ``BI``). Communication ops:
``SEND_F`` (send the outputs of ``stage`` to the next stage), ``RECV_F`` (receive the inputs of ``stage``),
``SEND_B`` (send the input gradients of ``stage`` to the previous stage), ``RECV_B`` (receive the output gradients of
``stage``). Communication appears only between stages on different ranks; consecutive communication ops of a rank are
posted together as one batch by the runtime.

Built-in schedules, by name (``S`` stages over ``P`` ranks, ``M`` microbatches):

``gpipe``             all forwards, then all backwards; ``S`` a multiple of ``P`` (looped placement); any ``M``.
``1f1b``              one-forward-one-backward; ``S == P``; ``M >= P``.
``interleaved_1f1b``  Megatron's interleaved 1F1B over ``V = S / P`` looped chunks; ``M`` a multiple of ``P``.
``zb_h1``             zero-bubble H1: backward split into ``BI``/``BW``, ``BW`` fills the bubbles; at most P+1
                      microbatches in flight per rank (1F1B holds P on rank 0);
                      ``S == P``; ``M >= P``.
``zbv``               zero-bubble V: two chunks in a V placement (stage ``s`` on rank ``s`` for ``s < P``, on rank
                      ``2P-1-s`` after); ``S == 2P``; ``M >= P``.

:func:`register_schedule` adds user schedules; :func:`vescale.pipe.validate_schedule` simulates any schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vescale.pipe.errors import ScheduleError

__all__ = ["Action", "PipeSchedule", "COMPUTE_OPS", "COMM_OPS", "register_schedule", "build_schedule",
           "schedule_names", "add_communication", "looped_placement", "v_placement"]

COMPUTE_OPS = ("F", "B", "BI", "BW")
COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One instruction: ``op`` on ``stage`` for microbatch ``mb``; prints as ``F(s1,m0)``."""

    op: str
    stage: int
    mb: int

    def __post_init__(self) -> None:
        if self.op not in COMPUTE_OPS + COMM_OPS:
            raise ScheduleError(f"unknown pipeline op {self.op!r}; known ops are {COMPUTE_OPS + COMM_OPS}")

    def __str__(self) -> str:
        return f"{self.op}(s{self.stage},m{self.mb})"

    __repr__ = __str__


@dataclass
class PipeSchedule:
    """Instructions per pipeline rank (``actions[r]``) and the rank of each stage (``stage_to_rank[s]``)."""

    name: str
    actions: list[list[Action]]
    stage_to_rank: list[int]
    num_microbatches: int
    meta: dict = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        """The stage indices placed on pipeline rank ``rank``, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def format(self) -> str:
        """One line per rank, for printing and diffing."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))


ScheduleFn = Callable[[int, int, int], PipeSchedule]
_REGISTRY: dict[str, ScheduleFn] = {}


def register_schedule(name: str, fn: ScheduleFn, *, overwrite: bool = False) -> None:
    """Register ``fn(num_ranks, num_microbatches, num_stages) -> PipeSchedule`` under ``name``.

    The schedule is validated (simulated) when the engine builds it, so a broken user schedule fails with a clear
    message on every rank before any communication.
    """
    if name in _REGISTRY and not overwrite:
        raise ScheduleError(f"schedule {name!r} is already registered (pass overwrite=True to replace it)")
    _REGISTRY[name] = fn


def schedule_names() -> list[str]:
    """Registered schedule names."""
    return sorted(_REGISTRY)


def build_schedule(name: str, num_ranks: int, num_microbatches: int, num_stages: int | None = None) -> PipeSchedule:
    """Generate the schedule ``name`` for ``num_ranks`` ranks and ``num_microbatches`` microbatches.

    ``num_stages`` defaults to the schedule's natural count (``2P`` for ``zbv``, ``P`` otherwise). Raises
    :class:`ScheduleError` for an unknown name, a stage count the schedule cannot place, or too few microbatches.
    """
    if name not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; registered: {schedule_names()}")
    if num_ranks < 1 or num_microbatches < 1:
        raise ScheduleError(f"schedule {name!r} needs num_ranks >= 1 and num_microbatches >= 1, "
                            f"got {num_ranks} and {num_microbatches}")
    if num_stages is None:
        num_stages = 2 * num_ranks if name == "zbv" else num_ranks
    sched = _REGISTRY[name](num_ranks, num_microbatches, num_stages)
    if sched.num_ranks != num_ranks or sched.num_stages != num_stages:
        raise ScheduleError(f"schedule {name!r} returned {sched.num_ranks} ranks x {sched.num_stages} stages, "
                            f"expected {num_ranks} x {num_stages}")
    return sched


def looped_placement(num_ranks: int, num_stages: int) -> list[int]:
    """Stage ``s`` on rank ``s % P`` (``S`` must be a multiple of ``P``)."""
    if num_stages % num_ranks:
        raise ScheduleError(f"{num_stages} stages cannot be looped over {num_ranks} pipeline ranks "
                            "(need a multiple)")
    return [s % num_ranks for s in range(num_stages)]


def v_placement(num_ranks: int) -> list[int]:
    """Two chunks in a V: stage ``s`` on rank ``s`` for ``s < P``, on rank ``2P-1-s`` after."""
    return list(range(num_ranks)) + list(reversed(range(num_ranks)))


def add_communication(compute: list[list[Action]], stage_to_rank: list[int]) -> list[list[Action]]:
    """Insert the sends and receives that a per-rank list of compute actions needs.

    A receive goes right before the compute that needs it and a send right after the compute that produces it, so a
    send followed by a receive forms one batch. Stages on the same rank hand tensors over locally, without messages.
    """
    last = len(stage_to_rank) - 1
    out: list[list[Action]] = []
    for rank, acts in enumerate(compute):
        seq: list[Action] = []
        for a in acts:
            s = a.stage
            if a.op == "F":
                if s > 0 and stage_to_rank[s - 1] != rank:
                    seq.append(Action("RECV_F", s, a.mb))
                seq.append(a)
                if s < last and stage_to_rank[s + 1] != rank:
                    seq.append(Action("SEND_F", s, a.mb))
            elif a.op in ("B", "BI"):
                if s < last and stage_to_rank[s + 1] != rank:
                    seq.append(Action("RECV_B", s, a.mb))
                seq.append(a)
                if s > 0 and stage_to_rank[s - 1] != rank:
                    seq.append(Action("SEND_B", s, a.mb))
            else:
                seq.append(a)
        out.append(seq)
    return out


def _check_min_mb(name: str, num_microbatches: int, minimum: int, why: str) -> None:
    if num_microbatches < minimum:
        raise ScheduleError(f"schedule {name!r} needs at least {minimum} microbatches ({why}), "
                            f"got num_microbatches={num_microbatches}")


def _gpipe(P: int, M: int, S: int) -> PipeSchedule:
    place = looped_placement(P, S)
    compute = []
    for r in range(P):
        mine = [s for s in range(S) if place[s] == r]
        fwd = [Action("F", s, m) for s in mine for m in range(M)]
        bwd = [Action("B", s, m) for s in reversed(mine) for m in range(M)]
        compute.append(fwd + bwd)
    return PipeSchedule("gpipe", add_communication(compute, place), place, M)


def _one_f_one_b(P: int, M: int, S: int) -> PipeSchedule:
    if S != P:
        raise ScheduleError(f"schedule '1f1b' places one stage per rank: got {S} stages for {P} ranks "
                            "(use 'interleaved_1f1b' for virtual stages)")
    _check_min_mb("1f1b", M, P, "one per pipeline rank to fill the pipeline")
    compute = []
    for r in range(P):
        warm = min(P - 1 - r, M)
        seq = [Action("F", r, m) for m in range(warm)]
        for i in range(M - warm):
            seq += [Action("F", r, warm + i), Action("B", r, i)]
        seq += [Action("B", r, m) for m in range(M - warm, M)]
        compute.append(seq)
    return PipeSchedule("1f1b", add_communication(compute, list(range(P))), list(range(P)), M)


def _interleaved(P: int, M: int, S: int) -> PipeSchedule:
    place = looped_placement(P, S)
    V = S // P
    if M % P:
        raise ScheduleError(f"schedule 'interleaved_1f1b' needs num_microbatches to be a multiple of the "
                            f"{P} pipeline ranks, got {M}")
    _check_min_mb("interleaved_1f1b", M, P, "one per pipeline rank")
    total = M * V

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, P * V)
        chunk = within // P
        if backward:
            chunk = V - 1 - chunk
        return chunk, group * P + within % P

    compute = []
    for r in range(P):
        warm = min((P - 1 - r) * 2 + (V - 1) * P, total)
        seq = []
        for k in range(warm):
            c, m = unit(k, False)
            seq.append(Action("F", c * P + r, m))
        for i in range(total - warm):
            c, m = unit(warm + i, False)
            seq.append(Action("F", c * P + r, m))
            c, m = unit(i, True)
            seq.append(Action("B", c * P + r, m))
        for k in range(total - warm, total):
            c, m = unit(k, True)
            seq.append(Action("B", c * P + r, m))
        compute.append(seq)
    return PipeSchedule("interleaved_1f1b", add_communication(compute, place), place, M)


def _greedy_zero_bubble(P: int, M: int, place: list[int], limit: list[int]) -> list[list[Action]]:
    """List-schedule F, BI, BW with unit costs: BI first (critical path), then F within a memory limit, then BW.

    ``limit[r]`` bounds the microbatch-stages whose activations rank ``r`` holds (F done, BW not yet done).
    """
    S = len(place)
    f_done: dict[tuple[int, int], int] = {}   # (stage, mb) -> completion time
    bi_done: dict[tuple[int, int], int] = {}
    next_f = [0] * S                            # next microbatch to forward, per stage
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(P)]
    inflight = [0] * P
    busy_until = [0] * P
    order: list[list[Action]] = [[] for _ in range(P)]
    mine = [[s for s in range(S) if place[s] == r] for r in range(P)]
    remaining = 3 * S * M
    t = 0
    while remaining:
        if t > 20 * S * M + 100:
            raise ScheduleError(f"zero-bubble list scheduling did not finish for P={P}, M={M} (internal error)")
        for r in range(P):
            if busy_until[r] > t:
                continue
            choice = None
            # 1. input-gradient backward that is ready: lowest microbatch, latest stage first.
            cands = []
            for s in mine[r]:
                for m in range(M):
                    if (s, m) in f_done and f_done[(s, m)] <= t and (s, m) not in bi_done:
                        if s == S - 1 or bi_done.get((s + 1, m), t + 1) <= t:
                            cands.append((m, -s))
            if cands:
                m, ns = min(cands)
                choice = Action("BI", -ns, m)
            if choice is None and inflight[r] < limit[r]:
                fc = []
                for s in mine[r]:
                    m = next_f[s]
                    if m < M and (s == 0 or f_done.get((s - 1, m), t + 1) <= t):
                        fc.append((-s, m))
                if fc:
                    ns, m = min(fc)
                    choice = Action("F", -ns, m)
            if choice is None and pending_w[r]:
                s, m = pending_w[r].pop(0)
                choice = Action("BW", s, m)
            if choice is None:
                continue
            busy_until[r] = t + 1
            order[r].append(choice)
            remaining -= 1
            key = (choice.stage, choice.mb)
            if choice.op == "F":
                f_done[key] = t + 1
                next_f[choice.stage] += 1
                inflight[r] += 1
            elif choice.op == "BI":
                bi_done[key] = t + 1
                pending_w[r].append(key)
            else:
                inflight[r] -= 1
        t += 1
    return order


def _zb_h1(P: int, M: int, S: int) -> PipeSchedule:
    if S != P:
        raise ScheduleError(f"schedule 'zb_h1' places one stage per rank: got {S} stages for {P} ranks")
    _check_min_mb("zb_h1", M, P, "one per pipeline rank to fill the pipeline")
    place = list(range(P))
    compute = _greedy_zero_bubble(P, M, place, [P + 1] * P)
    return PipeSchedule("zb_h1", add_communication(compute, place), place, M)


def _zbv(P: int, M: int, S: int) -> PipeSchedule:
    if S != 2 * P:
        raise ScheduleError(f"schedule 'zbv' places two stages per rank in a V: needs {2 * P} stages for {P} "
                            f"ranks, got {S} (split with virtual_chunks=2)")
    _check_min_mb("zbv", M, P, "one per pipeline rank to fill the V")
    place = v_placement(P)
    compute = _greedy_zero_bubble(P, M, place, [2 * P] * P)
    return PipeSchedule("zbv", add_communication(compute, place), place, M)


for _name, _fn in (("gpipe", _gpipe), ("1f1b", _one_f_one_b), ("interleaved_1f1b", _interleaved),
                   ("zb_h1", _zb_h1), ("zbv", _zbv)):
    register_schedule(_name, _fn)
