"""The configuration of ``tools/train.py``: :class:`TrainConfig`, its command line, and the check that a mesh fits
the model and the batch (made before any rank starts, so a bad mesh is one clear message)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

import lora
import models

from vescale.core.mesh import CANONICAL_DIM_ORDER, parse_mesh_spec
from vescale.plan.spec import DTYPES, ParallelSpec, SpecError

__all__ = ["INITS", "LR_SCHEDULES", "RUN_OUTPUTS", "TrainConfig", "check_fits", "lr_at", "parallel_spec", "parse_args",
           "prepare_out", "uses_document_mask"]

INITS = ("deferred", "eager")
LR_SCHEDULES = ("cosine", "linear", "constant")
#: TrainConfig fields that are ParallelSpec fields of another name (the rest share their names)
SPEC_FIELDS = {"dims": "mesh", "microbatches": "microbatches", "zero": "zero", "dtype": "dtype",
               "reduce_dtype": "reduce_dtype", "schedule": "schedule", "grad_accum": "grad_accum",
               "sequence_parallel": "sequence_parallel", "compile": "compile",
               "activation_checkpointing": "activation_checkpointing", "split_points": "split_points",
               "optimizer_state_dtype": "optimizer_state_dtype", "fp8": "fp8"}


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
    optimizer: str = "adamw"  # adamw | muon: Muon (torch.optim.Muon, owners of whole matrices) for hidden matrices
    optimizer_state_dtype: str = "fp32"  # fp32 | bf16: optimizer state (moments, momenta) kept in bf16, masters fp32
    fp8: str = "none"  # none | tensorwise | rowwise: torchao Float8Linear hidden linears (vescale.parallel.fp8)
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
    chat: bool = False  # --data FILE.jsonl holds conversations: chat template, assistant tokens trained (chat_data.py)
    chat_field: str = "messages"  # the conversation field (a list of {role, content}) of --chat records
    document_mask: bool = True  # packed real text: attend within each EOS-delimited document (off: markov, --chat)
    heldout: float = 0.02  # fraction of the documents held out (--eval-every, the sample prompt)
    eval_every: int = 0  # held-out loss every N steps and at the last (0: off)
    sample_every: int = 0  # print generations every N steps (0: only at the end of a run on real text)
    prompt: str | None = None  # the samples' prompt; None: the held-out split's first tokens
    out: str = "runs/latest"
    ckpt_every: int = 0
    resume: str | None = None  # a checkpoint directory, or auto: the newest complete one under --out
    resume_fallbacks: list[str] = field(default_factory=list)  # --resume auto: older complete ones, newest first
    max_bad_steps: int = 3  # consecutive non-finite steps skipped before the run stops (0: stop at the first)
    preempt_signal: str | None = None  # stop cleanly on it too (SIGTERM always), e.g. SIGUSR1 from SLURM
    tensorboard: bool = False  # event files under <out>/tensorboard (the tensorboard package)
    on_save_error: str = "stop"  # stop | continue: a checkpoint save that failed on some rank stops the run, or warns
    slow_rank: float = 1.5  # warn naming ranks whose busy step time is this many times the median rank's (0: off)
    trace_steps: int = 3
    quiet: bool = False
    grad_dump: str | None = None  # file: the first step's whole gradients by FQN (safetensors, rank 0 writes)
    collective_timeout: float | None = None  # seconds; None: $VESCALE_COLLECTIVE_TIMEOUT, else 300
    collective_ring: int = 0  # last collectives each rank records for the hang diagnosis (0: none, use torch's
    # flight recorder: no call sites, but no per-op cost)
    lora: dict | None = None  # --lora r=8,alpha=16,targets=q_proj,...: train LoRA adapters only (tools/lora.py)
    export_hf: str | None = None  # directory: the trained model as from_pretrained loads it (+ config, tokenizer)
    peak_tflops: float = 0.0  # one device's peak (dense, the run's dtype) for the MFU figure; 0: no MFU
    overwrite: bool = False  # replace another run's outputs in --out
    spec: str | None = None  # a ParallelSpec JSON file (vescale.plan); its fields replace the parallelism flags
    tp_plan: str | None = None  # "auto" or a vescale.parallel.PLANS family; None: the model family's hand plan
    split_points: list | None = None  # module FQNs starting pipeline stages 1..; None: balanced by parameters
    dims: dict = field(default_factory=dict)


def parallel_spec(cfg: TrainConfig) -> ParallelSpec:
    """The ``vescale.plan.ParallelSpec`` of ``cfg``'s parallelism flags (the tp plan: ``cfg.tp_plan``, else the
    model family's hand plan, else ``auto``)."""
    fields = {spec_name: getattr(cfg, name) for name, spec_name in SPEC_FIELDS.items()}
    return ParallelSpec(**fields, tp_plan=cfg.tp_plan or models.plan_family(cfg.model),
                        document_mask=uses_document_mask(cfg))


