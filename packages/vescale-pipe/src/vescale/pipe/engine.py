"""PipeEngine: run one global batch through the pipeline stages of this rank under a schedule.

Semantics (single-device equivalence): ``engine.step(batch, target)`` splits ``batch`` and ``target`` along dim 0
into ``M`` microbatches, runs forward and backward of every microbatch through all stages, and leaves in each local
parameter's ``.grad`` the sum over microbatches of ``d(loss_fn(out_m, target_m) / M)`` - what one device computes
by accumulating ``(loss_fn(model(x_m), t_m) / M).backward()`` over the same microbatches. It returns the mean
microbatch loss on every pipeline rank. Gradients accumulate into ``.grad`` like ``backward`` does: zero them between
steps (``optimizer.zero_grad()``).

Collectives it issues: at construction (and in :meth:`PipeEngine.wrap_stages`), one ``all_gather_object`` over the
pp group (errors and parameter FQNs);
per step, first one ``all_gather`` over the pp group of a fixed-size int64 description of the batch and target each
rank was passed (presence, shapes, dtypes; see :mod:`vescale.pipe.microbatch`), so that a bad or missing batch raises
the same :class:`PipeError` on every pp rank before any stage waits on another; then p2p sends/receives between
neighbouring stages (tagged, batched), one ``all_reduce`` over the pp group for parameters held by several stages
(tied embeddings), one ``all_reduce`` over ``dp`` (when given) of every local gradient not reduced by a stage that
owns its dp reduction (see below), and one ``broadcast`` of the loss from the rank holding the last stage. Every
tensor these collectives touch lives on :attr:`PipeEngine.device`, the rank's device
(``vescale.core.launch.rank_device`` of the pp group: ``cuda:<current>`` under NCCL; otherwise the stages'
parameters' device, else CPU).

Data parallelism, two ways. (1) ``dp_group``: after the step, one flat ``all_reduce`` per gradient dtype averages
every local gradient over dp, not overlapped with anything (for stages that are plain modules). (2) Stages that own
their dp gradient reduction: :meth:`PipeEngine.wrap_stages` replaces each local stage by a module; one implementing
:class:`~vescale.pipe.StageGradSync` (``no_sync``, ``defer_grad_sync``, ``finish_grad_sync``, ``split_backward``;
e.g. ``vescale.parallel.DistributedDataParallel``) is told its tied parameters once (``defer_grad_sync``: their
gradients are complete only after the pp sum), runs every backward action but the stage's last weight-gradient one
(its last ``B`` or ``BW`` of the step) under ``no_sync()``, so its reduction overlaps the last microbatch's
backward, and gets ``finish_grad_sync()`` after the tied-weight sum over pp; the flat dp all-reduce skips that
stage's parameters. vescale-pipe does not import the reducer: the caller composes the two (``vescale.plan.build``
does, for every pp x dp mesh).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vescale.core.launch import rank_device
from vescale.core.mesh import dim_group
from vescale.core.sharded_state import mark_piece
from vescale.pipe import _p2p
from vescale.pipe._backward import PendingWeightGrad, backward_full, backward_input, backward_weight
from vescale.pipe.errors import PipeError, ScheduleError
from vescale.pipe.grad_sync import (
    StageGradSync,
    _local,
    average_dp_grads,
    grad_sync_problem,
    sum_tied_grads,
    tied_before,
)
from vescale.pipe.microbatch import (
    _BAD,
    _DESC_LEAVES,
    _PRESENT,
    _describe_batch,
    _first_difference,
    _leaf_name,
    _leaf_text,
    split_microbatches,
)
from vescale.pipe.schedule import COMM_OPS, PipeSchedule, build_schedule
from vescale.pipe.timeline import span
from vescale.pipe.validate import ScheduleReport, validate_schedule

__all__ = ["PipeEngine", "split_microbatches"]

_FWD, _BWD = 0, 1
_CATEGORY = {"F": "forward", "B": "backward", "BI": "backward_input", "BW": "backward_weight"}


def _plain(t: Any) -> Any:
    """A DTensor activation or loss as a plain full tensor (differentiable; a collective only if it is sharded)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class PipeEngine:
    """Pipeline runtime for the stages of this rank.

    ``stages``: every stage of the pipeline in order (entries for other ranks may be ``None``), or a mapping
    ``{stage index: module}`` of this rank's stages together with ``num_stages``. A stage is any ``nn.Module``: stage
    0 is called with the microbatch (``stage(*mb)`` for a tuple, ``stage(**mb)`` for a dict, ``stage(mb)`` for a
    tensor), later stages with the previous stage's outputs (a tensor or a tuple of tensors), and ``loss_fn(output,
    target_mb)`` is applied to the last stage's output. DTensor outputs (stages with TP parameters) become plain
    full tensors: later stages and ``loss_fn`` receive plain tensors. Parameters of different stages are the same
    (tied) parameter when their FQNs match, or map to the same name in the stage's ``canonical_names`` dict (as
    :func:`split` sets); their gradients are summed over the pp group. ``mesh`` is a process group, a 1-D DeviceMesh,
    or a named nD DeviceMesh with a ``pp`` dimension (then ``dp``, when present and ``dp_group`` is not given,
    averages gradients over stage replicas). ``schedule`` is a registered name or a :class:`PipeSchedule`.

    Raises :class:`ScheduleError` (too few microbatches, wrong stage count for the schedule) or
    :class:`PipeError` (a stage missing for this rank) on every rank before any p2p traffic.
    """

    def __init__(self, stages: Sequence[nn.Module | None] | Mapping[int, nn.Module], mesh: Any = None, *,
                 schedule: str | PipeSchedule = "1f1b", num_microbatches: int,
                 loss_fn: Callable[[Any, Any], torch.Tensor], num_stages: int | None = None,
                 dp_group: Any = None) -> None:
        self.group, self.dp_group, self.mesh = self._resolve_groups(mesh, dp_group)
        self.pp_rank = dist.get_rank(self.group)
        self.pp_size = dist.get_world_size(self.group)
        self.peers = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        if isinstance(stages, Mapping):
            if num_stages is None:
                raise PipeError("pass num_stages=... when stages is a mapping of this rank's stages")
            all_stages: list = [stages.get(i) for i in range(num_stages)]
        else:
            all_stages = list(stages)
            if num_stages is not None and num_stages != len(all_stages):
                raise PipeError(f"num_stages={num_stages} but {len(all_stages)} stages were given")
        self.num_stages = len(all_stages)
        self.num_microbatches = num_microbatches
        if isinstance(schedule, str):
            self.schedule = build_schedule(schedule, self.pp_size, num_microbatches, self.num_stages)
        else:
            self.schedule = schedule
            if (schedule.num_ranks, schedule.num_stages, schedule.num_microbatches) != (
                    self.pp_size, self.num_stages, num_microbatches):
                raise ScheduleError(f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks x "
                                    f"{schedule.num_stages} stages x {schedule.num_microbatches} microbatches; the "
                                    f"engine has {self.pp_size} x {self.num_stages} x {num_microbatches}")
        self.report: ScheduleReport = validate_schedule(self.schedule)
        self.loss_fn = loss_fn
        self.owner = self.schedule.stage_to_rank
        self.local_ids = self.schedule.stages_of(self.pp_rank)
        errors = [f"pp rank {self.pp_rank} has no module for stage {s} (schedule {self.schedule.name!r} places it "
                  "here)" for s in self.local_ids if not isinstance(all_stages[s], nn.Module)]
        self.stages: dict[int, nn.Module] = {s: all_stages[s] for s in self.local_ids if not errors}
        #: The stage modules as given (their parameter FQNs are the model's), whatever wrap_stages puts around them.
        self._unwrapped: dict[int, nn.Module] = dict(self.stages)
        self._register_parameters(errors)
        self._sync_owners: dict[int, StageGradSync] = {}  # local stage -> its wrapper owning its dp reduction
        self._last_weight_action: dict[int, tuple[str, int]] = {}  # local stage -> (op, mb) of its last B / BW
        #: The device of every tensor the engine communicates (see the module docstring).
        params = [p for ps in self._params.values() for p in ps]
        self.device = rank_device(self.group)  # (NCCL: the current CUDA device, whether or not the rank holds params)
        if self.device.type == "cpu" and params:
            self.device = params[0].device
        self._step = 0

    def _register_parameters(self, errors: list[str]) -> None:
        """Collect this rank's trainable parameters by (canonical) FQN from the unwrapped stages, and learn over pp
        which names several stages hold (tied weights: ``shared``, with their local shapes), and mark each of
        :meth:`tied_copies` ``mark_piece(p, counts_in_norm=False)``. One ``all_gather_object`` over the pp group,
        which also raises every rank's ``errors`` on every rank."""
        self._params: dict[str, list[nn.Parameter]] = {}
        for s in self._unwrapped.values():
            aliases = getattr(s, "canonical_names", {})
            for name, p in s.named_parameters(remove_duplicate=False):
                key = aliases.get(name, name)
                if p.requires_grad and not any(p is q for q in self._params.setdefault(key, [])):
                    self._params[key].append(p)
        info = {n: (tuple(_local(ps[0]).shape), str(ps[0].dtype).replace("torch.", ""))
                for n, ps in self._params.items()}
        gathered: list[Any] = [None] * self.pp_size
        dist.all_gather_object(gathered, (errors, info), group=self.group)
        all_errors = [e for errs, _ in gathered for e in errs]
        if all_errors:
            raise PipeError("; ".join(all_errors))
        holders: dict[str, list] = {}
        for r, (_, inf) in enumerate(gathered):
            for n, meta in inf.items():
                holders.setdefault(n, []).append((r, meta))
        self.shared = {n: h[0][1] for n, h in sorted(holders.items()) if len(h) > 1}
        self._first_holder = {n: h[0][0] for n, h in holders.items()}  # the lowest pp rank holding each name
        for p in self.tied_copies():  # a gradient norm over pp (vescale.parallel's clipping) counts the weight once
            mark_piece(p, counts_in_norm=False)

    @staticmethod
    def _resolve_groups(pp: Any, dp_group: Any) -> tuple[Any, Any, Any]:
        if pp is None:
            return None, dp_group, None
        if not hasattr(pp, "mesh_dim_names"):
            return pp, dp_group, None
        found = dim_group(pp, "pp")  # a 1-D mesh is all pp
        if found is None:
            raise PipeError(f"the mesh has dimensions {list(pp.mesh_dim_names or ())}; PipeEngine needs a 'pp' "
                            "dimension")
        if dp_group is None and pp.ndim > 1:
            dp_group = (dim_group(pp, "dp", whole_if_1d=False) or (None,))[0]
        return found[0], dp_group, pp

    def tied_parameters(self, stage: int) -> list[nn.Parameter]:
        """This rank's parameters of local stage ``stage`` that are tied to a parameter of another stage.

        Their gradients are complete only after the engine sums them over pp (or over this rank's stages) at the end
        of a step: :meth:`wrap_stages` hands them to a stage's reducer (``StageGradSync.defer_grad_sync``), which
        reduces them only in ``finish_grad_sync()``.
        """
        # by name: the stage module holds the current parameters, also while a wrapper that replaced them in place
        # (FSDP2) is being set up and before the engine has collected them again
        tied = {n for n, ps in self._params.items() if n in self.shared or len(ps) > 1}
        module = self._unwrapped[stage]
        aliases = getattr(module, "canonical_names", {})
        out: dict[int, nn.Parameter] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if p.requires_grad and aliases.get(name, name) in tied:
                out.setdefault(id(p), p)
        return list(out.values())

    def tied_copies(self) -> list[nn.Parameter]:
        """The local parameters whose gradient, after a step, another holder also has and counts in a global norm.

        A tied weight held by several stages has after :meth:`step` the same summed gradient on each holder. It is
        counted by its lowest pp rank's first local copy; every other copy is listed here, and the engine marks each
        ``vescale.core.sharded_state.mark_piece(p, counts_in_norm=False)`` (at construction and after
        :meth:`wrap_stages`), so that a gradient norm over pp counts the weight once.
        """
        out = []
        for name, ps in self._params.items():
            first = self._first_holder.get(name, self.pp_rank) == self.pp_rank
            out += ps[1:] if first else ps
        return out

    def wrap_stages(self, wrap: Callable[[int, nn.Module], nn.Module]) -> None:
        """Replace each local stage ``s`` by ``wrap(s, stage)``, e.g. to own its dp gradient reduction.

        The returned module runs the stage's forward. It may keep the stage's parameters (DDP) or replace them in
        the stage module under the same FQNs (FSDP2 shards them in place): the engine collects them again from the
        stage modules afterwards, so :meth:`parameters` (what the optimizer gets) and the tied-weight sums see the
        parameters the stages now hold. A wrapper implementing :class:`~vescale.pipe.StageGradSync` owns the stage's
        dp reduction from the next step on: it gets ``defer_grad_sync(tied_parameters(s))`` now, earlier backward
        actions run under ``no_sync()``, ``finish_grad_sync()`` follows the tied-weight sum, and ``dp_group``'s flat
        all-reduce skips its parameters (see the module docstring).

        Collective: one ``all_gather_object`` over the pp group (call it on every pp rank). Raises
        :class:`PipeError` on every pp rank when on any of them a wrapper implements only part of
        :class:`~vescale.pipe.StageGradSync` or its ``defer_grad_sync`` raises, a parameter is held by two local
        stages and either becomes a reduction owner (two reducers of one gradient), or a wrapper with
        ``split_backward = False`` gets a stage that the schedule runs with ``BI`` / ``BW`` actions (zero-bubble
        schedules).
        """
        if not _takes_two(wrap):
            raise PipeError(f"wrap_stages calls wrap(index, stage), and {wrap!r} does not take two arguments; a "
                            "stage's tied parameters reach its reducer through StageGradSync.defer_grad_sync")
        held: dict[int, list[int]] = {}  # parameter id -> the local stages holding it (before any wrapper runs)
        for s, m in self.stages.items():
            for p in m.parameters():
                if s not in held.setdefault(id(p), []):
                    held[id(p)].append(s)
        wrapped = {s: wrap(s, m) for s, m in self.stages.items()}
        errors = sorted(f"stage {s} on pp rank {self.pp_rank}: {why}" for s, m in wrapped.items()
                        if (why := grad_sync_problem(m)) is not None)
        owners = {s: m for s, m in wrapped.items() if isinstance(m, StageGradSync)}
        errors += sorted({f"a parameter is held by local stages {both[0]} and {both[1]} of pp rank {self.pp_rank}; "
                          "two dp reducers cannot own one gradient" for both in held.values()
                          if len(both) > 1 and any(s in owners for s in both)})
        acts = self.schedule.actions[self.pp_rank]
        errors += [f"stage {s} on pp rank {self.pp_rank} is wrapped in {type(m).__name__}, whose gradient reduction "
                   f"runs in autograd hooks that a split backward (BI / BW) does not reach; schedule "
                   f"{self.schedule.name!r} splits it: use gpipe, 1f1b or interleaved_1f1b"
                   for s, m in owners.items() if m.split_backward is False
                   and any(a.stage == s and a.op in ("BI", "BW") for a in acts)]
        for s, m in owners.items():  # before the gather below, so that a refusal is raised on every pp rank
            try:
                m.defer_grad_sync(self.tied_parameters(s))
            except Exception as exc:  # noqa: BLE001 (whatever the reducer raises, every rank must hear of it)
                errors.append(f"stage {s} on pp rank {self.pp_rank}: {type(m).__name__}.defer_grad_sync raised "
                              f"{type(exc).__name__}: {exc}")
        self._register_parameters(errors)
        self.stages = wrapped
        self._sync_owners = owners
        self._last_weight_action = {a.stage: (a.op, a.mb) for a in acts if a.op in ("B", "BW")}

    def parameters(self) -> list[nn.Parameter]:
        """The distinct trainable parameters of this rank's stages (give them to the optimizer)."""
        seen: dict[int, nn.Parameter] = {}
        for ps in self._params.values():
            for p in ps:
                seen.setdefault(id(p), p)
        return list(seen.values())

    # ------------------------------------------------------------------ step
    def step(self, batch: Any = None, target: Any = None) -> torch.Tensor:
        """Forward and backward of one global batch; returns the mean microbatch loss (a 0-d tensor, every rank).

        ``batch`` is needed on the rank holding stage 0, ``target`` on the rank holding the last stage; other ranks
        may pass ``None``, or the same batch and target (same shapes and dtypes). Before the schedule starts, the pp
        ranks exchange what they were passed (one small ``all_gather``) and every rank raises the same
        :class:`PipeError`, naming the argument, the pp rank, and the shape and dtype expected and got, when: the
        rank holding stage 0 (the last stage) has no batch (target); a tensor of a batch or target cannot be split
        into ``num_microbatches`` along dim 0; or a rank was passed a batch (target) whose shapes or dtypes differ
        from those on the rank holding stage 0 (the last stage). Nothing has been sent then, so the engine can
        step again.
        """
        S, M = self.num_stages, self.num_microbatches
        self._mbs = self._tgts = None
        self._check_step_args(batch, target)
        if batch is not None:
            self._mbs = split_microbatches(batch, M, "batch")
        if target is not None:
            self._tgts = split_microbatches(target, M, "target")
        self._inputs: dict = {}      # (stage, mb) -> input tensors (received or handed over locally)
        self._saved: dict = {}       # (stage, mb) -> (input leaves needing grad, backward roots)
        self._out_grads: dict = {}   # (stage, mb) -> gradients of the stage's outputs
        self._to_send: dict = {}     # (op, stage, mb) -> tensors
        self._pending: dict = {}     # (stage, mb) -> PendingWeightGrad
        self._in_meta: dict = {}     # stage -> [(shape, dtype, requires_grad)] of its inputs, this step
        self._losses: dict = {}
        self._sends: list = []
        # Tied gradients are summed over ranks per step: keep what .grad held before, sum only this step's part.
        self._before = tied_before(self.shared, self._params)
        acts = self.schedule.actions[self.pp_rank]
        i = 0
        while i < len(acts):
            if acts[i].op in COMM_OPS:
                j = i
                while j < len(acts) and acts[j].op in COMM_OPS:
                    j += 1
                self._communicate(acts[i:j])
                i = j
            else:
                self._compute(acts[i])
                i += 1
        for work in self._sends:
            work.wait()
        self._sends = []
        leftovers = {k: len(v) for k, v in (("inputs", self._inputs), ("saved", self._saved),
                                            ("pending", self._pending), ("to_send", self._to_send)) if v}
        if leftovers:
            raise ScheduleError(f"schedule {self.schedule.name!r} left work undone on pp rank {self.pp_rank}: "
                                f"{leftovers}")
        sum_tied_grads(self.shared, self._params, self._before, self.group, self.device)
        for module in self._sync_owners.values():
            with span("dp grad sync (tied)", "collective"):
                module.finish_grad_sync()
        owned = {id(p) for m in self._sync_owners.values() for p in m.parameters()}
        average_dp_grads([p for p in self.parameters() if id(p) not in owned], self.dp_group)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if S - 1 in self.stages:
            loss = torch.stack([self._losses[m] for m in range(M)]).float().mean().to(self.device)
        with span("loss broadcast", "collective"):
            dist.broadcast(loss, src=self.peers[self.owner[S - 1]], group=self.group)
        self._step += 1
        return loss

    def _check_step_args(self, batch: Any, target: Any) -> None:
        """Raise the same :class:`PipeError` on every pp rank when any rank's batch or target is missing or bad.

        Issues one ``all_gather`` over the pp group of a ``[2, _DESC_LEN]`` int64 tensor on :attr:`device`.
        """
        M = self.num_microbatches
        mine = torch.tensor([_describe_batch(batch, M), _describe_batch(target, M)], dtype=torch.int64,
                            device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.pp_size)]
        with span("batch check all_gather", "collective"):
            dist.all_gather(rows, mine, group=self.group)
        table = [r.cpu().tolist() for r in rows]  # table[pp rank][0: batch, 1: target]
        problems = []
        for arg, (what, stage, role) in enumerate((("batch", 0, "stage 0"),
                                                   ("target", self.num_stages - 1, "the last stage"))):
            holder = self.owner[stage]
            ref = table[holder][arg]
            if not ref[_PRESENT]:
                problems.append(f"pp rank {holder} holds {role} and needs the {what}, got None")
            seen: dict[tuple, list[int]] = {}  # each distinct description passed, and the pp ranks given it
            for r, rows_r in enumerate(table):
                if rows_r[arg][_PRESENT]:
                    seen.setdefault(tuple(rows_r[arg]), []).append(r)
            for row, ranks in ((list(k), v) for k, v in seen.items()):
                where = f"pp rank {ranks[0]}" if len(ranks) == 1 else f"pp ranks {', '.join(map(str, ranks))}"
                if row[_BAD] >= 0:
                    problems.append(f"{_leaf_name(what, row, row[_BAD])} has {_leaf_text(row, _DESC_LEAVES)} on "
                                    f"{where}: dim 0 must be a multiple of num_microbatches={M}")
                elif ref[_PRESENT] and row[_PRESENT:_BAD] != ref[_PRESENT:_BAD]:
                    problems.append(f"the {what} on {where} differs from the {what} on pp rank {holder} ({role}): "
                                    f"got {_first_difference(row, ref)}")
        if problems:
            raise PipeError("; ".join(problems) + f" (raised on every pp rank, before step {self._step} started)")

    def _compute(self, a) -> None:
        s, m = a.stage, a.mb
        S = self.num_stages
        owner = self._sync_owners.get(s)
        # a stage owning its dp reduction reduces during its last weight-gradient backward only
        quiet = owner is not None and a.op != "F" and self._last_weight_action.get(s) != (a.op, m)
        with span(f"{a.op}{m}" + (f"s{s}" if len(self.local_ids) > 1 else ""), _CATEGORY[a.op],
                  stage=s, mb=m, step=self._step), owner.no_sync() if quiet else contextlib.nullcontext():
            if a.op == "F":
                self._forward(s, m)
                return
            if a.op == "BW":
                backward_weight(self._pending.pop((s, m)))
                return
            leaves, roots = self._saved.pop((s, m))
            grads = None if s == S - 1 else self._out_grads.pop((s, m))
            if not roots:
                in_grads = [None] * len(leaves)
                if a.op == "BI":
                    self._pending[(s, m)] = PendingWeightGrad()
            elif a.op == "B":
                in_grads = backward_full(roots, grads, leaves)
            else:
                in_grads, self._pending[(s, m)] = backward_input(roots, grads, leaves)
            in_grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(in_grads, leaves)]
            if s > 0:
                if self.owner[s - 1] == self.pp_rank:
                    self._out_grads[(s - 1, m)] = in_grads
                else:
                    self._to_send[("SEND_B", s, m)] = in_grads

    def _forward(self, s: int, m: int) -> None:
        S, M = self.num_stages, self.num_microbatches
        stage = self.stages[s]
        if s == 0:
            mb = self._mbs[m]
            leaves: list[torch.Tensor] = []
            if isinstance(mb, Mapping):
                out = stage(**mb)
            elif isinstance(mb, (tuple, list)):
                out = stage(*mb)
            else:
                out = stage(mb)
        else:
            raw = self._inputs.pop((s, m))
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in raw]
            leaves = [t for t in inputs if t.requires_grad]
            out = stage(*inputs)
        if s == S - 1:
            loss = _plain(self.loss_fn(_plain(out), self._tgts[m]))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise PipeError(f"loss_fn must return a one-element tensor, got {type(loss).__name__}")
            self._losses[m] = loss.detach()
            roots = [loss / M] if loss.requires_grad else []
            self._saved[(s, m)] = (leaves, roots)
            return
        outs = tuple(_plain(o) for o in ((out,) if isinstance(out, torch.Tensor) else out))
        bad = [i for i, o in enumerate(outs) if not isinstance(o, torch.Tensor)]
        if bad:
            raise PipeError(f"stage {s} output(s) {bad} are not tensors ({[type(outs[i]).__name__ for i in bad]}); "
                            "non-last stages must return a tensor or a tuple of tensors")
        # An input passed straight through must stay connected to its leaf for the backward.
        outs = tuple(o.view_as(o) if o.requires_grad and o.grad_fn is None else o for o in outs)
        roots = [o for o in outs if o.requires_grad]
        self._saved[(s, m)] = (leaves, roots)
        if self.owner[s + 1] == self.pp_rank:
            self._inputs[(s + 1, m)] = outs
        else:
            self._to_send[("SEND_F", s, m)] = outs

    def _communicate(self, acts) -> None:
        S, M = self.num_stages, self.num_microbatches
        first: list = []
        headers: list = []
        data_recvs: list = []
        for a in acts:
            s, m = a.stage, a.mb
            if a.op == "SEND_F":
                outs = self._to_send.pop(("SEND_F", s, m))
                peer = self.peers[self.owner[s + 1]]
                if m == 0:
                    first.append(("send", _p2p.encode_header(list(outs), s, self.device), peer,
                                  _p2p.tag(_FWD, s, m, 0, S, M)))
                for i, t in enumerate(outs):
                    first.append(("send", t.detach().contiguous(), peer, _p2p.tag(_FWD, s, m, i + 1, S, M)))
            elif a.op == "SEND_B":
                grads = self._to_send.pop(("SEND_B", s, m))
                peer = self.peers[self.owner[s - 1]]
                for i, g in enumerate(grads):
                    first.append(("send", _local(g).detach().contiguous(), peer, _p2p.tag(_BWD, s, m, i + 1, S, M)))
            elif a.op == "RECV_F":
                if m == 0:
                    buf = torch.empty(_p2p.HEADER_LEN, dtype=torch.int64, device=self.device)
                    headers.append((s, buf))
                    first.append(("recv", buf, self.peers[self.owner[s - 1]], _p2p.tag(_FWD, s - 1, m, 0, S, M)))
                data_recvs.append(a)
            else:  # RECV_B
                data_recvs.append(a)
        with span("p2p " + " ".join(str(a) for a in acts), "p2p"):
            for kind, w in _p2p.post(first, self.group):
                if kind == "send":
                    self._sends.append(w)
                else:
                    w.wait()
            for s, buf in headers:
                self._in_meta[s] = _p2p.decode_header(buf)
            second, targets = [], []
            for a in data_recvs:
                s, m = a.stage, a.mb
                if a.op == "RECV_F":
                    if s not in self._in_meta:
                        raise ScheduleError(f"pp rank {self.pp_rank} receives stage {s} microbatch {m} before "
                                            "microbatch 0, whose message carries the shapes")
                    bufs = [torch.empty(shape, dtype=dt, device=self.device).requires_grad_(False)
                            for shape, dt, _ in self._in_meta[s]]
                    peer, sender, kind = self.peers[self.owner[s - 1]], s - 1, _FWD
                    targets.append((a, bufs))
                else:
                    _, roots = self._saved[(s, m)]
                    bufs = [torch.empty(_local(r).shape, dtype=r.dtype, device=self.device) for r in roots]
                    peer, sender, kind = self.peers[self.owner[s + 1]], s + 1, _BWD
                    targets.append((a, bufs))
                for i, b in enumerate(bufs):
                    second.append(("recv", b, peer, _p2p.tag(kind, sender, m, i + 1, S, M)))
            for _, w in _p2p.post(second, self.group):
                w.wait()
        for a, bufs in targets:
            if a.op == "RECV_F":
                flags = [rg for _, _, rg in self._in_meta[a.stage]]
                self._inputs[(a.stage, a.mb)] = [b.requires_grad_(rg) for b, rg in zip(bufs, flags)]
            else:
                self._out_grads[(a.stage, a.mb)] = bufs

    # --------------------------------------------------------- gradient sums


def _takes_two(fn: Callable) -> bool:
    """Whether ``fn(index, stage)`` binds (True for a callable without a signature to check: it is just called)."""
    try:
        inspect.signature(fn).bind(0, None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True
