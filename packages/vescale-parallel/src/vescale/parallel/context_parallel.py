"""Context parallelism: a model's sequences sharded over the ``cp`` mesh dim, exact causal attention across the shards.

:func:`context_parallel` wraps a causal language model so that each rank of the ``cp`` dim runs the whole model on its
part of every sequence. Two kinds of model are taken, unmodified:

- **transformers causal LMs** (Llama, Qwen2, Mistral and any model whose attention goes through transformers'
  attention interface): the model's attention implementation becomes ``vescale_context_parallel``, registered in that
  interface (the model's own must be sdpa or eager);
- **models with their own attention arithmetic** (the in-repo GPT of ``tools/models.py`` and
  ``vescale.core.testing.models``) that follow the **causal-attention hook**: the root
  ``forward(tokens, positions=None)`` takes the global positions of its tokens (int64 ``[T]``, the same for every
  row; default ``0 .. T-1``) for its position embeddings, and every attention module computes its causal
  self-attention by calling its own method ``causal_attention(q, k, v) -> [B, H, T, D]`` (queries
  ``[B, H, T, D]``, keys and values ``[B, Hkv, T, D]`` with ``H`` a multiple of ``Hkv``, scale ``D ** -0.5``, rotary
  already applied). :func:`context_parallel` replaces that method on each instance that has one; nothing is
  recognised by class name.

How it runs:

- **Load-balanced causal sharding.** A sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks; cp rank ``r``
  holds chunk ``r`` and chunk ``2 * cp - 1 - r`` (a head and a tail), so every rank has the same amount of causal
  attention work and none idles on the masked half.
- **Positions.** The model is called with the global positions of the rank's tokens (``position_ids`` /
  ``positions``), so rotary embeddings are those of one device.
- **Attention: all-gather of keys and values** (the scheme Llama 3 trained with), then blockwise exact attention,
  as one custom operator per layer (``vescale::cp_attention``, forward and backward registered with
  ``torch.library``) so that ``torch.export`` keeps it whole: a pipeline stage cut from a captured graph
  (``vescale.pipe.split``) still attends over cp; with DTensor strategies registered (heads sharded over tp, or
  replicated), a tp-sharded captured stage runs it on each rank's local heads (pp x cp x tp).
  Each attention layer gathers the keys and values of the whole sequence over ``cp`` (backward: one reduce-scatter)
  and computes its own queries against them with
  :func:`~vescale.parallel.chunked_attention.chunked_forward`: per query chunk, a causal diagonal block and
  the whole blocks before it (sliding window respected, where the model has one), each ``S/2cp x S/2cp``, merged by
  log-sum-exp, with a flash-style recomputing backward. No mask or score matrix of ``S/cp x S`` exists at any time:
  every activation per rank falls as ``1 / cp`` except the gathered keys and values (``S x kv_heads x head_dim`` a
  layer). All-gather was chosen over a ring exchange because its backward is a single reduce-scatter and it needs
  no per-step send schedule; a ring overlaps better on a fast interconnect and is left for later.
- **Packed rows.** Called as one device would find packed documents in a row (transformers' rule: ``position_ids``
  given, no ``attention_mask`` and no KV cache, i.e. ``use_cache=False`` or the config's cache turned off by
  gradient checkpointing; a new document wherever a position is not its predecessor's plus one, e.g. restarting at
  0 as ``DataCollatorWithFlattening`` packs), each query attends only to the keys of its own document, causally:
  the whole rows' document ids are computed once per call on every rank from the ``position_ids`` every rank holds
  (no collective), passed to every attention layer as the keyword argument ``vescale_cp_documents`` (transformers
  passes a forward's keyword arguments on to the attention, as flash attention's ``cu_seq_lens``), and the blockwise
  kernel masks each block by document (a document may cross any chunk boundary). An attention module that drops
  the argument is refused (``ContextParallelError`` on every rank, before the first key/value gather). With an
  attention mask or a cache one device attends over the whole row, and so does cp. **Hook models** take
  per-row ``positions`` and, for packed rows, ``documents=`` (the whole rows' document ids ``[B or 1, S]``): the cp
  forward slices the positions and hands the whole ``documents`` on, which the model passes to every
  ``causal_attention(q, k, v, documents)``; the blockwise kernel masks by them as above.
- **Loss.** With ``labels`` (transformers models) the model's own loss function receives this rank's labels already
  shifted (the shift is done on the whole sequence first, so no token loses its target at a chunk boundary) and the
  whole batch's count of target tokens divided by ``cp``: each rank's loss is its tokens' summed loss over ``N / cp``,
  so **the mean of the cp ranks' losses is the one-device loss, and the mean of their gradients is the one-device
  gradient.** A hook model returns logits only: take the targets of this rank's positions
  (``targets[:, local_positions(S, cp, rank)]``). Reduce gradients with a mean over ``cp`` (with dp: over the dp x cp
  ranks, e.g. vescale DDP on that group).

What is refused, with the reason, before any collective: a sequence length not divisible by ``2 * cp``; attention
masks with padding (pack sequences instead: every row must be whole); a KV cache (``use_cache=True`` is turned off
when not asked for, refused when asked for, and ``past_key_values`` refused: generation under cp is not supported);
attention dropout in training (a transformers ``attention_dropout``, or an ``nn.Dropout`` with ``p > 0`` inside a
hook attention module); soft-capped or sink attention (Gemma 2, gpt-oss); a model that is neither kind. Outputs
(``logits``) hold this rank's positions, in its chunk order; :func:`gather_sequence` puts a tensor of them back into
sequence order.
"""
from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vescale.core.mesh import dim_group
from vescale.parallel.chunked_attention import ChunkLayout, attention_output, chunked_backward, chunked_forward
from vescale.parallel.collectives import all_gather_along, op_state, reduce_scatter_along, register_op_state
from vescale.parallel.errors import ContextParallelError
from vescale.parallel.factory import capture_suspended

