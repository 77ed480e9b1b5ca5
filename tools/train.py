"""Train a decoder-only LLM with nD parallelism (pipeline x data/ZeRO x tensor/sequence) on a named mesh.

    python tools/train.py                                  # 2 CPU ranks (dp=2), ~11M-param Llama-shaped GPT
    python tools/train.py --mesh pp=2,dp=2,tp=2 --schedule 1f1b --steps 200
    torchrun --nproc-per-node 8 tools/train.py --mesh dp=2,tp=4      # GPUs: the launcher's ranks, NCCL

Out of the box it spawns its own gloo ranks and trains on a corpus it generates (``data.py``): token sequences from a
fixed random sparse Markov chain, so the loss falls from ln(vocab) towards the chain's entropy. Every rank generates
the same global batch of a step from ``(seed, step)`` and takes its data-parallel slice, so the loss curve is the
single-device curve whatever the mesh, and a run resumed from a checkpoint continues it exactly.

The job, top to bottom: ``build_model`` (``models.py``; by default deferred: recorded on the meta device, each rank
materialising only what it holds, bitwise the 1-rank init), ``apply_pp`` or ``apply_tp``, ``apply_dp``,
``build_optimizer``, then the loop. It writes into ``--out`` (``report.py``): ``metrics.jsonl``, ``loss.png``,
``timeline.json`` (+ ``.png``), ``summary.json`` and checkpoints under ``ckpt/step_N`` every ``--ckpt-every`` steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vescale.core.comm import count_comms
from vescale.core.launch import init_distributed, spawn
from vescale.core.mesh import dim_size, init_mesh, mesh_coordinates, sub_mesh
from vescale.core.watchdog import watch_collectives

# The other vescale packages are imported where they are used: a spawned rank imports this file before it joins.
TOOLS = str(Path(__file__).resolve().parent)
if TOOLS not in sys.path:  # config, models, data and report live next to this file (tests load it by path)
    sys.path.insert(0, TOOLS)
import models  # noqa: E402
from config import TrainConfig, check_fits, parse_args  # noqa: E402
from data import MarkovCorpus  # noqa: E402
from report import RunLog, TimelineWindow, dump_grads, gather_per_rank, peak_memory_mb, state_bytes  # noqa: E402


def log(cfg: TrainConfig, message: str) -> None:
    """One line on rank 0's stdout, unless ``--quiet``."""
    if not cfg.quiet and dist.get_rank() == 0:
        print(f"train.py: {message}", flush=True)


def rank_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """This rank's device, where the model, the batches and every collective's tensors over ``group`` live: NCCL
    (GPU runs) takes CUDA tensors only, ``cuda:<current device>`` (set to the local rank by ``init_distributed`` /
    ``spawn``); any other backend (gloo) the CPU. The rule of ``init_mesh``'s device type and ``PipeEngine``."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_model(cfg: TrainConfig, device: torch.device) -> nn.Module:
    """Model ``cfg.model`` from ``cfg.seed``: recorded on meta (``deferred``), or built whole on ``device`` (``eager``).

    Deferred runs ``models.create`` under ``vescale.dtensor.deferred_init``: no parameter memory yet, random init from
    vescale's counter RNG, so whatever a rank later materialises (a shard, a stage, all of it) is bitwise the slice of
    the single-device model. Eager: torch's RNG, every rank the whole model (another init, the same on every mesh).
    """
    from vescale.dtensor import deferred_init
    from vescale.dtensor import random as vescale_random

    torch.manual_seed(cfg.seed)
    log(cfg, f"model {cfg.model}, {cfg.init} init")
    if cfg.init == "eager":
        return models.create(cfg.model).to(device)
    vescale_random.manual_seed(cfg.seed)
    return deferred_init(models.create, cfg.model)


def apply_tp(model: nn.Module, tp_mesh, cfg: TrainConfig) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` by its family's hand plan; a deferred model goes straight into its shards."""
    from vescale.parallel import parallelize_module

    log(cfg, f"tp={tp_mesh.size()}: {cfg.model} by its hand plan, sequence parallel {cfg.sequence_parallel}")
    return parallelize_module(model, tp_mesh, models.tp_plan(cfg.model, tp_mesh, cfg.sequence_parallel))


