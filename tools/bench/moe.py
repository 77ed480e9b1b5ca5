"""Benchmark expert parallelism against today's TP-sharded experts on the same Mixtral-shaped model, one run.

    python tools/bench/moe.py [--small] [--world-size 4] [--steps N]

One training step (forward with the model's own loss and load-balancing loss, backward, SGD step) of a Hugging Face
``MixtralForCausalLM`` (eager experts; ``--small``: a tiny one) over the same global batch on ``--world-size`` ranks:

* ``ep``: ``vescale.parallel.parallelize_experts`` on an ``ep`` mesh: each rank runs the model on 1/ep of the batch
  and holds E/ep whole experts; tokens go to their experts' ranks with ``all_to_all_single``;
* ``tp``: ``parallelize_module`` with ``mixtral_plan`` on a ``tp`` mesh (what the training CLI does today): every rank
  runs the whole batch, attention and each expert's FFN sharded 1/tp.

Each mode runs on fresh ranks (peak RSS is per process). Reports, per mode: the median step time of the slowest rank,
the largest growth of any rank's peak RSS during the steps (CPU torch has no allocator statistics), the parameter
bytes each rank holds, and the collectives of one step (calls and bytes per collective; bytes are each rank's inputs,
as :class:`vescale.core.comm.CommCounter` counts them). For ``ep`` also the all-to-all bytes of one step summed over
the ranks against their theoretical value: per MoE layer each rank sends its ``N k`` (token, choice) rows of ``D``
values to the experts and gets as many back, and backward does both again (``4 L N k D`` values in all, ``N`` tokens
per rank), plus the split sizes (``L W`` int64 per rank) and the expert ids (``L N k`` int64 per rank). Summed over
the ranks this is exact whatever the routing. The losses of both modes (the whole batch's) are reported as a sanity
check: they must agree to fp32 rounding. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tp import _peak_rss_reset, _proc_status_bytes  # peak-RSS reading shared with the TP bench


def _config(small: bool) -> tuple[dict, int, int]:
    """(Mixtral config kwargs, global batch, sequence length)."""
    if small:
        return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2), 8, 32
    return dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2), 8, 256


def _rank_main(mode: str, small: bool, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    import transformers as tf

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh
    from vescale.parallel import mixtral_plan, parallelize_experts, parallelize_module

    torch.set_num_threads(1)
    kwargs, batch, seq = _config(small)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**kwargs, max_position_embeddings=seq, output_router_logits=True,
                                                   router_aux_loss_coef=0.02, experts_implementation="eager",
                                                   attn_implementation="eager")).train()
    mesh = init_mesh({mode: world})
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, kwargs["vocab_size"], (batch, seq), generator=g)
    labels = torch.randint(0, kwargs["vocab_size"], (batch, seq), generator=g)
    if mode == "ep":
        parallelize_experts(model, mesh)
        r = mesh.get_local_rank("ep")
        tokens, labels = tokens.chunk(world)[r], labels.chunk(world)[r]
    else:
        parallelize_module(model, mesh, mixtral_plan(mesh))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    param_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    def step() -> float:
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    with count_comms(mesh) as comms:
        first_loss = step()
    for _ in range(warmup):
        step()
    before = _peak_rss_reset()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = _proc_status_bytes("VmHWM") - before
    out = torch.tensor([statistics.median(times), float(peak), float(param_bytes)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    a2a = torch.tensor([float(comms.bytes.get("all_to_all_single", 0))], dtype=torch.float64)
    dist.all_reduce(a2a)
    result = {"mode": mode, "step_s": round(out[0].item(), 4), "peak_rss_growth_mb": round(out[1].item() / 2**20, 1),
              "param_mb_per_rank": round(out[2].item() / 2**20, 2), "first_step_loss": first_loss,
              "collectives_per_step": dict(comms.counts), "bytes_per_step_rank0": dict(comms.bytes)}
    if mode == "ep":
        layers, k, d = kwargs["num_hidden_layers"], kwargs["num_experts_per_tok"], kwargs["hidden_size"]
        n = tokens.numel()  # tokens per rank
        per_rank = layers * (4 * n * k * d * 4 + world * 8 + n * k * 8)
        result["all_to_all_bytes_all_ranks"] = int(a2a.item())
        result["all_to_all_bytes_theory"] = per_rank * world
        result["all_to_all_ratio"] = round(a2a.item() / (per_rank * world), 4)
    return result


def main() -> None:
    from vescale.core.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny model, few steps")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (3 if args.small else 6)
    warmup = 1
    ep, tp = (spawn(_rank_main, args.world_size, mode, args.small, steps, warmup) for mode in ("ep", "tp"))
    kwargs, batch, seq = _config(args.small)
    print(json.dumps({"benchmark": "moe", "small": args.small, "world_size": args.world_size, "steps": steps,
                      "model": {**kwargs, "batch": batch, "seq_len": seq}, "ep": ep, "tp": tp,
                      "ep_over_tp_step_time": round(ep["step_s"] / tp["step_s"], 3),
                      "loss_diff": abs(ep["first_step_loss"] - tp["first_step_loss"])}))


if __name__ == "__main__":
    main()
