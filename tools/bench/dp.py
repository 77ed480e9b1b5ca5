"""Benchmark vescale data parallelism against PyTorch's own, same model and ranks, one run.

    python tools/bench/dp.py [--small] [--world-size N] [--steps N] [--zero3-vs-fsdp2 [--rounds N]]

Compares, per rank (the slowest rank's median step time; peak memory of the rank process):
  * vescale ``DistributedDataParallel`` (ZeRO 0)  vs  ``torch.nn.parallel.DistributedDataParallel``
  * vescale ZeRO 1 (DDP + ``DistributedOptimizer(zero_stage=1)``)
  * vescale ZeRO 2 (DDP ``zero_stage=2`` + ``DistributedOptimizer``)  vs  torch ``fully_shard`` with
    ``reshard_after_forward=False`` (FSDP2 in its ZeRO-2-like mode)
  * vescale ZeRO 3 (``fully_shard_dp``)  vs  torch ``fully_shard`` per block and root, used directly; and the same
    pair again in one set of rank processes, their steps interleaved (A B B A per round, a barrier before every
    step, the slowest rank's time), which is the step-time ratio to trust on a loaded machine: its median over the
    rounds' paired ratios and their spread (``zero3_vs_fsdp2_interleaved``; ``--zero3-vs-fsdp2`` runs only it)
all with ``torch.optim.AdamW`` on the nanoGPT-style GPT of ``vescale.core.testing.models``. Every configuration runs in
fresh rank processes, so peak memory is its own: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the growth of the
process's peak RSS over its size before the model was built. Held bytes per rank are also counted from the tensors
after the last step (parameters, gradients with their buffers, optimizer states) and set beside the theoretical
figures of each ZeRO stage for P fp32 parameters over dp ranks with AdamW (params / grads / optimizer bytes): ZeRO 0
4P / 4P / 8P, ZeRO 1 4P / 4P / 8P/dp, ZeRO 2 4P / 4P/dp / 8P/dp, ZeRO 3 4P/dp / 4P/dp / 8P/dp. Prints one JSON object
with the figures and the ratios (vescale / torch; < 1 is better for vescale).

``--memory`` (also part of the full run, as ``memory_table``): vescale ZeRO 0/1/2/3, each without and with activation
checkpointing (``checkpoint_activations(model, "full")``: ``+ac`` in a method's name), one row each: the measured
peak, the bytes held after the step beside the theoretical ones, and (DDP-based stages) the largest gradient-buffer
bytes seen at any gradient hook of any step's backward (ZeRO-2: the shards plus the full buckets alive then).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time


def _config(small: bool):
    from vescale.core.testing.models import GPTConfig

    if small:
        return GPTConfig(vocab_size=256, d_model=64, n_layer=2, n_head=4, max_seq_len=64), 4, 64
    return GPTConfig(vocab_size=8192, d_model=384, n_layer=4, n_head=6, max_seq_len=128), 8, 128


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _run(method: str, small: bool, steps: int) -> dict:
    """One configuration on this rank; returns its figures (called on every rank)."""
    import gc

    import torch
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
        # Warm the process (imports, allocator, collectives) on the tiny model so that the growth of peak RSS after
        # this point is the real model's.
        _train(method, *_config(True), 1, device, cuda)
        gc.collect()
    base = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, state, numel, held, grads_peak = _train(method, *_config(small), steps, device, cuda)
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss_bytes()) - base
    # The slowest rank's median step, and the largest per-rank memory figures.
    worst = torch.tensor([statistics.median(times), peak, state, -1 if grads_peak is None else grads_peak, *held],
                         dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    held_bytes = dict(zip(("params", "grads", "optimizer"), (int(v) for v in worst[4:].tolist())))
    theory = _theory(method, numel, dist.get_world_size())
    return {"step_s": worst[0].item(), "peak_mem_bytes": int(worst[1].item()), "opt_state_bytes": int(worst[2].item()),
            "full_opt_state_bytes": 2 * 4 * numel, "params": numel, "held_bytes_per_rank": held_bytes,
            "theory_bytes_per_rank": theory, "held_total": sum(held_bytes.values()),
            "theory_total": sum(theory.values()),
            "grads_peak_in_backward_bytes": None if worst[3].item() < 0 else int(worst[3].item())}


# ZeRO stage of each method, for its theoretical bytes per rank.
_STAGE = {"torch_ddp": 0, "vescale_ddp": 0, "vescale_zero1": 1, "vescale_zero2": 2, "torch_fsdp2_no_reshard": 2,
          "vescale_zero3": 3, "torch_fsdp2": 3}
# The --memory table: vescale's ZeRO 0/1/2/3, each without and with full activation checkpointing ("+ac").
_MEMORY_METHODS = tuple(m + ac for m in ("vescale_ddp", "vescale_zero1", "vescale_zero2", "vescale_zero3")
                        for ac in ("", "+ac"))


def _theory(method: str, numel: int, dp: int) -> dict:
    """Bytes per rank of fp32 parameters, gradients and AdamW's two states at this method's ZeRO stage."""
    stage = _STAGE[method.removesuffix("+ac")]
    return {"params": 4 * numel // (dp if stage >= 3 else 1), "grads": 4 * numel // (dp if stage >= 2 else 1),
            "optimizer": 8 * numel // (dp if stage >= 1 else 1)}


def _held(model, opt, method: str) -> list[int]:
    """Bytes this rank holds after a step: parameters, gradients (vescale DDP: its flat buffers and ZeRO-2 shards;
    else the ``.grad`` tensors), optimizer states (vescale ZeRO: its fp32 masters too, when not aliased)."""
    import torch

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in model.parameters())
    if hasattr(model, "grad_buffer_bytes"):
        grads = model.grad_buffer_bytes()
    else:
        grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    inner = opt.optimizer if hasattr(opt, "master_bytes") else opt
    state = sum(nbytes(v) for st in inner.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    if hasattr(opt, "master_bytes"):
        state += opt.master_bytes()
    return [params, grads, state]


def _train(method: str, cfg, batch: int, seq: int, steps: int, device, cuda: bool):
    """Build ``method`` around a fresh GPT and time ``steps`` AdamW steps: (step times, opt-state bytes, numel)."""
    import torch
    import torch.distributed as dist

    from vescale.core.testing.models import GPT, cross_entropy

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    numel = sum(p.numel() for p in model.parameters())
    if method.endswith("+ac"):  # every block's activations recomputed in backward (only its input is kept)
        from vescale.parallel import checkpoint_activations

        checkpoint_activations(model, "full")
        method = method.removesuffix("+ac")

    if method == "torch_ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif method == "vescale_ddp":
        from vescale.parallel import DDPOptions, DistributedDataParallel

        model = DistributedDataParallel(model, dist.group.WORLD)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif method == "torch_fsdp2_no_reshard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif method in ("vescale_zero1", "vescale_zero2"):
        from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

        stage = _STAGE[method]
        model = DistributedDataParallel(model, dist.group.WORLD, DDPOptions(zero_stage=stage if stage == 2 else 0))
        opt = DistributedOptimizer(model, torch.optim.AdamW, zero_stage=stage, lr=1e-4)
    elif method == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif method == "vescale_zero3":
        from torch.distributed.device_mesh import init_device_mesh

        from vescale.parallel import fully_shard_dp

        model = fully_shard_dp(model, init_device_mesh(device.type, (world,), mesh_dim_names=("dp",)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        raise ValueError(method)

    grads_peak = None
    if hasattr(model, "grad_buffer_bytes"):  # vescale DDP: its gradient bytes at every gradient hook of backward
        from torch.autograd.graph import get_gradient_edge

        grads_peak = [0]

        def sample(*_):
            grads_peak[0] = max(grads_peak[0], model.grad_buffer_bytes())

        for p in model.slots:  # hooks run after DDP's own (registered first) on the same node, which DDP keeps
            get_gradient_edge(p).node.register_hook(sample)

    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps + 1):  # one warm-up step
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        if step == steps:  # what a rank holds at its fullest: after the update, before the gradients are freed
            held = _held(model, opt, method)
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        if step >= 1:
            times.append(time.perf_counter() - t0)
    inner = opt.optimizer if hasattr(opt, "optimizer") and method.startswith("vescale_zero") else opt
    state = 0
    for st in inner.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                local = v.to_local() if hasattr(v, "to_local") else v
                state += local.numel() * local.element_size()
    return times, state, numel, held, None if grads_peak is None else grads_peak[0]


def _build_zero3(method: str, cfg, device):
    """A fresh GPT (seed 0) sharded per block and root over all ranks: by vescale (``fully_shard_dp``) or by torch's
    ``fully_shard`` called directly; with its AdamW."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vescale.core.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    if method == "vescale_zero3":
        from vescale.parallel import fully_shard_dp

        fully_shard_dp(model, mesh)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _zero3_vs_fsdp2(small: bool, rounds: int, block: int) -> dict:
    """vescale ZeRO 3 against torch FSDP2 used directly, interleaved in one set of rank processes (on every rank).

    Both models live side by side. Each round times ``block`` steps of each, in the order A B B A (vescale, torch,
    torch, vescale), so that a load that drifts linearly over a round weighs both alike; every step starts after a
    barrier and its time is the slowest rank's. A round's ratio is the median of its vescale steps over the median
    of its torch steps (and, less sensitive to bursts of other load, its fastest vescale step over its fastest torch
    step): the rounds' ratios are paired measurements under the same load, and their median and quartiles are what
    a loaded machine can say."""
    import torch
    import torch.distributed as dist

    from vescale.core.testing.models import cross_entropy

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    cfg, batch, seq = _config(small)
    models = {m: _build_zero3(m, cfg, device) for m in ("vescale_zero3", "torch_fsdp2")}
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)

    def step(method: str) -> float:
        model, opt = models[method]
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for method in models:  # warm-up: lazy init, allocator, first collectives
        step(method)
        step(method)
    times: dict[str, list[list[float]]] = {m: [] for m in models}
    for _ in range(rounds):
        mine: dict[str, list[float]] = {m: [] for m in models}
        for method in ("vescale_zero3", "torch_fsdp2", "torch_fsdp2", "vescale_zero3"):
            mine[method] += [step(method) for _ in range(block)]
        for method in models:
            times[method].append(mine[method])
    # the slowest rank's time of every step
    flat = torch.tensor([times[m] for m in models], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    slowest = {m: flat[i].tolist() for i, m in enumerate(models)}
    pairs = list(zip(slowest["vescale_zero3"], slowest["torch_fsdp2"]))
    ratios = sorted(statistics.median(v) / statistics.median(t) for v, t in pairs)
    # the fastest step of each method in a round: the step least disturbed by other load, paired within the round
    fastest = sorted(min(v) / min(t) for v, t in pairs)
    every = {m: [x for r in slowest[m] for x in r] for m in models}
    quart = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    fquart = statistics.quantiles(fastest, n=4, method="inclusive") if len(fastest) > 1 else [fastest[0]] * 3
    return {"rounds": rounds, "steps_per_method_per_round": 2 * block,
            "vescale_step_s_median": statistics.median(every["vescale_zero3"]),
            "torch_step_s_median": statistics.median(every["torch_fsdp2"]),
            "vescale_step_s_min": min(every["vescale_zero3"]), "torch_step_s_min": min(every["torch_fsdp2"]),
            "ratio_median": statistics.median(ratios), "ratio_q1": quart[0], "ratio_q3": quart[2],
            "ratio_min": ratios[0], "ratio_max": ratios[-1],
            "fastest_step_ratio_median": statistics.median(fastest), "fastest_step_ratio_q1": fquart[0],
            "fastest_step_ratio_q3": fquart[2], "round_ratios": ratios}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny model, few steps (a smoke run)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", nargs="+", choices=sorted({*_STAGE, *_MEMORY_METHODS}),
                        help="run these methods only (no ratios)")
    parser.add_argument("--memory", action="store_true",
                        help="only the memory table: vescale ZeRO 0/1/2/3 without and with activation checkpointing")
    parser.add_argument("--zero3-vs-fsdp2", action="store_true",
                        help="only the interleaved ZeRO-3 vs torch FSDP2 comparison (see --rounds)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of the interleaved ZeRO-3 vs FSDP2 comparison (default 9, --small 3)")
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.small else 10)
    rounds = args.rounds or (3 if args.small else 9)

    from vescale.core.launch import spawn

    if args.zero3_vs_fsdp2:
        out = {"bench": "dp", "world_size": args.world_size, "small": args.small,
               "zero3_vs_fsdp2_interleaved": spawn(_zero3_vs_fsdp2, args.world_size, args.small, rounds, 2)}
        print(json.dumps(out, indent=1))
        return out
    results = {}
    if args.memory:
        for method in _MEMORY_METHODS:
            results[method] = spawn(_run, args.world_size, method, args.small, steps)
        out = {"bench": "dp", "world_size": args.world_size, "small": args.small, "steps": steps,
               "memory_measure": _memory_measure(args.world_size), "memory_table": _memory_table(results)}
        print(json.dumps(out, indent=1))
        return out
    methods = ("torch_ddp", "vescale_ddp", "vescale_zero1", "torch_fsdp2_no_reshard", "vescale_zero2", "torch_fsdp2",
               "vescale_zero3", *(m for m in _MEMORY_METHODS if m.endswith("+ac")))
    for method in args.only or methods:
        results[method] = spawn(_run, args.world_size, method, args.small, steps)
    if args.only:
        print(json.dumps({"bench": "dp", "world_size": args.world_size, "results": results}, indent=1))
        return results
    full = results["vescale_zero2"]["full_opt_state_bytes"]
    dp = args.world_size
    out = {
        "bench": "dp",
        "world_size": args.world_size,
        "small": args.small,
        "steps": steps,
        "params": results["torch_ddp"]["params"],
        "memory_measure": _memory_measure(args.world_size),
        "results": results,
        "ddp_step_time_ratio": results["vescale_ddp"]["step_s"] / results["torch_ddp"]["step_s"],
        "ddp_peak_mem_ratio": _ratio(results["vescale_ddp"]["peak_mem_bytes"], results["torch_ddp"]["peak_mem_bytes"]),
        "zero2_step_time_ratio": results["vescale_zero2"]["step_s"] / results["torch_fsdp2_no_reshard"]["step_s"],
        "zero2_peak_mem_ratio": _ratio(results["vescale_zero2"]["peak_mem_bytes"],
                                       results["torch_fsdp2_no_reshard"]["peak_mem_bytes"]),
        "zero3_step_time_ratio": results["vescale_zero3"]["step_s"] / results["torch_fsdp2"]["step_s"],
        "zero3_peak_mem_ratio": _ratio(results["vescale_zero3"]["peak_mem_bytes"],
                                       results["torch_fsdp2"]["peak_mem_bytes"]),
        # the step-time ratio to trust on a shared machine: both in the same processes, interleaved, paired rounds
        "zero3_vs_fsdp2_interleaved": spawn(_zero3_vs_fsdp2, args.world_size, args.small, rounds, 2),
        "zero2_opt_state_vs_full_over_dp": results["vescale_zero2"]["opt_state_bytes"] * dp / full,
        "fsdp2_opt_state_vs_full_over_dp": results["torch_fsdp2_no_reshard"]["opt_state_bytes"] * dp / full,
        "memory_table": _memory_table(results),
    }
    print(json.dumps(out, indent=1))
    return out


def _memory_table(results: dict) -> list[dict]:
    """One row per ZeRO stage and activation checkpointing (of ``_MEMORY_METHODS`` run): measured peak, held bytes
    after the step against the theoretical ones (params + grads + optimizer), and their ratio."""
    rows = []
    for method in _MEMORY_METHODS:
        r = results.get(method)
        if r is None:
            continue
        rows.append({"method": method, "zero": _STAGE[method.removesuffix("+ac")],
                     "activation_checkpointing": "full" if method.endswith("+ac") else "none",
                     "peak_mem_bytes": r["peak_mem_bytes"], "held_bytes": r["held_bytes_per_rank"],
                     "theory_bytes": r["theory_bytes_per_rank"], "held_total": r["held_total"],
                     "theory_total": r["theory_total"], "held_over_theory": _ratio(r["held_total"], r["theory_total"]),
                     "grads_peak_in_backward_bytes": r["grads_peak_in_backward_bytes"]})
    return rows


def _memory_measure(world_size: int) -> str:
    return "cuda max_memory_allocated" if _cuda_ranks(world_size) else "peak RSS growth"


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _cuda_ranks(world_size: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


if __name__ == "__main__":
    main(sys.argv[1:])
