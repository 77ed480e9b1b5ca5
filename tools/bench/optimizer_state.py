"""bf16 optimizer state (vescale.parallel.low_precision_state) against fp32 state: loss curve, state bytes, step time.

    python tools/bench/optimizer_state.py [--small] [--steps 200] [--world-size 2]

1. The curve: one process trains a small GPT (vescale.core.testing.models, d=128, 4 layers, learnable progression
   batches) for ``--steps`` AdamW steps twice from the same init and batches, with fp32 state (torch's AdamW as is,
   the PyTorch-native way) and with bf16 state; prints both loss curves' summary: the largest absolute and relative
   difference of the loss at any step, and of the last 10 steps' mean (the batches are learnable to a loss near 0,
   where relative differences of tiny losses are large: read the absolute ones there).
2. ZeRO 1 over ``--world-size`` dp ranks (vescale DistributedOptimizer, the same model), fp32 against bf16 state:
   the optimizer-step median time (max over ranks), state bytes per rank (the optimizer's own ``state_bytes()``),
   and their ratios (bf16 / fp32). CPU gloo timings are noisy (a shared 2-core machine: repeat before trusting one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from vescale.core.testing import run_on_ranks

VOCAB, SEQ, BATCH = 128, 32, 8


def _model(d: int, layers: int):
    import torch

    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, d_model=d, n_layer=layers, n_head=4, n_kv_head=4, max_seq_len=SEQ))


def _loss(model, step: int, rows: slice = slice(None)):
    import torch.nn.functional as F

    from vescale.core.testing.reference import progression_batch

    x, y = progression_batch(5000 + step, BATCH, SEQ, VOCAB)
    return F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())


def curve(state_dtype: str, steps: int, d: int, layers: int) -> list[float]:
    """Losses of ``steps`` AdamW steps (lr 3e-3, weight decay 0.1) with the optimizer state in ``state_dtype``."""
    import torch

    from vescale.parallel import low_precision_state

    torch.set_num_threads(1)
    model = _model(d, layers)
    opt = low_precision_state(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), state_dtype)
    losses = []
    for step in range(steps):
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _zero1_rank(state_dtype: str, steps: int, d: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    torch.set_num_threads(1)
    dp, rank = dist.get_world_size(), dist.get_rank()
    ddp = DistributedDataParallel(_model(d, layers), init_mesh({"dp": dp}), DDPOptions(zero_stage=1))
    opt = DistributedOptimizer(ddp, torch.optim.AdamW(ddp.module.parameters(), lr=3e-3, weight_decay=0.1),
                               zero_stage=1, state_dtype=None if state_dtype == "fp32" else state_dtype)
    per = BATCH // dp
    times = []
    for step in range(steps + 1):
        _loss(ddp, step, slice(rank * per, (rank + 1) * per)).backward()
        ddp.finish_grad_sync()
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        if step:  # the first step builds the lazy state
            times.append(time.perf_counter() - t0)
        opt.zero_grad()
    return {"step_s": statistics.median(times), "state_bytes": opt.state_bytes()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="30 steps, d=64, 2 layers (a smoke run)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.small:
        args.steps, args.timed_steps, args.d, args.layers = 30, 3, 64, 2
    fp32, bf16 = (curve(dt, args.steps, args.d, args.layers) for dt in ("fp32", "bf16"))
    rel = [abs(b - a) / a for a, b in zip(fp32, bf16)]
    tail = min(10, args.steps)
    out: dict = {
        "model": {"d_model": args.d, "layers": args.layers, "vocab": VOCAB, "seq": SEQ, "batch": BATCH},
        "steps": args.steps,
        "curve": {"fp32_first_last": [fp32[0], fp32[-1]], "bf16_first_last": [bf16[0], bf16[-1]],
                  "max_abs_loss_diff": max(abs(b - a) for a, b in zip(fp32, bf16)),
                  "steps_to_half_loss": [next((i for i, v in enumerate(c) if v < c[0] / 2), None)
                                         for c in (fp32, bf16)],
                  "max_rel_loss_diff": max(rel),
                  "last10_mean_abs_diff": abs(sum(bf16[-tail:]) - sum(fp32[-tail:])) / tail,
                  "last10_mean_rel_diff": abs(sum(bf16[-tail:]) - sum(fp32[-tail:])) / sum(fp32[-tail:])},
        "zero1": {"world_size": args.world_size},
    }
    for dt in ("fp32", "bf16"):
        ranks = run_on_ranks(_zero1_rank, args.world_size, dt, args.timed_steps, args.d, args.layers)
        out["zero1"][dt] = {"step_s": max(r["step_s"] for r in ranks),
                            "state_bytes_per_rank": [r["state_bytes"] for r in ranks]}
    z = out["zero1"]
    z["step_ratio_bf16_over_fp32"] = z["bf16"]["step_s"] / z["fp32"]["step_s"]
    z["state_bytes_ratio_bf16_over_fp32"] = sum(z["bf16"]["state_bytes_per_rank"]) / sum(
        z["fp32"]["state_bytes_per_rank"])
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
