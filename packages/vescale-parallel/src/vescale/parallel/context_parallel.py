"""Context parallelism: a model's sequences sharded over the ``cp`` mesh dim, exact causal attention across the shards.

:func:`context_parallel` wraps an unmodified Hugging Face causal language model (Llama, Qwen2, Mistral and any model
whose attention goes through transformers' attention interface) so that each rank of the ``cp`` dim runs the whole
model on its part of every sequence:

- **Load-balanced causal sharding.** A sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks; cp rank ``r``
  holds chunk ``r`` and chunk ``2 * cp - 1 - r`` (a head and a tail), so every rank has the same amount of causal
  attention work and none idles on the masked half.
- **Positions.** The model is called with the global ``position_ids`` of the rank's tokens, so rotary embeddings are
  those of one device.
- **Attention: all-gather of keys and values** (the scheme Llama 3 trained with). The model's attention
  implementation becomes ``vescale_context_parallel`` (registered in transformers' attention interface; the model's
  own, sdpa or eager, keeps setting the arithmetic). Each attention layer gathers the
  keys and values of the whole sequence over ``cp`` and computes its own queries against them under the global causal
  mask (and sliding window, where the model has one). Scores and probabilities per rank are ``S / cp x S``: they,
  and every other activation of the model, fall as ``1 / cp``; the gathered keys and values (``S x kv_heads x
  head_dim`` a layer) do not. It was chosen over a ring exchange with an online softmax because it is exact in one
  kernel call per layer (the same sdpa or eager arithmetic as one device, only the key order differs) and its
  backward is a single reduce-scatter; a ring overlaps better on a fast interconnect and is left for later.
- **Loss.** With ``labels`` the model's own loss function receives this rank's labels already shifted (the shift is
  done on the whole sequence first, so no token loses its target at a chunk boundary) and the whole batch's count of
  target tokens divided by ``cp``: each rank's loss is its tokens' summed loss over ``N / cp``, so **the mean of the
  cp ranks' losses is the one-device loss, and the mean of their gradients is the one-device gradient.** Reduce
  gradients with a mean over ``cp`` (with dp: over the dp x cp ranks, e.g. vescale DDP on that group).

What is refused, with the reason, before any collective: a sequence length not divisible by ``2 * cp``; attention
masks with padding (pack sequences instead: every row must be whole); a KV cache (``use_cache=True`` is turned off
when not asked for, refused when asked for, and ``past_key_values`` refused: generation under cp is not supported);
attention dropout in training; soft-capped or sink attention (Gemma 2, gpt-oss). Outputs (``logits``) hold this
rank's positions, in its chunk order; :func:`gather_sequence` puts a tensor of them back into sequence order.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vescale.core.mesh import dim_group
from vescale.parallel.errors import ContextParallelError
from vescale.parallel.factory import capture_suspended

__all__ = ["context_parallel", "gather_sequence", "local_positions"]

ATTENTION_NAME = "vescale_context_parallel"  # the name registered in transformers' attention interfaces


@dataclass(frozen=True)
class _Setup:
    """A context-parallel model's cp group and its own attention arithmetic, found from its config by the attention
    function (which transformers calls with the attention module, whose ``config`` is the model's)."""

    config: weakref.ref
    group: dist.ProcessGroup
    size: int
    rank: int
    attn_implementation: str  # the model's own: "sdpa" or "eager" arithmetic is kept


_SETUPS: dict[int, _Setup] = {}  # id(config) -> its _Setup


def _setup_of(module: nn.Module) -> _Setup:
    config = getattr(module, "config", None)
    setup = _SETUPS.get(id(config))
    if setup is None or setup.config() is not config:
        raise ContextParallelError(f"{type(module).__name__} runs the {ATTENTION_NAME!r} attention but its model was "
                                   f"not set up by context_parallel")
    return setup


@functools.lru_cache(maxsize=16)
def _mask(seq_len: int, size: int, rank: int, window: int | None, device: str, dtype: torch.dtype) -> torch.Tensor:
    """``[S_local, S]``: which gathered keys (every rank's positions, rank after rank) each of ``rank``'s queries may
    attend to (causal, within ``window``); bool, or additive (0 / -inf) in a floating ``dtype``. Cached, so every
    layer of a forward (and its recompute under activation checkpointing) shares one: torch's CPU attention kernel
    turns a bool mask into a float copy it keeps for backward, one per layer; an additive mask of the query's dtype
    is kept as is."""
    q_pos = local_positions(seq_len, size, rank).to(device)
    k_pos = torch.cat([local_positions(seq_len, size, r) for r in range(size)]).to(device)
    allowed = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    if dtype != torch.bool:
        allowed = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return allowed


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions cp rank ``rank`` holds of a ``seq_len`` sequence: chunk ``rank`` and chunk ``2 cp - 1 - rank``
    of ``2 cp`` equal chunks (int64, ascending)."""
    if seq_len % (2 * cp):
        raise ContextParallelError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp} (load-balanced "
                                   f"causal sharding cuts each sequence into 2 x cp equal chunks)")
    chunk = seq_len // (2 * cp)
    head, tail = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


def _cp_group(mesh) -> dist.ProcessGroup:
    found = dim_group(mesh, "cp")
    if found is None:
        raise ContextParallelError(f"context_parallel needs a 1-D mesh or one with a 'cp' dimension; got dimensions "
                                   f"{list(getattr(mesh, 'mesh_dim_names', None) or ())}")
    return found[0]


class _GatherSequence(torch.autograd.Function):
    """All-gather of ``[B, H, S_local, D]`` along the sequence (rank after rank); backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        local = x.movedim(2, 0).contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(out, local, group=group)
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        whole = grad.movedim(2, 0).contiguous()
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce-scatter: sum everywhere, keep this rank's part
            dist.all_reduce(whole, group=ctx.group)
            part = whole.chunk(ctx.size)[dist.get_rank(ctx.group)]
        else:
            part = whole.new_empty((whole.shape[0] // ctx.size, *whole.shape[1:]))
            dist.reduce_scatter_single(part, whole, group=ctx.group)
        return part.movedim(0, 2), None, None


def _local_heads(t: torch.Tensor):
    """(local tensor, rewrap) for an attention operand that may be a DTensor sharded by heads over tp."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t, lambda out: out
    placements = t.placements
    if any(not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 1)) for p in placements):
        raise ContextParallelError(f"context parallel attention takes heads sharded (Shard(1)) or replicated over tp; "
                                   f"got placements {placements}")
    mesh = t.device_mesh
    # the output is [B, S, H, D]: the head dim moves from 1 to 2
    out_placements = tuple(Shard(2) if isinstance(p, Shard) else p for p in placements)
    return t.to_local(), lambda out: DTensor.from_local(out, mesh, out_placements, run_check=False)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention-interface function: this rank's queries against the whole sequence's keys and values.
    Everything it needs comes from the model's config and the operands' shapes (the sequence length is ``cp`` times
    the local one), so a recompute in backward (activation checkpointing) computes exactly what the forward did."""
    setup = _setup_of(module)
    if dropout and module.training:
        raise ContextParallelError(f"attention dropout ({dropout}) under context parallelism is not supported: its "
                                   f"random mask would not equal one device's; set attention_dropout=0")
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise ContextParallelError(f"{type(module).__name__}: soft-capped or sink attention is not supported under "
                                   f"context parallelism")
    q, wrap = _local_heads(query)
    k, _ = _local_heads(key)
    v, _ = _local_heads(value)
    with capture_suspended():  # plain per-rank tensors from here on, also inside a tensor-parallel forward
        out = _local_attention(q, k, v, setup, scaling, kwargs.get("sliding_window"))
    return wrap(out), None


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: _Setup, scaling: float | None,
                     window: int | None) -> torch.Tensor:
    """``[B, S_local, H, D]``: queries ``q`` (this rank's positions) against the whole sequence's keys and values."""
    seq_len = q.shape[2] * setup.size
    k = _GatherSequence.apply(k, setup.group, setup.size)
    v = _GatherSequence.apply(v, setup.group, setup.size)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if setup.attn_implementation == "eager":  # transformers' eager arithmetic: softmax in fp32
        allowed = _mask(seq_len, setup.size, setup.rank, window, str(q.device), torch.bool)
        if q.shape[1] != k.shape[1]:  # grouped key/value heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)
    else:  # grouped key/value heads stay grouped: the kernel reads them without a repeated copy kept for backward
        mask = _mask(seq_len, setup.size, setup.rank, window, str(q.device), q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


def _no_mask(*args, **kwargs):
    """transformers mask-interface function: none; the attention builds the global causal mask itself."""
    return None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def context_parallel(model: nn.Module, mesh) -> nn.Module:
    """Run ``model`` (a transformers causal LM, possibly already tensor-parallel) with its sequences sharded over the
    ``cp`` dim of ``mesh`` (a 1-D mesh, or one with a ``cp`` dim); return it, its ``forward`` wrapped in place.

    Every cp rank calls the model with the same whole batch (``input_ids`` ``[B, S]`` with ``S`` divisible by
    ``2 * cp``, optional ``labels`` and ``position_ids`` of the same shape, an all-ones ``attention_mask`` or none);
    the output's ``logits`` hold this rank's positions (:func:`local_positions` order) and its ``loss`` this rank's
    share (see the module docstring): mean the losses and the gradients over cp to get one device's.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ContextParallelError(f"context_parallel takes a transformers model (with a config); got "
                                   f"{type(model).__name__}")
    own = config._attn_implementation or "sdpa"
    if own not in ("sdpa", "eager"):
        raise ContextParallelError(f"context_parallel supports the sdpa and eager attention implementations; the model "
                                   f"uses {own!r}")
    group = _cp_group(mesh)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _register()
    _SETUPS[id(config)] = _Setup(weakref.ref(config), group, size, rank, own)
    weakref.finalize(config, _SETUPS.pop, id(config), None)
    config._attn_implementation = ATTENTION_NAME  # from now on: every attention layer goes through _attention
    inner = model.forward

    @functools.wraps(inner)
    def forward(input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        if input_ids is None:
            raise ContextParallelError("context_parallel needs input_ids (inputs_embeds is not sharded)")
        seq_len = input_ids.shape[1]
        local_positions(seq_len, size, rank)  # refuses a length that does not split into 2 x cp chunks
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise ContextParallelError("attention masks with padding are not supported under context parallelism: "
                                       "pack whole sequences (every row full) instead")
        if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise ContextParallelError("a KV cache (use_cache / past_key_values) is not supported under context "
                                       "parallelism: it serves generation, which cp does not")
        kwargs["use_cache"] = False
        index = local_positions(seq_len, size, rank).to(input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        if labels is not None:
            shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
            count = (shifted != -100).sum().to(torch.float32)
            local = shifted[:, index].contiguous()
            kwargs.update(labels=local, shift_labels=local, num_items_in_batch=count / size)
        return inner(input_ids=input_ids[:, index].contiguous(), position_ids=position_ids[..., index].contiguous(),
                     **kwargs)

    model.forward = forward
    return model


def gather_sequence(local: torch.Tensor, mesh, dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor, in sequence order, from every cp rank's ``local`` (its positions along ``dim``, as
    :func:`context_parallel`'s outputs hold them). A collective over cp; not differentiable."""
    group = _cp_group(mesh)
    size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    seq_len = local.shape[dim] * size
    order = torch.cat([local_positions(seq_len, size, r) for r in range(size)]).to(local.device)
    out = torch.empty_like(torch.cat(parts, dim=dim))
    out.index_copy_(dim, order, torch.cat(parts, dim=dim))
    return out
