"""Pipeline step time: vescale.pipe against torch.distributed.pipelining, same stages, model and microbatches.

    python tools/bench/pipe.py [--pp 2] [--microbatches 8] [--steps 5] [--small]

Both runtimes get the very same stage modules (cut by ``vescale.pipe.split`` from one GPT) on gloo CPU ranks. For
1F1B it times ``PipeEngine(schedule="1f1b")`` against ``Schedule1F1B``, for ZB-H1 ``PipeEngine(schedule="zb_h1")``
against ``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's zero-bubble schedule that accepts one
stage per rank). It prints one JSON object: median step seconds of each (the two runtimes alternate step by
step so that both see the same machine load), their ratio (vescale / torch, lower is better) and the ratio of their
fastest steps, the loss of both (a sanity check that they computed the same thing), and the bubble measured from a
vescale timeline of one step against the theory ((P-1)/M idle over busy for 1F1B, about a third of it for ZB-H1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _rank(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble

    from vescale.core.testing.models import GPT, GPTConfig, cross_entropy
    from vescale.pipe import PipeEngine, split, timeline

    torch.set_num_threads(cfg["threads"])
    P, M, mb, seq = dist.get_world_size(), cfg["microbatches"], cfg["microbatch_size"], cfg["seq"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layer=cfg["layers"], n_head=8,
                          max_seq_len=seq))
    example = torch.randint(0, cfg["vocab"], (mb, seq))
    stages = split(model, num_stages=P, example_inputs=(example,))
    rank = dist.get_rank()
    mine = stages[rank]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (M * mb, seq), generator=g)
    y = torch.randint(0, cfg["vocab"], (M * mb, seq), generator=g)

    def timed(steps: list) -> list[tuple[list[float], float]]:
        """Alternate the runtimes step by step, so that both see the same machine load; times per runtime."""
        results: list = [([], float("nan")) for _ in steps]
        for i in range(cfg["warmup"] + cfg["steps"]):
            for k, step in enumerate(steps):
                mine.zero_grad(set_to_none=True)
                dist.barrier()
                t = time.perf_counter()
                loss = step()
                dist.barrier()
                times = results[k][0]
                if i >= cfg["warmup"]:
                    times.append(time.perf_counter() - t)
                results[k] = (times, loss)
        return results

    out: dict = {}
    for name, torch_cls in (("1f1b", Schedule1F1B), ("zb_h1", ScheduleInterleavedZeroBubble)):
        engine = PipeEngine(stages, None, schedule=name, num_microbatches=M, loss_fn=cross_entropy)
        stage = PipelineStage(mine, rank, P, torch.device("cpu"))
        if torch_cls is Schedule1F1B:
            sched = torch_cls(stage, n_microbatches=M, loss_fn=cross_entropy)
        else:
            sched = torch_cls([stage], n_microbatches=M, loss_fn=cross_entropy)

        def torch_step(sched=sched) -> float:
            losses: list = []
            if rank == 0:
                sched.step(x)
            elif rank == P - 1:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            value = torch.stack(losses).mean() if losses else torch.zeros(())
            dist.broadcast(value, src=P - 1)
            return value.item()

        (ours, our_loss), (theirs, their_loss) = timed([lambda engine=engine: engine.step(x, y).item(), torch_step])
        mine.zero_grad(set_to_none=True)
        with timeline.Timeline() as tl:
            engine.step(x, y)
        trace = tl.export(cfg["trace"].format(name=name), png=False)
        med_ours, med_theirs = statistics.median(ours), statistics.median(theirs)
        entry = {"vescale_s": round(med_ours, 4), "torch_s": round(med_theirs, 4),
                 "ratio": round(med_ours / med_theirs, 3), "ratio_of_min": round(min(ours) / min(theirs), 3),
                 "loss_vescale": round(our_loss, 6), "loss_torch": round(their_loss, 6),
                 "bubble_theory_unit_costs": round(engine.report.bubble_ratio, 4)}
        if trace is not None:
            measured = timeline.bubble(trace)
            entry["bubble_measured"] = round(measured["ratio"], 4)
        out[name] = entry
    theory = (P - 1) / M
    out["bubble_theory"] = {"1f1b": round(theory, 4), "zb_h1": round(theory / 3, 4)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a tiny model and few steps (the nox bench session)")
    parser.add_argument("--trace", default="/tmp/vescale_pipe_bench_{name}.json")
    args = parser.parse_args()
    cfg = {"microbatches": args.microbatches, "microbatch_size": 4, "seq": 128, "vocab": 1024, "d_model": 256,
           "layers": 4 * args.pp, "warmup": 2, "steps": args.steps, "threads": 1, "trace": args.trace}
    if args.small:
        cfg.update(seq=32, d_model=64, vocab=256, warmup=1, steps=3)
    from vescale.core.launch import spawn

    t = time.time()
    result = spawn(_rank, args.pp, cfg)
    result["config"] = {"pp": args.pp, **{k: v for k, v in cfg.items() if k != "trace"}}
    result["wall_s"] = round(time.time() - t, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
