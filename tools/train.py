"""Train a decoder-only LLM with nD parallelism (pipeline x data/ZeRO x tensor/sequence) on a named mesh.

    python tools/train.py                                  # 2 CPU ranks (dp=2), ~11M-param Llama-shaped GPT
    python tools/train.py --mesh pp=2,dp=2,tp=2 --zero 1 --schedule 1f1b --steps 200
    torchrun --nproc-per-node 8 tools/train.py --mesh dp=2,tp=4      # GPUs: the launcher's ranks, NCCL

Out of the box it spawns its own gloo ranks and trains on a corpus it generates: token sequences from a fixed random
sparse Markov chain, so the loss falls visibly from ln(vocab) towards the chain's entropy. Every rank generates the
same global batch of a step from ``(seed, step)`` and takes its data-parallel slice, so the loss curve is the
single-device curve whatever the mesh, and a run resumed from a checkpoint continues it exactly.

The model is built with deferred init by default (``--init deferred``): recorded on the meta device, then each rank
materialises only what it holds - its tensor-parallel shards, its pipeline stage (pp x tp: the stage's shards), or
the whole model for dp/ZeRO and one rank (each dp replica computing 1/dp of it, then all-gathering) - with
vescale's counter RNG, so every mesh starts from bitwise the 1-rank init. That RNG is much slower than torch's
(figures in the README). ``--init eager`` is the old way: every rank builds the whole model from torch's RNG, then
shards it.

Writes into ``--out``: ``metrics.jsonl`` (one line a step), ``loss.png``, ``timeline.json`` (+ ``.png``: the nD
timeline of a few traced steps), ``summary.json`` (with each rank's init seconds and MB built), and checkpoints under
``ckpt/step_N`` every ``--ckpt-every`` steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from vescale.core.launch import init_distributed, spawn
from vescale.core.mesh import dim_size, init_mesh, parse_mesh_spec, sub_mesh
from vescale.core.testing.models import GPT, GPTConfig, cross_entropy

MODEL_SIZES = {  # name -> GPTConfig fields
    "gpt-11m": dict(d_model=384, n_layer=6, n_head=6, n_kv_head=6, vocab_size=512, max_seq_len=256),
    "gpt-tiny": dict(d_model=64, n_layer=2, n_head=4, n_kv_head=2, vocab_size=128, max_seq_len=64),
}
# Unmodified Hugging Face architectures with small configs (no download): name -> (config class, model class, fields).
HF_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=512, n_embd=256, n_layer=4, n_head=8, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
}
MODELS = sorted([*MODEL_SIZES, *HF_MODELS])
INITS = ("deferred", "eager")


@dataclass
class ModelSpec:
    """What the trainer needs to know of a model, whatever its family."""

    vocab_size: int
    n_layer: int
    max_seq_len: int
    divisible: dict  # quantities tensor parallelism splits, name -> size


def model_spec(name: str) -> ModelSpec:
    """Sizes of model ``name`` that decide which meshes fit it, read from its config without building it."""
    if name in MODEL_SIZES:
        g = GPTConfig(**MODEL_SIZES[name])
        return ModelSpec(g.vocab_size, g.n_layer, g.max_seq_len,
                         dict(n_head=g.n_head, n_kv_head=g.n_kv_head, ffn_hidden=g.ffn_hidden, vocab_size=g.vocab_size))
    fields = HF_MODELS[name][2]
    heads = fields.get("num_attention_heads", fields.get("n_head"))
    divisible = dict(heads=heads, kv_heads=fields.get("num_key_value_heads", heads), vocab_size=fields["vocab_size"],
                     ffn=fields.get("intermediate_size", 4 * fields.get("n_embd", 0)))
    return ModelSpec(fields["vocab_size"], fields.get("num_hidden_layers", fields.get("n_layer")),
                     fields.get("max_position_embeddings", fields.get("n_positions")), divisible)


def build_model(name: str) -> torch.nn.Module:
    """The unmodified model named ``name``, initialised from the current torch seed."""
    if name in MODEL_SIZES:
        return GPT(GPTConfig(**MODEL_SIZES[name]))
    import transformers

    config_cls, model_cls, fields = HF_MODELS[name]
    # Eager attention: torch's CPU SDPA kernel has no DTensor sharding rule; matmul attention shards op by op.
    config = getattr(transformers, config_cls)(**fields, use_cache=False, tie_word_embeddings=False,
                                               attn_implementation="eager")
    return getattr(transformers, model_cls)(config)


def rank_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device this rank computes on, where every tensor a collective over ``group`` touches must live.

    NCCL (the backend of GPU runs) takes CUDA tensors only: ``cuda:<current device>``, which ``init_distributed`` /
    ``spawn`` set to the rank's local rank (and which torch's object collectives use too). Any other backend (gloo):
    the CPU. The same rule as ``vescale.core.mesh.init_mesh``'s mesh device type and ``PipeEngine.device``.
    """
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_per_rank(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``values`` (same length on every rank) as a ``[world, len(values)]`` float64 CPU tensor.

    Collective over ``group`` (default: all ranks): one ``all_gather`` of tensors on ``device``, which must be the
    rank's device (:func:`rank_device`), since NCCL refuses CPU tensors. Returned on every rank.
    """
    mine = torch.tensor([values], dtype=torch.float64, device=device)
    per_rank = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(per_rank, mine, group=group)
    return torch.cat(per_rank).cpu()


def init_model(name: str, seed: int, init: str, device: torch.device) -> torch.nn.Module:
    """Model ``name`` from ``seed``: built whole on ``device`` (``eager``), or only recorded on meta (``deferred``).

    ``deferred`` (the default) runs ``build_model`` under ``vescale.dtensor.deferred_init``: no parameter memory, and
    random init drawn from vescale's counter RNG, so that whatever part of the model a rank later materialises (a
    shard, a pipeline stage, all of it) is bitwise the slice of the single-device model. ``eager`` is the torch-RNG
    build of every rank (a different, equally valid init; same on every mesh).
    """
    from vescale.dtensor import deferred_init, random

    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    torch.manual_seed(seed)
    if init == "eager":
        return build_model(name).to(device)
    random.manual_seed(seed)
    return deferred_init(build_model, name)


def state_bytes(modules: list[torch.nn.Module]) -> int:
    """Bytes of the distinct parameters and buffers of ``modules`` as this rank holds them (DTensors: local shards)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            seen[id(t)] = t.to_local() if isinstance(t, DTensor) else t
    return sum(t.numel() * t.element_size() for t in seen.values())


