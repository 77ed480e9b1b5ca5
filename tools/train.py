"""Train a decoder-only LLM with nD parallelism (pipeline x data/ZeRO x tensor/sequence) on a named mesh.

    python tools/train.py                                  # 2 CPU ranks (dp=2), ~11M-param Llama-shaped GPT
    python tools/train.py --mesh pp=2,dp=2,tp=2 --schedule 1f1b --steps 200
    torchrun --nproc-per-node 8 tools/train.py --mesh dp=2,tp=4      # GPUs: the launcher's ranks, NCCL

Out of the box it spawns its own gloo ranks and trains on real text every machine has: this interpreter's standard
library source, tokenized once by a byte-level BPE trained on it (``prepare_data.py``, cached); ``--data PATH`` takes
your own text, ``--data markov`` the synthetic corpus of the equivalence tests (``data.py``). Every rank computes the
same global batch of a step from ``(data, seed, step)`` and takes its data-parallel slice, so the loss curve is the
single-device curve whatever the mesh, and a run resumed from a checkpoint (which records the data position)
continues it exactly. ``--eval-every`` adds the held-out loss (``evaluate.py``), ``--sample-every`` generations
(``sample.py``; also printed at the end of a run on real text).

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
from config import DTYPES, HSDP_DIMS, TrainConfig, check_fits, dp_dims, parse_args  # noqa: E402
from data import DataError, open_data, resume_offset  # noqa: E402
from evaluate import TextMonitor  # noqa: E402
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


def cast_model(model: nn.Module, cfg: TrainConfig) -> None:
    """``--dtype bf16`` with ZeRO 0-2 (and ZeRO 3 with pp, whose stages are captured in bf16 and widened to fp32
    masters by ``apply_zero3_stages``): ``model``'s floating-point parameters and buffers to bf16, in place, before
    anything splits, shards or wraps it; DDP's fp32 buffer and ``DistributedOptimizer``'s fp32 masters keep the
    gradient reduction and the update in fp32. A deferred model records the cast
    (``vescale.dtensor.record_deferred``): each rank casts only what it materialises, bitwise the one-device fp32
    init cast to bf16; a pipeline split is captured in bf16, as its stages run; and no tp DTensor parameter is
    swapped by a ``module.to()`` after ``parallelize_module``. Pretrained weights are cast as they load."""
    from vescale.dtensor import is_deferred, record_deferred

    dtype = getattr(torch, DTYPES[cfg.dtype])
    with record_deferred(model) if is_deferred(model) else contextlib.nullcontext():
        model.to(dtype)


def apply_tp(model: nn.Module, tp_mesh, cfg: TrainConfig) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` by its family's hand plan; a deferred model goes straight into its shards."""
    from vescale.parallel import parallelize_module

    log(cfg, f"tp={tp_mesh.size()}: {cfg.model} by its hand plan, sequence parallel {cfg.sequence_parallel}")
    return parallelize_module(model, tp_mesh, models.tp_plan(cfg.model, tp_mesh, cfg.sequence_parallel, model))


