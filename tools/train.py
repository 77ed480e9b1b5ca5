"""Train a decoder-only LLM with nD parallelism (pipeline x data/ZeRO x context x expert x tensor) on a named mesh.

    python tools/train.py                                  # 2 CPU ranks (dp=2), ~11M-param Llama-shaped GPT
    python tools/train.py --mesh pp=2,dp=2,tp=2 --schedule 1f1b --steps 200
    python tools/train.py --spec spec.json                 # the parallelism a vescale.plan spec describes
    torchrun --nproc-per-node 8 tools/train.py --mesh dp=2,tp=4      # GPUs: the launcher's ranks, NCCL

Out of the box it spawns its own gloo ranks and trains on real text every machine has: this interpreter's standard
library source, tokenized once by a byte-level BPE trained on it (``prepare_data.py``, cached); ``--data PATH`` takes
your own text, ``--data markov`` the synthetic corpus (``data.py``), ``--data FILE.jsonl --chat`` conversations whose
assistant tokens alone train (``chat_data.py``), ``--data a:0.7,b:0.3`` a seeded mix. Every rank computes the same
global batch of a step from ``(data, seed, step)`` and takes its slice, so the loss curve (one device's token mean) is
the single-device curve whatever the mesh, and a run resumed from a checkpoint (which records the data position)
continues it exactly.

The job, top to bottom: the flags become a ``vescale.plan.ParallelSpec`` (``config.py``; checked before any rank
starts), ``build_model`` records the model (``models.py``; by default on the meta device, each rank later
materialising only what it holds), ``vescale.plan.build`` applies every parallelism in its one order and returns the
training interface (forward-backward, optimizer, checkpointable state), then the loop. It writes into ``--out``
(``report.py``): ``metrics.jsonl``, ``loss.png``, ``timeline.json`` (+ ``.png``), ``summary.json`` and checkpoints
under ``ckpt/step_N`` every ``--ckpt-every`` steps; ``--eval-every`` / ``--sample-every`` add the held-out loss and
generations (``evaluate.py``, ``sample.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vescale.core.comm import count_comms
from vescale.core.launch import init_distributed, rank_device, spawn
from vescale.core.mesh import mesh_coordinates
from vescale.core.preemption import forward_signals
from vescale.core.watchdog import watch_collectives
from vescale.plan.documents import documents_from_eos

# The other vescale packages are imported where they are used: a spawned rank imports this file before it joins.
TOOLS = str(Path(__file__).resolve().parent)
if TOOLS not in sys.path:  # config, models, data and report live next to this file (tests load it by path)
    sys.path.insert(0, TOOLS)
import lora  # noqa: E402
import models  # noqa: E402
from config import TrainConfig, check_fits, lr_at, parallel_spec, parse_args, prepare_out  # noqa: E402
from data import DataError, open_data, resume_offset, step_rows  # noqa: E402
from evaluate import TextMonitor  # noqa: E402
from report import RunLog, TimelineWindow, dump_grads, run_summary, state_bytes  # noqa: E402
from resilience import Resilience, auto_resume, load_resume  # noqa: E402


def log(cfg: TrainConfig, message: str) -> None:
    """One line on rank 0's stdout, unless ``--quiet``."""
    if not cfg.quiet and dist.get_rank() == 0:
        print(f"train.py: {message}", flush=True)


