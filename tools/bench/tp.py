"""Benchmark vescale tensor/sequence parallelism against PyTorch's own, same model, mesh and ranks, one run.

    python tools/bench/tp.py [--small] [--tp 2 4] [--steps N]

One training step (forward, vocab-parallel loss, backward, SGD step) of the Llama-shaped GPT of
``vescale.core.testing.models`` (~30M parameters; ``--small``: ~0.3M) on a ``tp`` mesh with sequence parallelism:

* vescale: ``vescale.parallel.parallelize_module`` with ``gpt_plan(sequence_parallel=True, loss_parallel=True)`` and
  ``vocab_parallel_cross_entropy``;
* torch: ``torch.distributed.tensor.parallel.parallelize_module`` with the canonical (torchtitan) Llama plan
  (Colwise/Rowwise/SequenceParallel/PrepareModuleInput, ``loss_parallel``).

Both run in the same rank processes, steps interleaved (vescale, torch, vescale, ...) so machine noise hits both.
Reports the median step time of the slowest rank, the ratio vescale / torch (target <= 1.05), the bytes each rank
hands to collectives per step (the inputs of every collective issued, functional or ``torch.distributed``, counted by
:class:`vescale.core.comm.CommCounter`), their ratio (target 1.0), and the loss difference after the steps as a
sanity check. Prints one JSON object.

``--activation-checkpointing full|selective`` measures instead vescale's TP+SP step (dropout 0.1) with
``vescale.parallel.checkpoint_activations`` against the same step without it, on fresh ranks each: median step time,
peak RSS growth during the steps (CPU torch has no allocator statistics; Linux ``clear_refs`` resets the peak after
warm-up), their ratios, and whether the losses are equal (they must be, bitwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _config(small: bool):
    from vescale.core.testing.models import GPTConfig

    if small:
        return GPTConfig(vocab_size=512, d_model=64, n_layer=2, n_head=4, ffn_hidden=192, max_seq_len=64), 4, 64
    return GPTConfig(vocab_size=8192, d_model=512, n_layer=6, n_head=8, ffn_hidden=1408, max_seq_len=256), 4, 256


def _torch_plan(model, mesh):
    """torchtitan's Llama TP+SP plan, spelled for this model's FQNs."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


def _rank_main(small: bool, tp: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import GPT
    from vescale.parallel import parallelize_module, vocab_parallel_cross_entropy
    from vescale.parallel.plans import gpt_plan

    torch.set_num_threads(1)
    cfg, batch, seq = _config(small)
    mesh = init_mesh({"tp": tp})
    torch.manual_seed(0)
    ours = GPT(cfg)
    theirs = GPT(cfg)
    theirs.load_state_dict(ours.state_dict())
    n_params = sum(p.numel() for p in ours.parameters())
    parallelize_module(ours, mesh, gpt_plan(mesh, sequence_parallel=True, loss_parallel=True))
    _torch_plan(theirs, mesh)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=1e-2)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)

    def step_ours() -> float:
        loss = vocab_parallel_cross_entropy(ours(tokens), targets)
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        return loss.to_local().item()

    def step_theirs() -> float:
        logits = theirs(tokens)
        with torch_loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
        return loss.to_local().item()

    with count_comms(mesh) as c_ours:
        step_ours()
    with count_comms(mesh) as c_theirs:
        step_theirs()
    for _ in range(warmup):
        step_ours()
        step_theirs()
    t_ours, t_theirs = [], []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss_ours = step_ours()
        t_ours.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        loss_theirs = step_theirs()
        t_theirs.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(t_ours), statistics.median(t_theirs)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return {"tp": tp, "params": n_params, "vescale_step_s": round(med[0].item(), 4),
            "torch_step_s": round(med[1].item(), 4), "time_ratio": round(med[0].item() / med[1].item(), 3),
            "vescale_bytes_per_step": c_ours.total_bytes, "torch_bytes_per_step": c_theirs.total_bytes,
            "bytes_ratio": round(c_ours.total_bytes / max(c_theirs.total_bytes, 1), 4),
            "vescale_collectives": dict(c_ours.counts), "torch_collectives": dict(c_theirs.counts),
            "loss_diff_after_steps": abs(loss_ours - loss_theirs)}