def apply_pp(model: nn.Module, mesh, cfg: TrainConfig, device: torch.device):
    """Split ``model`` into one stage per pp rank; build (tp-shard, compile) only this rank's; return the engine."""
    from vescale.plan import build_pipeline, language_model_loss

    pp, dp, tp, mb = dim_size(mesh, "pp"), dim_size(mesh, "dp"), dim_size(mesh, "tp"), microbatches(cfg, mesh)
    tp_mesh = sub_mesh(mesh, "tp") if tp > 1 else None
    log(cfg, f"pp={pp}: schedule {cfg.schedule}, {mb} microbatches" + (", stages tp-sharded" if tp > 1 else ""))
    return build_pipeline(
        model, sub_mesh(mesh, "pp"), schedule=cfg.schedule, num_microbatches=mb, loss_fn=language_model_loss,
        example_inputs=torch.zeros(cfg.batch_size // dp // mb, cfg.seq_len, dtype=torch.long, device=device),
        tp_mesh=tp_mesh, plan=models.tp_plan(cfg.model, tp_mesh, False) if tp_mesh is not None else None,
        dp_group=sub_mesh(mesh, "dp").get_group() if dp > 1 else None, device=device, compile=cfg.compile)


def apply_dp(model: nn.Module, mesh, cfg: TrainConfig):
    """``model`` in ``DistributedDataParallel`` over dp (ZeRO-2 shards its gradients), or ``None`` without dp/ZeRO."""
    from vescale.parallel import DistributedDataParallel

    if dim_size(mesh, "dp") == 1 and not cfg.zero:
        return None
    log(cfg, f"dp={dim_size(mesh, 'dp')}: DistributedDataParallel, ZeRO stage {cfg.zero}")
    return DistributedDataParallel(model, sub_mesh(mesh, "dp"), zero_stage=2 if cfg.zero == 2 else 0)


def build_optimizer(params: list[nn.Parameter], ddp, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW without weight decay; with ZeRO vescale's ``DistributedOptimizer`` over ``ddp``, which also clips."""
    from vescale.parallel import DistributedOptimizer

    if cfg.zero:
        return DistributedOptimizer(ddp, torch.optim.AdamW, zero_stage=cfg.zero, clip_grad=cfg.clip or None,
                                    lr=cfg.lr, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)


@dataclass
class Trainer:
    """What the loop needs, the same on every mesh."""

    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # this dp rank's batch -> detached loss
    parameters: list[nn.Parameter]  # this rank's, as gradient clipping sees them
    optimizer: torch.optim.Optimizer
    state: dict  # what a checkpoint holds: {"model": the model or this rank's pipeline stages, "optim": ...}
    num_params: int  # of the whole model
    init_s: float  # seconds this rank spent building its part of the model
    init_bytes: int  # bytes of parameters and buffers this rank built (eager: the whole model)
    # this rank's dp-reduced gradients by parameter FQN (``grads_by_fqn``); a collective over dp with ZeRO-2
    grads: Callable[[], dict[str, torch.Tensor]] | None = None


def build_trainer(cfg: TrainConfig, mesh) -> Trainer:
    """Build the model as this rank holds it on ``mesh``, its optimizer, and its forward-backward step."""
    from vescale.dtensor import is_deferred, materialize
    from vescale.parallel import checkpoint_activations, compile_parallel
    from vescale.pipe.timeline import span
    from vescale.plan import language_model_loss

    device = rank_device()
    t0 = time.perf_counter()
    model = build_model(cfg, device)
    num_params, whole_bytes = sum(p.numel() for p in model.parameters()), state_bytes([model])
    if dim_size(mesh, "pp") > 1:
        engine = apply_pp(model, mesh, cfg, device)
        held, init_s = list(engine.stages.values()), time.perf_counter() - t0
        if cfg.activation_checkpointing != "none":  # a captured stage has no block modules: one region per stage
            for stage in held:
                checkpoint_activations(stage, cfg.activation_checkpointing, whole=True)
        bytes_built = whole_bytes if cfg.init == "eager" else state_bytes(held)
        from vescale.parallel.clip_grad import mark_tied_copy

        for p in engine.tied_copies():  # a tied weight held by two stages counts once in the clip norm over pp
            mark_tied_copy(p)
        optimizer = build_optimizer(engine.parameters(), None, cfg)
        return Trainer(lambda x, y: engine.step(x, y).detach(), engine.parameters(), optimizer,
                       {"model": held, "optim": optimizer}, num_params, init_s, bytes_built,
                       grads=lambda: grads_by_fqn(held))
    if dim_size(mesh, "tp") > 1:
        model = apply_tp(model, sub_mesh(mesh, "tp"), cfg)
    elif is_deferred(model):  # dp replicas each compute 1/dp of the init, then all-gather it
        dp = dim_size(mesh, "dp")
        materialize(model, device=device, replicate_over=sub_mesh(mesh, "dp") if dp > 1 else None)
    init_s, bytes_built = time.perf_counter() - t0, whole_bytes if cfg.init == "eager" else state_bytes([model])
    if cfg.activation_checkpointing != "none":  # before compile and DDP (see checkpoint_activations)
        checkpoint_activations(model, cfg.activation_checkpointing)
    if cfg.compile:
        compile_parallel(model)
    ddp = apply_dp(model, mesh, cfg)
    module = ddp if ddp is not None else model

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # --grad-accum N: N micro-steps over equal slices of this rank's rows, each loss / N, so the summed gradient
        # is that of the mean loss over all rows; DDP reduces over dp only in the last micro-step's backward.
        n, total = cfg.grad_accum, None
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            last = i == n - 1
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                with span("forward", cat="forward"):
                    loss = language_model_loss(module(x), y) / n
                with span("backward", cat="backward"):
                    loss.backward()
                    if ddp is not None and last:
                        ddp.finish_grad_sync()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    params = list(model.parameters())
    optimizer = build_optimizer(params, ddp, cfg)
    return Trainer(forward_backward, params, optimizer, {"model": model, "optim": optimizer}, num_params, init_s,
                   bytes_built, grads=lambda: grads_by_fqn([model], ddp))


def grads_by_fqn(modules: list[nn.Module], ddp=None) -> dict[str, torch.Tensor]:
    """This rank's gradients by parameter FQN of the unwrapped model (every name of a tied parameter), as the
    optimizer will see them: dp-averaged, laid out as the parameters are (DTensors over tp, or plain). Parameters
    without a gradient are left out. With ``ddp`` they come from its buffers (``reduced_grads``; with ZeRO-2 an
    all-gather over dp, so every dp rank must call it), else from ``.grad`` (a pipeline engine has reduced them)."""
    reduced = None
    if ddp is not None:
        by_fqn = ddp.reduced_grads()
        reduced = {id(slot.param): by_fqn[slot.fqn] for slot in ddp.slots.values()}
    out = {}
    for module in modules:
        for name, p in module.named_parameters(remove_duplicate=False):
            grad = p.grad if reduced is None else reduced.get(id(p))
            if grad is not None:
                out[name] = grad
    return out


def microbatches(cfg: TrainConfig, mesh) -> int:
    """Microbatches a pipeline step is cut into: ``--microbatches``, by default two per pp rank."""
    return cfg.microbatches or 2 * dim_size(mesh, "pp")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_watched(cfg: TrainConfig) -> dict:
    """``train`` under the collective watchdog (``vescale.core.watchdog``): a collective that waits longer than
    ``--collective-timeout`` raises ``CollectiveTimeoutError`` on every waiting rank (naming the missing rank, the
    collective, its mesh dim and call site), after each writes its last collectives to
    ``<out>/collectives-rank<r>.json`` (with torch's flight recorder where it recorded). With ``--compile`` no ring is
    kept (torch.compile runs eager under a dispatch mode); the timeout and the flight recorder still apply."""
    from vescale.core.errors import CollectiveTimeoutError

    watch = watch_collectives(timeout=cfg.collective_timeout, ring_size=max(cfg.collective_ring, 1),
                              record=cfg.collective_ring > 0 and not cfg.compile)
    try:
        with watch:
            return train(cfg, watch)
    except CollectiveTimeoutError as exc:
        watch.dump(Path(cfg.out) / f"collectives-rank{dist.get_rank()}.json", exc)
        raise


def train(cfg: TrainConfig, watch=None) -> dict:
    """Run the job on this rank (the default process group is initialised); rank 0 returns the summary. ``watch``
    (a ``watch_collectives``) learns the mesh's dims."""
    from vescale import checkpoint
    from vescale.parallel import clip_grad_norm_

    rank, mesh, out = dist.get_rank(), init_mesh(cfg.dims), Path(cfg.out)
    if watch is not None:
        watch.add_mesh(mesh)
    check_fits(cfg, models.model_spec(cfg.model), *(dim_size(mesh, n) for n in ("pp", "dp", "tp")))
    device, dp, pp = rank_device(), dim_size(mesh, "dp"), dim_size(mesh, "pp")
    dp_rank = sub_mesh(mesh, "dp").get_local_rank() if dp > 1 else 0
    trainer = build_trainer(cfg, mesh)
    corpus = MarkovCorpus(models.model_spec(cfg.model).vocab_size, cfg.seed)
    start = 0
    if cfg.resume:
        progress = {"step": 0}
        checkpoint.load(cfg.resume, {**trainer.state, "progress": progress})
        start = int(progress["step"])
    run_log = RunLog(out, cfg.steps, start, active=rank == 0, append=bool(cfg.resume), quiet=cfg.quiet)
    window = TimelineWindow(mesh, start, cfg.steps, cfg.trace_steps, out / "timeline.json")
    tokens_per_step, pending_save, t_start = cfg.batch_size * cfg.seq_len, None, time.perf_counter()
    comm_step, comms = min(start + 1, cfg.steps - 1), None  # collectives counted on one warm step
    for step in range(start, cfg.steps):
        window.before(step)
        t0 = time.perf_counter()
        tokens = corpus.batch(step, cfg.batch_size, cfg.seq_len).chunk(dp)[dp_rank].to(device)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        trainer.optimizer.zero_grad(set_to_none=True)
        with count_comms(mesh) if step == comm_step else contextlib.nullcontext() as counter:
            loss = trainer.forward_backward(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            if cfg.grad_dump and step == start:  # before clipping and the update: the raw gradient of the batch
                at = mesh_coordinates(mesh)  # one copy of each gradient: the dp and tp replicas' first
                dump_grads(trainer.grads(), cfg.grad_dump, keep=at.get("dp", 0) == at.get("tp", 0) == 0)
            if cfg.clip and not cfg.zero:  # (ZeRO's optimizer clips its shards itself)
                clip_grad_norm_(trainer.parameters, cfg.clip,
                                pp_group=sub_mesh(mesh, "pp").get_group() if pp > 1 else None)
            trainer.optimizer.step()
        if step == comm_step:
            comms = counter.summary()
        if dp > 1:  # the logged loss is the global-batch mean, as one device computes it
            loss = loss.clone()
            dist.all_reduce(loss, group=sub_mesh(mesh, "dp").get_group())
            loss /= dp
        dt = time.perf_counter() - t0
        window.after(step)
        run_log.step(step, {"step": step + 1, "loss": float(loss), "lr": lr_at(step, cfg), "step_s": dt,
                            "tokens_per_s": tokens_per_step / dt})
        if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
            if pending_save is not None:
                pending_save.wait()
            pending_save = checkpoint.save(out / "ckpt" / f"step_{step + 1}",
                                           {**trainer.state, "progress": {"step": step + 1}}, async_save=True)
    if pending_save is not None:
        pending_save.wait()
    wall = time.perf_counter() - t_start
    # one gather: peak memory MB, init seconds, init bytes of every rank
    per_rank = gather_per_rank([peak_memory_mb(), trainer.init_s, trainer.init_bytes], device)
    if rank != 0:
        return {}
    losses = [r["loss"] for r in run_log.records]
    return run_log.finish({
        "mesh": cfg.dims, "model": cfg.model, "parameters": trainer.num_params, "steps": cfg.steps,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "corpus_entropy": corpus.entropy(), "tokens_per_s": tokens_per_step * max(1, cfg.steps - start) / wall,
        "wall_s": wall, "peak_memory_mb_per_rank": [round(float(p), 1) for p in per_rank[:, 0]], "init": cfg.init,
        "init_s_per_rank": [round(float(t), 3) for t in per_rank[:, 1]],
        "init_mb_per_rank": [round(float(b) / 2**20, 2) for b in per_rank[:, 2]],
        "communication_share_traced_steps": window.comm_share, "collectives_one_step": comms,
        "grad_accum": cfg.grad_accum,
    }, corpus.entropy())


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv, description=__doc__.splitlines()[0])
    world = math.prod(cfg.dims.values())
    # Checked here, before any rank starts, so a bad mesh is one clear message rather than one per rank.
    check_fits(cfg, models.model_spec(cfg.model), *(cfg.dims.get(n, 1) for n in ("pp", "dp", "tp")))
    # torch's flight recorder (gloo and NCCL): each rank's last collectives, in collectives-rank<r>.json on a hang;
    # NCCL also dumps it to <out>/flight-recorder-rank<r> when its watchdog times a collective out.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(cfg.out).resolve() / "flight-recorder-rank"))
    if "WORLD_SIZE" in os.environ:  # under torchrun: join its ranks
        init_distributed(collective_timeout=cfg.collective_timeout)
        try:  # leave the group even when the job fails (NCCL otherwise warns of a leaked communicator, or hangs)
            if dist.get_world_size() != world:
                raise SystemExit(f"train.py: --mesh {cfg.mesh} needs {world} ranks but torchrun started "
                                 f"{dist.get_world_size()}")
            summary = train_watched(cfg)
        finally:
            dist.destroy_process_group()
    else:
        summary = spawn(train_watched, world, cfg, collective_timeout=cfg.collective_timeout)
    if summary and not cfg.quiet:
        print(json.dumps({k: v for k, v in summary.items() if k != "peak_memory_mb_per_rank"}, default=str))
        print(f"peak memory per rank (MB): {summary['peak_memory_mb_per_rank']}; outputs in {cfg.out}/")
    return summary


if __name__ == "__main__":
    main()
