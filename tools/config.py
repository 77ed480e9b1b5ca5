"""The configuration of ``tools/train.py``: :class:`TrainConfig`, its command line, and the check that a mesh fits
the model and the batch (made before any rank starts, so a bad mesh is one clear message)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import models

from vescale.core.mesh import parse_mesh_spec

__all__ = ["DTYPES", "HSDP_DIMS", "INITS", "LR_SCHEDULES", "TrainConfig", "check_fits", "dp_dims", "parse_args"]

INITS = ("deferred", "eager")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype / --reduce-dtype -> torch dtype name
HSDP_DIMS = ("dp_replicate", "dp_shard")  # the mesh dims of HSDP (vescale.parallel.zero3.HSDP_DIMS)


def dp_dims(dims: dict) -> int:
    """Data-parallel ranks of a parsed mesh: ``dp``, or ``dp_replicate x dp_shard`` (HSDP); the batch is split over
    all of them."""
    return dims.get("dp", 1) * dims.get(HSDP_DIMS[0], 1) * dims.get(HSDP_DIMS[1], 1)
LR_SCHEDULES = ("cosine", "linear", "constant")


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
    lr_schedule: str = "cosine"  # after the warm-up: cosine | linear decay to min_lr at the last step, or constant
    min_lr: float | None = None  # None: lr / 10
    weight_decay: float = 0.1  # AdamW's decoupled decay, on matrices (ndim >= 2) only
    clip: float = 1.0
    zero: int = 0  # over dp: 0-2 vescale DDP / DistributedOptimizer, 3 FSDP2 (HSDP on dp_replicate x dp_shard)
    dtype: str = "fp32"  # fp32 | bf16: bf16 parameters and compute over fp32 master weights and optimizer state
    reduce_dtype: str = "fp32"  # the dtype dp gradients are accumulated and reduced in with --dtype bf16
    schedule: str = "1f1b"
    microbatches: int = 0  # 0: 2 x pp
    grad_accum: int = 1  # micro-steps per optimizer step over slices of the batch; dp gradients synced on the last
    sequence_parallel: bool = False
    compile: bool = False  # torch.compile the blocks (vescale.parallel.compile_parallel) after parallelization
    activation_checkpointing: str = "none"  # none | full | selective (vescale.parallel.checkpoint_activations)
    init: str = "deferred"  # deferred: each rank materialises only what it holds; eager: every rank builds it all
    seed: int = 1234
    data: str = "stdlib"  # stdlib (this interpreter's standard library), markov (synthetic), or a path (data.py)
    tokenizer: str | None = None  # HF tokenizer directory for --data; None: the --model directory's own
    data_field: str = "text"  # the text field of .jsonl records
    heldout: float = 0.02  # fraction of the documents held out (--eval-every, the sample prompt)
    eval_every: int = 0  # held-out loss every N steps and at the last (0: off)
    sample_every: int = 0  # print generations every N steps (0: only at the end of a run on real text)
    prompt: str | None = None  # the samples' prompt; None: the held-out split's first tokens
    out: str = "runs/latest"
    ckpt_every: int = 0
    resume: str | None = None
    trace_steps: int = 3
    quiet: bool = False
    grad_dump: str | None = None  # file: the first step's whole gradients by FQN (safetensors, rank 0 writes)
    collective_timeout: float | None = None  # seconds; None: $VESCALE_COLLECTIVE_TIMEOUT, else 300
    collective_ring: int = 0  # last collectives each rank records for the hang diagnosis (0: none, use torch's
    # flight recorder: no call sites, but no per-op cost)
    export_hf: str | None = None  # directory: the trained model as from_pretrained loads it (+ config, tokenizer)
    peak_tflops: float = 0.0  # one device's peak (dense, the run's dtype) for the MFU figure; 0: no MFU
    dims: dict = field(default_factory=dict)


def check_fits(cfg: TrainConfig, spec: models.ModelSpec, pp: int, dp: int, tp: int) -> None:
    """Refuse (SystemExit naming every reason) a mesh that does not fit the model or the batch."""
    problems = []
    if cfg.batch_size % dp:
        problems.append(f"--batch-size {cfg.batch_size} is not divisible by dp={dp}")
    if cfg.grad_accum < 1:
        problems.append(f"--grad-accum {cfg.grad_accum} must be at least 1")
    elif cfg.batch_size % (dp * cfg.grad_accum):
        problems.append(f"--batch-size {cfg.batch_size} is not divisible by dp={dp} x --grad-accum {cfg.grad_accum} "
                        f"(each micro-step takes an equal slice of every dp rank's rows)")
    # with pp, --grad-accum N multiplies the microbatches of the one engine step (train.microbatches)
    elif pp > 1 and (cfg.batch_size // max(dp, 1)) % ((cfg.microbatches or 2 * pp) * cfg.grad_accum):
        problems.append(f"the per-dp-rank batch {cfg.batch_size // dp} is not divisible by "
                        f"{(cfg.microbatches or 2 * pp) * cfg.grad_accum} microbatches ("
                        + (f"{cfg.microbatches or 2 * pp} x --grad-accum {cfg.grad_accum})" if cfg.grad_accum > 1
                           else "--microbatches, by default 2 x pp)"))
    if pp > spec.n_layer:
        problems.append(f"pp={pp} exceeds the model's {spec.n_layer} layers")
    problems += [f"model {cfg.model}: {what}={n} is not divisible by tp={tp}" for what, n in spec.divisible.items()
                 if n % tp]
    if cfg.sequence_parallel and cfg.seq_len % tp:
        problems.append(f"--seq-len {cfg.seq_len} is not divisible by tp={tp} (sequence parallel)")
    if cfg.seq_len > spec.max_seq_len:
        problems.append(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len={spec.max_seq_len}")
    if cfg.init not in INITS:
        problems.append(f"--init {cfg.init!r} is not one of {list(INITS)}")
    for flag, n in (("--eval-every", cfg.eval_every), ("--sample-every", cfg.sample_every)):
        if n and pp > 1:
            problems.append(f"{flag} needs a mesh without pp (the pipeline engine runs training steps only)")
        if n and cfg.data == "markov":
            problems.append(f"{flag} needs real text (--data PATH or the default stdlib), not --data markov")
    if cfg.eval_every and not 0 < cfg.heldout < 1:
        problems.append(f"--eval-every needs a held-out split: --heldout {cfg.heldout} must lie in (0, 1)")
    problems += _precision_and_sharding_problems(cfg, pp)
    problems += _context_parallel_problems(cfg)
    problems += models.pretrained_problems(cfg.model)
    if cfg.export_hf and not (models.is_hf_dir(cfg.model) or cfg.model in models.HF_MODELS):
        problems.append(f"--export-hf needs a Hugging Face model (a model directory or one of "
                        f"{sorted(models.HF_MODELS)}); {cfg.model} has no transformers class")
    if cfg.lr_schedule not in LR_SCHEDULES:
        problems.append(f"--lr-schedule {cfg.lr_schedule!r} is not one of {list(LR_SCHEDULES)}")
    if cfg.min_lr is not None and not 0 <= cfg.min_lr <= cfg.lr:
        problems.append(f"--min-lr {cfg.min_lr} must lie in [0, --lr {cfg.lr}]")
    if problems:
        raise SystemExit("train.py: the mesh does not fit the model or batch:\n  " + "\n  ".join(problems))


def _context_parallel_problems(cfg: TrainConfig) -> list[str]:
    """What refuses a ``cp`` mesh dim (``vescale.parallel.context_parallel``) in ``cfg``."""
    cp = cfg.dims.get("cp", 1)
    if cp == 1:
        return []
    problems = []  # (the built-in GPTs run through their causal_attention hook, transformers models as they are)
    if cfg.seq_len % (2 * cp):
        problems.append(f"--seq-len {cfg.seq_len} is not divisible by 2 x cp = {2 * cp} (each sequence is cut into "
                        f"2 x cp chunks, a head and a tail per cp rank)")
    other = sorted(set(cfg.dims) - {"pp", "dp", "cp", "tp"})
    # pp x cp x tp: a tp-sharded captured stage hands the cp attention operator DTensors sharded by heads, which it
    # takes (DTensor strategies registered in vescale.parallel.context_parallel); ZeRO 3 shards over dp x cp.
    if other or cfg.compile or cfg.eval_every or cfg.sample_every:
        problems.append(f"--mesh {cfg.mesh}: cp composes with pp, dp and tp (ZeRO 0-3, bf16, --grad-accum, activation "
                        f"checkpointing) in train.py; not with {', '.join(other) or 'ep/HSDP'}, --compile (cp under "
                        f"torch.compile is not verified against one device yet), --eval-every or --sample-every")
    return problems


def _precision_and_sharding_problems(cfg: TrainConfig, pp: int) -> list[str]:
    """What refuses ``--dtype``, ``--reduce-dtype``, ``--zero 3`` and the HSDP mesh dims in ``cfg``."""
    problems, dims = [], cfg.dims
    for flag, value in (("--dtype", cfg.dtype), ("--reduce-dtype", cfg.reduce_dtype)):
        if value not in DTYPES:
            problems.append(f"{flag} {value!r} is not one of {list(DTYPES)}")
    if cfg.reduce_dtype != "fp32" and cfg.dtype == "fp32":
        problems.append(f"--reduce-dtype {cfg.reduce_dtype} needs --dtype bf16 (fp32 parameters reduce in fp32)")
    hsdp = [n for n in HSDP_DIMS if n in dims]
    if hsdp and (len(hsdp) != 2 or "dp" in dims):
        problems.append(f"--mesh {cfg.mesh}: HSDP names both {' and '.join(HSDP_DIMS)} (replicas of ZeRO-3 shard "
                        f"groups) instead of dp, e.g. dp_replicate=2,dp_shard=2,tp=2")
    elif hsdp and cfg.zero != 3:
        problems.append(f"--mesh {cfg.mesh} is an HSDP mesh ({' x '.join(HSDP_DIMS)}): it needs --zero 3 (for ZeRO "
                        f"{cfg.zero} name one dp={dims[HSDP_DIMS[0]] * dims[HSDP_DIMS[1]]} instead)")
    if cfg.zero == 3 and pp > 1 and cfg.schedule in ("zb_h1", "zbv"):  # (the built-ins with BI / BW actions)
        problems.append(f"--zero 3 with --schedule {cfg.schedule} is not supported: FSDP2 reduce-scatters a stage's "
                        "gradients in autograd hooks that a split backward (BI / BW) does not reach; use gpipe, 1f1b "
                        "or interleaved_1f1b, or --zero 1 or 2")
    return problems


def _expert_parallel_problems(cfg: TrainConfig) -> list[str]:
    """What refuses an ``ep`` mesh dim in ``cfg`` (each reason named): ep composes with dp and tp (ZeRO 0-2, bf16,
    --grad-accum, activation checkpointing, --eval-every, --sample-every) and with pp (pp x [dp x] ep: ZeRO 0-2, bf16,
    activation checkpointing of each stage as one region)."""
    dims, problems = cfg.dims, []
    ep, dp, pp = dims.get("ep", 1), dims.get("dp", 1), dims.get("pp", 1)
    other = sorted(set(dims) - {"pp", "dp", "ep", "tp"})
    if other:
        problems.append(f"it composes with pp, dp and tp in train.py, not with {', '.join(other)}")
    if cfg.zero == 3:
        problems.append("--zero 3 is not supported (FSDP2 shards every parameter over dp, not composed with the "
                        "experts' Shard(0) over ep); use --zero 1 or 2")
    if cfg.compile:
        problems.append("--compile is not supported (untested: the token dispatch's split sizes are data-dependent)")
    # --eval-every / --sample-every: dp x ep [x tp] splits held-out rows as training rows (each ep rank its own part)
    # and samples the same rows on every rank in lockstep (tools/evaluate.py); pp x ep is refused by check_fits, as
    # every pp mesh is (the pipeline engine runs training steps only)
    rows = dp * ep * cfg.grad_accum * ((cfg.microbatches or 2 * pp) if pp > 1 else 1)
    if cfg.batch_size % rows:
        problems.append(f"--batch-size {cfg.batch_size} is not divisible by dp x ep x --grad-accum"
                        + (" x microbatches" if pp > 1 else "") + f" = {rows} (each ep rank runs its own rows)")
    if pp > 1:
        if dims.get("tp", 1) > 1:
            problems.append("pp x ep x tp is not supported (a captured stage's tp DTensors would reach the experts' "
                            "dispatch operator, which takes plain tensors)")
        if cfg.schedule in ("zb_h1", "zbv"):
            problems.append(f"--schedule {cfg.schedule} is not supported with pp x ep (its split backward would "
                            "re-run the experts' operator, all-to-alls included, in the weight pass); use gpipe, "
                            "1f1b or interleaved_1f1b")
        if cfg.dtype != "fp32" and (cfg.ckpt_every or cfg.resume):
            problems.append(f"checkpoints (--ckpt-every, --resume) of pp x ep with --dtype {cfg.dtype} are not "
                            "supported yet (the fp32 masters of the stages' plain [E / ep, ...] experts, moved into "
                            "the global tensors by vescale.parallel.expert_state, are untested); fp32 ones are")
    return problems


def parse_args(argv: list[str] | None, description: str) -> TrainConfig:
    """``TrainConfig`` from the command line ``argv``; a usage error (exit 2) for a malformed or unsupported mesh."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    d = TrainConfig()
    p.add_argument("--mesh", default=d.mesh, help="named mesh, e.g. pp=2,dp=2,tp=2 (product = number of ranks)")
    p.add_argument("--model", default=d.model,
                   help=f"one of {', '.join(models.MODELS)} (gpt-*: the GPT of tools/models.py; the others unmodified\n"
                        "transformers models), or a Hugging Face model directory (config.json + safetensors):\n"
                        "its weights, each rank reading only what it holds")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps of linear warm-up to --lr")
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=LR_SCHEDULES,
                   help="after the warm-up: cosine or linear decay to --min-lr at the last step, or constant")
    p.add_argument("--min-lr", type=float, default=d.min_lr, help="the decay's floor (default: --lr / 10)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="AdamW weight decay on matrices (ndim >= 2: linear weights, embeddings); never on norm\n"
                        "scales or biases")
    p.add_argument("--clip", type=float, default=d.clip, help="max global grad norm (0: off)")
    p.add_argument("--zero", type=int, default=d.zero, choices=[0, 1, 2, 3],
                   help="ZeRO stage over dp: 1 optimizer states, 2 + gradients (vescale DistributedOptimizer),\n"
                        "3 + parameters (torch FSDP2 per block). HSDP: --zero 3 on a mesh naming\n"
                        "dp_replicate=R,dp_shard=S instead of dp (S-way ZeRO 3 groups, R replicas of them)")
    p.add_argument("--dtype", default=d.dtype, choices=list(DTYPES),
                   help="bf16: bf16 parameters and compute, fp32 master weights and optimizer state (saved in\n"
                        "checkpoints); fp32 gradient accumulation and reduction unless --reduce-dtype bf16")
    p.add_argument("--reduce-dtype", default=d.reduce_dtype, choices=list(DTYPES),
                   help="with --dtype bf16: the dtype dp gradients are accumulated and reduced in")
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
    p.add_argument("--data", default=d.data,
                   help="what to train on: stdlib (default: this interpreter's standard library source, with a\n"
                        "byte-level BPE tokenizer trained on it at first use), markov (the synthetic corpus of the\n"
                        "equivalence tests), or a directory / glob / file of text (.jsonl: --data-field) or of ids\n"
                        "(.bin), tokenized once into a cached token file (tools/prepare_data.py)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="Hugging Face tokenizer directory for --data (default: the --model directory's own)")
    p.add_argument("--data-field", default=d.data_field, help="the text field of .jsonl records")
    p.add_argument("--heldout", type=float, default=d.heldout, help="fraction of documents held out")
    p.add_argument("--eval-every", type=int, default=d.eval_every, metavar="N",
                   help="held-out loss and perplexity every N steps and at the last (metrics.jsonl, loss.png)")
    p.add_argument("--sample-every", type=int, default=d.sample_every, metavar="N",
                   help="print greedy and sampled continuations every N steps (always at the end on real text)")
    p.add_argument("--prompt", default=None, help="the samples' prompt (default: the held-out split's start)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="async checkpoint every N steps (0: off)")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from (any mesh)")
    p.add_argument("--trace-steps", type=int, default=d.trace_steps, help="steps recorded in timeline.json")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="at the end, write the trained model as a directory transformers' from_pretrained loads\n"
                        "(config.json, safetensors, and the model directory's tokenizer when it has one)")
    p.add_argument("--peak-tflops", type=float, default=d.peak_tflops,
                   help="one device's peak TFLOP/s in the run's dtype: summary.json then reports the model\n"
                        "FLOPs utilisation (MFU, the formula in the README)")
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
    unsupported = sorted(set(cfg.dims) - {"pp", "dp", "cp", "tp", "ep", *HSDP_DIMS})
    if unsupported:
        p.error(f"--mesh {cfg.mesh}: dimension(s) {unsupported} are not supported by train.py (use pp, dp, cp, tp, "
                f"ep; HSDP: {', '.join(HSDP_DIMS)} instead of dp)")
    ep = cfg.dims.get("ep", 1)
    if ep > 1 and _expert_parallel_problems(cfg):
        p.error(f"--mesh {cfg.mesh}: expert parallelism (ep): " + "; ".join(_expert_parallel_problems(cfg)))
    return cfg