def ep_trainer(cfg: TrainConfig, mesh, model: nn.Module, num_params: int, whole_bytes: int, flops: int,
               t0: float) -> Trainer:
    """``--mesh [dp=D,]ep=E[,tp=T]``: the experts over ep (``vescale.parallel.parallelize_experts`` on the ep[,tp]
    sub-mesh), attention and each expert's FFN by the family's tp plan when tp > 1. Each ep rank runs 1/ep of the
    rows it is given; the step's loss is the mean over all of them and so are the gradients (each rank backpropagates
    its share, loss / ep). With dp (or ZeRO 1/2, which add dp=1): ``DistributedDataParallel(data_dims=("ep",))``
    reduces the dense parameters' gradients over dp x ep and the experts' over dp, bucketed; ZeRO shards each over
    those ranks. ``--grad-accum`` and ``--activation-checkpointing`` as on any mesh (a checkpointed block re-runs its
    token dispatch in backward). ``--dtype bf16``: bf16 model and compute, DDP's fp32 gradient buffers and fp32
    masters, as on any mesh. The dispatch combines a token's choices as the model's experts do (fp32 sum, one
    rounding), so on CPU ranks the forward and the top-k routing are one device's and the gradients differ only by
    the order of their fp32 accumulation (matrix cell dp2 x ep2 bf16). bf16 routing is sensitive to the last bit:
    a token whose k-th and (k+1)-th experts nearly tie switches expert on any other rounding of its hidden state,
    moving that layer's gradients by several percent (9 % when the combine rounded each choice to bf16 first; see
    the experts section of ``packages/vescale-parallel/README.md``). pp x ep: ``ep_pipeline``."""
    from vescale.parallel import DistributedDataParallel, checkpoint_activations, parallelize_experts
    from vescale.pipe.timeline import span
    from vescale.plan import language_model_loss

    ep, tp = dim_size(mesh, "ep"), dim_size(mesh, "tp")
    has_dp = "dp" in (mesh.mesh_dim_names or ())
    log(cfg, f"ep={ep}: {cfg.model}'s experts over ep" + (f", tp={tp} by its hand plan" if tp > 1 else "")
        + (f", dp={dim_size(mesh, 'dp')}: DistributedDataParallel over dp x ep, ZeRO stage {cfg.zero}"
           if has_dp else ""))
    # the model's DTensor mesh: ep[, tp] (dp is DDP's, outside the model)
    inner = sub_mesh(mesh, *(n for n in mesh.mesh_dim_names if n != "dp")) if has_dp else mesh
    plan = models.tp_plan(cfg.model, inner, cfg.sequence_parallel, model) if tp > 1 else None
    model = parallelize_experts(model, inner, plan)
    if models.is_hf_dir(cfg.model):
        models.load_pretrained(cfg.model, [model])
    init_s = time.perf_counter() - t0
    ep_mesh = sub_mesh(mesh, "ep")
    rank = ep_mesh.get_local_rank()
    if cfg.activation_checkpointing != "none":  # each block's forward (its token dispatch too) re-run in backward
        checkpoint_activations(model, cfg.activation_checkpointing)
    ddp = (DistributedDataParallel(model, mesh, zero_stage=2 if cfg.zero == 2 else 0, data_dims=("ep",),
                                   grad_dtype=getattr(torch, DTYPES[cfg.reduce_dtype])) if has_dp else None)
    module = ddp if ddp is not None else model

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # --grad-accum N: N micro-steps over equal slices of this ep rank's rows, each loss / (ep N); DDP reduces
        # only in the last micro-step's backward
        n, total = cfg.grad_accum, None
        rows = zip(inputs.chunk(ep)[rank].chunk(n), targets.chunk(ep)[rank].chunk(n))
        for i, (x, y) in enumerate(rows):
            last = i == n - 1
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                with span("forward", cat="forward"):
                    loss = language_model_loss(module(input_ids=x), y) / n
                with span("backward", cat="backward"):
                    (loss / ep).backward()
                    if ddp is not None and last:
                        ddp.finish_grad_sync()
            total = loss.detach() if total is None else total + loss.detach()
        total = total.clone()
        dist.all_reduce(total, group=ep_mesh.get_group())
        return total / ep

    params = list(model.parameters())
    optimizer = build_optimizer(params, ddp, cfg)
    return Trainer(forward_backward, params, optimizer, {"model": model, "optim": optimizer}, num_params, init_s,
                   whole_bytes if cfg.init == "eager" else state_bytes([model]),
                   grads=lambda: grads_by_fqn([model], ddp), flops_per_token=flops)


