"""A small nanoGPT-style, Llama-shaped decoder for tests, benchmarks and the training CLI.

Deliberately ordinary PyTorch: ``nn.Linear``/``nn.Embedding`` parameters, explicit attention arithmetic (no fused
kernels), a causal mask and positions created inside ``forward``, weights initialised in ``__init__`` through
``_init_weights`` like Hugging Face models do. That is exactly what a parallelizer must cope with unchanged.

Parameter FQNs (``L`` = layer index)::

    embed.weight                                   [vocab, d_model]
    layers.L.attn_norm.weight                      [d_model]
    layers.L.attn.{wq,wk,wv,wo}.weight             wq [n_head*hd, d], wk/wv [n_kv_head*hd, d], wo [d, n_head*hd]
    layers.L.mlp_norm.weight                       [d_model]
    layers.L.mlp.{w_gate,w_up,w_down}.weight       w_gate/w_up [ffn, d], w_down [d, ffn]
    norm.weight                                    [d_model]
    lm_head.weight                                 [vocab, d_model] (the same Parameter as embed.weight when tied)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "RMSNorm", "Attention", "MLP", "Block", "cross_entropy", "TiedPair", "TiedPairStage",
           "tiny_mixtral"]


@dataclass
class GPTConfig:
    """Shape of :class:`GPT`. ``ffn_hidden=None`` picks the Llama rule: 8/3 d_model rounded up to a multiple of 32."""

    vocab_size: int = 256
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    max_seq_len: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"head dim {self.d_model // self.n_head} must be even for rotary embeddings")
        if self.ffn_hidden is None:
            self.ffn_hidden = 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (Llama's norm)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal multi-head attention with grouped key/value heads and rotary positions."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.wo.residual_out = True
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = self.causal_attention(q, k, v, documents).transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.wo(y))

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         documents: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H, T, D]``: causal self-attention of ``q [B, H, T, D]`` over ``k, v [B, Hkv, T, D]``, with
        ``documents`` (int ``[B or 1, T]``) only within each query's document (the hook
        ``vescale.parallel.context_parallel`` replaces on each instance to attend across a cp-sharded sequence)."""
        t = q.shape[2]
        groups = self.n_head // self.n_kv_head
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        if documents is not None:  # [B or 1, 1, T, T]: the same document, causally
            causal = causal & (documents[:, None, :, None] == documents[:, None, None, :])
        scores = scores.masked_fill(~causal, float("-inf"))
        att = self.attn_dropout(F.softmax(scores, dim=-1))
        return att @ v


class MLP(nn.Module):
    """SwiGLU feed-forward: ``w_down(silu(w_gate x) * w_up x)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)
        self.w_down.residual_out = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w_down(F.silu(self.w_gate(x)) * self.w_up(x)))


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
    """Decoder-only language model: ``forward(tokens [B, T] int64) -> logits [B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.cfg.init_std
        if isinstance(module, nn.Linear):
            # Output projections of residual branches get the GPT-2 depth scaling.
            if getattr(module, "residual_out", False):
                std = std / math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def rotary(self, seq_len: int, device: torch.device,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables ``[seq_len, head_dim]`` for ``positions`` (int ``[seq_len]``; default
        ``0 .. seq_len-1``), ``[B, 1, seq_len, head_dim]`` for per-row positions ``[B, seq_len]``."""
        pos = (torch.arange(seq_len, device=device, dtype=torch.float32) if positions is None
               else positions.to(device=device, dtype=torch.float32))
        freqs = pos[..., None] * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:
            emb = emb[:, None]
        return emb.cos(), emb.sin()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the tokens' global positions for the rotary tables (int ``[T]`` or per row ``[B, T]``;
        context parallelism passes each rank's). ``documents``: int ``[B or 1, T]`` document ids of packed rows (each
        token attends only within its document)."""
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rotary(t, tokens.device, positions)
        x = self.drop(self.embed(tokens))
        for layer in self.layers:
            x = layer(x, cos, sin) if documents is None else layer(x, cos, sin, documents)
        return self.lm_head(self.norm(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token loss over all positions: ``logits [B, T, V]``, ``targets [B, T]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


class TiedPair(nn.Module):
    """The smallest model with a weight shared by two pipeline stages: an embedding, two tanh layers, and the embedding
    weight again as the output projection. ``TiedPairStage(model, i)`` cuts it in two."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.emb, self.l1, self.l2 = nn.Embedding(vocab, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l2(torch.tanh(self.l1(self.emb(x))))) @ self.emb.weight.T


class TiedPairStage(nn.Module):
    """Stage ``index`` (0 or 1) of a :class:`TiedPair`, with that model's values: stage 0 embeds and applies ``l1``;
    stage 1 applies ``l2`` and the projection by its own copy of ``emb.weight``, under the same FQN as stage 0's, so
    a pipeline engine ties the two."""

    def __init__(self, whole: TiedPair, index: int) -> None:
        super().__init__()
        if index not in (0, 1):
            raise ValueError(f"a TiedPair has stages 0 and 1, not {index}")
        vocab, width = whole.emb.weight.shape
        self.index = index
        self.emb = nn.Embedding(vocab, width)
        layer = "l1" if index == 0 else "l2"
        setattr(self, layer, nn.Linear(width, width))
        self.load_state_dict({k: v for k, v in whole.state_dict().items() if k.split(".")[0] in ("emb", layer)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            return torch.tanh(self.l1(self.emb(x)))
        return torch.tanh(self.l2(x)) @ self.emb.weight.T


def tiny_mixtral(seed: int = 0, *, num_hidden_layers: int = 2, **config) -> nn.Module:
    """An unmodified Hugging Face ``MixtralForCausalLM`` in training mode, initialised from ``seed``: vocabulary 64,
    width 32, 4 heads over 2 kv heads, 4 experts of width 32 with top-2 routing, eager attention and experts (the
    paths a parallelizer must handle unchanged); ``config`` overrides or adds ``MixtralConfig`` fields (e.g.
    ``output_router_logits=True, router_aux_loss_coef=0.1`` for the load-balancing loss). Needs ``transformers``."""
    import transformers

    torch.manual_seed(seed)
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4,
                  num_experts_per_tok=2, attn_implementation="eager", experts_implementation="eager")
    fields.update(config)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**fields)).train()
