"""A dry run of one rank of a large mesh, in one process: torch's fake process group and the meta device.

:func:`dry_run` initialises a ``fake`` process group of the job's world size as rank ``rank`` (no other process, no
communication: each collective returns at once), builds the model on the meta device (shapes, no storage) and applies
the spec through :func:`vescale.plan.build`, the path a real job takes. Then it checks what one rank can check
without data:

* ``build``: every step of the composition ran for this rank (spec rules, mesh, tp plan resolved and applied,
  pipeline split and schedule built, data parallelism wrapped);
* ``shapes``: every sharded parameter's sharded dims divide by their mesh dims (DTensor accepts uneven shards; a
  job usually does not want them);
* ``bytes``: this rank's parameter, gradient and optimizer-state bytes, counted from the tensors that were built
  (DTensor local shards, the DDP gradient buffers, the optimizer's state after one ``step``), not estimated;
* ``step``: one training step's forward and backward on meta tensors of this rank's rows (with a pipeline, this
  rank's stages under the schedule), then the optimizer step, with every collective counted by mesh dim
  (:class:`vescale.core.comm.CommCounter`).

What it cannot check is reported, not skipped silently (:attr:`DryRunReport.not_checked`): values (the token-id
range check, MoE routing counts and anything else read back from a tensor get a stand-in scalar), and, with a
pipeline, what the other pp ranks would send: stage boundaries carry their shapes in a header the previous rank
sends, which no one sends here; the receiving stage's own captured input shapes stand in for it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from vescale.plan.spec import ParallelSpec

__all__ = ["DryRunReport", "dry_run", "meta_scalars", "rank_bytes"]

_SCALAR_READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__"})


class _MetaScalars(TorchFunctionMode):
    """Answers host reads of meta tensors (``.item()``, ``.tolist()``, ``bool()``) with stand-ins: zeros, and True
    for truth tests. Model code and vescale's checks read values back (transformers' packed-sequence test, the
    token-id range check); a meta tensor has none, and the dry run checks shapes, not values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.histc and args and args[0].is_meta and not args[0].is_floating_point():
            # models that count tokens per expert call histc on integer ids off the CPU (Mixtral); DTensor's
            # propagation runs the CPU kernel on fake tensors, which has no integer histc: count in float
            return torch.histc(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        name = getattr(func, "__name__", "")
        if name in _SCALAR_READS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            t = args[0]
            if name == "tolist":
                return torch.zeros(t.shape, dtype=t.dtype).tolist()
            return True if name == "__bool__" else 0
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_scalars():
    """Within the block, host reads of meta tensors return stand-ins (zeros; True for ``bool``) and ``nonzero`` on
    meta assumes every element is nonzero, so code that branches on a value runs on the meta device."""
    from vescale.core.torch_internals import meta_nonzero_assumed

    with meta_nonzero_assumed(), _MetaScalars():
        yield


@dataclass
class DryRunReport:
    """What :func:`dry_run` saw on one rank.

    ``checks``: ``{name: detail}`` of what passed; ``failed``: ``{name: error}``; ``not_checked``: ``{name: why}``.
    ``bytes``: this rank's exact ``parameters``, ``gradients`` and ``optimizer`` bytes (``None`` where the step that
    creates them did not run). ``collectives``: :meth:`vescale.core.comm.CommCounter.summary` of one step (forward,
    backward and optimizer step), by mesh dim. ``seconds``: wall time per phase.
    """

    world_size: int
    rank: int
    spec: ParallelSpec
    coordinate: dict[str, int] = field(default_factory=dict)
    checks: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    not_checked: dict[str, str] = field(default_factory=dict)
    bytes: dict[str, int | None] = field(default_factory=dict)
    collectives: dict | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    def as_dict(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "mesh": dict(self.spec.mesh),
                "coordinate": self.coordinate, "ok": self.ok, "checks": self.checks, "failed": self.failed,
                "not_checked": self.not_checked, "bytes": self.bytes, "collectives": self.collectives,
                "seconds": {k: round(v, 2) for k, v in self.seconds.items()}}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    """Bytes of the local pieces of ``tensors``, each counted once (by the identity of the live tensor given, not
    of its local piece: ``to_local()`` makes a new object each call, whose id a later one may reuse)."""
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            local = _local(t)
            total += local.numel() * local.element_size()
    return total


def _uneven(params: list[tuple[str, nn.Parameter]]) -> list[str]:
    """``name dim size / mesh dim`` for every Shard placement that does not divide its dim."""
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in params:
        if not isinstance(p, DTensor):
            continue
        mesh_names = p.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(p.device_mesh.ndim))
        for i, pl in enumerate(p.placements):
            if pl.is_shard() and p.shape[pl.dim] % p.device_mesh.size(i):
                out.append(f"{name} dim {pl.dim} ({p.shape[pl.dim]}) over {mesh_names[i]}={p.device_mesh.size(i)}")
    return out