def ep_pipeline(cfg: TrainConfig, mesh, model: nn.Module, num_params: int, whole_bytes: int, flops: int,
                t0: float, device: torch.device) -> Trainer:
    """``--mesh pp=P,[dp=D,]ep=E``: pipeline stages whose MoE blocks dispatch tokens over ep. Before the split each
    experts module's dispatch becomes one operator (``vescale.parallel.experts_as_operator``), which the captured
    stage graphs keep whole; each stage then keeps this ep rank's experts (``keep_local_experts``: plain
    ``[E / ep, ...]`` parameters; the stage is materialised whole first, then sliced). Each (dp, ep) rank pipelines
    its own rows and backpropagates its share of the step's loss (its rows' mean / ep). Each stage is then in its
    own ``DistributedDataParallel`` over dp with ``data_dims=("ep",)`` and the local experts named in
    ``local_shards``: one bucketed reduction per group, started in the last microbatch's backward as for pp x dp
    (``apply_dp_stages``): the dense gradients summed over ep and averaged over dp (dp x ep flattened), the experts'
    (already summed over ep by the all-to-all) averaged over dp. ZeRO 1/2 shard each group over its own ranks
    (``DistributedOptimizer``); ``--dtype bf16``: bf16 stages, fp32 buffers and masters, as for pp x dp.
    ``--activation-checkpointing``: each stage one region before its DDP, as for pp x dp; the recompute runs every
    dispatch of the stage again, all-to-alls included, in the same order on every ep rank of the stage (they run the
    same schedule), so a dispatch runs three times per microbatch (forward, recompute, the operator's backward)."""
    from vescale.parallel import checkpoint_activations
    from vescale.parallel.clip_grad import mark_tied_copy
    from vescale.parallel.expert_state import local_experts_state
    from vescale.parallel.experts import experts_as_operator, keep_local_experts
    from vescale.plan import language_model_loss

    ep_mesh = sub_mesh(mesh, "ep")
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    log(cfg, f"ep={ep}: every MoE block of the pipeline stages dispatches its tokens over ep; each stage in "
        f"DistributedDataParallel over dp={dim_size(mesh, 'dp')} x ep (experts over dp), ZeRO stage {cfg.zero}, "
        f"{cfg.dtype}")
    experts = experts_as_operator(model, mesh)
    # each ep rank's loss is its share of the step's (the mean over its rows / ep): DDP sums the dense gradients over
    # ep, and an expert's gradient, summed over ep by the dispatch's all-to-all, is then one device's
    engine = apply_pp(model, mesh, cfg, device, loss_fn=lambda out, target: language_model_loss(out, target) / ep)
    held = list(engine.stages.values())
    if models.is_hf_dir(cfg.model):
        models.load_pretrained(cfg.model, held, stages=True, tied=models.tied_names(model))
    if cfg.activation_checkpointing != "none":  # as pp x dp: one region per captured stage, before its DDP
        for stage in held:
            checkpoint_activations(stage, cfg.activation_checkpointing, whole=True)
    ddps: list = []

    def local_experts(index: int, stage: nn.Module, late: list) -> nn.Module:
        replaced = keep_local_experts(stage, experts, mesh)  # in place; the engine collects the new parameters
        ddps.append(ddp_of_stage(stage, mesh, cfg, late, data_dims=("ep",),
                                 local_shards={fqn: ("ep",) for fqn in replaced}))
        return ddps[-1]

    engine.wrap_stages(local_experts)
    held = [ddp.module for ddp in ddps]
    stage_ddp = ddps[0]  # apply_pp builds one stage per pp rank
    init_s = time.perf_counter() - t0
    expert_fqns = {fqn for info in experts for fqn in info.params}
    for p in engine.tied_copies():  # (before DistributedOptimizer, which marks its shards of them)
        mark_tied_copy(p)
    pp_group = sub_mesh(mesh, "pp").get_group()

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine.step(inputs.chunk(ep)[rank], targets.chunk(ep)[rank]).detach().clone()
        dist.all_reduce(loss, group=ep_mesh.get_group())  # the ranks' shares: the mean over this dp rank's rows
        return loss

    def whole_grads() -> dict[str, torch.Tensor]:  # experts gathered over ep (the --grad-dump of one device)
        out = grads_by_fqn(held, stage_ddp)
        for name in sorted(set(out) & expert_fqns):
            parts = [torch.empty_like(out[name]) for _ in range(ep)]
            dist.all_gather(parts, out[name].contiguous(), group=ep_mesh.get_group())
            out[name] = torch.cat(parts)
        return out

    optimizer = build_optimizer(engine.parameters(), stage_ddp, cfg, pp_group=pp_group)
    return Trainer(forward_backward, engine.parameters(), optimizer, {"model": held, "optim": optimizer},
                   num_params, init_s, whole_bytes if cfg.init == "eager" else state_bytes(held), grads=whole_grads,
                   flops_per_token=flops,
                   # checkpoints see each rank's experts as its rows of the global [E, ...] tensors (any mesh loads)
                   ckpt_state=local_experts_state(held, optimizer, experts, mesh))


def apply_pp(model: nn.Module, mesh, cfg: TrainConfig, device: torch.device, loss_fn=None):
    """Split ``model`` into one stage per pp rank; build (tp-shard, compile) only this rank's; return the engine.
    ``loss_fn``: the last stage's loss (default ``language_model_loss``; ``ep_pipeline`` takes each ep rank's share)."""
    from vescale.plan import build_pipeline, language_model_loss

    pp, dp, tp, mb = dim_size(mesh, "pp"), dp_size(mesh), dim_size(mesh, "tp"), microbatches(cfg, mesh)  # (HSDP too)
    tp_mesh = sub_mesh(mesh, "tp") if tp > 1 else None
    log(cfg, f"pp={pp}: schedule {cfg.schedule}, {mb} microbatches" + (", stages tp-sharded" if tp > 1 else ""))
    return build_pipeline(
        model, sub_mesh(mesh, "pp"), schedule=cfg.schedule, num_microbatches=mb,
        loss_fn=language_model_loss if loss_fn is None else loss_fn,
        example_inputs=torch.zeros(cfg.batch_size // dp // dim_size(mesh, "ep") // mb, cfg.seq_len, dtype=torch.long,
                                   device=device),  # (with ep each ep rank runs its own rows: ep_pipeline)
        tp_mesh=tp_mesh, plan=models.tp_plan(cfg.model, tp_mesh, False, model) if tp_mesh is not None else None,
        device=device, compile=cfg.compile)  # dp: each stage's own DDP (apply_dp_stages), no flat all-reduce


def apply_dp(model: nn.Module, mesh, cfg: TrainConfig):
    """``model`` in ``DistributedDataParallel`` over dp (ZeRO-2 shards its gradients), or ``None`` without dp/ZeRO."""
    from vescale.parallel import DistributedDataParallel

    # bf16 always takes DDP (over dp=1 without dp, see mesh_dims): its fp32 buffer accumulates the gradients that
    # DistributedOptimizer's fp32 masters step with.
    cp = dim_size(mesh, "cp")
    if cfg.zero == 3 or (dp_size(mesh) * cp == 1 and not cfg.zero and cfg.dtype == "fp32"):
        return None
    log(cfg, f"dp={dp_size(mesh)}" + (f" x cp={cp}" if cp > 1 else "")
        + f": DistributedDataParallel, ZeRO stage {cfg.zero}, {cfg.dtype}")
    return DistributedDataParallel(model, grad_mesh(mesh), zero_stage=2 if cfg.zero == 2 else 0,
                                   grad_dtype=getattr(torch, DTYPES[cfg.reduce_dtype]))


