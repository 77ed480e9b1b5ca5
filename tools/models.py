"""The models ``tools/train.py`` trains: its own Llama-shaped GPT in two sizes, and unmodified Hugging Face models.

Every model here is plain PyTorch that vescale parallelizes unchanged: ``nn.Linear``/``nn.Embedding`` parameters,
attention written out op by op, rotary tables and the causal mask made inside ``forward``. :func:`create` builds one
from the current torch seed (``tools/train.py`` calls it under ``vescale.dtensor.deferred_init`` by default);
:func:`model_spec` reads the sizes that decide which meshes fit a model without building it; :func:`tp_plan` is the
hand-written tensor-parallel plan of its family (``vescale.parallel.plans``).

GPT parameter FQNs (``L`` = layer), the names ``vescale.parallel.plans.gpt_plan`` shards by::

    embed.weight  layers.L.{attn_norm,mlp_norm}.weight  layers.L.attn.{wq,wk,wv,wo}.weight
    layers.L.mlp.{w_gate,w_up,w_down}.weight  norm.weight  lm_head.weight
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "MODEL_SIZES", "HF_MODELS", "MODELS", "ModelSpec", "model_spec", "create", "tp_plan"]


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.n_head > self.n_kv_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.wo((att @ v).transpose(1, 2).reshape(b, t, -1))


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        freqs = torch.outer(torch.arange(t, device=tokens.device, dtype=torch.float32), self.inv_freq.to(tokens.device))
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
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


def model_spec(name: str) -> ModelSpec:
    """Sizes of model ``name`` that decide which meshes fit it, read from its config without building it."""
    if name in MODEL_SIZES:
        g = MODEL_SIZES[name]
        return ModelSpec(g.vocab_size, g.n_layer, g.max_seq_len,
                         dict(n_head=g.n_head, n_kv_head=g.n_kv_head, ffn_hidden=g.ffn_hidden, vocab_size=g.vocab_size))
    fields = HF_MODELS[name][2]
    heads = fields.get("num_attention_heads", fields.get("n_head"))
    divisible = dict(heads=heads, kv_heads=fields.get("num_key_value_heads", heads), vocab_size=fields["vocab_size"],
                     ffn=fields.get("intermediate_size", 4 * fields.get("n_embd", 0)))
    return ModelSpec(fields["vocab_size"], fields.get("num_hidden_layers", fields.get("n_layer")),
                     fields.get("max_position_embeddings", fields.get("n_positions")), divisible)


def create(name: str) -> nn.Module:
    """The unmodified model named ``name``, initialised from the current torch seed (or the recording RNG)."""
    if name in MODEL_SIZES:
        return GPT(MODEL_SIZES[name])
    import transformers

    config_cls, model_cls, fields = HF_MODELS[name]
    # Eager attention: torch's CPU SDPA kernel has no DTensor sharding rule; matmul attention shards op by op.
    config = getattr(transformers, config_cls)(**fields, use_cache=False, tie_word_embeddings=False,
                                               attn_implementation="eager")
    return getattr(transformers, model_cls)(config)


def tp_plan(name: str, tp_mesh, sequence_parallel: bool) -> dict:
    """The hand-written Megatron-style plan (``vescale.parallel.plans``) of model ``name``'s family over ``tp_mesh``."""
    from vescale.parallel import PLANS

    return PLANS[name.split("-")[0]](tp_mesh, dp=None, sequence_parallel=sequence_parallel)