def _grad_bytes(out) -> int:
    ddp = out.ddp
    if ddp is not None and hasattr(ddp, "grad_buffer_bytes"):  # (DDP's flat buffers; ZeRO 2: its shards)
        return int(ddp.grad_buffer_bytes())
    return _nbytes(p.grad for p in out.parameters() if p.grad is not None)


def _optimizer_bytes(opt) -> int:
    if hasattr(opt, "state_bytes"):  # DistributedOptimizer: its fp32 states and masters
        total = int(opt.state_bytes())
        return total + int(opt.master_bytes()) if hasattr(opt, "master_bytes") else total
    return _nbytes(v for state in opt.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)


@contextlib.contextmanager
def _alone_in_pipeline(model: nn.Module):
    """Let ``PipeEngine`` learn which parameters other pp ranks hold without them: the fake group's
    ``all_gather_object`` hands every rank's slot this rank's own object, so every parameter of this rank's stages
    would look held by every pp rank (a tied weight), be summed over pp after each step and left out of gradient
    norms. Within the block, the engine's gather (``(errors, {name: (shape, dtype)})``) gives the other slots no
    errors and only this rank's names the model ties (one parameter under several FQNs), which are the names other
    stages can hold too. Other gathers are left as the fake group answers them."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = {n for ns in names.values() if len(ns) > 1 for n in ns}
    gather = dist.all_gather_object

    def gather_alone(object_list, obj, group=None):
        gather(object_list, obj, group=group)
        if (isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], list) and isinstance(obj[1], dict)):
            me = dist.get_rank(group) if group is not None else dist.get_rank()
            for r in range(len(object_list)):
                if r != me:
                    object_list[r] = ([], {n: m for n, m in obj[1].items() if n in tied})

    dist.all_gather_object = gather_alone
    try:
        yield
    finally:
        dist.all_gather_object = gather


def rank_bytes(par, optimizer) -> dict[str, int]:
    """This rank's exact ``parameters``, ``gradients`` and ``optimizer`` bytes of a built job (``par``: what
    :func:`vescale.plan.build` returned; ``optimizer``: its ``make_optimizer``'s, after a step so that its state
    exists), counted from the live tensors: DTensor local shards, DDP's flat gradient buffers (ZeRO 2: their
    shards), the optimizer's states and fp32 masters. No collective."""
    held = [p for m in par.modules for p in m.parameters()]
    return {"parameters": _nbytes(held), "gradients": _grad_bytes(par), "optimizer": _optimizer_bytes(optimizer)}