def apply_dp_stages(engine, mesh, cfg: TrainConfig) -> list:
    """Each of this rank's pipeline stages in its own ``DistributedDataParallel`` over dp (``engine.wrap_stages``):
    one bucketed dp reduction per step, started in the last microbatch's backward and overlapped with the rest of
    it; a weight tied across stages is reduced after the engine's sum over pp (``late_params``). Returns the
    wrappers, one per local stage; none when ``apply_dp`` would take none (no dp, ZeRO or bf16)."""

    cp = dim_size(mesh, "cp")  # with cp: over dp x cp (grad_mesh), each cp rank holding its share of every row
    if grad_mesh(mesh) is None or (dp_size(mesh) * cp == 1 and not cfg.zero and cfg.dtype == "fp32"):
        return []
    log(cfg, f"dp={dp_size(mesh)}" + (f" x cp={cp}" if cp > 1 else "")
        + f": each pipeline stage in DistributedDataParallel, ZeRO stage {cfg.zero}")
    wrappers = []

    def wrap(index: int, stage: nn.Module, late: list[nn.Parameter]) -> nn.Module:
        wrappers.append(ddp_of_stage(stage, grad_mesh(mesh), cfg, late))
        return wrappers[-1]

    engine.wrap_stages(wrap)
    return wrappers


def ddp_of_stage(stage: nn.Module, mesh, cfg: TrainConfig, late: list[nn.Parameter], **kwargs):
    """A pipeline stage's ``DistributedDataParallel`` over ``mesh``: ZeRO 2's gradient shards or a full buffer in
    ``--reduce-dtype``, ``late`` (tied weights) reduced after the engine's sum over pp, and the reduction left running
    at the end of each backward (the engine waits once, after the last microbatch). ``kwargs``: DDP's other arguments
    (expert parallelism: ``data_dims``, ``local_shards``)."""
    from vescale.parallel import DistributedDataParallel

    return DistributedDataParallel(stage, mesh, zero_stage=2 if cfg.zero == 2 else 0,
                                   grad_dtype=getattr(torch, DTYPES[cfg.reduce_dtype]), late_params=late,
                                   wait_in_backward=False, **kwargs)


def apply_zero3_stages(engine, mesh, cfg: TrainConfig) -> None:
    """ZeRO 3 (or HSDP) of each of this rank's pipeline stages (``vescale.parallel.fully_shard_stage``): a stage is
    one FSDP2 unit over dp, gathered at its first forward of a step and freed after its last backward, whose
    gradients are summed locally over the microbatches and reduce-scattered once, in that last backward. With
    ``--dtype bf16`` the stage was captured in bf16: its parameters become fp32 masters before sharding and FSDP2's
    policy gathers them in bf16 for the graph, reducing gradients in ``--reduce-dtype``."""
    from vescale.parallel.zero3 import bf16_policy, fully_shard_stage

    log(cfg, f"dp={dp_size(mesh)}: each pipeline stage sharded by FSDP2 (ZeRO 3), {cfg.dtype}")
    policy = bf16_policy(getattr(torch, DTYPES[cfg.reduce_dtype])) if cfg.dtype == "bf16" else None
    master = torch.float32 if policy is not None else None  # the bf16-captured stage's parameters widened to fp32
    over = grad_mesh(mesh) if dim_size(mesh, "cp") > 1 else mesh  # with cp: over dp x cp flattened, as apply_zero3
    engine.wrap_stages(lambda index, stage, late: fully_shard_stage(stage, over, mp_policy=policy,
                                                                    master_dtype=master))