__all__ = ["context_parallel", "gather_sequence", "local_positions"]

ATTENTION_NAME = "vescale_context_parallel"  # the name registered in transformers' attention interfaces


HOOK_NAME = "causal_attention"  # the attention method a hook model's attention modules call (see the docstring)


@dataclass(frozen=True)
class _Setup:
    """A context-parallel model's cp group, its size and this rank's place in it."""

    group: dist.ProcessGroup
    size: int
    rank: int


# A transformers model's modules carry the key of their _Setup (in vescale.parallel.collectives' registry) as this
# attribute: the attention function is called with the attention module, and an attribute survives the deep copy the
# pipeline split traces (vescale.plan.build_pipeline), where a process group could not be copied and an id() of the
# config would change.
_KEY_ATTR = "_vescale_cp_setup_key"


def _setup_of(module: nn.Module) -> _Setup:
    key = getattr(module, _KEY_ATTR, None)
    if key is None:
        raise ContextParallelError(f"{type(module).__name__} runs the {ATTENTION_NAME!r} attention but its model was "
                                   f"not set up by context_parallel")
    return op_state(key)


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


# The attention of one layer is one custom operator (``vescale::cp_attention``): torch.export (the pipeline split of
# vescale.pipe) keeps it as a single node, so a pipeline stage cut from a captured graph still gathers over cp when it
# runs, and its backward (blockwise, then one reduce-scatter) is registered with it. The cp group travels as an int
# key into vescale.parallel.collectives' registry (an operator takes no process group).


def _setup_key(setup: _Setup) -> int:
    """The registry key of ``setup`` (that of an equal one registered before: the same group, size and rank)."""
    return register_op_state(setup)


