"""Generate text with an unmodified Hugging Face causal LM, tensor parallel (and data parallel) on a named mesh.

    python tools/generate.py --model DIR --mesh tp=2 --prompt "Once upon a time" --max-new-tokens 64
    python tools/generate.py --model DIR --mesh dp=2,tp=2 --prompt "a" --prompt "b" --do-sample --seed 3 --top-p 0.9
    python tools/generate.py --model DIR --token-ids 1,5,9 --token-ids 1,7   # a directory without a tokenizer
    python tools/generate.py --model DIR --mesh tp=2 --prompt "a" --compile   # torch.compile'd decode step
    torchrun --nproc-per-node 4 tools/generate.py --model DIR --mesh dp=2,tp=2 --prompt ...   # joins its ranks

``DIR`` is a ``save_pretrained`` directory: ``config.json`` plus ``model.safetensors`` (or sharded safetensors with
``model.safetensors.index.json``), and a tokenizer if it has one. The model is recorded on the meta device
(``vescale.dtensor.deferred_init``), sharded by its family's hand plan (``vescale.parallel.PLANS``; other families by
``vescale.plan.auto_plan``) and filled by ``vescale.checkpoint.import_hf``: each rank opens the safetensors files
memory-mapped and copies only the boxes of its own shards, so the pages it touches are those of its slices (a
row-sharded weight is one contiguous range; a column-sharded one a strided range of every row). No rank ever holds a
whole sharded weight. A model with fewer key/value heads than tp ranks (GQA/MQA) is planned by ``auto_plan``
(``k_proj``/``v_proj`` replicated) and each rank's KV cache keeps only the kv head its query heads read
(``parallelize_module`` sets this up: ``vescale.parallel.kv_replicas``; the summary counts the layers as
``kv_replica_layers``).

All prompts are tokenized together, left-padded to one length, and split into ``dp`` contiguous groups: each dp group
generates its own rows (``model.generate`` of the parallelized model). Greedy output is what one device's
``generate`` of the whole batch gives. Sampling: every rank seeds torch's generator with ``--seed``; the ranks of a tp
group compute the same full logits (the plan gathers them) and so draw the same tokens, which is checked after the run
(the tokens of the tp group are compared; a difference is an error, never a silent result). With ``dp > 1`` each dp
group's draws are what one device draws for *that group's* prompts under ``--seed`` (a batch is one random stream;
the groups are independent batches, as independent servers are).

Rank 0 (only) streams the text of its first prompt as it is produced (``[0] ...``), then prints the other completions
(``[1] ...``; each text once) and a JSON summary: prefill seconds, decode tokens/s, KV-cache bytes and peak memory per
rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from vescale.core.launch import init_distributed, spawn
from vescale.core.mesh import parse_mesh_spec

TOOLS = str(Path(__file__).resolve().parent)
if TOOLS not in sys.path:  # models.py and report.py live next to this file (tests load it by path)
    sys.path.insert(0, TOOLS)
from models import load_sharded  # noqa: E402  (shared with train.py --model DIR)
from report import gather_per_rank, peak_memory_mb, state_bytes  # noqa: E402

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class GenerateConfig:
    model: str = ""
    mesh: str = "tp=2"
    prompt: list[str] = field(default_factory=list)
    token_ids: list[str] = field(default_factory=list)
    max_new_tokens: int = 64
    do_sample: bool = False
    seed: int = 0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    static_cache: bool = False
    compile: bool = False
    plan: str = "hand"
    dtype: str = "float32"
    quiet: bool = False
    chat: bool = False  # each --prompt a user turn of the tokenizer's chat template, its assistant turn opened
    dims: dict = field(default_factory=dict)


def fail(message: str) -> None:
    raise SystemExit(f"generate.py: {message}")


def parse_args(argv: list[str] | None) -> GenerateConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    d = GenerateConfig()
    p.add_argument("--model", required=True, help="a save_pretrained directory (config.json + safetensors)")
    p.add_argument("--mesh", default=d.mesh, help="named mesh of dp and tp, e.g. tp=2 or dp=2,tp=2")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    p.add_argument("--token-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeat for a batch); for directories without a "
                        "tokenizer")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--seed", type=int, default=d.seed, help="torch's generator on every rank (sampling)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--static-cache", action="store_true", help="a StaticCache (preallocated, sharded by heads)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (implies --static-cache): HF generate's own compiled forward, "
                        "inductor, static shapes")
    p.add_argument("--plan", default=d.plan, choices=["hand", "auto"],
                   help="hand: vescale.parallel.PLANS by model_type (auto_plan for other families); auto: auto_plan")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quiet", action="store_true", help="no streaming and no completions; only the JSON summary")
    p.add_argument("--chat", action="store_true",
                   help="format each --prompt as a user turn of the tokenizer's chat template (a chat fine-tune)")
    cfg = GenerateConfig(**vars(p.parse_args(argv)))
    cfg.static_cache = cfg.static_cache or cfg.compile  # a compiled decode step needs a static (fixed-shape) cache
    try:
        cfg.dims = parse_mesh_spec(cfg.mesh)
    except ValueError as exc:
        p.error(str(exc))
    if set(cfg.dims) - {"dp", "tp"}:
        p.error(f"--mesh {cfg.mesh}: generate.py takes dp and tp dims only, got {sorted(cfg.dims)}")
    return cfg


def check(cfg: GenerateConfig) -> None:
    """Refuse, before any rank starts, what cannot run: one SystemExit naming every problem."""
    problems = []
    src = Path(cfg.model)
    if not src.is_dir():
        fail(f"--model {cfg.model}: no such directory")
    if not (src / "config.json").is_file():
        fail(f"--model {cfg.model}: no config.json (expected a save_pretrained directory)")
    if not any((src / f).is_file() for f in WEIGHT_FILES):
        problems.append(f"--model {cfg.model}: no safetensors weights (neither of {list(WEIGHT_FILES)})")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src)
    tp, dp = cfg.dims.get("tp", 1), cfg.dims.get("dp", 1)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        problems.append(f"{config.model_type}: {heads} attention heads are not divisible by tp={tp}")
    if kv_heads and kv_heads % tp and tp % kv_heads:
        problems.append(f"{config.model_type}: num_key_value_heads={kv_heads} and tp={tp}: the kv heads neither divide "
                        f"over the tp ranks nor replicate over them (tp must be a multiple of num_key_value_heads)")
    if cfg.prompt and cfg.token_ids:
        problems.append("give --prompt or --token-ids, not both")
    n = len(cfg.prompt) + len(cfg.token_ids)
    if n == 0:
        problems.append("no prompt: give --prompt TEXT (or --token-ids 1,2,3) at least once")
    elif n % dp:
        problems.append(f"{n} prompts do not split into dp={dp} equal groups")
    if cfg.prompt and not has_tokenizer(src):
        problems.append(f"--model {cfg.model} has no tokenizer: give prompts as --token-ids 1,2,3")
    elif cfg.chat and not cfg.prompt:
        problems.append("--chat formats --prompt text with the chat template; give --prompt")
    elif cfg.chat:
        from transformers import AutoTokenizer

        if not getattr(AutoTokenizer.from_pretrained(src), "chat_template", None):
            problems.append(f"--chat: the tokenizer of --model {cfg.model} has no chat template")
    for ids in cfg.token_ids:
        try:
            bad = [t for t in map(int, ids.split(",")) if not 0 <= t < config.vocab_size]
        except ValueError:
            problems.append(f"--token-ids {ids!r}: not comma-separated integers")
            continue
        if bad:
            problems.append(f"--token-ids {ids!r}: ids {bad} outside the vocabulary [0, {config.vocab_size})")
    if cfg.compile and kv_heads and kv_heads < tp:
        problems.append(f"--compile with num_key_value_heads={kv_heads} fewer than tp={tp}: not supported (the kv-head "
                        f"replication wraps the cache in Python hooks, which have not been run under torch.compile)")
    if cfg.max_new_tokens < 1:
        problems.append(f"--max-new-tokens {cfg.max_new_tokens}: must be at least 1")
    if problems:
        fail("cannot run:\n  " + "\n  ".join(problems))


def has_tokenizer(src: Path) -> bool:
    return any((src / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                              "tokenizer.model"))


def encode(cfg: GenerateConfig, config, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Every prompt, left-padded to one length: ``(input_ids, attention_mask)`` of the whole batch."""
    if tokenizer is not None and cfg.prompt:
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        texts = cfg.prompt
        if cfg.chat:  # the template writes its own special tokens (BOS included)
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                   add_generation_prompt=True) for p in cfg.prompt]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not cfg.chat)
        return batch["input_ids"], batch["attention_mask"]
    rows = [[int(t) for t in ids.split(",")] for ids in cfg.token_ids]
    width = max(map(len, rows))
    pad = pad_id(config)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def pad_id(config) -> int:
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