def build_model(cfg: TrainConfig, device: torch.device) -> nn.Module:
    """Model ``cfg.model`` from ``cfg.seed``: recorded on meta (``deferred``: vescale's counter RNG, so whatever a
    rank materialises is bitwise the slice of the single-device model), or built whole on ``device`` (``eager``:
    torch's RNG, every rank the whole model)."""
    from vescale.dtensor import deferred_init
    from vescale.dtensor import random as vescale_random

    create = lora.creator(cfg.lora)  # models.create; with --lora its PEFT model (the adapters recorded too)
    torch.manual_seed(cfg.seed)
    if cfg.init == "eager":
        return create(cfg.model).to(device)
    vescale_random.manual_seed(cfg.seed)
    return deferred_init(create, cfg.model)


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (``ndim >= 2``: linear weights, embeddings, the head) decay by ``weight_decay``;
    vectors (norm scales, biases) do not: their zero is no prior (a scale at 0 switches its activation off), as in
    GPT-2, Megatron-LM and the transformers Trainer."""
    groups = ({"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


@dataclass
class Trainer:
    """The built job on this rank: ``par`` (``vescale.plan.Parallelized``), its optimizer, what a checkpoint holds,
    and the figures of the build."""

    par: object
    optimizer: torch.optim.Optimizer
    state: dict
    num_params: int
    init_s: float
    init_bytes: int
    flops_per_token: int


def build_trainer(cfg: TrainConfig) -> Trainer:
    """Build the model as this rank holds it on ``cfg``'s mesh (``vescale.plan.build``) and its optimizer. (``main``
    ran ``check_fits`` before any rank started; ``build``'s own spec check is the rank-side refusal.)"""
    from vescale.plan import build

    spec, t0 = parallel_spec(cfg), time.perf_counter()
    model = build_model(cfg, rank_device())
    num_params, whole_bytes = sum(p.numel() for p in model.parameters()), state_bytes([model])
    flops = models.flops_per_token(models.matmul_params(model), models.model_spec(cfg.model), cfg.seq_len)
    load = None
    if models.is_hf_dir(cfg.model):  # each rank fills what it holds from the directory's safetensors
        tied = models.tied_names(model)
        load = lambda held, stages: lora.load_pretrained(cfg.model, held, stages=stages, tied=tied)  # noqa: E731
    log(cfg, f"model {cfg.model} ({num_params / 1e6:.1f}M parameters, {cfg.init} init), mesh {cfg.mesh}: "
        f"ZeRO {spec.zero}, {spec.dtype}, tp plan {spec.tp_plan if isinstance(spec.tp_plan, str) else 'dict'}"
        + (f", schedule {spec.schedule} x {spec.pipeline_microbatches} microbatches" if spec.size("pp") > 1 else ""))
    par = build(model, spec, batch_size=cfg.batch_size, seq_len=cfg.seq_len, load_weights=load)
    kw: dict = {"lr": cfg.lr, "clip_grad": cfg.clip or None,
                "param_groups": lambda ps: decay_groups(ps, cfg.weight_decay),
                "skip_nonfinite": True, "max_bad_steps": cfg.max_bad_steps}  # par.step_guard: bad steps skipped
    if cfg.optimizer == "muon":  # hidden matrices: Muon scaled to AdamW's update RMS (Moonlight), the rest AdamW
        kw.update(weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw",
                  rest=(torch.optim.AdamW, {"lr": cfg.lr}))
    optimizer = par.make_optimizer(torch.optim.Muon if cfg.optimizer == "muon" else torch.optim.AdamW, **kw)
    init_bytes = whole_bytes if cfg.init == "eager" else state_bytes(par.modules)
    return Trainer(par, optimizer, par.state(optimizer), num_params, time.perf_counter() - t0, init_bytes, flops)


