"""The models ``tools/train.py`` trains: its own Llama-shaped GPT in two sizes, and unmodified Hugging Face models.

Every model here is plain PyTorch that vescale parallelizes unchanged: ``nn.Linear``/``nn.Embedding`` parameters,
attention written out op by op, rotary tables and the causal mask made inside ``forward``. :func:`create` builds one
from the current torch seed (``tools/train.py`` calls it under ``vescale.dtensor.deferred_init`` by default);
:func:`model_spec` reads the sizes that decide which meshes fit a model without building it; :func:`tp_plan` is the
hand-written tensor-parallel plan of its family (``vescale.parallel.plans``; ``vescale.plan.auto_plan`` for a family
without one).

A model name is one of :data:`MODELS`, or a Hugging Face model directory (``config.json`` plus safetensors, single file
or sharded with ``model.safetensors.index.json``, as ``save_pretrained`` writes): :func:`create` then builds that
architecture from its config (initialised, and under ``deferred_init`` only recorded) and :func:`load_pretrained`
fills what a rank holds (its TP shards, its pipeline stages, or the whole model on a dp replica) from the
safetensors, each rank reading only the bytes of its own pieces (``vescale.checkpoint.import_hf``).

GPT parameter FQNs (``L`` = layer), the names ``vescale.parallel.plans.gpt_plan`` shards by::

    embed.weight  layers.L.{attn_norm,mlp_norm}.weight  layers.L.attn.{wq,wk,wv,wo}.weight
    layers.L.mlp.{w_gate,w_up,w_down}.weight  norm.weight  lm_head.weight
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "MODEL_SIZES", "HF_MODELS", "MODELS", "ModelSpec", "model_spec", "create", "plan_family",
           "tp_plan",
           "is_hf_dir", "hf_config", "hf_weight_names", "tied_names", "pretrained_problems", "stored_names",
           "load_pretrained", "load_renamed_and_tied",
           "load_sharded", "matmul_params", "flops_per_token", "has_tokenizer", "export_pretrained", "export_run"]


@dataclass
class GPTConfig:
    """Shape of :class:`GPT`; the feed-forward width follows Llama: 8/3 ``d_model`` rounded up to a multiple of 32."""

    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    ffn_hidden: int = field(init=False)

    def __post_init__(self) -> None:
        self.ffn_hidden = 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding: each half of the head dim rotated against the other."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    """Causal attention, grouped key/value heads, rotary positions."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.wo(self.causal_attention(q, k, v, documents).transpose(1, 2).reshape(b, t, -1))

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         documents: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H, T, D]``: causal self-attention of ``q [B, H, T, D]`` over ``k, v [B, Hkv, T, D]``; with
        ``documents`` (int ``[B or 1, T]``, the document id of every position) a query attends only to the keys of
        its own document (a block-diagonal causal mask). The hook ``vescale.parallel.context_parallel`` replaces on
        each instance to attend across a cp-sharded sequence (it then receives the whole rows' ``documents``)."""
        t = q.shape[2]
        if self.n_head > self.n_kv_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        if documents is not None:  # [B or 1, 1, T, T]: the same document, causally
            allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
        att = F.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return att @ v


class MLP(nn.Module):
    """SwiGLU feed-forward: ``w_down(silu(w_gate x) * w_up x)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        attn_in = (self.attn_norm(x), cos, sin) if documents is None else (self.attn_norm(x), cos, sin, documents)
        x = x + self.attn(*attn_in)  # unmasked: the three inputs a module-input plan (PrepareModuleInput) names
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model: ``forward(tokens [B, T] int64) -> logits [B, T, vocab]``.

    Init: every weight normal with std ``init_std``, the residual-branch outputs (``wo``, ``w_down``) scaled by
    ``1 / sqrt(2 n_layer)`` (GPT-2), norms at one.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        residual = {id(m) for block in self.layers for m in (block.attn.wo, block.mlp.w_down)}
        for module in self.modules():  # in registration order, so the random draws have one fixed order
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = cfg.init_std / math.sqrt(2 * cfg.n_layer) if id(module) in residual else cfg.init_std
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the positions of the tokens for the rotary tables (int ``[T]``, or ``[B, T]`` per row, e.g.
        restarting at each packed document; default ``0 .. T-1``); context parallelism passes each rank's
        (``vescale.parallel.context_parallel``). ``documents``: int ``[B or 1, T]``, the document id of every
        position of packed rows (non-decreasing along a row): each token then attends only within its document."""
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        pos = (torch.arange(t, device=tokens.device, dtype=torch.float32) if positions is None
               else positions.to(device=tokens.device, dtype=torch.float32))
        freqs = pos[..., None] * self.inv_freq.to(tokens.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        if angles.dim() == 3:  # per-row positions: [B, 1, T, D] against the [B, H, T, D] heads
            angles = angles[:, None]
        x = self.embed(tokens)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (a bf16 model computes in bf16 throughout)
        for layer in self.layers:
            x = layer(x, cos, sin) if documents is None else layer(x, cos, sin, documents)
        return self.lm_head(self.norm(x))


MODEL_SIZES = {  # name -> GPTConfig
    "gpt-11m": GPTConfig(vocab_size=512, d_model=384, n_layer=6, n_head=6, n_kv_head=6, max_seq_len=256),
    "gpt-tiny": GPTConfig(vocab_size=128, d_model=64, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64),
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


@dataclass
class ModelSpec:
    """What the trainer needs to know of a model, whatever its family."""

    vocab_size: int
    n_layer: int
    max_seq_len: int
    divisible: dict  # quantities tensor parallelism splits, name -> size
    attn_width: int = 0  # heads x head dim: the width of the q.k and attention.v products (the FLOPs formula)
    experts: int = 0  # experts per MoE layer (0: a dense model)


def is_hf_dir(name: str) -> bool:
    """Whether ``name`` is a Hugging Face model directory (it has a ``config.json``) rather than a built-in name."""
    return Path(name, "config.json").is_file()


def hf_config(name: str):
    """The ``transformers`` config of model ``name`` (a directory's ``config.json``, or a built-in HF model's), with
    the key/value cache off (training)."""
    import transformers

    if is_hf_dir(name):
        config = transformers.AutoConfig.from_pretrained(name)
    else:
        config_cls, _, fields = HF_MODELS[name]
        config = getattr(transformers, config_cls)(**fields, tie_word_embeddings=False)
    config.use_cache = False
    return config


def model_spec(name: str) -> ModelSpec:
    """Sizes of model ``name`` that decide which meshes fit it, read from its config without building it."""
    if name in MODEL_SIZES:
        g = MODEL_SIZES[name]
        return ModelSpec(g.vocab_size, g.n_layer, g.max_seq_len,
                         dict(n_head=g.n_head, n_kv_head=g.n_kv_head, ffn_hidden=g.ffn_hidden, vocab_size=g.vocab_size),
                         g.n_head * g.head_dim)
    if not is_hf_dir(name) and name not in HF_MODELS:
        raise SystemExit(f"train.py: --model {name!r} is neither a built-in model ({', '.join(MODELS)}) nor a Hugging "
                         f"Face model directory (a directory with config.json and safetensors weights)")
    c = hf_config(name)
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
    hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None)
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
    divisible = dict(heads=heads, kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                     vocab_size=c.vocab_size, ffn=ffn)
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    positions = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
    return ModelSpec(c.vocab_size, layers, positions, divisible, heads * head_dim, experts)


def create(name: str) -> nn.Module:
    """The unmodified model named ``name`` (or of the HF directory ``name``: its architecture, not yet its weights),
    initialised from the current torch seed (or the recording RNG); fp32, eager attention."""
    if name in MODEL_SIZES:
        return GPT(MODEL_SIZES[name])
    import transformers

    if is_hf_dir(name):
        return transformers.AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="eager",
                                                             dtype=torch.float32)
    config_cls, model_cls, fields = HF_MODELS[name]
    # Eager attention: torch's CPU SDPA kernel has no DTensor sharding rule; matmul attention shards op by op.
    config = getattr(transformers, config_cls)(**fields, use_cache=False, tie_word_embeddings=False,
                                               attn_implementation="eager")
    return getattr(transformers, model_cls)(config)


def plan_family(name: str) -> str:
    """The tensor-parallel plan of model ``name`` as a ``vescale.plan.ParallelSpec`` names it: its family's hand plan
    (``vescale.parallel.PLANS``; a directory's family is its config's ``model_type``), else ``"auto"``."""
    from vescale.parallel import PLANS

    family = hf_config(name).model_type if is_hf_dir(name) else name.split("-")[0]
    return family if family in PLANS else "auto"


def tp_plan(name: str, tp_mesh, sequence_parallel: bool, model: nn.Module | None = None) -> dict:
    """The hand-written Megatron-style plan (``vescale.parallel.plans``) of model ``name``'s family over ``tp_mesh``
    (a directory's family is its config's ``model_type``); for a family without one, ``vescale.plan.auto_plan`` of
    ``model`` (the deferred model)."""
    from vescale.parallel import PLANS

    family = hf_config(name).model_type if is_hf_dir(name) else name.split("-")[0]
    if family in PLANS:
        return PLANS[family](tp_mesh, dp=None, sequence_parallel=sequence_parallel)
    if model is None:
        raise ValueError(f"model family {family!r} has no hand plan (vescale.parallel.PLANS): pass the model for "
                         f"auto_plan")
    from vescale.plan import auto_plan

    return auto_plan(model, tp_mesh, sequence_parallel=sequence_parallel, dp=None)


# -- pretrained weights ------------------------------------------------------------------------------------------

INDEX_FILE = "model.safetensors.index.json"


def hf_weight_names(src: str) -> dict[str, list[int]]:
    """The tensors of the HF directory ``src``: name -> shape, from the safetensors headers (no tensor data read)."""
    from safetensors import safe_open

    index = Path(src, INDEX_FILE)
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif Path(src, "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return {}
    shapes = {}
    for file in files:
        with safe_open(str(Path(src, file)), framework="pt") as f:
            shapes.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def tied_names(model: nn.Module) -> dict[str, str]:
    """``{output embedding FQN: input embedding FQN}`` when the model ties them (``save_pretrained`` then writes only
    the input embedding), else empty."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None or get_out() is None or get_in().weight is not get_out().weight:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(get_out())]}.weight": f"{names[id(get_in())]}.weight"}


def pretrained_problems(name: str) -> list[str]:
    """Why the weights of the HF directory ``name`` cannot fill its model (missing or unexpected tensors, shape
    mismatches), checked on the meta device from the safetensors headers alone; empty when they can."""
    if not is_hf_dir(name):
        return []
    files = hf_weight_names(name)
    if not files:
        return [f"--model {name}: no safetensors weights (neither model.safetensors nor {INDEX_FILE})"]
    with torch.device("meta"):
        model = create(name)
    held = {k: list(t.shape) for k, t in model.state_dict().items()}
    tied = tied_names(model)
    stored = stored_names(name, held, files)  # (experts one tensor per expert, by transformers' conversion rules)
    problems = [f"--model {name}: {k!r} is {_stored_shape(s, files)} from its safetensors "
                f"({s.parts[0][0]!r}, ...), {held[k]} in the model built from its config.json"
                for k, s in stored.items() if _stored_shape(s, files) != held[k]]
    files = {**{k: v for k, v in files.items() if not any(k in p for s in stored.values() for p in s.parts)},
             **{k: held[k] for k in stored}}
    problems += [f"--model {name}: {k!r} (shape {shape}) is not in its safetensors" for k, shape in held.items()
                 if k not in files and tied.get(k) not in files]
    problems += [f"--model {name}: {k!r} is {files[k]} in its safetensors, {shape} in the model built from its "
                 f"config.json" for k, shape in held.items() if k in files and files[k] != shape]
    problems += [f"--model {name}: its safetensors hold {k!r}, which the model built from its config.json has not"
                 for k in files if k not in held]
    return problems


def load_pretrained(src: str, modules: list[nn.Module], *, stages: bool = False,
                    tied: dict[str, str] | None = None) -> None:
    """Fill ``modules`` in place from the HF directory ``src``: this rank's model (plain, or with DTensor parameters
    over tp), or its pipeline stages (which keep the model's FQNs), each rank reading only the bytes of what it holds
    (``vescale.checkpoint.import_hf`` opens the files memory-mapped and copies each local box). ``tied`` (from
    :func:`tied_names` of the whole model): a stage that holds the tied output embedding under its own name gets the
    input embedding's tensor (that one tensor read whole on that rank). No communication; call it before DDP or the
    optimizer take the parameters (their flat buffers and master copies are views of, or copies from, them).
    A whole model (``stages=False``, one module) loads strictly; pipeline stages (``stages=True``) each hold a part,
    so their loads are not strict: ``pretrained_problems`` has checked the names and shapes beforehand. Tensors the
    directory stores under other names (:func:`stored_names`: Mixtral's experts, one tensor per expert) are read by
    :func:`load_renamed_and_tied`, each rank reading only its boxes (an ep rank: its experts' tensors)."""
    from vescale.checkpoint import import_hf

    files = hf_weight_names(src)  # the safetensors headers, read once for every module
    # tensors the directory holds under other names (experts one tensor per expert), read by load_renamed_and_tied
    stored = [stored_names(src, {k: list(t.shape) for k, t in m.state_dict().items()}, files) for m in modules]
    if not stages and not stored[0]:  # the whole model: a strict load (which also resolves weights tied by storage)
        import_hf(src, modules[0])
        return
    for module, renamed in zip(modules, stored):
        import_hf(src, module, strict=False)  # (with renamed tensors: pretrained_problems checked every name)
        load_renamed_and_tied(src, module.state_dict(), files, renamed, tied)


def load_renamed_and_tied(src: str, tensors: dict[str, torch.Tensor], files: dict[str, list[int]],
                          stored: dict[str, _Stored], tied: dict[str, str] | None = None) -> None:
    """Fill, in place, the tensors of ``tensors`` that the HF directory ``src`` does not hold under their own names
    (what ``vescale.checkpoint.import_hf`` leaves out); every other tensor is left untouched.

    ``tensors``: FQN (the directory's naming) -> the tensor to fill, plain or a DTensor on any mesh (a module's
    ``state_dict()``, whose tensors are views of its parameters). ``files``: the directory's tensors
    (:func:`hf_weight_names`). Two kinds are read:

    * the FQNs in ``stored`` (:func:`stored_names`: Mixtral's experts, one file tensor per expert; renamed
      tensors): each rank reads only the bytes of the boxes it holds (a DTensor's local chunks; an expert parameter
      ``Shard(0)`` on ep: its experts' tensors);
    * an FQN absent from ``files`` whose ``tied[FQN]`` (same naming: the tied input embedding) is in ``files``: that
      tensor is read whole on this rank and its local shard copied (a pipeline stage holding the tied output
      embedding without the input one).

    No communication (a DTensor's shard is sliced locally)."""
    if stored:
        _load_stored(src, tensors, stored, files)
    for name, t in tensors.items():
        if name not in files and (tied or {}).get(name) in files:
            _copy_whole(src, tied[name], t)


def _copy_whole(src: str, key: str, target: torch.Tensor) -> None:
    """Copy the tensor ``key`` of the HF directory ``src`` into ``target`` (a DTensor: its local shard)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    index = Path(src, INDEX_FILE)
    file = json.loads(index.read_text())["weight_map"][key] if index.is_file() else "model.safetensors"
    with safe_open(str(Path(src, file)), framework="pt") as f:
        whole = f.get_tensor(key)
    with torch.no_grad():
        if isinstance(target, DTensor):  # src_data_rank=None: every rank slices its own shard, no communication
            local = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(whole)


# -- directories that store a model's tensors under other names (experts one tensor per expert) ---------------------

# The conversion operations of transformers' checkpoint conversion rules this reader applies: stacking the per-expert
# tensors along a new dim 0 (MergeModulelist) and concatenating the stacked parts along dim 1 (Concatenate).
_CONVERSION_OPS = {("MergeModulelist", 0), ("Concatenate", 1)}


@dataclass
class _Stored:
    """Where a model tensor lives in an HF directory: ``parts[i][e]``, the file tensor of part ``i`` of expert
    ``e`` (the parts concatenated along dim 1, the experts stacked along dim 0), or with ``stacked`` False one part
    of one tensor, the model tensor itself under another name."""

    parts: list[list[str]]
    stacked: bool


def stored_names(src: str, held: dict[str, list[int]], files: dict[str, list[int]]) -> dict[str, _Stored]:
    """The model tensors (``held``: FQN -> shape) that the HF directory ``src`` (whose tensors are ``files``:
    :func:`hf_weight_names`) stores under other names, by the
    installed ``transformers``' own checkpoint conversion rules for its ``model_type``: renames, and stacked experts
    (Mixtral's ``save_pretrained`` writes ``block_sparse_moe.experts.E.w1/w3/w2.weight``, one tensor per expert,
    for the model's ``mlp.experts.gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``). Tensors the directory
    holds under the model's own name are left out; so are rules with operations other than stacking and
    concatenating (their tensors are then reported by :func:`pretrained_problems`). No tensor data is read."""
    import re

    if all(k in files for k in held):
        return {}
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without conversion rules: its models keep the directory's names
        return {}
    rules = get_checkpoint_conversion_mapping(hf_config(src).model_type) or []
    renames = [(r.source_patterns[0], r.target_patterns[0]) for r in rules if type(r).__name__ == "WeightRenaming"]
    converters = [r for r in rules if type(r).__name__ == "WeightConverter" and len(r.target_patterns) == 1
                  and {(type(o).__name__, getattr(o, "dim", None)) for o in r.operations} <= _CONVERSION_OPS]
    found: dict[str, dict[int, dict[int, str]]] = {}
    out: dict[str, _Stored] = {}
    for name in files:
        key = name
        for pattern, target in renames:
            key = re.sub(pattern, target, key)
        for conv in converters:
            for part, pattern in enumerate(conv.source_patterns):
                m = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
                if m:
                    target = key[:m.start()] + conv.target_patterns[0] + key[m.end():]
                    found.setdefault(target, {}).setdefault(part, {})[int(m.group(1))] = name
                    break
            else:
                continue
            break
        else:
            if key != name and key in held and key not in files:
                out[key] = _Stored([[name]], stacked=False)
    for target, parts in found.items():
        if target in held and target not in files:
            experts = held[target][0]
            if sorted(parts) == list(range(len(parts))) and all(sorted(p) == list(range(experts))
                                                                  for p in parts.values()):
                out[target] = _Stored([[parts[i][e] for e in range(experts)] for i in range(len(parts))], True)
    return out


def _stored_shape(stored: _Stored, files: dict[str, list[int]]) -> list[int]:
    """The model tensor's shape that ``stored``'s file tensors make."""
    first = files[stored.parts[0][0]]
    if not stored.stacked:
        return list(first)
    return [len(stored.parts[0]), sum(files[p[0]][0] for p in stored.parts), *first[1:]]


def _load_stored(src: str, tensors: dict[str, torch.Tensor], stored: dict[str, _Stored],
                 files: dict[str, list[int]]) -> None:
    """Fill the tensors of ``tensors`` named in ``stored`` from the HF directory ``src`` (whose tensors are ``files``),
    each rank reading only the bytes of the boxes it holds (a DTensor's local chunks; an expert parameter
    ``Shard(0)`` on ep: its experts' tensors)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from vescale.dtensor.layout import local_chunks

    index = Path(src, INDEX_FILE)
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    handles: dict[str, object] = {}

    def part(name: str):
        file = str(Path(src, where.get(name, "model.safetensors")))
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        return handles[file].get_slice(name)

    with torch.no_grad():
        for fqn, t in tensors.items():
            info = stored.get(fqn)
            if info is None:
                continue
            if isinstance(t, DTensor):
                local = t.to_local()
                chunks = [(c.global_offset, c.local_offset, c.size)
                          for c in local_chunks(t.shape, t.device_mesh, t.placements)]
            else:
                local, chunks = t, [((0,) * t.dim(), (0,) * t.dim(), tuple(t.shape))]
            for offsets, at, size in chunks:
                view = local[tuple(slice(a, a + n) for a, n in zip(at, size))]
                if not info.stacked:
                    view.copy_(part(info.parts[0][0])[tuple(slice(o, o + n) for o, n in zip(offsets, size))])
                    continue
                rest = tuple(slice(o, o + n) for o, n in zip(offsets[2:], size[2:]))
                for e in range(offsets[0], offsets[0] + size[0]):
                    start = 0  # where each part begins along dim 1 of the model tensor
                    for names in info.parts:
                        rows = files[names[e]][0]
                        lo, hi = max(start, offsets[1]), min(start + rows, offsets[1] + size[1])
                        if lo < hi:
                            view[e - offsets[0], lo - offsets[1]:hi - offsets[1]].copy_(
                                part(names[e])[(slice(lo - start, hi - start), *rest)])
                        start += rows
    handles.clear()


def load_sharded(src: str, mesh, plan: str = "hand", dtype: torch.dtype = torch.float32):
    """The model of the HF directory ``src`` recorded on meta (``deferred_init``), sharded over ``mesh`` (its
    ``tp`` dim; a ``dp`` dim batch-shards activations) by its family's hand plan (``plan="hand"``; ``auto_plan``
    for other families, or ``plan="auto"``) and filled from its safetensors, each rank reading only its shards.
    Returns ``(model in eval mode, config)``. ``tools/generate.py``'s loader."""
    import transformers as tf

    from vescale.dtensor import deferred_init
    from vescale.parallel import PLANS, parallelize_module

    config = tf.AutoConfig.from_pretrained(src)
    model = deferred_init(tf.AutoModelForCausalLM.from_config, config, dtype=dtype)
    if plan == "hand" and config.model_type in PLANS:
        layout = PLANS[config.model_type](mesh)
    else:
        from vescale.plan import auto_plan

        layout = auto_plan(model, mesh)
    parallelize_module(model, mesh, layout)
    load_pretrained(src, [model])
    return model.eval(), config


# -- throughput ----------------------------------------------------------------------------------------------------

def matmul_params(model: nn.Module) -> int:
    """Parameters that multiply activations: every distinct parameter except those only looked up (an
    ``nn.Embedding`` not tied to an output projection). Counted on the whole (meta or deferred) model."""
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    looked_up -= {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}  # tied: also a matmul
    return sum(p.numel() for p in model.parameters() if id(p) not in looked_up)


def flops_per_token(n_matmul: int, spec: ModelSpec, seq_len: int) -> int:
    """Model FLOPs of one token's forward and backward: ``6 N + 12 L d T`` (PaLM, appendix B): 2 FLOPs per
    multiply-add per matmul parameter forward, twice that backward; plus the attention products (``q.k`` and
    ``attention.v``, ``2 x 2 L d T`` forward, causal mask not discounted) with ``d`` the attention width, ``T`` the
    sequence length. Activation recomputation is not counted (model FLOPs, not hardware FLOPs)."""
    return 6 * n_matmul + 12 * spec.n_layer * spec.attn_width * seq_len


# -- export ----------------------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer(path: str | None) -> bool:
    """Whether the directory ``path`` holds a Hugging Face tokenizer."""
    return path is not None and any(Path(path, f).is_file() for f in TOKENIZER_FILES)


def export_pretrained(ckpt: str, out_dir: str, name: str, tokenizer: str | None = None) -> list[str]:
    """Write the model of the checkpoint ``ckpt`` (train.py's ``model.`` keys, from any mesh) as a directory that
    ``transformers``' ``from_pretrained`` loads: sharded safetensors and index (``vescale.checkpoint.export_hf``),
    ``config.json`` (the HF directory ``name``'s own, or the built-in HF model's), and the tokenizer of the directory
    ``tokenizer`` when given (re-saved by ``AutoTokenizer``). One process; returns the files written."""
    from vescale.checkpoint import export_hf

    if is_hf_dir(name):
        config = str(Path(name, "config.json"))
    else:
        config = hf_config(name)
        config.use_cache = True  # the inference default; training turned it off
    files = export_hf(ckpt, out_dir, prefix="model.", config=config)
    if tokenizer is not None:
        from transformers import AutoTokenizer

        files += AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out_dir)
    return files


def export_run(cfg, model_state, out: Path, log=print) -> None:
    """``--export-hf DIR``: the trained weights as a directory ``from_pretrained`` loads; collective. Every rank saves
    the model part it holds (``model_state``: a vescale checkpoint under ``out``, any mesh, replicas written once),
    rank 0 converts it (:func:`export_pretrained`: config.json, and the tokenizer of ``--tokenizer`` or of the model
    directory when it has one) and removes the checkpoint."""
    import shutil

    import torch.distributed as dist

    from vescale import checkpoint

    tmp = out / "export-hf-ckpt"
    checkpoint.save(tmp, {"model": model_state})
    if dist.get_rank() == 0:
        tokenizer = getattr(cfg, "tokenizer", None) or (cfg.model if has_tokenizer(cfg.model) else None)
        export_pretrained(str(tmp), cfg.export_hf, cfg.model, tokenizer)
        shutil.rmtree(tmp)
        log(f"exported the model to {cfg.export_hf}" + (f" with the tokenizer of {tokenizer}" if tokenizer else ""))
