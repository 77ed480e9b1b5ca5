"""A cost model for one training step on a pp x dp x cp x ep x tp mesh: flops, bytes per collective per mesh dim,
memory.

Deliberately simple and explicit (every term is a field of :class:`CostEstimate`), in the spirit of the Megatron-LM
papers' accounting:

* compute: ``3 x`` forward matmul flops (forward + backward) of the traced model, scaled linearly to
  ``batch_size x seq_len`` tokens, divided over all ranks, at ``device_tflops``; the pipeline bubble adds
  ``(pp - 1) / microbatches`` of it (1F1B).
* tp: per column/row pair, an all-reduce of the rank's activations in forward and one in backward (with sequence
  parallelism an all-gather and a reduce-scatter each way: the same bytes), a vocab-parallel lookup's forward
  all-reduce, plus the head's logits. Ring cost ``(n - 1) / n`` of the full tensor per all-gather/reduce-scatter,
  twice that per all-reduce. A pipeline stage (DTensor propagation, embeddings replicated) is priced at twice the
  pairs' bytes, as measured at tp=2.
* dp: ring bytes of the gradient reduction as vescale runs it (gradients in ``reduce_dtype``, fp32 by default;
  parameters in their dtype): ZeRO 0 an all-reduce of the gradients; ZeRO 1 the same all-reduce (DDP) plus an
  all-gather of the updated parameters; ZeRO 2 a reduce-scatter plus that all-gather; ZeRO 3 two all-gathers of the
  parameters (forward, backward) and a reduce-scatter of the gradients. With cp the gradient reduction spans dp x cp
  (cp ranks hold the same parameters); with ep the dense parameters' spans dp x ep, the experts' dp only.
* cp: per layer, an all-gather of the keys and values (``2 g d`` per token) in forward and a reduce-scatter of their
  gradients in backward.
* ep: per MoE layer, each rank's ``k`` routed copies of its tokens (``h`` each) go out and come back by all-to-all in
  forward and again in backward: ``4 (ep - 1) / ep x tokens x k x h`` bytes.
* pp: activations of one microbatch sent forward and their gradients backward at each stage boundary.
* memory per rank: parameters (sharded by tp, split by pp; experts' divided by ep), gradients (``grad_bytes`` an
  element: ``build``'s fp32 gradient buffers under bf16 parameters), Adam's two states and an fp32 master copy when
  ``param_bytes < 4`` (divided by dp from ZeRO-1 on, by dp x cp with cp; gradients too from
  ZeRO-2; everything, parameters included, from ZeRO-3, plus the largest block gathered whole, twice: the one
  computing and the one prefetched), and activations (:mod:`vescale.plan.activations`: what autograd keeps per
  layer, the S^2 term of eager attention included, divided by tp, cp, and the tokens of this rank; ``pp``
  microbatches in flight on the first stage). Without a :class:`~vescale.plan.activations.ModelShape`, Megatron's
  ``34 x tokens x hidden`` bytes per layer at 2-byte activations stands in.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from vescale.plan.activations import ModelShape, activation_bytes
from vescale.plan.trace import ModelTrace

__all__ = ["CostEstimate", "HardwareModel", "estimate", "estimate_spec"]


@dataclass(frozen=True)
class HardwareModel:
    """What one rank and its links can do. Bandwidths in GB/s per mesh dim kind (tp links are usually NVLink)."""

    device_tflops: float = 100.0
    tp_gbps: float = 150.0
    dp_gbps: float = 25.0
    cp_gbps: float = 150.0  # cp and ep usually span a node too
    ep_gbps: float = 150.0
    pp_gbps: float = 25.0
    collective_latency_s: float = 20e-6


@dataclass(frozen=True)
class CostEstimate:
    """The estimate for one candidate (times in seconds, bytes per rank per step)."""

    pp: int
    dp: int
    tp: int
    zero_stage: int
    compute_s: float
    bubble_s: float
    tp_bytes: float
    dp_bytes: float
    pp_bytes: float
    comm_s: float
    step_s: float
    memory_gb: float
    fits: bool
    note: str = ""
    cp: int = 1
    ep: int = 1
    cp_bytes: float = 0.0
    ep_bytes: float = 0.0
    params_gb: float = 0.0  # parameters + gradients + optimizer states per rank
    activations_gb: float = 0.0
    attention_gb: float = 0.0  # the part of the activations that grows faster than the tokens (S^2, gathered k/v)
    weights_gb: float = 0.0  # the terms of params_gb: this rank's parameters (its ZeRO-3 shard under ZeRO 3),
    grads_gb: float = 0.0  # its gradients, its optimizer states (Adam's two, plus fp32 masters below 4-byte
    states_gb: float = 0.0  # parameters), and the ZeRO-3 blocks gathered whole (communication buffers)
    gathered_gb: float = 0.0
    microbatches: int = 0  # pipeline microbatches per step priced (0 without a pipeline)

    @property
    def dims(self) -> dict[str, int]:
        """The mesh in canonical order, size-1 dims left out."""
        return {n: s for n, s in (("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("ep", self.ep),
                                  ("tp", self.tp)) if s > 1}

    def as_dict(self) -> dict:
        return asdict(self)


def _shape_facts(trace: ModelTrace, tp_sharded: set[str]) -> tuple[float, float, int]:
    """(parameter elements, elements of the tp-sharded parameters, hidden size)."""
    total = sharded = 0.0
    for fqn, shape in trace.shapes.items():
        n = math.prod(shape)
        total += n
        if fqn in tp_sharded:
            sharded += n
    hidden = next((e.out_shape[-1] for e in trace.events if e.kind == "embedding"), 0)
    return total, sharded, hidden


def _dp_bytes(zero: int, ranks: int, params: float, param_bytes: int, grad_bytes: int) -> float:
    """Ring bytes per step of the data-parallel reduction over ``ranks`` for ``params`` elements, as vescale runs
    it: ZeRO 0 all-reduces the gradients; ZeRO 1 all-reduces them too (DDP) and all-gathers the updated parameters;
    ZeRO 2 reduce-scatters the gradients and all-gathers the parameters; ZeRO 3 all-gathers the parameters in
    forward and again in backward and reduce-scatters the gradients."""
    if ranks <= 1:
        return 0.0
    ring = (ranks - 1) / ranks * params
    return ring * {0: 2 * grad_bytes, 1: 2 * grad_bytes + param_bytes, 2: grad_bytes + param_bytes,
                   3: 2 * param_bytes + grad_bytes}[zero]


def estimate(trace: ModelTrace, *, pp: int, dp: int, tp: int, zero_stage: int, tp_sharded: set[str],
             pairs: int, layers: int, batch_size: int, seq_len: int, microbatches: int | None = None,
             param_bytes: int = 4, act_bytes: int = 4, memory_budget_gb: float | None = None,
             hw: HardwareModel | None = None, sequence_parallel: bool = False,
             vocab: int = 0, cp: int = 1, ep: int = 1, shape: ModelShape | None = None,
             largest_block: float = 0.0, grad_bytes: int = 4, state_bytes: int = 4) -> CostEstimate:
    """Estimate one step of ``trace``'s model (see the module docstring for every term).

    ``tp_sharded`` are the canonical parameter FQNs the tp plan shards; ``pairs`` its column/row pairs; ``layers``
    the number of blocks (for activation memory and pipeline); ``batch_size`` the global batch in sequences;
    ``shape`` the model's shape for the activation, cp and ep terms (:func:`vescale.plan.activations.model_shape`);
    ``largest_block`` the parameter elements of the largest block (ZeRO-3 gathers one whole at a time);
    ``grad_bytes`` the bytes of a gradient element (``build`` keeps gradients in the spec's ``reduce_dtype``, fp32 by
    default, whatever the parameters' dtype); ``state_bytes`` those of an Adam state element.
    """
    hw = hw or HardwareModel()
    lookups = {e.param for e in trace.events if e.kind == "embedding"}
    if pp > 1:  # a captured pipeline stage keeps its embeddings replicated over tp (only the plan's linears are cut)
        tp_sharded = set(tp_sharded) - lookups
    total, sharded, hidden = _shape_facts(trace, tp_sharded)
    traced_tokens = next((math.prod(e.out_shape[:-1]) for e in trace.events if e.kind == "embedding"), 1)
    tokens = batch_size * seq_len
    flops = trace.flops_under("") / traced_tokens * tokens
    flops += sum(2.0 * math.prod(s) * tokens for f, s in trace.shapes.items()
                 if any(f.startswith(o + ".") for o in trace.opaque if o))
    microbatches = microbatches or max(pp, 1) * 2
    world = pp * dp * cp * ep * tp
    compute = 3.0 * flops / world / (hw.device_tflops * 1e12)
    bubble = compute * (pp - 1) / microbatches if pp > 1 else 0.0

    sequences = batch_size / (dp * ep)  # this rank's sequences (cp ranks share them, each its 1/cp of the tokens)
    rank_tokens = sequences * seq_len / cp
    act_full = rank_tokens * hidden * act_bytes  # one [tokens, hidden] activation of this rank
    ring = (tp - 1) / tp if tp > 1 else 0.0
    # Megatron's layout (vescale's fast path): per pair one all-reduce forward and one backward, or with sequence
    # parallelism an all-gather and a reduce-scatter each way, the same ring bytes; a vocab-parallel lookup adds one
    # forward all-reduce. A pipeline stage runs its tp layout by DTensor propagation instead, which measured twice
    # Megatron's bytes at tp=2 (tools/bench/planner_accuracy.py; more at larger tp: not priced)
    per_pair = 4 * ring * act_full * (2 if pp > 1 else 1)
    vocab_lookup = 2 * ring * act_full if pp == 1 and lookups & set(tp_sharded) else 0.0
    tp_bytes = (pairs / pp) * per_pair + vocab_lookup + (2 * ring * rank_tokens * vocab * act_bytes if tp > 1 else 0.0)
    experts = float(shape.expert_params) if shape is not None and ep > 1 else 0.0
    dense = total - experts
    dense_sharded = min(sharded, dense)
    params_rank = (dense - dense_sharded + dense_sharded / tp) / pp + experts / ep
    grad_ranks = dp * cp  # ranks holding the same (dense) parameters whose gradients are averaged
    dp_bytes = _dp_bytes(zero_stage, grad_ranks, params_rank, param_bytes, grad_bytes)
    if ep > 1:  # dense gradients also averaged over ep (experts' over dp only)
        dense_rank = params_rank - experts / ep
        dp_bytes = 2 * (dp * ep - 1) / (dp * ep) * dense_rank * grad_bytes
        dp_bytes += 2 * (dp - 1) / dp * experts / ep * grad_bytes if dp > 1 else 0.0
    cp_bytes = ep_bytes = 0.0
    if cp > 1 and shape is not None:
        kv = 2 * shape.kv_heads * shape.head_dim / tp * sequences * seq_len * act_bytes  # one layer's k, v
        cp_bytes = 2 * (cp - 1) / cp * kv * layers / pp
    if ep > 1 and shape is not None:
        routed = sequences * seq_len * shape.top_k * shape.hidden * act_bytes
        ep_bytes = 4 * (ep - 1) / ep * routed * shape.moe_layers
    pp_bytes = 2 * act_full / tp * (pp - 1) / pp * 2 if pp > 1 else 0.0
    n_coll = (4 * pairs / pp if tp > 1 else 0) + (2 if grad_ranks > 1 else 0) + (2 * microbatches if pp > 1 else 0)
    n_coll += 2 * layers if cp > 1 else 0
    n_coll += 4 * (shape.moe_layers if shape is not None else 0) if ep > 1 else 0
    dp_s = dp_bytes / (hw.dp_gbps * 1e9)
    comm = (tp_bytes / (hw.tp_gbps * 1e9) + dp_s + pp_bytes / (hw.pp_gbps * 1e9) + cp_bytes / (hw.cp_gbps * 1e9)
            + ep_bytes / (hw.ep_gbps * 1e9) + n_coll * hw.collective_latency_s)
    # dp gradient reduction overlaps with backward in DDP; tp/cp/ep/pp traffic sits on the critical path (ZeRO-3's
    # forward gathers too: a third of its dp bytes)
    exposed_dp = dp_s / 3 if zero_stage == 3 else 0.0
    step = compute + bubble + max(comm - dp_s, 0.0) + exposed_dp + max(dp_s - exposed_dp - 2 * compute / 3, 0.0)

    shard = grad_ranks if zero_stage else 1
    weights = params_rank * param_bytes / (shard if zero_stage >= 3 else 1)
    grads = params_rank * grad_bytes / (shard if zero_stage >= 2 else 1)
    states = params_rank * (2 * state_bytes + (4 if param_bytes < 4 else 0)) / (shard if zero_stage >= 1 else 1)
    gathered = 2 * largest_block / tp * param_bytes if zero_stage >= 3 else 0.0  # computing and prefetched
    weights += gathered
    layers_rank = max(layers / pp, 1)
    in_flight = min(pp, microbatches) if pp > 1 else 1
    if shape is not None:
        acts_b = activation_bytes(shape, sequences=sequences / microbatches if pp > 1 else sequences,
                                  seq_len=seq_len, layers=layers_rank, tp=tp, cp=cp,
                                  sequence_parallel=sequence_parallel, act_bytes=act_bytes)
        acts = (acts_b.total - acts_b.head) * in_flight + acts_b.head
        attention = (acts_b.quadratic + acts_b.gathered_kv) * in_flight
    else:
        acts = 34 * (rank_tokens / microbatches if pp > 1 else rank_tokens) * hidden * layers_rank * act_bytes / 2
        acts = acts / tp if sequence_parallel else acts * (0.5 + 0.5 / tp)
        acts *= in_flight
        attention = 0.0
    state_bytes = weights + grads + states
    mem_gb = (state_bytes + acts) / 2**30
    fits = memory_budget_gb is None or mem_gb <= memory_budget_gb
    return CostEstimate(pp, dp, tp, zero_stage, compute, bubble, tp_bytes, dp_bytes, pp_bytes, comm, step, mem_gb,
                        fits, cp=cp, ep=ep, cp_bytes=cp_bytes, ep_bytes=ep_bytes, params_gb=state_bytes / 2**30,
                        activations_gb=acts / 2**30, attention_gb=attention / 2**30,
                        weights_gb=(weights - gathered) / 2**30, grads_gb=grads / 2**30, states_gb=states / 2**30,
                        gathered_gb=gathered / 2**30, microbatches=microbatches if pp > 1 else 0)


def estimate_spec(model, spec, *, batch_size: int, seq_len: int, hw: HardwareModel | None = None,
                  memory_budget_gb: float | None = None, trace: ModelTrace | None = None) -> CostEstimate:
    """The cost model's estimate of one step of ``spec`` (a :class:`vescale.plan.ParallelSpec`) on ``model``: no
    search, the given mesh, ZeRO stage, dtypes and microbatches priced as :func:`choose_parallelism` prices a
    candidate.

    ``model``: the unmodified model, best on the meta device (traced, never run); ``batch_size`` global sequences of
    ``seq_len`` tokens. The tp-sharded parameters are :func:`vescale.plan.auto_plan`'s for the spec's tp (a named or
    hand-written plan is priced as the auto plan); activation checkpointing and gradient accumulation are not priced
    (the estimate is of one whole-batch forward and backward). Pure: no process group needed.
    """
    from vescale.plan.activations import model_shape
    from vescale.plan.auto_plan import plan_from_trace
    from vescale.plan.dry_run import meta_scalars
    from vescale.plan.pipeline import _blocks
    from vescale.plan.trace import trace_model

    if trace is None:
        with meta_scalars():  # transformers' models read values back (e.g. a packed-sequence test) while traced
            trace = trace_model(model)
    dims = {n: spec.size(n) for n in ("pp", "dp", "cp", "ep", "tp")}
    tp = dims["tp"]
    sharded: set[str] = set()
    rows = heads = 0
    if tp > 1:
        plan = plan_from_trace(trace, ["tp"], {"tp": tp}, sequence_parallel=spec.sequence_parallel)
        params = [d for d in plan.decisions if d.kind == "parameter"]
        sharded = {d.fqn for d in params if d.role != "replicated"}
        rows = sum(1 for d in params if d.role == "row")
        heads = sum(1 for d in params if d.role == "head")
    _, blocks = _blocks(model)
    block_sizes = [sum(math.prod(s) for f, s in trace.shapes.items() if f.startswith(b + ".")) for b in blocks]
    vocab = next((trace.shapes[e.param][0] for e in trace.events if e.kind == "embedding"), 0)
    nbytes = {"fp32": 4, "bf16": 2}
    return estimate(trace, pp=dims["pp"], dp=dims["dp"], tp=tp, cp=dims["cp"], ep=dims["ep"], zero_stage=spec.zero,
                    tp_sharded=sharded, pairs=rows, layers=len(blocks), batch_size=batch_size, seq_len=seq_len,
                    microbatches=spec.pipeline_microbatches if dims["pp"] > 1 else None,
                    param_bytes=nbytes[spec.dtype], act_bytes=nbytes[spec.dtype],
                    grad_bytes=nbytes[spec.reduce_dtype], state_bytes=nbytes[spec.optimizer_state_dtype],
                    memory_budget_gb=memory_budget_gb, hw=hw, sequence_parallel=spec.sequence_parallel,
                    vocab=vocab if heads else 0, shape=model_shape(model, trace),
                    largest_block=float(max(block_sizes, default=0)))