class Stream:
    """A ``generate`` streamer: times the prefill and every decode step; on rank 0 prints row 0's text as it comes,
    labelled ``[0]`` as :func:`completion_lines` labels the other rows (ids as a list when there is no tokenizer)."""

    def __init__(self, tokenizer, echo: bool) -> None:
        self.tokenizer, self.echo, self.times, self.row, self.shown = tokenizer, echo, [], [], ""

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) == 1:  # the prompt
            return
        self.row.append(int(value.reshape(-1)[0]))
        if self.echo:
            text = self.tokenizer.decode(self.row, skip_special_tokens=True) if self.tokenizer else \
                "[" + ", ".join(map(str, self.row))
            if not self.shown:
                print("[0] ", end="")
            elif not text.startswith(self.shown):  # the decode of the longer row rewrote earlier text
                print("\n[0] ", end="")
                self.shown = ""
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text

    def end(self) -> None:
        if self.echo and self.row:
            print("" if self.tokenizer else "]", flush=True)


def completion_lines(rows: list, streamed: bool) -> list[str]:
    """The printed completions, ``[i] row``: every row but the first when rank 0 has already streamed it (each text
    is printed once)."""
    return [f"[{i}] {row}" for i, row in enumerate(rows) if not (streamed and i == 0)]


CACHE_RENAME_WARNING = "`past_key_values`/`cache_params` are deprecated"