def build_optimizer(params: list[nn.Parameter], ddp, cfg: TrainConfig, pp_group=None) -> torch.optim.Optimizer:
    """AdamW with ``--weight-decay`` on matrices only (:func:`decay_groups`); with ZeRO vescale's
    ``DistributedOptimizer`` over ``ddp`` (the same groups, on its shards), which also clips (over ``pp_group``
    too: a pipeline stage's optimizer)."""
    from vescale.parallel import DistributedOptimizer

    adamw = torch.optim.AdamW(decay_groups(params, cfg.weight_decay), lr=cfg.lr)
    if ddp is not None and (cfg.zero or cfg.dtype != "fp32"):  # (bf16 without ZeRO: zero_stage 0, fp32 masters)
        return DistributedOptimizer(ddp, adamw, zero_stage=cfg.zero, clip_grad=cfg.clip or None, pp_group=pp_group)
    return adamw


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Two AdamW groups: the matrices (``ndim >= 2``: linear weights, embeddings, the output head) decay by
    ``weight_decay``; vectors (norm scales, biases) do not. Decay pulls a weight towards zero: for a matrix that
    regularises, but a norm's scale or a bias is an offset whose zero is no prior (decaying a scale towards 0
    shrinks a whole activation), as in GPT-2, Megatron-LM and the transformers Trainer. Embeddings decay, as there."""
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0})
            if g["params"]]


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
    flops_per_token: int = 0  # model FLOPs of one token's forward and backward (``models.flops_per_token``)
    # what a checkpoint saves and loads when it is not ``state`` itself: pp x ep's stages and optimizer with each
    # rank's plain [E / ep, ...] experts shown as rows of the global tensors (``vescale.parallel.expert_state``)
    ckpt_state: dict | None = None

    def checkpointed(self) -> dict:
        """The state a checkpoint saves and loads: ``ckpt_state``, or ``state``."""
        return self.state if self.ckpt_state is None else self.ckpt_state


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
    flops = models.flops_per_token(models.matmul_params(model), models.model_spec(cfg.model), cfg.seq_len)
    pretrained = models.is_hf_dir(cfg.model)  # then each rank fills what it holds from the directory's safetensors
    tied = models.tied_names(model) if pretrained else {}
    # ZeRO 3: FSDP2's fp32 shards, cast for compute by its policy; with pp the stages are still captured in bf16 (the
    # graph hard-codes its dtypes) and apply_zero3_stages widens their parameters back to fp32 masters
    if cfg.dtype != "fp32" and (cfg.zero != 3 or dim_size(mesh, "pp") > 1):
        cast_model(model, cfg)
    if dim_size(mesh, "pp") > 1 and dim_size(mesh, "ep") > 1:  # (config.py: pp x [dp x] ep, ZeRO 0-2)
        return ep_pipeline(cfg, mesh, model, num_params, whole_bytes, flops, t0, device)
    if dim_size(mesh, "pp") > 1:
        cp_positions = None
        if dim_size(mesh, "cp") > 1:  # before the split: the captured stages call the cp attention operator
            from vescale.parallel import context_parallel
            from vescale.parallel.context_parallel import local_positions

            cp_mesh = sub_mesh(mesh, "cp")
            log(cfg, f"cp={cp_mesh.size()}: every stage's attention over cp (the model is captured taking whole rows)")
            context_parallel(model, cp_mesh)
            cp_positions = local_positions(cfg.seq_len, cp_mesh.size(), cp_mesh.get_local_rank()).to(device)
        engine = apply_pp(model, mesh, cfg, device)
        held = list(engine.stages.values())
        if pretrained:
            log(cfg, f"weights from {cfg.model}: each rank reads its stages' shards")
            models.load_pretrained(cfg.model, held, stages=True, tied=tied)
        init_s = time.perf_counter() - t0
        if cfg.activation_checkpointing != "none":  # a captured stage has no block modules: one region per stage
            for stage in held:
                checkpoint_activations(stage, cfg.activation_checkpointing, whole=True)
        bytes_built = whole_bytes if cfg.init == "eager" else state_bytes(held)
        from vescale.parallel.clip_grad import mark_tied_copy

        stage_ddp = None
        if cfg.zero == 3:  # FSDP2 shards each stage in place: the engine collects the new parameters
            apply_zero3_stages(engine, mesh, cfg)
        else:  # apply_pp builds one stage per pp rank, so at most one stage DDP here
            stage_ddp = next(iter(apply_dp_stages(engine, mesh, cfg)), None)
        for p in engine.tied_copies():  # a tied weight held by two stages counts once in the clip norm over pp
            mark_tied_copy(p)  # (before DistributedOptimizer, which marks its shards of them)
        optimizer = build_optimizer(engine.parameters(), stage_ddp, cfg, pp_group=sub_mesh(mesh, "pp").get_group())
        return Trainer(lambda x, y: engine.step(x, y if cp_positions is None else y[:, cp_positions]).detach(),
                       engine.parameters(), optimizer,
                       {"model": held, "optim": optimizer}, num_params, init_s, bytes_built,
                       grads=lambda: grads_by_fqn(held, stage_ddp), flops_per_token=flops)
    if dim_size(mesh, "ep") > 1:  # experts over ep, the rest by the family's tp plan (config.py: dp x ep x tp only)
        return ep_trainer(cfg, mesh, model, num_params, whole_bytes, flops, t0)
    if dim_size(mesh, "tp") > 1:
        model = apply_tp(model, sub_mesh(mesh, "tp"), cfg)
    elif is_deferred(model):  # dp replicas each compute 1/dp of the init, then all-gather it (pretrained: no
        dp = dim_size(mesh, "dp")  # gather, every replica reads the weights itself)
        materialize(model, device=device, replicate_over=sub_mesh(mesh, "dp") if dp > 1 and not pretrained else None)
    if pretrained and cfg.zero != 3:  # (ZeRO 3: into FSDP2's shards, below)
        log(cfg, f"weights from {cfg.model}: each rank reads its own shards")
        models.load_pretrained(cfg.model, [model])
    init_s, bytes_built = time.perf_counter() - t0, whole_bytes if cfg.init == "eager" else state_bytes([model])
    if cfg.activation_checkpointing != "none":  # before compile and DDP (see checkpoint_activations)
        checkpoint_activations(model, cfg.activation_checkpointing)
    if cfg.compile:
        compile_parallel(model)
    cp_positions = None
    if dim_size(mesh, "cp") > 1:  # every cp rank runs its head and tail chunks of each row; targets sliced alike
        from vescale.parallel import context_parallel
        from vescale.parallel.context_parallel import local_positions

        cp_mesh = sub_mesh(mesh, "cp")
        log(cfg, f"cp={cp_mesh.size()}: sequences sharded over cp (load-balanced chunks, all-gathered keys/values)")
        context_parallel(model, cp_mesh)
        cp_positions = local_positions(cfg.seq_len, cp_mesh.size(), cp_mesh.get_local_rank()).to(device)
    if cfg.zero == 3:  # FSDP2 per block over dp (or dp_replicate x dp_shard); its fp32 shards are the masters
        model = apply_zero3(model, mesh, cfg)
        if pretrained:  # each rank reads only the bytes of its ZeRO-3 (and tp) shard of every weight
            log(cfg, f"weights from {cfg.model}: each rank reads its ZeRO-3 shards")
            models.load_pretrained(cfg.model, [model])
    ddp = apply_dp(model, mesh, cfg)
    module = ddp if ddp is not None else model

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # --grad-accum N: N micro-steps over equal slices of this rank's rows, each loss / N, so the summed gradient
        # is that of the mean loss over all rows; DDP reduces over dp only in the last micro-step's backward.
        n, total = cfg.grad_accum, None
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            last = i == n - 1
            if cfg.zero == 3:  # FSDP2 reduce-scatters only in the last micro-step's backward
                model.set_requires_gradient_sync(last)
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                if cp_positions is not None:  # this rank's positions: its loss is its share (mean over cp: the row's)
                    y = y[:, cp_positions]
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
                   bytes_built, grads=lambda: grads_by_fqn([model], ddp), flops_per_token=flops)


def grads_by_fqn(modules: list[nn.Module], ddp=None) -> dict[str, torch.Tensor]:
    """This rank's gradients by parameter FQN of the unwrapped model (every name of a tied parameter), as the
    optimizer will see them: dp-averaged, laid out as the parameters are (DTensors over tp, or plain). Parameters
    without a gradient are left out. With ``ddp`` they come from its buffers (``reduced_grads``; with ZeRO-2 an
    all-gather over dp, so every dp rank must call it), else from ``.grad`` (nothing to reduce over dp)."""
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


def apply_zero3(model: nn.Module, mesh, cfg: TrainConfig) -> nn.Module:
    """``model`` sharded by FSDP2 per block over dp (ZeRO 3), or HSDP over ``dp_replicate x dp_shard``; with
    ``--dtype bf16`` gathered parameters are cast to bf16 for compute and gradients reduced in ``--reduce-dtype``,
    while the fp32 shards stay the masters the optimizer steps (``vescale.parallel.zero3``)."""
    from vescale.parallel.zero3 import bf16_policy, fully_shard_dp

    hsdp = all(n in (mesh.mesh_dim_names or ()) for n in HSDP_DIMS)
    log(cfg, f"dp={dp_size(mesh)}: ZeRO 3 (FSDP2 per block)" + (
        f", HSDP {dim_size(mesh, HSDP_DIMS[0])} replicas x {dim_size(mesh, HSDP_DIMS[1])} shards" if hsdp else "")
        + f", {cfg.dtype}")
    policy = bf16_policy(getattr(torch, DTYPES[cfg.reduce_dtype])) if cfg.dtype == "bf16" else None
    # with cp the parameters are sharded (and gradients averaged) over dp x cp flattened, as DDP's are (grad_mesh)
    return fully_shard_dp(model, grad_mesh(mesh) if dim_size(mesh, "cp") > 1 else mesh, mp_policy=policy)


def mesh_dims(cfg: TrainConfig) -> dict[str, int]:
    """The mesh ``train`` builds: ``--mesh``, plus ``dp=1`` for a bf16 or ZeRO 1/2 run without data parallelism,
    whose master weights (optimizer state) live in ``DistributedOptimizer`` over a DDP of one rank, and for pp x ep,
    whose stage DDP reduces over dp x ep (``ep_pipeline``)."""
    dims = dict(cfg.dims)
    pp_ep = dims.get("pp", 1) > 1 and dims.get("ep", 1) > 1
    if ((cfg.dtype != "fp32" or cfg.zero or pp_ep) and cfg.zero != 3 and dp_dims(dims) == 1
            and "dp" not in dims):
        dims["dp"] = 1
    return dims


def dp_size(mesh) -> int:
    """Data-parallel ranks of ``mesh``: ``dp``, or ``dp_replicate x dp_shard`` (HSDP)."""
    return dim_size(mesh, "dp") * dim_size(mesh, HSDP_DIMS[0]) * dim_size(mesh, HSDP_DIMS[1])


def grad_mesh(mesh):
    """The 1-D mesh gradients are averaged over: the dp mesh, or with context parallelism dp x cp flattened (cp
    ranks hold the same parameters and each computes its share of the loss of the same rows; see
    ``vescale.parallel.context_parallel``)."""
    from vescale.core.torch_internals import flattened_mesh

    if dim_size(mesh, "cp") == 1:
        return dp_mesh(mesh)
    return flattened_mesh(sub_mesh(mesh, "dp", "cp")) if "dp" in (mesh.mesh_dim_names or ()) else sub_mesh(mesh, "cp")


def dp_mesh(mesh):
    """The 1-D mesh the batch is split over: ``dp``, or HSDP's two dims flattened (replica-major), or None."""
    from vescale.core.torch_internals import flattened_mesh

    names = tuple(mesh.mesh_dim_names or ())
    if "dp" in names:
        return sub_mesh(mesh, "dp")
    if all(n in names for n in HSDP_DIMS):
        return flattened_mesh(sub_mesh(mesh, *HSDP_DIMS))
    return None


