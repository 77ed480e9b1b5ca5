"""vescale.plan: planning time on a 7B-shaped Llama (meta device), and auto plan vs hand-written plan step time.

    python tools/bench/plan.py [--small]

1. Planning: a 32-layer ``LlamaForCausalLM`` shaped like Llama-2-7B (hidden 4096, ffn 11008, 32 heads, vocab 32000)
   is built on the meta device (no memory); we time ``trace_model`` + ``plan_from_trace`` for a dp=8 x tp=8 mesh
   (what ``auto_plan`` does), best of 3 in wall and CPU time (the CPU time is the fair figure on a shared machine),
   and ``choose_parallelism`` over 64 ranks (every pp x dp x tp x ZeRO).
2. Step time on 2 CPU ranks (gloo), tp=2 with sequence parallelism: the reference GPT (``--small``: a smaller one)
   parallelized with the hand-written ``vescale.parallel.plans.gpt_plan`` and with ``auto_plan``; median forward +
   backward time over the timed steps (slowest rank; the three models' steps are interleaved so that outside load
   affects them alike), collectives and bytes per step, and the auto/hand ratio. The unparallelized model's step
   time (each rank runs it whole) is reported for scale.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from vescale.core.launch import spawn


def planning_time() -> dict:
    import torch
    import transformers as T

    from vescale.plan import choose_parallelism, plan_from_trace, trace_model

    cfg = T.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    times, cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        trace = trace_model(model)
        plan = plan_from_trace(trace, ["dp", "tp"], {"dp": 8, "tp": 8}, sequence_parallel=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    t0 = time.perf_counter()
    report = choose_parallelism(model, 64, batch_size=64, seq_len=4096, memory_budget_gb=80, trace=trace)
    choose_s = time.perf_counter() - t0
    c = report.chosen
    return {"params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
            "plan_s": round(min(times), 3), "plan_cpu_s": round(min(cpu), 3), "plan_target_s": 2.0,
            "plan_entries": sum(len(section) for section in plan.values()),
            "sharded_params": sum(1 for d in plan.decisions if d.kind == "parameter" and d.role != "replicated"),
            "choose_64_ranks_s": round(choose_s, 3), "candidates": len(report.candidates),
            "chosen": {"pp": c.pp, "dp": c.dp, "tp": c.tp, "zero": c.zero_stage, "mem_gb": round(c.memory_gb, 1),
                       "step_s_est": round(c.step_s, 3)}}


def _steps(small: bool) -> dict:
    import torch
    import torch.distributed as dist

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.parallel import parallelize_module, plans
    from vescale.plan import auto_plan

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, d_model=64, n_layer=2, n_head=4, max_seq_len=64) if small else \
        GPTConfig(vocab_size=1024, d_model=192, n_layer=4, n_head=6, max_seq_len=64)
    batch, seq, steps = (2, 32, 4) if small else (4, 64, 8)
    mesh = init_mesh({"tp": 2})
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    models = {}
    for name in ("single", "hand", "auto"):
        torch.manual_seed(0)
        models[name] = GPT(cfg)
    parallelize_module(models["hand"], mesh, plans.gpt_plan(mesh, sequence_parallel=True))
    parallelize_module(models["auto"], mesh, auto_plan(models["auto"], mesh, sequence_parallel=True))
    times: dict[str, list[float]] = {name: [] for name in models}
    comms = {}
    for i in range(steps + 1):  # interleaved, so that load from other processes hits all three alike
        for name, model in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            with count_comms(mesh) as comm:
                model(ids).float().pow(2).mean().backward()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= 1:
                times[name].append(t.item())
            comms[name] = comm
    out = {name: {"step_ms": round(statistics.median(times[name]) * 1e3, 2), "collectives": comms[name].total,
                  "comm_mb": round(comms[name].total_bytes / 1e6, 3)} for name in models}
    out["auto_over_hand"] = round(out["auto"]["step_ms"] / out["hand"]["step_ms"], 3)
    out["model"] = {"d_model": cfg.d_model, "n_layer": cfg.n_layer, "batch": batch, "seq": seq}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a smaller model and fewer steps for step timing")
    args = parser.parse_args()
    result = {"planning_7b": planning_time(), "tp2_step": spawn(_steps, 2, args.small)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