class _DropCacheRename(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return CACHE_RENAME_WARNING not in record.getMessage()


def quiet_cache_rename_warning() -> None:
    """Drop transformers' "`past_key_values`/`cache_params` are deprecated. Use `cache` instead." on this rank.

    It is noise a user of this tool cannot act on: the sharded model's boundary (``vescale.parallel.fast``) still
    reads and passes the cache under its transformers 4 name, which transformers 5 warns about once per process,
    i.e. once per rank. Only that message is dropped; transformers' other warnings still print."""
    log = logging.getLogger("transformers.utils.generic")
    if not any(isinstance(f, _DropCacheRename) for f in log.filters):
        log.addFilter(_DropCacheRename())


def cache_bytes(cache) -> int:
    """Bytes of keys and values this rank holds in ``cache`` (DTensors: the local shards)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                t = t.to_local() if isinstance(t, DTensor) else t
                total += t.numel() * t.element_size()
    return total


def kv_replicated(cfg: GenerateConfig) -> bool:
    """Whether the model has fewer key/value heads than tp ranks (GQA/MQA): they are then replicated over the ranks
    that share them (:mod:`vescale.parallel.kv_replicas`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model)
    kv = getattr(config, "num_key_value_heads", None)
    return bool(kv) and kv < cfg.dims.get("tp", 1)


def plan_for(cfg: GenerateConfig) -> str:
    """``auto`` for fewer kv heads than tp ranks (``auto_plan`` replicates k/v there; the loader's hand plans split
    them inside a head, which is correct but replicates the cache), else ``--plan``."""
    return "auto" if kv_replicated(cfg) else cfg.plan


def compile_config():
    """HF ``generate``'s compiled decode step on any device: its forward is ``torch.compile``d (inductor, static
    shapes, ``mode="default"``: the default ``reduce-overhead`` captures CUDA graphs) and called for every decode step
    after the eager prefill. ``_compile_all_devices`` is transformers' switch for compiling off CUDA/XPU (a
    transformers attribute, not torch's)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True
    return config


def generate(cfg: GenerateConfig) -> dict:
    """Run on this rank (the default process group is initialised); rank 0 returns the summary."""
    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel.kv_replicas import kv_replicated_modules

    quiet_cache_rename_warning()
    rank = dist.get_rank()
    dp, tp = cfg.dims.get("dp", 1), cfg.dims.get("tp", 1)
    mesh = init_mesh({"dp": dp, "tp": tp} if dp > 1 else {"tp": tp})
    dp_rank = mesh.get_local_rank("dp") if dp > 1 else 0
    t0 = time.perf_counter()
    model, config = load_sharded(cfg.model, mesh, plan_for(cfg), getattr(torch, cfg.dtype))
    load_s = time.perf_counter() - t0
    # kv heads fewer than tp: parallelize_module set each rank's cache to keep only the kv head it reads
    replicas = len(kv_replicated_modules(model))
    tokenizer = None
    if has_tokenizer(Path(cfg.model)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    ids, mask = encode(cfg, config, tokenizer)
    rows = ids.shape[0] // dp
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    stream = Stream(tokenizer, echo=rank == 0 and not cfg.quiet)
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.do_sample, pad_token_id=pad_id(config),
                  return_dict_in_generate=True, streamer=stream)
    if cfg.do_sample:
        kwargs.update(temperature=cfg.temperature, top_k=cfg.top_k or 0, top_p=cfg.top_p or 1.0)
    if cfg.static_cache:
        kwargs["cache_implementation"] = "static"
    if cfg.compile:
        kwargs["compile_config"] = compile_config()
    torch.manual_seed(cfg.seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids[mine], attention_mask=mask[mine], **kwargs)
    new = out.sequences[:, ids.shape[1]:]
    if tp > 1:  # every rank of a tp group must hold the same tokens: checked, never assumed
        tp_group = sub_mesh(mesh, "tp").get_group()
        seen = [None] * tp
        dist.all_gather_object(seen, new.tolist(), group=tp_group)
        if any(s != seen[0] for s in seen):
            raise RuntimeError(f"generate.py: the ranks of tp group {dp_rank} drew different tokens: {seen}")
    steps = len(stream.times) - 1
    prefill_s = stream.times[1] - stream.times[0] if steps >= 1 else float("nan")
    decode_s = stream.times[-1] - stream.times[1] if steps >= 2 else float("nan")
    kv = cache_bytes(out.cache)
    completions = [None] * dist.get_world_size()
    dist.all_gather_object(completions, new.tolist())
    # the last collective: gather_per_rank returns only once gloo has let go of its tensors, so a rank that exits
    # right after it cannot free them from gloo's thread during shutdown (an abort; see tools/report.py)
    per_rank = gather_per_rank([peak_memory_mb(), kv, state_bytes([model]), prefill_s, decode_s, steps, load_s],
                               torch.device("cpu"))
    if rank != 0:
        return {}
    groups = [completions[g * tp] for g in range(dp)]  # the first rank of each dp group
    tokens = [row for group in groups for row in group]
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in tokens] if tokenizer is not None else None
    decode_steps = per_rank[:, 5] - 1
    return {
        "model": cfg.model, "model_type": config.model_type, "mesh": cfg.dims, "prompts": ids.shape[0],
        "max_new_tokens": cfg.max_new_tokens, "do_sample": cfg.do_sample, "seed": cfg.seed,
        "static_cache": cfg.static_cache, "compile": cfg.compile,
        # HF keeps its compiled forward here once generate() has used it for a decode step
        "compiled_decode": hasattr(model, "_compiled_call"), "tokens": tokens, "texts": texts, "plan": plan_for(cfg),
        "kv_heads_replicated": kv_replicated(cfg), "kv_replica_layers": replicas,
        # not the rows of one device's whole-batch run: said in the output, never silently different
        "sampling_stream": ("one seeded stream per dp group: each group's tokens are one device's generate() of that "
                            "group's prompts") if cfg.do_sample and dp > 1 else None,
        "load_s": round(float(per_rank[:, 6].max()), 3),
        "prefill_s": round(float(per_rank[:, 3].max()), 4),
        # every dp group decodes its rows in parallel: tokens/s of the whole mesh
        "decode_tokens_per_s": round(float(sum(
            rows * decode_steps[g * tp] / per_rank[g * tp, 4] for g in range(dp) if decode_steps[g * tp] > 0)), 2),
        "decode_step_ms": round(float(1e3 * per_rank[0, 4] / decode_steps[0]), 3) if decode_steps[0] > 0 else None,
        "kv_cache_bytes_per_rank": [int(b) for b in per_rank[:, 1]],
        "weight_bytes_per_rank": [int(b) for b in per_rank[:, 2]],
        "peak_memory_mb_per_rank": [round(float(p), 1) for p in per_rank[:, 0]],
    }


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    check(cfg)  # before any rank starts: one clear message rather than one per rank
    world = math.prod(cfg.dims.values())
    if "WORLD_SIZE" in os.environ:  # under torchrun: join its ranks
        init_distributed()
        try:
            if dist.get_world_size() != world:
                fail(f"--mesh {cfg.mesh} needs {world} ranks but torchrun started {dist.get_world_size()}")
            summary = generate(cfg)
        finally:
            dist.destroy_process_group()
    else:
        summary = spawn(generate, world, cfg)
    if summary:
        if not cfg.quiet:
            # rank 0 streamed row 0 (labelled [0]) when it produced any token
            for line in completion_lines(summary["texts"] or summary["tokens"], streamed=bool(summary["tokens"][0])):
                print(line)
        print(json.dumps({k: v for k, v in summary.items() if k not in ("texts",) and
                          (k != "tokens" or cfg.quiet)}))
    return summary


if __name__ == "__main__":
    main()