@contextlib.contextmanager
def _pipeline_shapes(engine):
    """Let this rank's pipeline stages receive without a sender: each forward header (the shapes of the tensors a
    stage receives, normally sent by the previous pp rank) is answered from the receiving stage's captured input
    shapes (``GraphStage.input_meta``), and the engine's cross-rank batch check, which compares values gathered
    from every pp rank, is skipped. Patches ``vescale.pipe._p2p`` for the block only."""
    if engine is None:
        yield
        return
    from vescale.pipe import _p2p

    post, decode = _p2p.post, _p2p.decode_header
    stride, stages, mbs = _p2p.MAX_TENSORS + 1, engine.num_stages, engine.num_microbatches
    headers: dict[int, tuple[torch.Tensor, int]] = {}

    def post_noting_headers(ops, group):
        for kind, t, _, tag in ops:
            if kind == "recv" and tag % stride == 0:  # slot 0: a forward header from stage (tag // stride // M) % S
                headers[id(t)] = (t, (tag // stride // mbs) % stages + 1)
        return post(ops, group)

    def decode_from_capture(head):
        entry = headers.pop(id(head), None)
        if entry is None:
            return decode(head)
        stage = engine.stages[entry[1]]
        meta = getattr(stage, "input_meta", None) or getattr(stage, "module", None).input_meta
        return [(tuple(shape), dtype, dtype.is_floating_point) for _, shape, dtype in meta]

    _p2p.post, _p2p.decode_header = post_noting_headers, decode_from_capture
    engine._check_step_args = lambda *args: None  # (an instance attribute: the class method is untouched)
    try:
        yield
    finally:
        _p2p.post, _p2p.decode_header = post, decode
        del engine._check_step_args


def dry_run(make_model: Callable[[], nn.Module], spec: ParallelSpec, *, world_size: int, rank: int = 0,
            batch_size: int, seq_len: int, optimizer: type = torch.optim.AdamW) -> DryRunReport:
    """Build ``spec`` for rank ``rank`` of ``world_size`` in this process and check it (see the module docstring).

    ``make_model()`` returns the unmodified model on the meta device (it is called after the fake group exists).
    ``batch_size`` (global sequences) and ``seq_len`` shape the step. Initialises and then destroys a ``fake``
    process group, so it must run where no process group is initialised. Nothing is communicated.
    """
    from vescale.core.comm import count_comms
    from vescale.core.torch_internals import clear_sharding_caches, fake_store
    from vescale.plan.build import build

    if dist.is_initialized():
        raise RuntimeError("dry_run initialises its own fake process group; a process group is already initialised")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    if spec.world_size != world_size:
        raise ValueError(f"spec mesh {spec.mesh} has {spec.world_size} ranks, not --world-size {world_size}")
    report = DryRunReport(world_size, rank, spec)
    problems = spec.problems(batch_size=batch_size, seq_len=seq_len)
    if problems:
        report.failed["spec"] = "; ".join(problems)
        return report
    report.checks["spec"] = "ParallelSpec.problems(): none"
    # meta tensors have no backend of their own: the fake group serves them as it serves the CPU's
    dist.init_process_group("cpu:fake,meta:fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        with meta_scalars():
            _run(report, make_model, spec, batch_size, seq_len, optimizer, build, count_comms)
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding decisions keyed by meshes that compare equal across worlds: a later dry run (or
        # job) in this process would get this world's dead meshes back
        clear_sharding_caches()
    return report


def _run(report: DryRunReport, make_model, spec, batch_size, seq_len, optimizer, build, count_comms) -> None:
    t0 = time.perf_counter()
    model = make_model()
    report.seconds["model"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        with _alone_in_pipeline(model):
            out = build(model, spec, batch_size=batch_size, seq_len=seq_len, device=torch.device("meta"))
    except Exception as exc:  # noqa: BLE001 - reported: which part of build failed on this rank, and why
        report.failed["build"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
        return
    report.seconds["build"] = time.perf_counter() - t0
    roles = out.roles
    if roles.mesh is not None:
        names = roles.mesh.mesh_dim_names or ()
        report.coordinate = dict(zip(names, roles.mesh.get_coordinate() or ()))
    from torch.distributed.tensor import DTensor

    pp = spec.size("pp")
    held = [(n, p) for m in out.modules for n, p in m.named_parameters()]
    what = f"{len(out.modules)} pipeline stage(s)" if out.engine is not None else "the model"
    report.checks["build"] = (f"build ran for rank {report.rank}: {what}, {len(held)} parameter tensors"
                              + (f", {sum(isinstance(p, DTensor) for _, p in held)} of them DTensors"))
    if out.engine is not None:
        report.checks["schedule"] = (f"schedule {spec.schedule!r} built for {pp} pp ranks x "
                                     f"{spec.pipeline_microbatches} microbatches: stages {sorted(out.engine.stages)}"
                                     " on this rank")
    uneven = _uneven(held)
    if uneven:
        report.failed["shapes"] = f"{len(uneven)} uneven shard(s): " + "; ".join(uneven[:8])
    else:
        report.checks["shapes"] = "every sharded parameter dim divides by its mesh dim"
    report.bytes["parameters"] = _nbytes(p for _, p in held)
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    try:
        opt = out.make_optimizer(optimizer, lr=1e-4)
        rows = out.shard_batch(ids)
        with count_comms(roles.mesh) as comms, _pipeline_shapes(out.engine):
            out.forward_backward(rows, rows)
            opt.step()
    except Exception as exc:  # noqa: BLE001 - reported, as for build
        report.failed["step"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
        return
    report.seconds["step"] = time.perf_counter() - t0
    report.checks["step"] = (f"forward, backward and {type(opt).__name__}.step ran on this rank's "
                             f"{tuple(rows.shape)} token ids")
    report.collectives = comms.summary()
    report.bytes["gradients"] = _grad_bytes(out)
    report.bytes["optimizer"] = _optimizer_bytes(opt)
    if pp > 1:
        report.not_checked["pipeline boundaries"] = (
            "the shapes a stage receives are this rank's stages' own captured input shapes, not a header sent by "
            "the previous pp rank (not built here); the engine's cross-rank batch check is skipped (it compares "
            "values); floating inputs are taken to require grad")
    report.not_checked["values"] = ("host reads of tensors (token-id range check, routing counts) got "
                                    "stand-in zeros; the fake group moves no data")