def microbatches(cfg: TrainConfig, mesh) -> int:
    """Microbatches a pipeline step is cut into: ``--microbatches`` (by default two per pp rank) per ``--grad-accum``
    micro-step. A pipeline accumulates over its microbatches already, so ``--grad-accum N`` is one engine step over N
    times the microbatches, each as large as one micro-step's would be: the same sum of gradients as N engine
    steps, but with one dp reduction (overlapped with the last microbatch's backward), one tied-weight sum over pp
    and one pipeline fill and drain per optimizer step, not N. (A 1F1B-family schedule keeps at most pp
    microbatches' activations alive whatever their number; gpipe keeps all of them.)"""
    return (cfg.microbatches or 2 * dim_size(mesh, "pp")) * cfg.grad_accum


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``--warmup`` steps to ``--lr``, then ``--lr-schedule``: cosine or linear decay to
    ``--min-lr`` (default a tenth of ``--lr``) reached at the last step, or constant at ``--lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    floor = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    left = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return floor + (cfg.lr - floor) * left


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
    from vescale.parallel import DistributedOptimizer, clip_grad_norm_

    rank, mesh, out = dist.get_rank(), init_mesh(mesh_dims(cfg)), Path(cfg.out)
    if watch is not None:
        watch.add_mesh(mesh)
    check_fits(cfg, models.model_spec(cfg.model), dim_size(mesh, "pp"), dp_size(mesh), dim_size(mesh, "tp"))
    device, dp, pp, cp = rank_device(), dp_size(mesh), dim_size(mesh, "pp"), dim_size(mesh, "cp")
    dp_rank = dp_mesh(mesh).get_local_rank() if dp > 1 else 0
    corpus = open_data(cfg, models.model_spec(cfg.model).vocab_size)  # prepared by main: a cache hit here
    trainer = build_trainer(cfg, mesh)
    start, offset = 0, 0  # offset: data position (sequences) minus step x batch size, from a resumed checkpoint
    if cfg.resume:
        progress = {"step": 0, "sequences": 0, "data": ""}
        checkpoint.load(cfg.resume, {**trainer.checkpointed(), "progress": progress})
        start = int(progress["step"])
        offset, note = resume_offset(progress, corpus, cfg.batch_size)
        if note:
            log(cfg, note)
    ep = dim_size(mesh, "ep")  # held-out rows split as training rows: each ep rank its part of its dp rank's slice
    ep_mesh = sub_mesh(mesh, "ep") if ep > 1 else None
    monitor = TextMonitor(cfg, corpus, trainer.state["model"], dp_rank=dp_rank, dp=dp, device=device,
                          dp_group=dp_mesh(mesh).get_group() if dp > 1 else None, log=lambda m: log(cfg, m),
                          ep_rank=ep_mesh.get_local_rank() if ep > 1 else 0, ep=ep,
                          ep_group=ep_mesh.get_group() if ep > 1 else None)
    run_log = RunLog(out, cfg.steps, start, active=rank == 0, append=bool(cfg.resume), quiet=cfg.quiet)
    window = TimelineWindow(mesh, start, cfg.steps, cfg.trace_steps, out / "timeline.json")
    tokens_per_step, pending_save, t_start = cfg.batch_size * cfg.seq_len, None, time.perf_counter()
    comm_step, comms = min(start + 1, cfg.steps - 1), None  # collectives counted on one warm step
    for step in range(start, cfg.steps):
        window.before(step)
        t0 = time.perf_counter()
        tokens = corpus.batch(step, cfg.batch_size, cfg.seq_len, offset).chunk(dp)[dp_rank].to(device)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        trainer.optimizer.zero_grad(set_to_none=True)
        with count_comms(mesh) if step == comm_step else contextlib.nullcontext() as counter:
            loss = trainer.forward_backward(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            if cfg.grad_dump and step == start:  # before clipping and the update: the raw gradient of the batch
                at = mesh_coordinates(mesh)  # one copy of each gradient: the dp and tp replicas' first
                dump_grads(trainer.grads(), cfg.grad_dump,
                           keep=at.get("dp", 0) == at.get("cp", 0) == at.get("tp", 0) == 0)
            if cfg.clip and not isinstance(trainer.optimizer, DistributedOptimizer):  # (that one clips itself)
                clip_grad_norm_(trainer.parameters, cfg.clip,
                                pp_group=sub_mesh(mesh, "pp").get_group() if pp > 1 else None)
            trainer.optimizer.step()
        if step == comm_step:
            comms = counter.summary()
        if dp * cp > 1:  # the logged loss is the global-batch mean, as one device computes it
            loss = loss.clone()
            dist.all_reduce(loss, group=grad_mesh(mesh).get_group())
            loss /= dp * cp
        dt = time.perf_counter() - t0
        window.after(step)
        run_log.step(step, {"step": step + 1, "loss": float(loss), "lr": lr_at(step, cfg), "step_s": dt,
                            "tokens_per_s": tokens_per_step / dt, **monitor.after_step(step)})
        if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
            if pending_save is not None:
                pending_save.wait()
            pending_save = checkpoint.save(out / "ckpt" / f"step_{step + 1}",
                                           {**trainer.checkpointed(), "progress": {
                                               "step": step + 1, "data": corpus.fingerprint,
                                               "sequences": offset + (step + 1) * cfg.batch_size}},
                                           async_save=True)
    if pending_save is not None:
        pending_save.wait()
    wall = time.perf_counter() - t_start
    # what the model learned, in text (real data; not on cp meshes, whose model takes only training rows; pp: noted.
    # ep: every rank generates the same rows in lockstep, see TextMonitor)
    if not cfg.quiet and cfg.steps > start and cp == 1:
        monitor.sample(cfg.steps - 1)
    if cfg.export_hf:
        export_hf(cfg, trainer, out)
    # one gather: peak memory MB, init seconds, init bytes of every rank
    per_rank = gather_per_rank([peak_memory_mb(), trainer.init_s, trainer.init_bytes], device)
    if rank != 0:
        return {}
    losses = [r["loss"] for r in run_log.records]
    return run_log.finish({
        "mesh": cfg.dims, "model": cfg.model, "parameters": trainer.num_params, "steps": cfg.steps,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "data": cfg.data, "data_fingerprint": corpus.fingerprint,
        "final_eval_loss": next((r["eval_loss"] for r in reversed(run_log.records) if "eval_loss" in r), None),
        "corpus_entropy": corpus.entropy(), "tokens_per_s": tokens_per_step * max(1, cfg.steps - start) / wall,
        "wall_s": wall, "peak_memory_mb_per_rank": [round(float(p), 1) for p in per_rank[:, 0]], "init": cfg.init,
        "init_s_per_rank": [round(float(t), 3) for t in per_rank[:, 1]],
        "init_mb_per_rank": [round(float(b) / 2**20, 2) for b in per_rank[:, 2]],
        "communication_share_traced_steps": window.comm_share, "collectives_one_step": comms,
        "grad_accum": cfg.grad_accum, **throughput(cfg, trainer, tokens_per_step * max(1, cfg.steps - start) / wall,
                                                   dist.get_world_size()),
        "export_hf": cfg.export_hf,
    }, corpus.entropy())


def throughput(cfg: TrainConfig, trainer: Trainer, tokens_per_s: float, devices: int) -> dict:
    """The figures runs are compared by: model FLOPs per token (``6 N + 12 L d T``, ``models.flops_per_token``),
    the model TFLOP/s they make at ``tokens_per_s``, and with ``--peak-tflops`` the model FLOPs utilisation: that
    rate over ``devices`` x the peak."""
    achieved = trainer.flops_per_token * tokens_per_s / 1e12
    return {"model_flops_per_token": trainer.flops_per_token, "model_tflops": achieved,
            "mfu": achieved / (devices * cfg.peak_tflops) if cfg.peak_tflops else None}


def export_hf(cfg: TrainConfig, trainer: Trainer, out: Path) -> None:
    """``--export-hf DIR``: the trained weights as a directory ``from_pretrained`` loads; collective. Every rank
    saves the model part it holds (a vescale checkpoint under ``out``: any mesh, replicas written once), rank 0
    converts it (``models.export_pretrained``: config.json, and the tokenizer of ``--tokenizer`` or of the model
    directory when it has one) and removes the checkpoint."""
    import shutil

    from vescale import checkpoint

    tmp = out / "export-hf-ckpt"
    checkpoint.save(tmp, {"model": trainer.checkpointed()["model"]})
    if dist.get_rank() == 0:
        tokenizer = getattr(cfg, "tokenizer", None) or (cfg.model if models.has_tokenizer(cfg.model) else None)
        models.export_pretrained(str(tmp), cfg.export_hf, cfg.model, tokenizer)
        shutil.rmtree(tmp)
        with_tokenizer = f" with the tokenizer of {tokenizer}" if tokenizer else ""
        log(cfg, f"exported the model to {cfg.export_hf}{with_tokenizer}")


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv, description=__doc__.splitlines()[0])
    world = math.prod(cfg.dims.values())
    # Checked here, before any rank starts, so a bad mesh is one clear message rather than one per rank.
    check_fits(cfg, models.model_spec(cfg.model), cfg.dims.get("pp", 1), dp_dims(cfg.dims), cfg.dims.get("tp", 1))
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