def materialize_replicas(model: torch.nn.Module, dp_mesh, device: torch.device) -> None:
    """Materialise the whole deferred ``model`` on every rank of ``dp_mesh``, each rank computing 1/dp of it.

    The counter RNG is slow, so rather than every data-parallel replica replaying the whole init, each replays
    its ``Shard(0)`` slice of every parameter whose first dim divides by dp (bitwise the slice of the single-device
    value) and an all-gather over ``dp_mesh`` assembles the whole; the rest (norms, buffers) is computed whole.
    Tied parameters stay tied. Issues one all-gather per sharded parameter.
    """
    from torch.distributed.tensor import DTensor, Shard

    from vescale.dtensor import materialize

    dp = dp_mesh.size()
    split = {fqn: [Shard(0)] for fqn, p in model.named_parameters() if p.dim() and p.shape[0] % dp == 0}
    materialize(model, dp_mesh, split, device=device)
    whole: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if isinstance(p, DTensor):
                if id(p) not in whole:
                    whole[id(p)] = torch.nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                module._parameters[name] = whole[id(p)]


def pipeline_stages(model: torch.nn.Module, pp: int, microbatch: int, seq_len: int, device: torch.device,
                    mine: list[int], tp_mesh=None, plan: dict | None = None) -> list[torch.nn.Module | None]:
    """Split ``model`` into ``pp`` stages; materialise (sharded over ``tp_mesh`` by ``plan``) only the stages ``mine``.

    Returns every stage index, ``None`` for the stages of other pp ranks. An eager model is captured as it is and its
    stages share its (already real) tensors. A deferred model is captured through a CPU shadow of uninitialised
    tensors (``to_empty``: address space, no page is ever written, so no resident memory) rather than on the meta
    device, because model code branches on ``device.type`` (Mixtral's ``histc``) and must trace the CPU path; each
    stage of this rank then swaps in the model's own meta tensors by their original FQNs and materialises them,
    bitwise the single-device values. On a GPU the captured graph's CPU factory ops are moved to ``device``.
    """
    import copy

    from vescale.dtensor import adopt_deferred, is_deferred, materialize
    from vescale.parallel import parallelize_stage
    from vescale.pipe import capture, split

    deferred = is_deferred(model)
    traced = copy.deepcopy(model).to_empty(device="cpu") if deferred else model
    example = (torch.zeros(microbatch, seq_len, dtype=torch.long, device="cpu" if deferred else device),)
    exported = capture(traced, example)
    if deferred and device.type != "cpu":
        _move_graph_device(exported.graph, torch.device("cpu"), device)
    stages: list[torch.nn.Module | None] = list(split(traced, num_stages=pp, example_inputs=example,
                                                      exported=exported))
    embeddings = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    for i, stage in enumerate(stages):
        if i not in mine:
            stages[i] = None
            continue
        if deferred:
            adopt_deferred(stage, model)  # the model's meta tensors by FQN, and its init record to replay
        if tp_mesh is not None:  # parallelize_module materialises a deferred stage straight into shards
            parallelize_stage(stage, tp_mesh, plan, embeddings)
        elif deferred:
            materialize(stage, device=device)
        stage.to(device)  # tensors the capture lifted out of forward (constants) are on the CPU
    return stages


