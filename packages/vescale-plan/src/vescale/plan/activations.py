"""What a decoder's training step keeps for backward: its shape (:class:`ModelShape`) and the activation bytes per
rank under tp / sp / cp / ep (:func:`activation_bytes`), the cost model's memory term for activations.

The count is of the tensors autograd saves in forward for backward (what ``torch.autograd.graph.saved_tensors_hooks``
sees, parameters excluded, each storage once), per token of one layer, for a pre-norm block (norm, attention, norm,
MLP or mixture of experts) as transformers' decoders and the in-repo GPT implement it, in elements of ``act_bytes``:

* norms: ``2 (h + 1)`` each (the input, and the normalised output that the next matmuls save; the inverse rms);
* attention inputs and outputs: ``h`` (the q/k/v input) and, per attention kind,

  - ``fused`` (sdpa / flash / flex: the scores are never materialised): ``4 a d + a + 2 g d`` (queries, keys and
    values at the query head count, the output, which the output projection saves too, the log-sum-exp, keys and
    values before the repeat); **no S^2 term**;
  - ``eager`` (scores computed with ``matmul`` + ``softmax``): ``6 a d`` plus **``a S`` per token** (the softmax
    probabilities ``[a, S, S]`` per sequence: the S^2 term), plus ``S^2`` bytes of a boolean causal mask per layer when
    the model builds one per layer (the in-repo GPT);
* MLP: ``h + f`` (the two matmul inputs) and ``3 f`` when gated (gate, its activation, up) or ``f`` when not;
* mixture of experts (``E`` experts, top ``k``): ``k (2 h + 4 f_e) + 2 E + h`` per token (each routed copy's input,
  the gate/up output, the activation, their product, the down output; the router's probabilities);

with ``h`` hidden, ``a`` / ``g`` query / key-value heads, ``d`` head dim, ``f`` the MLP width, ``S`` the sequence.
Outside the layers: the head's log-probabilities (``V`` per token), the final norm (``2 h + 1``), rotary tables and
token ids (``2 d + 16``). Measured against autograd's saved bytes on tiny Llama (sdpa and eager), Mixtral and the
in-repo GPT (``tests/test_activation_memory.py``): 0.981 to 0.993 of every measured figure, the S^2 growth of eager
attention within 2%; under cp=2 and cp=4 (eager Llama, the cp terms below) 0.995.

Parallel dims divide what each rank keeps:

* ``tp``: attention and MLP internals (heads and widths are sharded) ``/ tp``; the ``h``-sized norm and matmul inputs
  stay whole without sequence parallelism and are ``/ tp`` with it; the head's log-probabilities stay whole (the loss
  takes gathered logits).
* ``cp``: every token-linear term ``/ cp`` (each rank holds ``S / cp`` of every sequence); attention runs blockwise
  (:func:`vescale.parallel.context_parallel`: per chunk, merged by log-sum-exp, recomputed in backward), so there is
  no S^2 term whatever the model's own arithmetic; the attention internals are the fused ones with ``a d + 2 a``
  (per-chunk queries/outputs and log-sum-exps) in place of the ``2 g d`` before the repeat; each rank also keeps the
  keys and values it gathers for the whole sequence, ``2 g d S`` per sequence per layer: the part that does not fall
  as ``1 / cp``.
* ``ep`` and ``dp``: a data dim for activations: each rank's tokens are ``batch x seq / (dp x ep)``.

The tp / sp divisions are Megatron's accounting, not measured by the tests (the cp ones are).

Which attention is assumed: a transformers model's ``config._attn_implementation`` (``"eager"``: eager; ``"sdpa"``,
``"flash_attention_*"``, ``"flex_attention"``: fused), else eager (a hand-written model, such as the in-repo GPT,
computes its scores with ``matmul`` + ``softmax``). :attr:`ModelShape.attention_reason` says which, and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vescale.plan.trace import ModelTrace

__all__ = ["ModelShape", "model_shape", "ActivationBytes", "activation_bytes"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the activation and communication terms need (see the module docstring for the symbols)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool
    vocab: int
    attention: str  # "eager" (scores materialised: the S^2 term) or "fused" (sdpa/flash: none)
    attention_reason: str
    experts: int = 0  # experts per MoE layer (0: dense)
    top_k: int = 0
    expert_ffn: int = 0
    expert_params: int = 0  # elements of every experts module's parameters, all layers
    moe_layers: int = 0
    mask_per_layer: bool = False  # a boolean causal mask built per layer (eager, hand-written)
    cp_capable: bool = False  # what vescale.parallel.context_parallel takes: a transformers model, or attention hooks


_FUSED = ("sdpa", "flash", "flex", "paged")


def _attention_kind(model: nn.Module) -> tuple[str, str]:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None:
        return "eager", (f"{type(model).__name__} has no transformers config: assumed to compute its attention "
                         "scores with matmul + softmax (S^2 per head kept for backward)")
    if impl == "eager":
        return "eager", "config._attn_implementation='eager': softmax probabilities [heads, S, S] kept for backward"
    if impl.startswith(_FUSED) or impl == "vescale_context_parallel":
        return "fused", f"config._attn_implementation={impl!r}: a fused kernel, no [S, S] scores kept"
    return "eager", f"config._attn_implementation={impl!r} is not known to be fused: assumed eager (S^2 kept)"


def _cp_capable(model: nn.Module) -> bool:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", False)
    if impl is not False:
        return (impl or "sdpa") in ("sdpa", "eager")
    return any(callable(getattr(m, "causal_attention", None)) for m in model.modules())


def _first_block(model: nn.Module) -> tuple[str, int]:
    from vescale.core.blocks import find_blocks

    blocks = [fqn for fqn, _ in find_blocks(model)]
    return (blocks[0] if blocks else ""), len(blocks)


def model_shape(model: nn.Module, trace: ModelTrace) -> ModelShape:
    """The shape of ``model`` from its meta trace (heads from the views of q/k/v, widths from matmul shapes), its
    experts (found by structure, :func:`vescale.parallel.find_experts`) and, for a transformers model, its config
    (attention implementation, experts per token). Pure."""
    from vescale.parallel.experts import find_experts

    hidden = next((e.out_shape[-1] for e in trace.events if e.kind == "embedding"), 0)
    vocab = next((trace.shapes[e.param][0] for e in trace.events if e.kind == "embedding"), 0)
    block, layers = _first_block(model)
    prefix = block + "." if block else ""
    linear = [e for e in trace.events if e.kind == "linear" and e.param.startswith(prefix)]
    seen: set[str] = set()
    linear = [e for e in linear if not (e.param in seen or seen.add(e.param))]
    attn = [e for e in linear if e.param in trace.heads]
    heads = kv_heads = head_dim = 0
    if attn:
        per = []
        for e in attn:
            parts = trace.fused.get(e.param, 1)
            h_ = trace.heads[e.param]
            per.append((h_, e.out_shape[-1] // parts // max(h_, 1)))
        heads, head_dim = max(per)
        kv_heads = min(h_ for h_, _ in per)
    attn_params = {e.param for e in attn}
    experts = find_experts(model)
    routers = {e.num_experts for e in experts}
    # the MLP's column matmuls: not attention's, not the router's, widening the stream
    cols = [e for e in linear if e.param not in attn_params and e.producers.isdisjoint(attn_params)
            and e.out_shape[-1] not in (hidden, heads * head_dim) and e.out_shape[-1] not in routers]
    ffn, gated = 0, False
    if cols:
        widths = [e.out_shape[-1] // trace.fused.get(e.param, 1) for e in cols]
        ffn = max(widths)
        gated = sum(1 for w in widths if w == ffn) >= 2 or any(trace.fused.get(e.param) == 2 for e in cols)
    if not heads:  # no head views traced: Megatron's layout (h = a d), one head
        heads = kv_heads = 1
        head_dim = hidden
    config = getattr(model, "config", None)
    num = top_k = e_ffn = e_params = 0
    if experts:
        num = experts[0].num_experts
        e_params = sum(p.numel() for info in experts for p in info.module.parameters(recurse=False))
        shapes = sorted({tuple(p.shape[1:]) for p in experts[0].module.parameters(recurse=False)})
        smallest = min((min(s) for s in shapes if len(s) >= 2), default=0)
        e_ffn = smallest if smallest != hidden else max(max(s) for s in shapes) // 2
        top_k = int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "top_k", 0) or 2)
        if not ffn:
            gated = True
    attention, why = _attention_kind(model)
    return ModelShape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn,
                      gated=gated, vocab=vocab, attention=attention, attention_reason=why, experts=num, top_k=top_k,
                      expert_ffn=e_ffn, expert_params=e_params, moe_layers=len(experts),
                      mask_per_layer=attention == "eager" and config is None,
                      cp_capable=_cp_capable(model))


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes one rank keeps for backward in one step (one microbatch in flight per pipeline stage slot):
    ``linear`` (terms that grow with the tokens), ``quadratic`` (the S^2 terms: eager scores and masks),
    ``gathered_kv`` (cp: keys and values of the whole sequence), ``head`` (outside the layers); ``total``."""

    linear: float
    quadratic: float
    gathered_kv: float
    head: float

    @property
    def total(self) -> float:
        return self.linear + self.quadratic + self.gathered_kv + self.head

    @property
    def attention_share(self) -> float:
        """The fraction of the total that grows faster than the tokens (S^2 terms and gathered keys/values)."""
        return (self.quadratic + self.gathered_kv) / self.total if self.total else 0.0