def uses_document_mask(cfg: TrainConfig) -> bool:
    """Whether the run masks attention per document: ``--document-mask`` (the default) on packed real text, whose
    documents are delimited by the tokenizer's EOS; the synthetic Markov corpus has no documents, and ``--chat``
    rows are one conversation each."""
    return cfg.document_mask and cfg.data != "markov" and not cfg.chat


#: What a run writes into ``--out`` (``collectives-rank*.json`` and ``flight-recorder-rank*`` too, after a hang)
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", "timeline.json", "timeline.png", "ckpt", "export-hf-ckpt",
               "tensorboard")


def prepare_out(cfg: TrainConfig, *, under_launcher: bool) -> None:
    """Settle ``cfg.out`` before any rank starts, so no run mixes its outputs with another's: the default is a new
    ``runs/run-<time>`` (``runs/latest`` links to it), or ``runs/latest`` itself under torchrun (whose ranks start
    apart and must agree on one name). A directory holding another run's outputs is refused (SystemExit naming them)
    unless ``--overwrite`` (they are removed first, by one process) or ``--resume`` names a checkpoint inside it (the
    run continues there). ``--resume`` must name a vescale checkpoint directory."""
    import shutil
    import time
    from pathlib import Path

    if cfg.resume is not None:
        resume = Path(cfg.resume)
        if not (resume / "metadata.json").is_file():
            hint = " (a run's checkpoints are its <out>/ckpt/step_N directories)" if resume.is_dir() else ""
            raise SystemExit(f"train.py: --resume {cfg.resume} is not a vescale checkpoint: no "
                             f"{resume / 'metadata.json'}{hint}")
        cfg.resume = str(resume.resolve())  # before runs/latest moves to the new run
    if cfg.out is None and not under_launcher:
        runs = Path("runs")
        out = runs / time.strftime("run-%Y%m%d-%H%M%S")
        while out.exists():
            out = out.with_name(out.name + "-1")
        out.mkdir(parents=True)
        latest = runs / "latest"
        if latest.is_symlink() or not latest.exists():
            latest.unlink(missing_ok=True)
            latest.symlink_to(out.name)
        cfg.out = str(out)
        return
    cfg.out = cfg.out or "runs/latest"
    out = Path(cfg.out)
    found = [n for n in RUN_OUTPUTS if (out / n).exists()]
    found += sorted(p.name for p in out.glob("collectives-rank*.json"))
    inside = cfg.resume is not None and out.exists() and Path(cfg.resume).is_relative_to(out.resolve())
    if not found or inside:
        return
    if not cfg.overwrite:
        raise SystemExit(f"train.py: --out {cfg.out} holds another run's outputs ({', '.join(found)}); pass "
                         "--overwrite to replace them, --resume one of its checkpoints to continue that run, or "
                         "another --out")
    if os.environ.get("RANK", "0") == "0":  # (torchrun: one process removes them)
        for name in found:
            target = out / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()


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