def _move_graph_device(graph: torch.fx.Graph, old: torch.device, new: torch.device) -> None:
    """Rewrite every ``device=old`` argument of ``graph``'s nodes (factories, ``to``) to ``new``, in place."""
    from torch.utils import _pytree as pytree

    def swap(value):
        return new if isinstance(value, torch.device) and value == old else value

    for node in graph.nodes:
        args, kwargs = pytree.tree_map(swap, (node.args, node.kwargs))
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs


def plan_for(name: str, tp_mesh, sequence_parallel: bool) -> dict:
    """The hand-written Megatron-style plan of ``vescale.parallel.plans`` for model family ``name``."""
    from vescale.parallel import plans

    family = name.split("-")[0]
    return getattr(plans, f"{family}_plan")(tp_mesh, dp=None, sequence_parallel=sequence_parallel)


def language_model_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a model output: logits, or a Hugging Face output with ``.logits``."""
    logits = output.logits if hasattr(output, "logits") else output["logits"] if isinstance(output, dict) else output
    return cross_entropy(logits, targets)


@dataclass
class TrainConfig:
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
    sequence_parallel: bool = False
    compile: bool = False  # torch.compile the blocks (vescale.parallel.compile_parallel) after parallelization
    init: str = "deferred"  # deferred: each rank materialises only what it holds; eager: every rank builds it all
    seed: int = 1234
    out: str = "runs/latest"
    ckpt_every: int = 0
    resume: str | None = None
    trace_steps: int = 3
    quiet: bool = False
    dims: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------------
# Data: a learnable synthetic corpus that every rank can generate for any step without communicating.


class MarkovCorpus:
    """Sequences from a fixed random Markov chain in which each token has ``fanout`` likely successors."""

    def __init__(self, vocab_size: int, seed: int, fanout: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.successors = torch.randint(0, vocab_size, (vocab_size, fanout), generator=g)
        self.probs = torch.softmax(torch.randn(vocab_size, fanout, generator=g) * 1.5, dim=-1)
        self.seed = seed

    def entropy(self) -> float:
        """Per-token entropy of the chain (nats): the lowest loss a model can reach."""
        return float(-(self.probs * self.probs.log()).sum(-1).mean())

    def batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """The global batch of ``step``: ``[batch_size, seq_len + 1]`` int64 (inputs and shifted targets)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        for t in range(seq_len):
            choice = torch.multinomial(self.probs[tokens[:, t]], 1, generator=g).squeeze(1)
            tokens[:, t + 1] = self.successors[tokens[:, t], choice]
        return tokens