def train_watched(cfg: TrainConfig) -> dict:
    """``train`` under the collective watchdog (``vescale.core.watchdog``): a collective that waits longer than
    ``--collective-timeout`` raises ``CollectiveTimeoutError`` on every waiting rank (naming the missing rank, the
    collective, its mesh dim and call site), after each writes its last collectives to
    ``<out>/collectives-rank<r>.json``. With ``--compile`` no ring is kept (torch.compile runs eager under a dispatch
    mode); the timeout and torch's flight recorder still apply."""
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
    """Run the job on this rank (the default process group is initialised); rank 0 returns the summary."""
    rank, out = dist.get_rank(), Path(cfg.out)
    corpus = open_data(cfg, models.model_spec(cfg.model).vocab_size)  # prepared by main: a cache hit here
    trainer = build_trainer(cfg)
    startup = {"built_at": time.time()}  # wall-clock marks of a (re)start, for tools/bench/recovery.py
    par, optimizer = trainer.par, trainer.optimizer
    mesh, roles = par.mesh, par.roles
    if watch is not None and mesh is not None:
        watch.add_mesh(mesh)
    device = rank_device()
    start, offset = 0, 0  # offset: data position (sequences) minus step x batch size, from a resumed checkpoint
    if cfg.resume:
        cfg.resume, progress = load_resume(cfg, trainer.state,  # said even with --quiet, as auto_resume's lines
                                           say=lambda m: print(f"train.py: {m}", flush=True) if rank == 0 else None)
        startup["loaded_at"] = time.time()
        start = int(progress["step"])
        offset, note = resume_offset(progress, corpus, cfg.batch_size)
        if note:
            log(cfg, note)
    monitor = TextMonitor(cfg, corpus, par.held, dp_rank=roles.dp.rank, dp=roles.dp.size,
                          dp_group=roles.dp.group, log=lambda m: log(cfg, m), device=device, ep_rank=roles.ep.rank,
                          ep=roles.ep.size, ep_group=roles.ep.group)
    run_log = RunLog(out, cfg.steps, start, active=rank == 0, append=bool(cfg.resume), quiet=cfg.quiet,
                     tensorboard=cfg.tensorboard)
    res = Resilience(cfg, par, optimizer, trainer.state, out=out, progress=lambda n: {  # saves, bad steps, signals
        "step": n, "data": corpus.fingerprint, "sequences": offset + n * cfg.batch_size},
        log=lambda m: log(cfg, m), rank=rank)
    if cfg.resume:
        res.resumed(progress)  # the bad steps of the run so far
    window = TimelineWindow(mesh, start, cfg.steps, cfg.trace_steps, out / "timeline.json")
    tokens_per_step, t_start = cfg.batch_size * cfg.seq_len, time.perf_counter()
    # collectives counted on one warm step; not under --compile: the counter is a dispatch mode, under which dynamo
    # retraces the compiled blocks and fails (tp: factory capture, dp: "non-infra torch dispatch mode present")
    comm_step, comms = (-1 if cfg.compile else min(start + 1, cfg.steps - 1)), None
    try:  # the signal handlers and patches go back even when the loop raises (a pooled rank lives on)
        for step in range(start, cfg.steps):
            window.before(step)
            res.begin_step(step)
            inputs, targets, trained = step_rows(corpus.batch(step, cfg.batch_size, cfg.seq_len, offset))
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            optimizer.zero_grad(set_to_none=True)
            with count_comms(mesh) if step == comm_step and mesh is not None else contextlib.nullcontext() as counter:
                docs = documents_from_eos(inputs, corpus.eos_id) if par.spec.document_mask else None  # packed text
                loss = par.forward_backward(par.shard_batch(inputs).to(device), par.shard_batch(targets).to(device),
                                            num_tokens=trained,  # one device's mean over the trained tokens
                                            documents=None if docs is None else par.shard_batch(docs).to(device))
                if cfg.grad_dump and step == start:  # before clipping and the update: the raw gradient of the batch
                    at = mesh_coordinates(mesh) if mesh is not None else {}  # one copy of each: the replicas' first
                    dump_grads(par.grads(), cfg.grad_dump, keep=all(at.get(d, 0) == 0 for d in ("dp", "cp", "tp")))
                res.step(step)  # skipped on every rank when some rank's loss or gradient is not finite
            if counter is not None:
                comms = counter.summary()
            loss = par.global_loss(loss)  # the global batch's mean, as one device computes it
            dt = res.end_step()
            window.after(step)
            run_log.step(step, {"step": step + 1, "loss": float(loss), "lr": lr_at(step, cfg), "step_s": dt,
                                "tokens_per_s": tokens_per_step / dt, **res.metrics(), **monitor.after_step(step)})
            if step == start:
                startup["first_step_at"] = time.time()
            if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
                res.save(step + 1)
            if res.should_stop(step):  # a preemption signal reached some rank: every rank stops here, checkpointed
                log(cfg, f"preempted ({res.preempt.received or 'another rank'}): stopped after step {step + 1}, "
                    f"checkpoint {out / 'ckpt' / f'step_{step + 1}'}")
                break
    finally:
        res.release()
    res.close()
    wall = time.perf_counter() - t_start
    if not cfg.quiet and cfg.steps > start and roles.cp.size == 1:  # what the model learned, in text (real data)
        monitor.sample(cfg.steps - 1)
    if cfg.export_hf:
        lora.export(cfg, par.held, out, log=lambda m: log(cfg, m))
    return run_summary(cfg, trainer, corpus, run_log, res, wall=wall, comms=comms, startup=startup, device=device,
                       log=lambda m: log(cfg, m))


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv, description=__doc__.splitlines()[0])
    spec = check_fits(cfg)  # before any rank starts: a bad mesh or flag is one clear message, not one per rank
    if cfg.resume == "auto":  # the newest intact checkpoint under --out, or a fresh start there
        auto_resume(cfg, say=lambda m: print(f"train.py: {m}", flush=True) if os.environ.get("RANK", "0") == "0"
                    else None)
    prepare_out(cfg, under_launcher="WORLD_SIZE" in os.environ)  # never into another run's outputs
    try:  # tokenized once, here, before the ranks start (each rank then opens the cached token file)
        open_data(cfg, models.model_spec(cfg.model).vocab_size)
    except DataError as exc:
        raise SystemExit(f"train.py: {exc}") from None
    # torch's flight recorder (gloo and NCCL): each rank's last collectives, in collectives-rank<r>.json on a hang;
    # NCCL also dumps it to <out>/flight-recorder-rank<r> when its watchdog times a collective out.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(cfg.out).resolve() / "flight-recorder-rank"))
    if "WORLD_SIZE" in os.environ:  # under torchrun: join its ranks
        init_distributed(collective_timeout=cfg.collective_timeout)
        try:  # leave the group even when the job fails (NCCL otherwise warns of a leaked communicator, or hangs)
            if dist.get_world_size() != spec.world_size:
                raise SystemExit(f"train.py: --mesh {cfg.mesh} needs {spec.world_size} ranks but torchrun started "
                                 f"{dist.get_world_size()}")
            summary = train_watched(cfg)
        finally:
            dist.destroy_process_group()
    else:
        with forward_signals(["SIGTERM"] + ([cfg.preempt_signal] if cfg.preempt_signal else [])):  # to the ranks
            summary = spawn(train_watched, spec.world_size, cfg, collective_timeout=cfg.collective_timeout)
    if summary and not cfg.quiet:
        print(json.dumps({k: v for k, v in summary.items() if k != "peak_memory_mb_per_rank"}, default=str))
        print(f"peak memory per rank (MB): {summary['peak_memory_mb_per_rank']}; outputs in {cfg.out}/")
    return summary


if __name__ == "__main__":
    main()
