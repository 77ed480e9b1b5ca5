"""Eager per-op overhead of a tensor-parallel step: vescale against torch's TP and a hand-written Megatron floor.

    python tools/bench/overhead.py [--small] [--sizes dispatch middle compute] [--steps N] [--profile]
                                   [--modes vescale vescale_dtensor torch floor] [--kinds train decode]

One model, an unmodified Hugging Face ``LlamaForCausalLM``, at three sizes (``dispatch``: every op is tiny, the step
is bound by per-op CPU work, like a GPU step of a small model; ``middle``; ``compute``: ~30M parameters, bound by the
matmuls), on a ``tp=2`` mesh of CPU ranks, parallelized three ways in the same rank processes:

* ``floor``: Megatron-style, built here from plain torch: each rank's module holds its local weight shards as plain
  tensors (q/k/v/gate/up rows, o/down columns, the embedding's and lm head's vocabulary rows), and explicit
  autograd functions issue the collectives (an all-reduce after o_proj and down_proj and after the vocab-parallel
  embedding, the identity forward / all-reduce backward before each block, an all-gather of the logits). No DTensor.
* ``torch``: ``torch.distributed.tensor.parallel.parallelize_module`` (Colwise/Rowwise, local activations).
* ``vescale``: ``vescale.parallel.parallelize_module`` with ``llama_plan`` (its attention and MLP blocks on the fast
  path: local tensors between the plan's boundaries, see :class:`vescale.parallel.fast.FastBlock`);
* ``vescale_dtensor``: the same, with the fast path off (``vescale.parallel.fast.fast_path(False)``): DTensor
  activations in every block, as before the fast path.

Two steps: ``train`` (forward to full logits, cross-entropy, backward; no optimizer) and ``decode`` (one token of
``model.generate``, greedy, dynamic cache, timed by a streamer: the mean step after the first token). Modes are
interleaved step by step (vescale, torch, floor, ...) so machine noise hits all alike; each figure is the median over
steps of the slowest rank, with the rank processes' CPU time per train and decode step beside the wall time (on a
loaded machine the wall time of a collective is mostly waiting for the other rank). ``--profile`` adds, per mode, the
profiler's top entries by self CPU time on rank 0 (aten ops of a DTensor include DTensor's dispatch in their self
time), per step, for a train step and for the decode steps of one ``generate()`` (prefill excluded). Prints one JSON
object; also checks that all three produce the same loss / tokens (``agree``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from generate import _Timer, _torch_tp  # the same torch TP plan and token timer as the generation bench

#: ``LlamaConfig`` fields and the train batch (batch, seq) of each size.
SIZES = {
    "dispatch": (dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), (2, 16)),
    "middle": (dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256), (2, 64)),
    "compute": (dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256), (2, 256)),
}


# ---------------------------------------------------------------------------------------------------------------
# The Megatron-style floor: plain local shards, explicit collectives
# ---------------------------------------------------------------------------------------------------------------


def _floor_functions():
    import torch
    import torch.distributed as dist

    class CopyToTP(torch.autograd.Function):
        """Forward identity, backward all-reduce (Megatron's ``f``)."""

        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            dist.all_reduce(g)
            return g

    class ReduceFromTP(torch.autograd.Function):
        """Forward all-reduce, backward identity (Megatron's ``g``)."""

        @staticmethod
        def forward(ctx, x):
            x = x.contiguous()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class GatherLast(torch.autograd.Function):
        """Forward all-gather on the last dim, backward this rank's slice."""

        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, x.contiguous())
            ctx.n = x.shape[-1]
            return torch.cat(parts, dim=-1)

        @staticmethod
        def backward(ctx, g):
            r = dist.get_rank()
            return g[..., r * ctx.n:(r + 1) * ctx.n].contiguous()

    return CopyToTP, ReduceFromTP, GatherLast


def _floor(model):
    """``model`` (a copy of the single-device one) turned into this rank's Megatron-style shard, in place."""
    import torch.distributed as dist
    from torch import nn

    CopyToTP, ReduceFromTP, GatherLast = _floor_functions()
    r, n = dist.get_rank(), dist.get_world_size()

    def rows(linear):
        w = linear.weight
        linear.weight = nn.Parameter(w.detach().chunk(n, 0)[r].clone())

    def cols(linear):
        w = linear.weight
        linear.weight = nn.Parameter(w.detach().chunk(n, 1)[r].clone())

    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            rows(lin)
        for lin in (a.o_proj, m.down_proj):
            cols(lin)
            lin.register_forward_hook(lambda mod, args, out: ReduceFromTP.apply(out))
        a.register_forward_pre_hook(lambda mod, args, kwargs: (args, {**kwargs, "hidden_states": CopyToTP.apply(
            kwargs["hidden_states"])}) if "hidden_states" in kwargs else ((CopyToTP.apply(args[0]), *args[1:]),
                                                                          kwargs), with_kwargs=True)
        m.register_forward_pre_hook(lambda mod, args: (CopyToTP.apply(args[0]),))

    emb = model.model.embed_tokens
    vocab = emb.weight.shape[0]
    per = vocab // n
    emb.weight = nn.Parameter(emb.weight.detach()[r * per:(r + 1) * per].clone())

    def embed(ids):
        local = ids - r * per
        outside = (local < 0) | (local >= per)
        out = nn.functional.embedding(local.masked_fill(outside, 0), emb.weight)
        return ReduceFromTP.apply(out.masked_fill(outside.unsqueeze(-1), 0.0))

    emb.forward = embed
    rows(model.lm_head)
    model.lm_head.register_forward_pre_hook(lambda mod, args: (CopyToTP.apply(args[0]),))
    model.lm_head.register_forward_hook(lambda mod, args, out: GatherLast.apply(out))
    return model