def activation_bytes(shape: ModelShape, *, sequences: float, seq_len: int, layers: float | None = None,
                     tp: int = 1, cp: int = 1, sequence_parallel: bool = False, act_bytes: int = 4,
                     head: bool = True) -> ActivationBytes:
    """What one rank keeps for backward for ``sequences`` sequences of ``seq_len`` tokens over ``layers`` layers
    (default: all), sharded by ``tp`` (``sequence_parallel``) and ``cp``; ``head``: count the final norm and the
    head. See the module docstring for every term."""
    h, a, g, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
    layers = shape.layers if layers is None else layers
    stream = h / tp if sequence_parallel else h  # h-sized tensors of the residual stream
    norms = 2 * (stream + 1)
    fused = shape.attention == "fused" or cp > 1  # cp: blockwise attention merged by log-sum-exp, no scores kept
    if fused:
        # cp: the blockwise kernel keeps one more [a, d] per token (its per-chunk queries/outputs) and a log-sum-exp
        # per query chunk (2) instead of the local keys/values before the repeat (fitted to the measured bytes)
        attn = (4 * a * d + a + (a * d + 2 * a if cp > 1 else 2 * g * d)) / tp
    else:
        attn = 6 * a * d / tp
    attn += stream
    mlp = 0.0
    if f:
        mlp = stream + (f + (3 * f if shape.gated else f)) / tp
    moe = 0.0
    if shape.experts:
        moe = shape.top_k * (2 * h + 4 * shape.expert_ffn) + 2 * shape.experts + h
        moe *= min(shape.moe_layers / shape.layers, 1.0) if shape.layers else 1.0  # the MoE layers' share
    per_token = norms + attn + mlp + moe
    tokens = sequences * seq_len / cp  # this rank's tokens
    linear = per_token * tokens * layers * act_bytes
    quadratic = gathered = 0.0
    if not fused:
        quadratic = a / tp * seq_len * tokens * layers * act_bytes  # [a, S, S] probabilities per sequence
        if shape.mask_per_layer:
            quadratic += seq_len * seq_len * layers  # a bool causal mask [S, S] per layer
    if cp > 1:  # keys and values of the whole sequence, gathered over cp, kept for the blockwise backward
        gathered = 2 * g * d / tp * sequences * seq_len * layers * act_bytes
    out = 0.0
    if head:
        out = (shape.vocab + 2 * stream + 1 + 2 * d + 16) * tokens * act_bytes
    return ActivationBytes(linear, quadratic, gathered, out)