# ---------------------------------------------------------------------------------------------------------------------
# Model, parallelism and optimizer.


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    """The model as this rank holds it, and one training step over a global batch."""

    def __init__(self, cfg: TrainConfig, mesh) -> None:
        from vescale.dtensor import is_deferred, materialize
        from vescale.parallel import (
            DistributedDataParallel,
            DistributedOptimizer,
            parallelize_module,
        )

        self.cfg, self.mesh = cfg, mesh
        self.pp, self.dp, self.tp = (dim_size(mesh, n) for n in ("pp", "dp", "tp"))
        self.dp_rank = sub_mesh(mesh, "dp").get_local_rank() if self.dp > 1 else 0
        self.spec = model_spec(cfg.model)
        check_fits(cfg, self.spec, self.pp, self.dp, self.tp)
        self.device = rank_device()  # the model, the batches and every collective's tensors live here
        t0 = time.perf_counter()
        model = init_model(cfg.model, cfg.seed, cfg.init, self.device)
        self.num_params = sum(p.numel() for p in model.parameters())
        full_bytes = state_bytes([model])  # the whole model's, whether built (eager) or only recorded (deferred)
        tp_mesh = sub_mesh(mesh, "tp") if self.tp > 1 else None
        stages, schedule = None, None
        if self.pp > 1:
            from vescale.pipe import build_schedule

            schedule = build_schedule(cfg.schedule, self.pp, self.microbatches, self.pp)
            stages = pipeline_stages(model, self.pp, cfg.batch_size // self.dp // self.microbatches, cfg.seq_len,
                                     self.device, schedule.stages_of(sub_mesh(mesh, "pp").get_local_rank()), tp_mesh,
                                     plan_for(cfg.model, tp_mesh, False) if tp_mesh is not None else None)
            local = [s for s in stages if s is not None]
        else:
            if tp_mesh is not None:  # a deferred model is materialised straight into this rank's shards
                model = parallelize_module(model, tp_mesh, plan_for(cfg.model, tp_mesh, cfg.sequence_parallel))
            elif is_deferred(model) and self.dp > 1:
                materialize_replicas(model, sub_mesh(mesh, "dp"), self.device)
            elif is_deferred(model):
                materialize(model, device=self.device)
            local = [model]
        #: Seconds and bytes (parameters + buffers) of building the model on this rank: eager builds it all.
        self.init_s = time.perf_counter() - t0
        self.init_bytes = full_bytes if cfg.init == "eager" else state_bytes(local)
        if cfg.compile and stages is None:
            from vescale.parallel import compile_parallel

            compile_parallel(model)
        self.model = model
        self.engine = None
        if stages is not None:
            from vescale.pipe import PipeEngine

            if cfg.compile:
                from vescale.parallel import compile_forward

                stages = [compile_forward(stage) if stage is not None else None for stage in stages]
            self.engine = PipeEngine(stages, sub_mesh(mesh, "pp"), schedule=schedule,
                                     num_microbatches=self.microbatches, loss_fn=language_model_loss,
                                     dp_group=sub_mesh(mesh, "dp").get_group() if self.dp > 1 else None)
            self.trained = [stage for stage in self.engine.stages.values()]
            self.optimizer = torch.optim.AdamW(self.engine.parameters(), lr=cfg.lr, weight_decay=0.0)
        elif self.dp > 1 or cfg.zero:
            self.ddp = DistributedDataParallel(model, sub_mesh(mesh, "dp"), zero_stage=2 if cfg.zero == 2 else 0)
            self.trained = [self.ddp]
            if cfg.zero:
                self.optimizer = DistributedOptimizer(torch.optim.AdamW, self.ddp, zero_stage=cfg.zero,
                                                      clip_grad=cfg.clip or None, lr=cfg.lr, weight_decay=0.0)
            else:
                self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        else:
            self.trained = [model]
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    @property
    def microbatches(self) -> int:
        return self.cfg.microbatches or 2 * self.pp

    def torch_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def step(self, step: int, tokens: torch.Tensor) -> float:
        """One optimizer step on this rank's slice of the global batch; returns the global mean loss."""
        from vescale.parallel import clip_grad_norm_
        from vescale.pipe.timeline import span

        local = tokens.chunk(self.dp)[self.dp_rank].to(self.device)
        inputs, targets = local[:, :-1].contiguous(), local[:, 1:].contiguous()
        for group in self.torch_optimizer().param_groups:
            group["lr"] = lr_at(step, self.cfg)
        self.optimizer.zero_grad(set_to_none=True)
        if self.engine is not None:
            loss = self.engine.step(inputs, targets).detach()
        else:
            with span("forward", cat="forward"):
                loss = language_model_loss(self.trained[0](inputs), targets)
            with span("backward", cat="backward"):
                loss.backward()
                if hasattr(self, "ddp"):
                    self.ddp.finish_grad_sync()
            loss = loss.detach()
        if self.cfg.clip and not self.cfg.zero:
            pp_group = sub_mesh(self.mesh, "pp").get_group() if self.pp > 1 else None
            clip_grad_norm_(self._params(), self.cfg.clip, pp_group=pp_group)
        self.optimizer.step()
        if self.dp > 1:  # the logged loss is the global-batch mean, as one device computes it
            loss = loss.clone()
            dist.all_reduce(loss, group=sub_mesh(self.mesh, "dp").get_group())
            loss /= self.dp
        return float(loss)

    def _params(self) -> list[torch.nn.Parameter]:
        if self.engine is not None:
            return self.engine.parameters()
        return [p for p in self.model.parameters() if p.grad is not None]

    def state(self) -> dict:
        """What a checkpoint holds: the model as this rank has it, the optimizer."""
        return {"model": self.model if self.engine is None else self.trained, "optim": self.optimizer}


