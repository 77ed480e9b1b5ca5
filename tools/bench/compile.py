"""Benchmark compile mode: one TP+SP training step of a vescale-parallelized model, compiled vs eager, one run.

    python tools/bench/compile.py [--small] [--tp 2] [--steps N] [--backend inductor]

The Llama-shaped GPT of ``vescale.core.testing.models`` (``--small``: d=64, 2 layers; default: d=256, 4 layers) on a
``tp`` mesh with ``gpt_plan(sequence_parallel=True)``, parallelized twice from the same weights:

* eager: ``vescale.parallel.parallelize_module`` as is (the PyTorch-native eager DTensor execution);
* compiled: the same, then ``vescale.parallel.compile_parallel(backend=...)`` (every block one ``fullgraph`` graph);
* whole: the same, then ``torch.compile(model, backend=..., fullgraph=True)`` (the whole model, root boundary,
  embedding and lm head included, one graph).

A step is forward, cross-entropy on the gathered logits, backward and an SGD update. Steps are interleaved (eager,
compiled, whole, eager, ...) after warm-up so machine noise hits both. Reports the median step time of the slowest rank,
the ratio compiled / eager, the first (compiling) step's time, and the max loss difference over the steps (a
sanity check: it must stay ~1e-6). Runs on GPUs with NCCL when one per rank is visible, else on CPU with gloo.
Prints one JSON object.
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
    return GPTConfig(vocab_size=4096, d_model=256, n_layer=4, n_head=8, ffn_hidden=704, max_seq_len=128), 4, 128


def _rank(small: bool, tp: int, steps: int, backend: str) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import GPT
    from vescale.parallel import compile_parallel, gpt_plan, parallelize_module

    dev = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= tp else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(dist.get_rank())
    cfg, batch, seq = _config(small)
    mesh = init_mesh({"tp": tp}, device_type=dev) if dev == "cuda" else init_mesh({"tp": tp})
    torch.manual_seed(0)
    base = GPT(cfg).to(dev)
    eager, comp, whole = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    plan = gpt_plan(mesh, sequence_parallel=True)
    for m in (eager, comp, whole):
        parallelize_module(m, mesh, plan)
    compile_parallel(comp, backend=backend)
    models = {"eager": eager, "compiled": comp, "whole": torch.compile(whole, backend=backend, fullgraph=True)}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-2) for name, m in models.items()}
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev),
             torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)) for _ in range(steps + 1)]

    def step(name: str, model, i: int) -> tuple[float, float]:
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens, labels = data[i]
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        value = loss.item()
        return time.perf_counter() - t0, value

    first = {name: step(name, m, 0)[0] for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    diff = 0.0
    for i in range(1, steps + 1):
        losses = {}
        for name, m in models.items():
            t, losses[name] = step(name, m, i)
            times[name].append(t)
        diff = max(diff, *(abs(losses["eager"] - v) for v in losses.values()))
    med = torch.tensor([statistics.median(times["eager"]), statistics.median(times["compiled"]), first["compiled"],
                        statistics.median(times["whole"]), first["whole"]], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return {"device": dev, "tp": tp, "backend": backend, "eager_step_s": round(med[0].item(), 5),
            "compiled_step_s": round(med[1].item(), 5), "ratio_compiled_over_eager": round((med[1] / med[0]).item(), 3),
            "first_compiled_step_s": round(med[2].item(), 2), "whole_step_s": round(med[3].item(), 5),
            "ratio_whole_over_eager": round((med[3] / med[0]).item(), 3), "first_whole_step_s": round(med[4].item(), 2),
            "max_loss_diff": diff,
            "params": sum(p.numel() for p in base.parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--backend", default="inductor")
    a = p.parse_args()
    from vescale.core.launch import spawn

    steps = a.steps or (5 if a.small else 10)
    print(json.dumps(spawn(_rank, a.tp, a.small, a.tp, steps, a.backend)))


if __name__ == "__main__":
    main()