@torch.library.custom_op("vescale::cp_attention", mutates_args=())
def _cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None, setup_key: int,
                  scale: float, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gathered keys, gathered values, lse)``: this rank's queries against the whole sequence (the last three
    are kept for backward); ``docs``: the whole sequence's document ids (packed rows), or None."""
    setup = op_state(setup_key)
    keys, values = all_gather_along(k, 2, setup.group, setup.size), all_gather_along(v, 2, setup.group, setup.size)
    layout = ChunkLayout(setup.size, setup.rank, q.shape[2] // 2)
    out, lse = chunked_forward(q, keys, values, layout, scale, window, docs)
    return out, keys, values, lse


@_cp_attention.register_fake
def _(q, k, v, docs, setup_key, scale, window):
    b, h, t, d = q.shape
    size = op_state(setup_key).size
    gathered = (b, k.shape[1], size * k.shape[2], d)
    return (attention_output(q), k.new_empty(gathered), v.new_empty(gathered),
            q.new_empty((b, k.shape[1], h // k.shape[1], t, 1), dtype=torch.promote_types(q.dtype, torch.float32)))


def _cp_attention_setup(ctx, inputs, output):
    q, _, _, docs, setup_key, scale, window = inputs
    out, keys, values, lse = output
    ctx.save_for_backward(q, keys, values, out, lse, docs)
    ctx.setup_key, ctx.scale, ctx.window = setup_key, scale, window


@torch.library.custom_op("vescale::cp_attention_backward", mutates_args=())
def _cp_attention_grads(grad_out: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, docs: torch.Tensor | None, setup_key: int, scale: float,
                        window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``vescale::cp_attention``: blockwise, then the key and value gradients reduce-scattered
    over cp to this rank's positions. An operator of its own so that DTensor runs it on the local head shards (see
    :func:`_register_head_sharding`), as it runs the forward."""
    setup = op_state(setup_key)
    layout = ChunkLayout(setup.size, setup.rank, q.shape[2] // 2)
    dq, dkeys, dvalues = chunked_backward(grad_out, q, keys, values, out, lse, layout, scale, window, docs)
    return (dq, reduce_scatter_along(dkeys, 2, setup.group, setup.size, setup.rank),
            reduce_scatter_along(dvalues, 2, setup.group, setup.size, setup.rank))


@_cp_attention_grads.register_fake
def _(grad_out, q, keys, values, out, lse, docs, setup_key, scale, window):
    b, hkv, s, d = keys.shape
    local = (b, hkv, s // op_state(setup_key).size, d)
    return q.new_empty(q.shape), keys.new_empty(local), values.new_empty(local)


def _cp_attention_backward(ctx, grad_out, *unused):
    q, keys, values, out, lse, docs = ctx.saved_tensors
    dq, dk, dv = _cp_attention_grads(grad_out, q, keys, values, out, lse, docs, ctx.setup_key, ctx.scale,
                                     ctx.window)
    return dq, dk, dv, None, None, None, None


_cp_attention.register_autograd(_cp_attention_backward, setup_context=_cp_attention_setup)


def _register_head_sharding() -> None:
    """DTensor strategies of the two operators: heads (dim 1 of every tensor operand and result) sharded alike, or
    everything replicated. A tensor-parallel stage captured by ``torch.export`` (``vescale.parallel.parallelize_stage``)
    hands the operators DTensors whose heads are sharded over tp; DTensor then calls them on the local shards, where
    each tp rank's queries meet their own key/value heads (``H`` and ``Hkv`` both divisible by tp: contiguous head
    blocks of the queries map onto contiguous blocks of the key/value heads) and the cp collectives run over the cp
    group of that tp rank. Any other placement of an input is redistributed to one of these by DTensor. Document ids
    (packed rows; they have no head dim) are replicated in both."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.vescale.cp_attention.default)
    def _forward_strategies(q, k, v, docs, setup_key, scale, window):
        d = [None if docs is None else Replicate()]
        return [([Shard(1)] * 4, [Shard(1)] * 3 + d + [None] * 3),
                ([Replicate()] * 4, [Replicate()] * 3 + d + [None] * 3)]

    @register_sharding(torch.ops.vescale.cp_attention_backward.default)
    def _backward_strategies(grad_out, q, keys, values, out, lse, docs, setup_key, scale, window):
        d = [None if docs is None else Replicate()]
        return [([Shard(1)] * 3, [Shard(1)] * 6 + d + [None] * 3),
                ([Replicate()] * 3, [Replicate()] * 6 + d + [None] * 3)]


_register_head_sharding()


def _local_heads(t: torch.Tensor, out_head_dim: int):
    """(local tensor, rewrap) for an attention operand that may be a DTensor sharded by heads (dim 1) over tp; the
    rewrap puts a result whose head dim is ``out_head_dim`` back on the same mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t, lambda out: out
    placements = t.placements
    if any(not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 1)) for p in placements):
        raise ContextParallelError(f"context parallel attention takes heads sharded (Shard(1)) or replicated over tp; "
                                   f"got placements {placements}")
    mesh = t.device_mesh
    out_placements = tuple(Shard(out_head_dim) if isinstance(p, Shard) else p for p in placements)
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
    docs = kwargs.get(DOCUMENTS_KWARG)
    if docs is None and _documents_expected:
        raise ContextParallelError(f"{type(module).__name__} called its attention without the packed documents' ids "
                                   f"(its forward does not pass keyword arguments on to the attention function), so "
                                   f"packed rows (position_ids restarting within a row) cannot be masked per document "
                                   f"under context parallelism")
    q, wrap = _local_heads(query, 2)  # transformers' attention returns [B, S, H, D]
    k, _ = _local_heads(key, 2)
    v, _ = _local_heads(value, 2)
    if docs is not None:
        docs, _ = _local_heads(docs, 1)  # replicated (no head dim): its local tensor is all of it
    with capture_suspended():  # plain per-rank tensors from here on, also inside a tensor-parallel forward
        out = _local_attention(q, k, v, setup, scaling, kwargs.get("sliding_window"), docs)
    return wrap(out.transpose(1, 2).contiguous()), None


def _hook_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None, *,
                    module: nn.Module, setup_key: int) -> torch.Tensor:
    """The ``causal_attention`` method of a hook model's attention module under cp: ``[B, H, T_local, D]``;
    ``documents``: the whole rows' document ids ``[B or 1, S]`` (packed rows), or None. (It holds the cp group by
    key, not itself: the pipeline split deep-copies the model, and a process group is not copyable.)"""
    setup = op_state(setup_key)
    if module.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()):
        raise ContextParallelError(f"{type(module).__name__} has dropout in training; under context parallelism it is "
                                   f"not supported (its random mask would not equal one device's): set it to 0")
    q, wrap = _local_heads(q, 1)
    k, _ = _local_heads(k, 1)
    v, _ = _local_heads(v, 1)
    if documents is not None:
        documents, _ = _local_heads(documents, 1)  # replicated (no head dim): its local tensor is all of it
        if documents.shape[-1] != setup.size * q.shape[2]:
            raise ContextParallelError(f"{type(module).__name__}.causal_attention got document ids "
                                       f"{tuple(documents.shape)} under cp={setup.size}: they must cover the whole "
                                       f"rows ({setup.size * q.shape[2]} positions), as the model's forward got them")
    with capture_suspended():
        out = _local_attention(q, k, v, setup, None, None, documents)
    return wrap(out)


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: _Setup, scaling: float | None,
                     window: int | None, docs: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, S_local, D]``: queries ``q`` (this rank's positions) against the whole sequence's keys and values,
    gathered over cp, block by block (:func:`~vescale.parallel.chunked_attention.chunked_forward`); with ``docs`` (the
    whole sequence's document ids, ``[B or 1, S]``) only within each query's document."""
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return _cp_attention(q, k, v, docs, _setup_key(setup), float(scale), window)[0]


def _no_mask(*args, **kwargs):
    """transformers mask-interface function: none; the attention builds the global causal mask itself (and the
    document mask of packed rows, from the ids :func:`_hf_forward` passes it)."""
    return None


# The keyword argument _hf_forward adds to the model's call: the whole rows' document ids. transformers models pass
# their forward's keyword arguments on to the attention function (as flash attention's cu_seq_lens travel), so each
# layer's _attention receives it, also when activation checkpointing recomputes the layer in backward.
DOCUMENTS_KWARG = "vescale_cp_documents"
_documents_expected = 0  # > 0 while a context-parallel forward with packed rows runs (see _attention)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The document id of every position of packed rows, as transformers derives it for one device, or None.

    ``position_ids`` ``[B or 1, S]``: a new document starts wherever a position is not its predecessor's plus one
    (so position ids restarting at 0, or any other jump, start one); ids count from 0 in each row. None when every
    row is a single document (transformers then builds the plain causal mask), decided from the values except while
    a graph is traced (then always the ids, as transformers builds the packed mask then; its own test of tracing is
    used)."""
    from transformers.utils.import_utils import is_tracing

    first = position_ids[:, :1] - 1
    docs = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    if not is_tracing(docs) and not bool((docs[:, -1] != 0).any()):
        return None
    return docs


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def context_parallel(model: nn.Module, mesh) -> nn.Module:
    """Run ``model`` (a transformers causal LM, or a model following the causal-attention hook; possibly already
    tensor-parallel) with its sequences sharded over the ``cp`` dim of ``mesh`` (a 1-D mesh, or one with a ``cp``
    dim); return it, its ``forward`` wrapped in place.

    Every cp rank calls the model with the same whole batch: a transformers model with ``input_ids`` ``[B, S]`` (``S``
    divisible by ``2 * cp``), optional ``labels`` and ``position_ids`` of the same shape (packed rows, restarting
    ``position_ids`` without a mask, attend per document as on one device: see the module docstring), an all-ones
    ``attention_mask`` or none; a hook model with ``tokens`` ``[B, S]``. The output (``logits``) holds this rank's
    positions (:func:`local_positions` order) and a transformers model's ``loss`` this rank's share (see the module
    docstring): mean the losses and the gradients over cp to get one device's.
    """
    config = getattr(model, "config", None)
    hf = config is not None and hasattr(config, "_attn_implementation")
    hooks = [] if hf else [m for m in model.modules() if callable(getattr(m, HOOK_NAME, None))]
    if not hf and not hooks:
        raise ContextParallelError(f"context_parallel takes a transformers model (with a config) or a model whose "
                                   f"attention modules compute through a {HOOK_NAME}(q, k, v) method; "
                                   f"{type(model).__name__} is neither")
    if hooks and "positions" not in inspect.signature(model.forward).parameters:
        raise ContextParallelError(f"{type(model).__name__}.forward takes no `positions` argument: under context "
                                   f"parallelism each rank's tokens need their global positions")
    if hf and (config._attn_implementation or "sdpa") not in ("sdpa", "eager"):
        raise ContextParallelError(f"context_parallel supports the sdpa and eager attention implementations; the model "
                                   f"uses {config._attn_implementation!r}")
    group = _cp_group(mesh)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if hooks:
        key = _setup_key(_Setup(group, size, rank))
        for module in hooks:  # an instance attribute: the class's method stays the single-device arithmetic
            setattr(module, HOOK_NAME, functools.partial(_hook_attention, module=module, setup_key=key))
        model.forward = _hook_forward(model, size, rank)
        return model
    _register()
    key = _setup_key(_Setup(group, size, rank))
    for module in model.modules():  # (read by _setup_of from the attention module transformers hands _attention)
        setattr(module, _KEY_ATTR, key)
    config._attn_implementation = ATTENTION_NAME  # from now on: every attention layer goes through _attention
    model.forward = _hf_forward(model, size, rank)
    return model


def _hook_forward(model: nn.Module, size: int, rank: int):
    """A hook model's ``forward``: this rank's tokens at their global positions. A method bound to ``model`` (over
    the unbound function of the forward it wraps, where that is a method of ``model``), so that a deep copy of the
    model (the pipeline split traces one) runs the copy's own forward."""
    inner = model.forward
    unbound = inner.__func__ if isinstance(inner, types.MethodType) and inner.__self__ is model else None

    @functools.wraps(unbound or inner)  # (unbound: its signature keeps self, which a method binding drops)
    def forward(self, tokens: torch.Tensor, *args, positions: torch.Tensor | None = None, **kwargs):
        seq_len = tokens.shape[1]
        index = local_positions(seq_len, size, rank).to(tokens.device)  # refuses a length not in 2 x cp chunks
        if positions is None:
            positions = torch.arange(seq_len, device=tokens.device)
        documents = kwargs.get("documents")
        if documents is not None and documents.shape[-1] != seq_len:
            raise ContextParallelError(f"{type(self).__name__}: document ids {tuple(documents.shape)} do not cover "
                                       f"the {seq_len} tokens of each row")
        # (document ids stay whole: each layer's cp attention masks its queries against the whole rows' keys)
        call = functools.partial(unbound, self) if unbound is not None else inner
        return call(tokens[:, index].contiguous(), *args, positions=positions[..., index].contiguous(), **kwargs)

    return types.MethodType(forward, model)


def _hf_forward(model: nn.Module, size: int, rank: int):
    """A transformers model's ``forward``: this rank's tokens, positions and shifted labels, its loss share. Bound to
    ``model`` over the unbound forward it wraps, as :func:`_hook_forward` is, so a deep copy runs its own."""
    inner = model.forward
    unbound = inner.__func__ if isinstance(inner, types.MethodType) and inner.__self__ is model else None

    @functools.wraps(unbound or inner)  # (unbound: its signature keeps self, which a method binding drops)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
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
        # Packed rows (position_ids restarting inside a row): one device attends within each document when it
        # looks for packing (transformers does without an attention mask and without a KV cache); so does every
        # layer here then, from the whole rows' document ids
        packs = (position_ids is not None and position_ids.dim() == 2 and attention_mask is None
                 and not _one_device_caches(self, kwargs))
        docs = document_ids(position_ids) if packs else None
        kwargs["use_cache"] = False
        index = local_positions(seq_len, size, rank).to(input_ids.device)
        if docs is not None:
            kwargs[DOCUMENTS_KWARG] = docs
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        if labels is not None:
            shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
            count = (shifted != -100).sum().to(torch.float32)
            local = shifted[:, index].contiguous()
            kwargs.update(labels=local, shift_labels=local, num_items_in_batch=count / size)
        call = functools.partial(unbound, self) if unbound is not None else inner
        global _documents_expected
        _documents_expected += docs is not None
        try:
            return call(input_ids=input_ids[:, index].contiguous(),
                        position_ids=position_ids[..., index].contiguous(), **kwargs)
        finally:
            _documents_expected -= docs is not None

    return types.MethodType(forward, model)


def _one_device_caches(model: nn.Module, kwargs: dict) -> bool:
    """Whether the unmodified model, called with ``kwargs``, would build a KV cache (and so not look for packed rows):
    ``use_cache`` as given, else the config's, off under transformers' gradient checkpointing in training with
    gradients enabled (transformers' own resolution, on the decoder model whose forward makes the cache)."""
    base = getattr(model, "base_model", model)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(base, "config", model.config), "use_cache", None)
    if use_cache and getattr(base, "gradient_checkpointing", False) and base.training and torch.is_grad_enabled():
        use_cache = False
    return bool(use_cache)


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
