"""The configuration of ``tools/train.py``: :class:`TrainConfig`, its command line, and the check that a mesh fits
the model and the batch (made before any rank starts, so a bad mesh is one clear message)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import models

from vescale.core.mesh import parse_mesh_spec

__all__ = ["INITS", "TrainConfig", "check_fits", "parse_args"]

INITS = ("deferred", "eager")


@dataclass
class TrainConfig:
    """Every setting of a run; the command line sets each (``--batch-size`` for ``batch_size``), ``dims`` is the
    parsed ``mesh``."""

    mesh: str = "dp=2"
    model: str = "gpt-11m"
    steps: int = 200
    batch_size: int = 8  # global, in sequences
    seq_len: int = 64
    lr: float = 2e-3
    warmup: int = 10
    clip: float = 1.0
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 0  # 0: 2 x pp
    grad_accum: int = 1  # micro-steps per optimizer step over slices of the batch; dp gradients synced on the last
    sequence_parallel: bool = False
    compile: bool = False  # torch.compile the blocks (vescale.parallel.compile_parallel) after parallelization
    activation_checkpointing: str = "none"  # none | full | selective (vescale.parallel.checkpoint_activations)
    init: str = "deferred"  # deferred: each rank materialises only what it holds; eager: every rank builds it all
    seed: int = 1234
    out: str = "runs/latest"
    ckpt_every: int = 0
    resume: str | None = None
    trace_steps: int = 3
    quiet: bool = False
    grad_dump: str | None = None  # file: the first step's whole gradients by FQN (safetensors, rank 0 writes)
    collective_timeout: float | None = None  # seconds; None: $VESCALE_COLLECTIVE_TIMEOUT, else 300
    collective_ring: int = 0  # last collectives each rank records for the hang diagnosis (0: none, use torch's
    # flight recorder: no call sites, but no per-op cost)
    dims: dict = field(default_factory=dict)


def check_fits(cfg: TrainConfig, spec: models.ModelSpec, pp: int, dp: int, tp: int) -> None:
    """Refuse (SystemExit naming every reason) a mesh that does not fit the model or the batch."""
    problems = []
    if cfg.batch_size % dp:
        problems.append(f"--batch-size {cfg.batch_size} is not divisible by dp={dp}")
    if cfg.grad_accum < 1:
        problems.append(f"--grad-accum {cfg.grad_accum} must be at least 1")
    elif cfg.grad_accum > 1 and pp > 1:
        problems.append(f"--grad-accum with pp > 1 is not supported: the pipeline already accumulates over its "
                        f"microbatches with one dp reduction per step; use --microbatches "
                        f"{(cfg.microbatches or 2 * pp) * cfg.grad_accum} instead")
    elif cfg.batch_size % (dp * cfg.grad_accum):
        problems.append(f"--batch-size {cfg.batch_size} is not divisible by dp={dp} x --grad-accum {cfg.grad_accum} "
                        f"(each micro-step takes an equal slice of every dp rank's rows)")
    if pp > 1 and (cfg.batch_size // max(dp, 1)) % (cfg.microbatches or 2 * pp):
        problems.append(f"the per-dp-rank batch {cfg.batch_size // dp} is not divisible by "
                        f"{cfg.microbatches or 2 * pp} microbatches")
    if pp > spec.n_layer:
        problems.append(f"pp={pp} exceeds the model's {spec.n_layer} layers")
    problems += [f"model {cfg.model}: {what}={n} is not divisible by tp={tp}" for what, n in spec.divisible.items()
                 if n % tp]
    if cfg.sequence_parallel and cfg.seq_len % tp:
        problems.append(f"--seq-len {cfg.seq_len} is not divisible by tp={tp} (sequence parallel)")
    if cfg.seq_len > spec.max_seq_len:
        problems.append(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len={spec.max_seq_len}")
    if cfg.zero and pp > 1:
        problems.append("--zero with pp > 1 is not supported yet (ZeRO wraps a whole model, not pipeline stages)")
    if cfg.init not in INITS:
        problems.append(f"--init {cfg.init!r} is not one of {list(INITS)}")
    if problems:
        raise SystemExit("train.py: the mesh does not fit the model or batch:\n  " + "\n  ".join(problems))


def parse_args(argv: list[str] | None, description: str) -> TrainConfig:
    """``TrainConfig`` from the command line ``argv``; a usage error (exit 2) for a malformed or unsupported mesh."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    d = TrainConfig()
    p.add_argument("--mesh", default=d.mesh, help="named mesh, e.g. pp=2,dp=2,tp=2 (product = number of ranks)")
    p.add_argument("--model", default=d.model, choices=models.MODELS,
                   help="gpt-11m / gpt-tiny (the GPT of tools/models.py) or an unmodified transformers model")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--clip", type=float, default=d.clip, help="max global grad norm (0: off)")
    p.add_argument("--zero", type=int, default=d.zero, choices=[0, 1, 2], help="ZeRO stage over dp")
    p.add_argument("--schedule", default=d.schedule, help="pipeline schedule (pp > 1)")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="per step (pp > 1); 0: 2 x pp")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="micro-steps per optimizer step, each over 1/N of the batch, dp gradients reduced once\n"
                        "at the last (the step equals one over the whole batch; pp > 1: use --microbatches)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block (inductor)")
    p.add_argument("--activation-checkpointing", default=d.activation_checkpointing,
                   choices=["none", "full", "selective"],
                   help="recompute each block's activations in backward: full, or selective (matmul outputs\n"
                        "saved); dropout masks replay bitwise (vescale.parallel.checkpoint_activations)")
    p.add_argument("--init", default=d.init, choices=INITS,
                   help="deferred: meta build, each rank materialises only its shards/stage (vescale counter RNG);\n"
                        "eager: every rank builds the whole model from torch's RNG, then shards it")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="async checkpoint every N steps (0: off)")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from (any mesh)")
    p.add_argument("--trace-steps", type=int, default=d.trace_steps, help="steps recorded in timeline.json")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--grad-dump", default=None,
                   help="write the first step's gradients (whole, by parameter FQN, before clipping) to this\n"
                        "safetensors file (rank 0)")
    p.add_argument("--collective-timeout", type=float, default=None, metavar="SECONDS",
                   help="a collective waiting longer fails on every waiting rank, naming the missing rank, the\n"
                        "collective, its mesh dim and call site; each such rank writes its last collectives to\n"
                        "<out>/collectives-rank<r>.json (default: $VESCALE_COLLECTIVE_TIMEOUT, else 300). NCCL:\n"
                        "set TORCH_NCCL_BLOCKING_WAIT=1 to raise rather than abort; the flight recorder dumps to\n"
                        "<out>/flight-recorder-rank<r>")
    p.add_argument("--collective-ring", type=int, default=d.collective_ring, metavar="N",
                   help="collectives each rank records (op, mesh dim, call site) for the hang diagnosis. Default 0:\n"
                        "none; the diagnosis then reads torch's flight recorder (no call sites). The ring is a\n"
                        "dispatch mode on every op: +10%% to +73%% of a CPU step of a small model; off under --compile")
    args = p.parse_args(argv)
    cfg = TrainConfig(**vars(args))
    try:
        cfg.dims = parse_mesh_spec(cfg.mesh)
    except ValueError as exc:
        p.error(str(exc))
    unsupported = sorted(set(cfg.dims) - {"pp", "dp", "tp"})
    if unsupported:
        p.error(f"--mesh {cfg.mesh}: dimension(s) {unsupported} are not supported by train.py (use pp, dp, tp)")
    return cfg