def check_fits(cfg: TrainConfig) -> ParallelSpec:
    """The run's parallelism spec; refuse (SystemExit naming every reason) one that cannot be built, or that does not
    fit the model or the batch. Made before any rank starts: no process group, no model weights."""
    spec = parallel_spec(cfg)
    problems = spec.problems(batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    shape = models.model_spec(cfg.model)
    pp, tp, ep = spec.size("pp"), spec.size("tp"), spec.size("ep")
    numeric = {"--steps": (cfg.steps, 1), "--batch-size": (cfg.batch_size, 1), "--seq-len": (cfg.seq_len, 1),
               "--warmup": (cfg.warmup, 0), "--ckpt-every": (cfg.ckpt_every, 0), "--eval-every": (cfg.eval_every, 0),
               "--sample-every": (cfg.sample_every, 0), "--trace-steps": (cfg.trace_steps, 0),
               "--collective-ring": (cfg.collective_ring, 0), "--max-bad-steps": (cfg.max_bad_steps, 0)}
    problems += [f"{flag} {value} must be at least {least}" for flag, (value, least) in numeric.items()
                 if value < least]
    for flag, value in (("--lr", cfg.lr), ("--weight-decay", cfg.weight_decay), ("--clip", cfg.clip),
                        ("--peak-tflops", cfg.peak_tflops), ("--slow-rank", cfg.slow_rank)):
        if not math.isfinite(value) or value < 0 or (flag == "--lr" and value == 0):
            problems.append(f"{flag} {value} must be a finite number " + ("above 0" if flag == "--lr" else ">= 0"))
    if pp > shape.n_layer:
        problems.append(f"pp={pp} exceeds the model's {shape.n_layer} layers")
    problems += [f"model {cfg.model}: {what}={n} is not divisible by tp={tp}" for what, n in shape.divisible.items()
                 if n % tp]
    if ep > 1 and not shape.experts:
        problems.append(f"ep={ep} needs a model with experts; {cfg.model} has none (e.g. --model mixtral)")
    elif ep > 1 and shape.experts % ep:
        problems.append(f"model {cfg.model}: its {shape.experts} experts are not divisible by ep={ep}")
    if cfg.seq_len > shape.max_seq_len:
        problems.append(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len={shape.max_seq_len}")
    for flag, n in (("--eval-every", cfg.eval_every), ("--sample-every", cfg.sample_every)):
        if n and pp > 1:
            problems.append(f"{flag} needs a mesh without pp (the pipeline engine runs training steps only)")
        if n and spec.size("cp") > 1:
            problems.append(f"{flag} needs a mesh without cp (the cp model takes training rows only)")
        if n and cfg.data == "markov":
            problems.append(f"{flag} needs real text (--data PATH or the default stdlib), not --data markov")
    if cfg.eval_every and not 0 < cfg.heldout < 1:
        problems.append(f"--eval-every needs a held-out split: --heldout {cfg.heldout} must lie in (0, 1)")
    if pp > 1 and ep > 1 and cfg.dtype != "fp32" and (cfg.ckpt_every or cfg.resume):
        problems.append(f"checkpoints (--ckpt-every, --resume) of pp x ep with --dtype {cfg.dtype} are not "
                        "supported yet (the fp32 masters of the stages' plain [E / ep, ...] experts, placed in the "
                        "global tensors by their GlobalPiece marks, are untested); fp32 ones are")
    problems += models.pretrained_problems(cfg.model)
    problems += lora.lora_problems(cfg)
    if cfg.export_hf and not (models.is_hf_dir(cfg.model) or cfg.model in models.HF_MODELS):
        problems.append(f"--export-hf needs a Hugging Face model (a model directory or one of "
                        f"{sorted(models.HF_MODELS)}); {cfg.model} has no transformers class")
    if cfg.fp8 != "none" and cfg.init != "eager":
        problems.append(f"--fp8 {cfg.fp8} needs --init eager (torchao swaps the linears, which deferred init cannot "
                        "record)")
    if cfg.optimizer == "muon" and (cfg.reduce_dtype != "fp32" or ep > 1 or (pp > 1 and cfg.zero == 3
                                                                          and cfg.dtype != "fp32")):
        problems.append(f"--optimizer muon needs fp32 gradients, no ep, and fp32 with pp x ZeRO 3 (got --reduce-dtype "
                        f"{cfg.reduce_dtype}, ep={ep}, --dtype {cfg.dtype} with pp={pp}, --zero {cfg.zero})")
    if cfg.preempt_signal is not None:
        from vescale.core.preemption import signal_number

        try:
            signal_number(cfg.preempt_signal)
        except ValueError as exc:
            problems.append(f"--preempt-signal: {exc}")
    if cfg.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            problems.append("--tensorboard needs the tensorboard package, which is not installed (pip install "
                            "tensorboard)")
    if cfg.min_lr is not None and not 0 <= cfg.min_lr <= cfg.lr:
        problems.append(f"--min-lr {cfg.min_lr} must lie in [0, --lr {cfg.lr}]")
    if problems:
        raise SystemExit("train.py: the run cannot start:\n  " + "\n  ".join(dict.fromkeys(problems)))
    return spec


class _HelpFormat(argparse.ArgumentDefaultsHelpFormatter, argparse.RawTextHelpFormatter):
    """``--help`` with each flag's default, help lines kept as written."""


def _schedules() -> list[str]:
    from vescale.pipe.schedule import schedule_names

    return schedule_names()


def _lora_arg(text: str) -> dict:
    try:
        return lora.parse_lora(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None, description: str) -> TrainConfig:
    """``TrainConfig`` from the command line ``argv``; a usage error (exit 2) for a malformed or unsupported mesh."""
    p = argparse.ArgumentParser(description=description, formatter_class=_HelpFormat)
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
    p.add_argument("--optimizer", default=d.optimizer, choices=["adamw", "muon"],
                   help="muon: torch.optim.Muon on the hidden 2-D weights (at AdamW's update RMS, lr and decay),\n"
                        "AdamW on the rest; state and update owned by whole matrices under ZeRO 1/2/3 and tp")
    p.add_argument("--optimizer-state-dtype", default=d.optimizer_state_dtype, choices=list(DTYPES),
                   help="bf16: AdamW moments (and Muon momenta) kept in bf16 between steps, computed in fp32 over\n"
                        "fp32 master weights (vescale.parallel.low_precision_state): half the state bytes")
    p.add_argument("--fp8", default=d.fp8, choices=["none", "tensorwise", "rowwise"],
                   help="hidden linears as torchao Float8Linear (dynamic scaling; needs vescale-parallel[fp8]);\n"
                        "with --zero 3, tensorwise and no tp their weights are all-gathered in fp8")
    p.add_argument("--zero", type=int, default=d.zero, choices=[0, 1, 2, 3],
                   help="ZeRO stage over dp: 1 optimizer states, 2 + gradients (vescale DistributedOptimizer),\n"
                        "3 + parameters (torch FSDP2 per block). HSDP: --zero 3 on a mesh naming\n"
                        "dp_replicate=R,dp_shard=S instead of dp (S-way ZeRO 3 groups, R replicas of them)")
    p.add_argument("--dtype", default=d.dtype, choices=list(DTYPES),
                   help="bf16: bf16 parameters and compute, fp32 master weights and optimizer state (saved in\n"
                        "checkpoints); fp32 gradient accumulation and reduction unless --reduce-dtype bf16")
    p.add_argument("--reduce-dtype", default=d.reduce_dtype, choices=list(DTYPES),
                   help="with --dtype bf16: the dtype dp gradients are accumulated and reduced in")
    p.add_argument("--schedule", default=d.schedule, help="pipeline schedule (pp > 1): one of "
                   + ", ".join(_schedules()))
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
    p.add_argument("--chat", action="store_true",
                   help="--data FILE.jsonl holds conversations, formatted by the tokenizer's chat template; only\n"
                        "the assistant's tokens are trained (one conversation per row, padded)")
    p.add_argument("--document-mask", action=argparse.BooleanOptionalAction, default=d.document_mask,
                   help="packed real text: each token attends only within its own document (EOS-delimited),\n"
                        "positions restarting per document, as Llama 3 pretrained (default on; --no-document-mask:\n"
                        "attend across the whole packed row)")
    p.add_argument("--chat-field", default=d.chat_field,
                   help="the conversation field of --chat records (a list of {role, content})")
    p.add_argument("--heldout", type=float, default=d.heldout, help="fraction of documents held out")
    p.add_argument("--eval-every", type=int, default=d.eval_every, metavar="N",
                   help="held-out loss and perplexity every N steps and at the last (metrics.jsonl, loss.png)")
    p.add_argument("--sample-every", type=int, default=d.sample_every, metavar="N",
                   help="print greedy and sampled continuations every N steps (always at the end on real text)")
    p.add_argument("--prompt", default=None, help="the samples' prompt (default: the held-out split's start)")
    p.add_argument("--out", default=None,
                   help="the run's directory (default: a new runs/run-<time>, linked as runs/latest; under torchrun\n"
                        "runs/latest). One that holds another run's outputs is refused unless --overwrite (or\n"
                        "--resume from a checkpoint inside it)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the outputs (metrics, plots, summary, checkpoints) another run left in --out")
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="async checkpoint every N steps (0: off)")
    p.add_argument("--resume", default=None,
                   help="checkpoint directory to resume from (any mesh), or auto: the newest complete and intact\n"
                        "<out>/ckpt/step_N (skipping damaged ones, saying which; an error if every complete one is\n"
                        "damaged), else start fresh in --out")
    p.add_argument("--max-bad-steps", type=int, default=d.max_bad_steps, metavar="N",
                   help="a step with a non-finite loss or gradient on any rank is skipped on every rank; one more\n"
                        "than N in a row stops the run (NonFiniteStepError) after a checkpoint of the last good\n"
                        "state (0: stop at the first)")
    p.add_argument("--preempt-signal", default=None, metavar="SIGNAL",
                   help="besides SIGTERM, this signal (e.g. SIGUSR1, which SLURM's --signal sends before a time\n"
                        "limit) makes every rank finish its step, checkpoint and exit 0")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to <out>/tensorboard (needs the tensorboard package)")
    p.add_argument("--on-save-error", default=d.on_save_error, choices=["stop", "continue"],
                   help="a checkpoint save that fails on any rank (disk full, permission, storage backend) raises on\n"
                        "every rank naming the file; stop: the run stops with it; continue: a warning, training goes\n"
                        "on (the previous checkpoint stays the newest complete one)")
    p.add_argument("--slow-rank", type=float, default=d.slow_rank, metavar="RATIO",
                   help="warn naming ranks whose median busy step time (step time less collective waits) is at\n"
                        "least RATIO times the median rank's (0: off); summary.json has every rank's figures")
    p.add_argument("--trace-steps", type=int, default=d.trace_steps, help="steps recorded in timeline.json")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="at the end, write the trained model as a directory transformers' from_pretrained loads\n"
                        "(config.json, safetensors, and the model directory's tokenizer when it has one)")
    p.add_argument("--lora", default=None, type=_lora_arg, metavar="r=R,alpha=A,targets=NAME[,NAME...]",
                   help="train LoRA adapters (peft) on the named modules of a transformers --model, the base\n"
                        "frozen; checkpoints hold the adapters, --export-hf also writes them to DIR/adapter")
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
    p.add_argument("--tp-plan", default=None, metavar="PLAN",
                   help="the tensor-parallel plan: auto (vescale.plan.auto_plan) or a family of\n"
                        "vescale.parallel.PLANS (default: the model family's hand plan, else auto)")
    p.add_argument("--split-points", default=None, type=lambda text: [s for s in text.split(",") if s],
                   metavar="FQN[,FQN]", help="module FQNs starting pipeline stages 1.. (default: balanced by\n"
                                             "parameter count)")
    p.add_argument("--spec", default=None, metavar="FILE",
                   help="a parallelism spec (JSON: vescale.plan.ParallelSpec.to_json, e.g. the planner's choice,\n"
                        "auto_parallelize(...).report.spec()): its mesh, ZeRO stage,\n"
                        "dtypes, tp plan, schedule, microbatches, split points, grad-accum, activation\n"
                        "checkpointing and compile replace those flags")
    args = p.parse_args(argv)
    cfg = TrainConfig(**vars(args))
    if cfg.spec is not None:
        try:
            spec = ParallelSpec.from_json(open(cfg.spec).read())
        except (OSError, SpecError) as exc:
            p.error(f"--spec {cfg.spec}: {exc}")
        for name, spec_name in SPEC_FIELDS.items():
            setattr(cfg, name, getattr(spec, spec_name))
        cfg.mesh = ",".join(f"{k}={v}" for k, v in spec.mesh.items())
        cfg.tp_plan = spec.tp_plan
        return cfg
    try:
        cfg.dims = parse_mesh_spec(cfg.mesh)
    except ValueError as exc:
        p.error(str(exc))
    unsupported = sorted(set(cfg.dims) - set(CANONICAL_DIM_ORDER))
    if unsupported:
        p.error(f"--mesh {cfg.mesh}: dimension(s) {unsupported} are not supported by train.py (use pp, dp, cp, tp, "
                f"ep; HSDP: dp_replicate, dp_shard instead of dp)")
    return cfg
