"""A cost model for one training step on a pp x dp x tp mesh: flops, bytes per collective per mesh dim, memory.

Deliberately simple and explicit (every term is a field of :class:`CostEstimate`), in the spirit of the Megatron-LM
papers' accounting:

* compute: ``3 x`` forward matmul flops (forward + backward) of the traced model, scaled linearly to
  ``batch_size x seq_len`` tokens, divided over all ranks, at ``device_tflops``; the pipeline bubble adds
  ``(pp - 1) / microbatches`` of it (1F1B).
* tp: per column/row pair, an all-gather and a reduce-scatter of the rank's activations in forward and the same in
  backward (sequence parallel; without it two all-reduces of the same bytes each way), plus the head's logits.
  Ring cost ``(n - 1) / n`` of the full tensor per all-gather/reduce-scatter, twice that per all-reduce.
* dp: one all-reduce of the rank's gradients per step (ZeRO-1/2: reduce-scatter + all-gather, the same bytes).
* pp: activations of one microbatch sent forward and their gradients backward at each stage boundary.
* memory per rank: parameters (sharded by tp, split by pp), gradients, Adam's two states and an fp32 master copy
  when ``param_bytes < 4`` (divided by dp from ZeRO-1 on; gradients too from ZeRO-2), and activations
  (``34 x tokens x hidden`` bytes per layer at 2-byte activations, divided by tp under sequence parallelism,
  ``pp`` microbatches in flight on the first stage).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from vescale.plan.trace import ModelTrace

__all__ = ["CostEstimate", "HardwareModel", "estimate"]


@dataclass(frozen=True)
class HardwareModel:
    """What one rank and its links can do. Bandwidths in GB/s per mesh dim kind (tp links are usually NVLink)."""

    device_tflops: float = 100.0
    tp_gbps: float = 150.0
    dp_gbps: float = 25.0
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


def estimate(trace: ModelTrace, *, pp: int, dp: int, tp: int, zero_stage: int, tp_sharded: set[str],
             pairs: int, layers: int, batch_size: int, seq_len: int, microbatches: int | None = None,
             param_bytes: int = 4, act_bytes: int = 4, memory_budget_gb: float | None = None,
             hw: HardwareModel | None = None, sequence_parallel: bool = False,
             vocab: int = 0) -> CostEstimate:
    """Estimate one step of ``trace``'s model (see the module docstring for every term).

    ``tp_sharded`` are the canonical parameter FQNs the tp plan shards; ``pairs`` its column/row pairs; ``layers``
    the number of blocks (for activation memory and pipeline); ``batch_size`` the global batch in sequences.
    """
    hw = hw or HardwareModel()
    total, sharded, hidden = _shape_facts(trace, tp_sharded)
    traced_tokens = next((math.prod(e.out_shape[:-1]) for e in trace.events if e.kind == "embedding"), 1)
    tokens = batch_size * seq_len
    flops = trace.flops_under("") / traced_tokens * tokens
    flops += sum(2.0 * math.prod(s) * tokens for f, s in trace.shapes.items()
                 if any(f.startswith(o + ".") for o in trace.opaque if o))
    microbatches = microbatches or max(pp, 1) * 2
    compute = 3.0 * flops / (pp * dp * tp) / (hw.device_tflops * 1e12)
    bubble = compute * (pp - 1) / microbatches if pp > 1 else 0.0

    rank_tokens = tokens / dp
    act_full = rank_tokens * hidden * act_bytes  # one [tokens, hidden] activation of this dp rank
    ring = (tp - 1) / tp if tp > 1 else 0.0
    per_pair = 4 * ring * act_full if sequence_parallel else 4 * 2 * ring * act_full
    tp_bytes = (pairs / pp) * per_pair + (2 * ring * rank_tokens * vocab * act_bytes if tp > 1 else 0.0)
    params_rank = (total - sharded + sharded / tp) / pp
    dp_bytes = 2 * (dp - 1) / dp * params_rank * param_bytes if dp > 1 else 0.0
    pp_bytes = 2 * act_full / tp * (pp - 1) / pp * 2 if pp > 1 else 0.0
    n_coll = (4 * pairs / pp if tp > 1 else 0) + (2 if dp > 1 else 0) + (2 * microbatches if pp > 1 else 0)
    comm = (tp_bytes / (hw.tp_gbps * 1e9) + dp_bytes / (hw.dp_gbps * 1e9) + pp_bytes / (hw.pp_gbps * 1e9)
            + n_coll * hw.collective_latency_s)
    # dp gradient reduction overlaps with backward in DDP; tp/pp traffic sits on the critical path
    step = compute + bubble + max(comm - (dp_bytes / (hw.dp_gbps * 1e9)), 0.0) \
        + max(dp_bytes / (hw.dp_gbps * 1e9) - 2 * compute / 3, 0.0)

    weights = params_rank * param_bytes
    grads = params_rank * param_bytes / (dp if zero_stage >= 2 else 1)
    states = params_rank * (8 + (4 if param_bytes < 4 else 0)) / (dp if zero_stage >= 1 else 1)
    layers_rank = max(layers / pp, 1)
    acts = 34 * (rank_tokens / microbatches if pp > 1 else rank_tokens) * hidden * layers_rank * act_bytes / 2
    acts = acts / tp if sequence_parallel else acts * (0.5 + 0.5 / tp)
    acts *= min(pp, microbatches) if pp > 1 else 1
    mem_gb = (weights + grads + states + acts) / 2**30
    fits = memory_budget_gb is None or mem_gb <= memory_budget_gb
    return CostEstimate(pp, dp, tp, zero_stage, compute, bubble, tp_bytes, dp_bytes, pp_bytes, comm, step, mem_gb,
                        fits)