def _is_comm(name: str) -> bool:
    return "c10d" in name or "wait_tensor" in name or "allreduce" in name or "allgather" in name


def _top_entries(prof, steps: int, top: int) -> dict:
    """The ``top`` entries by self CPU time per step, collectives apart (their time is mostly waiting for the slower
    rank, i.e. the other rank's overhead), and the collectives' total."""
    events = list(prof.key_averages())
    rows = sorted((e for e in events if not _is_comm(e.key)), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"collectives_self_us_per_step": round(sum(e.self_cpu_time_total for e in events if _is_comm(e.key))
                                                  / steps, 1),
            "top": [{"op": e.key, "self_us_per_step": round(e.self_cpu_time_total / steps, 1),
                     "calls_per_step": e.count // steps} for e in rows[:top]]}


class _CpuTimer(_Timer):
    """A streamer that also notes the rank process's CPU time at each token."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: list[float] = []

    def put(self, value) -> None:
        super().put(value)
        self.cpu.append(time.process_time())


class _ProfiledTimer(_Timer):
    """A streamer that starts ``prof`` when the first new token arrives (the prompt comes first): the profile then
    covers the decode steps only."""

    def __init__(self, prof) -> None:
        super().__init__()
        self.prof = prof

    def put(self, value) -> None:
        super().put(value)
        if len(self.times) == 2:
            self.prof.start()


def _rank_main(size: str, steps: int, decode_tokens: int, profile: bool, modes: list[str],
               kinds: tuple = ("train", "decode")) -> dict:
    import contextlib
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers as tf

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import FastBlock, fast_path

    torch.set_num_threads(1)
    mesh = init_mesh({"tp": dist.get_world_size()})
    cfg, (batch, seq) = SIZES[size]
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg))
    n_params = sum(p.numel() for p in base.parameters())
    build = {"vescale": lambda m: parallelize_module(m, mesh, llama_plan(mesh)),
             "vescale_dtensor": lambda m: parallelize_module(m, mesh, llama_plan(mesh)),
             "torch": lambda m: _torch_tp(m, mesh), "floor": _floor}
    models = {k: build[k](copy.deepcopy(base)) for k in modes}
    # the same vescale model without the fast path: every block on DTensors (the state before the fast path)
    def context(k: str):
        return fast_path(False) if k == "vescale_dtensor" else contextlib.nullcontext()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg["vocab_size"], (batch, seq), generator=g)
    labels = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=g)

    def logits_of(out):
        x = out.logits
        return x.full_tensor() if hasattr(x, "full_tensor") else x

    def train(m, k) -> float:
        with context(k):
            return _train(m)

    def _train(m) -> float:
        loss = F.cross_entropy(logits_of(m(input_ids=ids)).flatten(0, 1), labels.flatten())
        loss.backward()
        for p in m.parameters():
            p.grad = None
        return loss.item()

    prompt = ids[:, : min(seq, 16)]

    def decode(m, k) -> tuple[float, float, list]:
        timer = _CpuTimer()
        with torch.no_grad(), context(k):
            out = m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=decode_tokens,
                             min_new_tokens=decode_tokens, do_sample=False, pad_token_id=0, streamer=timer)
        t, c = timer.times, timer.cpu
        return (t[-1] - t[1]) / (len(t) - 2), (c[-1] - c[1]) / (len(c) - 2), out.tolist()

    result: dict = {"size": size, "params": n_params, "train_batch": [batch, seq], "decode_batch": list(prompt.shape),
                    "decode_tokens": decode_tokens}
    if "vescale" in models:
        result["vescale_fast_blocks"] = sum(isinstance(m.forward, FastBlock) for m in models["vescale"].modules())
    for k, m in models.items():
        if "train" in kinds:
            train(m, k)  # warm-up (and DTensor's caches)
        m.eval()
        decode(m, k)
        m.train()
    times: dict[str, list] = {k: [] for k in models}
    cpu: dict[str, list] = {k: [] for k in models}
    losses: dict[str, float] = {}
    for _ in range(steps if "train" in kinds else 0):
        for k, m in models.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            losses[k] = train(m, k)
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    dec: dict[str, list] = {k: [] for k in models}
    dec_cpu: dict[str, list] = {k: [] for k in models}
    tokens: dict[str, list] = {}
    for m in models.values():
        m.eval()
    # decode-only runs (--kinds decode) take ``steps`` generate() calls per mode, with training a third of that
    for _ in range(0 if "decode" not in kinds else max(2, steps // 3) if "train" in kinds else steps):
        for k, m in models.items():
            dist.barrier()
            s, c, tokens[k] = decode(m, k)
            dec[k].append(s)
            dec_cpu[k].append(c)
    def median(v: list) -> float:
        return statistics.median(v) if v else float("nan")  # a kind not run (--kinds)

    med = torch.tensor([median(times[k]) for k in models] + [median(dec[k]) for k in models]
                       + [median(cpu[k]) for k in models] + [median(dec_cpu[k]) for k in models], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    n = len(models)
    train_s = dict(zip(models, med[:n].tolist()))
    decode_s = dict(zip(models, med[n:2 * n].tolist()))
    cpu_s = dict(zip(models, med[2 * n:3 * n].tolist()))
    decode_cpu_s = dict(zip(models, med[3 * n:].tolist()))
    result["load_average_1min"] = os.getloadavg()[0]
    if "train" in kinds:
        result["train_step_ms"] = {k: round(v * 1e3, 2) for k, v in train_s.items()}
        # CPU seconds of the rank process per train step (all its threads): less sensitive to a loaded machine than
        # wall time, whose collectives wait for the slower rank
        result["train_step_cpu_ms"] = {k: round(v * 1e3, 2) for k, v in cpu_s.items()}
    if "decode" in kinds:
        result["decode_step_ms"] = {k: round(v * 1e3, 3) for k, v in decode_s.items()}
        result["decode_step_cpu_ms"] = {k: round(v * 1e3, 3) for k, v in decode_cpu_s.items()}
    ratios = {}
    pairs = [(kind, k, base) for kind in kinds for k in models for base in ("floor", "torch")
             if base in models and k != base and (base == "floor" or k in ("vescale", "vescale_dtensor"))]
    for kind, k, base in pairs:
        wall, proc = (train_s, cpu_s) if kind == "train" else (decode_s, decode_cpu_s)
        ratios[f"{kind}_{k}_over_{base}"] = round(wall[k] / wall[base], 3)
        if base == "floor":
            ratios[f"{kind}_cpu_{k}_over_floor"] = round(proc[k] / proc["floor"], 3)
    result["ratios"] = ratios
    first = next(iter(models))
    result["agree"] = {}
    if losses:
        result["agree"]["max_loss_diff"] = max(abs(v - losses[first]) for v in losses.values())
    if tokens:
        result["agree"]["same_tokens"] = all(t == tokens[first] for t in tokens.values())
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        result["profile_top_self_cpu"] = {}
        result["profile_decode_top_self_cpu"] = {}
        for k, m in models.items():
            if "train" in kinds:
                m.train()
                dist.barrier()
                with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(2):
                        train(m, k)
                result["profile_top_self_cpu"][k] = _top_entries(prof, 2, 8)
            if "decode" not in kinds:
                continue
            # decode: the profiler runs from the first new token to the last (prefill excluded), via the streamer
            m.eval()
            dist.barrier()
            prof = torch_profile(activities=[ProfilerActivity.CPU])
            timer = _ProfiledTimer(prof)
            with torch.no_grad(), context(k):
                m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=decode_tokens,
                           min_new_tokens=decode_tokens, do_sample=False, pad_token_id=0, streamer=timer)
            prof.stop()
            result["profile_decode_top_self_cpu"][k] = _top_entries(prof, decode_tokens - 1, 12)
    return result


def main() -> None:
    from vescale.core.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the dispatch-bound size only, few steps (a smoke run)")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["vescale", "vescale_dtensor", "torch", "floor"],
                        choices=["vescale", "vescale_dtensor", "torch", "floor"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="add the profiler's top entries per mode")
    parser.add_argument("--kinds", nargs="+", default=["train", "decode"], choices=["train", "decode"],
                        help="which steps to time (decode alone: --steps generate() calls per mode)")
    args = parser.parse_args()
    sizes = ["dispatch"] if args.small else args.sizes
    results = []
    for size in sizes:
        steps = args.steps or (3 if args.small else 15 if size == "dispatch" else 9 if size == "middle" else 5)
        results.append(spawn(_rank_main, args.tp, size, steps, args.decode_tokens, args.profile, args.modes,
                             tuple(args.kinds)))
    print(json.dumps({"benchmark": "overhead", "tp": args.tp, "results": results}, indent=1))


if __name__ == "__main__":
    main()