def check_fits(cfg: TrainConfig, spec: ModelSpec, pp: int, dp: int, tp: int) -> None:
    """Refuse (SystemExit naming every reason) a mesh that does not fit the model or the batch."""
    problems = []
    if cfg.batch_size % dp:
        problems.append(f"--batch-size {cfg.batch_size} is not divisible by dp={dp}")
    if pp > 1 and (cfg.batch_size // max(dp, 1)) % (cfg.microbatches or 2 * pp):
        problems.append(f"the per-dp-rank batch {cfg.batch_size // dp} is not divisible by "
                        f"{cfg.microbatches or 2 * pp} microbatches")
    if pp > spec.n_layer:
        problems.append(f"pp={pp} exceeds the model's {spec.n_layer} layers")
    for what, n in spec.divisible.items():
        if n % tp:
            problems.append(f"model {cfg.model}: {what}={n} is not divisible by tp={tp}")
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


# ---------------------------------------------------------------------------------------------------------------------
# Reporting: progress bar, metrics, loss curve, summary.


class Progress:
    """A one-line progress bar on rank 0 (a line per ``every`` steps when stdout is not a terminal)."""

    def __init__(self, total: int, start: int, quiet: bool) -> None:
        self.total, self.start, self.quiet = total, start, quiet
        self.t0 = time.perf_counter()
        self.tty = sys.stdout.isatty()
        self.every = max(1, total // 20)

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if self.quiet:
            return
        done = step + 1 - self.start
        left = self.total - step - 1
        eta = (time.perf_counter() - self.t0) / max(done, 1) * left
        bar = "#" * int(24 * (step + 1) / self.total)
        line = (f"step {step + 1:>5}/{self.total} [{bar:<24}] loss {loss:7.4f} | {tok_s:8.0f} tok/s | "
                f"ETA {int(eta) // 60}m{int(eta) % 60:02d}s")
        if self.tty:
            print("\r" + line, end="\n" if left == 0 else "", flush=True)
        elif (step + 1) % self.every == 0 or left == 0 or step == self.start:
            print(line, flush=True)


def _plot_loss(metrics: list[dict], path: Path, floor: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train.py: matplotlib is not installed; skipping loss.png", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="training loss")
    ax.axhline(floor, color="gray", linestyle="--", label=f"corpus entropy {floor:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _peak_memory_mb() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------------------------------------------
# The job.


def train(cfg: TrainConfig) -> dict:
    """Run the job on this rank (the default process group is initialised); rank 0 returns the summary."""
    from vescale import checkpoint
    from vescale.pipe.timeline import Timeline

    rank = dist.get_rank()
    mesh = init_mesh(cfg.dims)
    trainer = Trainer(cfg, mesh)
    corpus = MarkovCorpus(trainer.spec.vocab_size, cfg.seed)
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    start = 0
    if cfg.resume:
        extra = {"step": 0}
        checkpoint.load(cfg.resume, {**trainer.state(), "progress": extra})
        start = int(extra["step"])
    metrics_file = open(out / "metrics.jsonl", "a" if cfg.resume else "w") if rank == 0 else None  # noqa: SIM115
    progress = Progress(cfg.steps, start, cfg.quiet or rank != 0)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    metrics, pending_save, timeline = [], None, None
    trace_at = min(start + 5, cfg.steps - cfg.trace_steps) if cfg.trace_steps else -1
    comm_s = traced_s = 0.0
    t_start = time.perf_counter()
    for step in range(start, cfg.steps):
        if step == trace_at:
            timeline = Timeline(mesh).__enter__()
        t0 = time.perf_counter()
        loss = trainer.step(step, corpus.batch(step, cfg.batch_size, cfg.seq_len))
        dt = time.perf_counter() - t0
        if timeline is not None and step == trace_at + cfg.trace_steps - 1:
            timeline.__exit__(None, None, None)
            trace = timeline.export(out / "timeline.json")
            if trace is not None:
                comm_s, traced_s = _comm_time(trace)
            timeline = None
        record = {"step": step + 1, "loss": loss, "lr": lr_at(step, cfg), "step_s": dt,
                  "tokens_per_s": tokens_per_step / dt}
        metrics.append(record)
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        progress.update(step, loss, tokens_per_step / dt)
        if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
            if pending_save is not None:
                pending_save.wait()
            pending_save = checkpoint.save(out / "ckpt" / f"step_{step + 1}",
                                           {**trainer.state(), "progress": {"step": step + 1}}, async_save=True)
    if pending_save is not None:
        pending_save.wait()
    wall = time.perf_counter() - t_start
    # one gather: peak memory MB, init seconds, init bytes of every rank
    per_rank = gather_per_rank([_peak_memory_mb(), trainer.init_s, trainer.init_bytes], trainer.device)
    if rank != 0:
        return {}
    metrics_file.close()
    steps_run = max(1, cfg.steps - start)
    summary = {
        "mesh": cfg.dims, "model": cfg.model, "parameters": trainer.num_params, "steps": cfg.steps,
        "first_loss": metrics[0]["loss"] if metrics else None, "final_loss": metrics[-1]["loss"] if metrics else None,
        "corpus_entropy": corpus.entropy(), "tokens_per_s": tokens_per_step * steps_run / wall, "wall_s": wall,
        "peak_memory_mb_per_rank": [round(float(p), 1) for p in per_rank[:, 0]], "init": cfg.init,
        "init_s_per_rank": [round(float(t), 3) for t in per_rank[:, 1]],
        "init_mb_per_rank": [round(float(b) / 2**20, 2) for b in per_rank[:, 2]],
        "communication_share_traced_steps": (comm_s / traced_s) if traced_s else None,
    }
    if metrics:
        _plot_loss(metrics, out / "loss.png", corpus.entropy())
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _comm_time(trace: dict) -> tuple[float, float]:
    """Seconds inside collectives and p2p on rank 0, and the traced wall span, from a Chrome trace."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("pid") == 0]
    if not events:
        return 0.0, 0.0
    comm = sum(e["dur"] for e in events if e.get("cat") in ("collective", "p2p")) / 1e6
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e6
    return comm, span


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    d = TrainConfig()
    p.add_argument("--mesh", default=d.mesh, help="named mesh, e.g. pp=2,dp=2,tp=2 (product = number of ranks)")
    p.add_argument("--model", default=d.model, choices=MODELS,
                   help="gpt-11m / gpt-tiny (vescale's reference GPT) or an unmodified transformers model")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--clip", type=float, default=d.clip, help="max global grad norm (0: off)")
    p.add_argument("--zero", type=int, default=d.zero, choices=[0, 1, 2], help="ZeRO stage over dp")
    p.add_argument("--schedule", default=d.schedule, help="pipeline schedule (pp > 1)")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="per step (pp > 1); 0: 2 x pp")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block (inductor)")
    p.add_argument("--init", default=d.init, choices=INITS,
                   help="deferred: meta build, each rank materialises only its shards/stage (vescale counter RNG);\n"
                        "eager: every rank builds the whole model from torch's RNG, then shards it")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="async checkpoint every N steps (0: off)")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from (any mesh)")
    p.add_argument("--trace-steps", type=int, default=d.trace_steps, help="steps recorded in timeline.json")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items()})
    try:
        cfg.dims = parse_mesh_spec(cfg.mesh)
    except ValueError as exc:
        p.error(str(exc))
    unsupported = sorted(set(cfg.dims) - {"pp", "dp", "tp"})
    if unsupported:
        p.error(f"--mesh {cfg.mesh}: dimension(s) {unsupported} are not supported by train.py (use pp, dp, tp)")
    return cfg


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    world = math.prod(cfg.dims.values())
    # Checked here, before any rank starts, so a bad mesh is one clear message rather than one per rank.
    check_fits(cfg, model_spec(cfg.model), *(cfg.dims.get(n, 1) for n in ("pp", "dp", "tp")))
    if "WORLD_SIZE" in os.environ:  # under torchrun: join its ranks
        init_distributed()
        try:  # leave the group even when the job fails (NCCL otherwise warns of a leaked communicator, or hangs)
            if dist.get_world_size() != world:
                raise SystemExit(f"train.py: --mesh {cfg.mesh} needs {world} ranks but torchrun started "
                                 f"{dist.get_world_size()}")
            summary = train(cfg)
        finally:
            dist.destroy_process_group()
    else:
        summary = spawn(train, world, cfg)
    if summary and not cfg.quiet:
        print(json.dumps({k: v for k, v in summary.items() if k != "peak_memory_mb_per_rank"}, default=str))
        print(f"peak memory per rank (MB): {summary['peak_memory_mb_per_rank']}; outputs in {cfg.out}/")
    return summary


if __name__ == "__main__":
    main()