def _peak_rss_reset() -> int:
    """Reset this process's peak RSS (Linux ``clear_refs`` 5) and return the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not resettable: the peak then also covers model building (reported as such)
    return _proc_status_bytes("VmRSS")


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _ac_rank_main(small: bool, tp: int, steps: int, warmup: int, policy: str, dropout: float, batch: int) -> dict:
    """vescale's TP+SP step with ``--activation-checkpointing policy`` (``none``: without): median step time of the
    slowest rank, and the largest growth of any rank's peak RSS during the steps over its RSS before them (the
    activations held for backward; CPU torch keeps no allocator statistics)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import GPT
    from vescale.dtensor import random as vrandom
    from vescale.parallel import checkpoint_activations, parallelize_module, vocab_parallel_cross_entropy
    from vescale.parallel.plans import gpt_plan

    torch.set_num_threads(1)
    cfg, default_batch, seq = _config(small)
    cfg, batch = dataclasses.replace(cfg, dropout=dropout), batch or default_batch
    mesh = init_mesh({"tp": tp})
    torch.manual_seed(0)
    model = GPT(cfg).train()
    parallelize_module(model, mesh, gpt_plan(mesh, sequence_parallel=True, loss_parallel=True))
    if policy != "none":
        checkpoint_activations(model, policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    vrandom.manual_seed(0)

    def step() -> float:
        loss = vocab_parallel_cross_entropy(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.to_local().item()

    for _ in range(warmup):
        step()
    before = _peak_rss_reset()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    peak = _proc_status_bytes("VmHWM") - before
    out = torch.tensor([statistics.median(times), float(peak)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return {"policy": policy, "step_s": round(out[0].item(), 4), "peak_rss_growth_mb": round(out[1].item() / 2**20, 1),
            "loss": loss}


def _activation_checkpointing(args, steps: int, warmup: int) -> list[dict]:
    """Each tp size: the step without and with ``--activation-checkpointing``, fresh ranks each (peak RSS is per
    process), and the ratios with / without."""
    from vescale.core.launch import spawn

    results = []
    for tp in args.tp:
        base, ac = (spawn(_ac_rank_main, tp, args.small, tp, steps, warmup, policy, args.dropout, args.batch)
                    for policy in ("none", args.activation_checkpointing))
        results.append({"tp": tp, "without": base, "with": ac,
                        "time_ratio": round(ac["step_s"] / base["step_s"], 3),
                        "peak_memory_ratio": round(ac["peak_rss_growth_mb"] / max(base["peak_rss_growth_mb"], 1e-9),
                                                   3),
                        "loss_equal": ac["loss"] == base["loss"]})
    return results


def main() -> None:
    from vescale.core.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny model, few steps (the nox bench session)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "selective"],
                        help="instead of vescale vs torch: vescale's step with this policy vs without it\n"
                             "(step time, peak RSS growth, their ratios)")
    parser.add_argument("--dropout", type=float, default=0.1, help="model dropout for --activation-checkpointing")
    parser.add_argument("--batch", type=int, default=0,
                        help="sequences per step for --activation-checkpointing (0: the model's default, 4)")
    args = parser.parse_args()
    steps = args.steps or (3 if args.small else 8)
    warmup = 1 if args.small else 2
    if args.activation_checkpointing != "none":
        print(json.dumps({"benchmark": "tp-activation-checkpointing", "policy": args.activation_checkpointing,
                          "small": args.small, "steps": steps, "dropout": args.dropout, "batch": args.batch or 4,
                          "results": _activation_checkpointing(args, steps, warmup)}))
        return
    results = [spawn(_rank_main, tp, args.small, tp, steps, warmup) for tp in args.tp]
    print(json.dumps({"benchmark": "tp", "small": args.small, "steps": steps, "results": results}))


if __name__ == "__main__":
    main()
