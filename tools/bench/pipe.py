"""Pipeline step time: vescale.pipe against torch.distributed.pipelining, same stages, model and microbatches.

    python tools/bench/pipe.py [--pp 2] [--microbatches 8] [--steps 5] [--small]
    python tools/bench/pipe.py --dp 2 [--pp 2] [--bucket-mb 2] [--tie]   # pp x dp: overlapped against flat dp reduction

Both runtimes get the very same stage modules (cut by ``vescale.pipe.split`` from one GPT) on gloo CPU ranks. For
1F1B it times ``PipeEngine(schedule="1f1b")`` against ``Schedule1F1B``, for ZB-H1 ``PipeEngine(schedule="zb_h1")``
against ``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's zero-bubble schedule that accepts one
stage per rank). It prints one JSON object: median step seconds of each (the two runtimes alternate step by
step so that both see the same machine load), their ratio (vescale / torch, lower is better) and the ratio of their
fastest steps, the loss of both (a sanity check that they computed the same thing), and the bubble measured from a
vescale timeline of one step against the theory ((P-1)/M idle over busy for 1F1B, about a third of it for ZB-H1).

With ``--dp N`` it runs pp x dp ranks instead and times the two ways ``PipeEngine`` reduces gradients over dp, on
the same model and data (1F1B): each stage in its own ``vescale.parallel.DistributedDataParallel``
(``engine.wrap_stages``: ``--bucket-mb`` buckets, reduced during the last microbatch's backward, overlapped with it),
against the engine's flat ``dp_group`` all-reduce after the step. It prints their median step seconds, the ratio
(overlapped / flat, lower is better), the dp collectives of one step of each, and the largest difference between
the two runs' gradients (a sanity check; ``--tie`` ties the embedding to the head, exercising the late bucket).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _alternate(steps: list, before, cfg: dict) -> list[tuple[list[float], float]]:
    """Run each of ``steps`` (callables returning a loss) ``warmup + steps`` times, alternating them step by step so
    that both see the same machine load; ``before()`` runs before each (clears gradients). Returns per step function
    the step seconds after the warm-up and the last loss."""
    import torch.distributed as dist

    results: list = [([], float("nan")) for _ in steps]
    for i in range(cfg["warmup"] + cfg["steps"]):
        for k, step in enumerate(steps):
            before(k)
            dist.barrier()
            t = time.perf_counter()
            loss = step()
            dist.barrier()
            times = results[k][0]
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t)
            results[k] = (times, loss)
    return results


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

        (ours, our_loss), (theirs, their_loss) = _alternate(
            [lambda engine=engine: engine.step(x, y).item(), torch_step], lambda k: mine.zero_grad(set_to_none=True),
            cfg)
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


def _rank_dp(cfg: dict) -> dict:
    """pp x dp ranks: DDP stages (overlapped bucketed reduction) against the engine's flat dp all-reduce."""
    import copy

    import torch
    import torch.distributed as dist

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.core.testing.models import GPT, GPTConfig, cross_entropy
    from vescale.parallel import DDPOptions, DistributedDataParallel
    from vescale.pipe import PipeEngine, split

    torch.set_num_threads(cfg["threads"])
    mesh = init_mesh(f"pp={cfg['pp']},dp={cfg['dp']}")
    pp_mesh, data_mesh = sub_mesh(mesh, "pp"), sub_mesh(mesh, "dp")
    P, M, mb, seq = cfg["pp"], cfg["microbatches"], cfg["microbatch_size"], cfg["seq"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layer=cfg["layers"], n_head=8,
                          max_seq_len=seq, tie_embeddings=cfg["tie"]))
    example = torch.randint(0, cfg["vocab"], (mb, seq))
    s = pp_mesh.get_local_rank()
    flat_stage = split(model, num_stages=P, example_inputs=(example,))[s]
    ddp_stage = split(copy.deepcopy(model), num_stages=P, example_inputs=(example,))[s]  # its own parameters
    flat = PipeEngine({s: flat_stage}, pp_mesh, num_stages=P, num_microbatches=M, loss_fn=cross_entropy,
                      dp_group=data_mesh.get_group())
    overlapped = PipeEngine({s: ddp_stage}, pp_mesh, num_stages=P, num_microbatches=M, loss_fn=cross_entropy)
    wrappers: list = []
    options = DDPOptions(bucket_size_mb=cfg["bucket_mb"])  # (the engine tells it the tied weights: StageGradSync)
    overlapped.wrap_stages(lambda index, stage: wrappers.append(DistributedDataParallel(stage, data_mesh, options))
                           or wrappers[-1])
    ddp = wrappers[0]
    g = torch.Generator().manual_seed(1 + data_mesh.get_local_rank())  # each dp rank its own rows
    x = torch.randint(0, cfg["vocab"], (M * mb, seq), generator=g)
    y = torch.randint(0, cfg["vocab"], (M * mb, seq), generator=g)
    engines = (flat, overlapped)

    def clear(k: int) -> None:
        (flat_stage.zero_grad if k == 0 else ddp.zero_grad)(set_to_none=True)

    (flat_t, flat_loss), (ovl_t, ovl_loss) = _alternate(
        [lambda e=e: e.step(x, y).item() for e in engines], clear, cfg)
    comms = []
    for k, engine in enumerate(engines):
        clear(k)
        with count_comms(mesh) as counter:
            engine.step(x, y)
        comms.append(dict(counter.dim_counts.get("dp", {})))
    ours = dict(ddp.reduced_grads())
    diff = max(float((flat_stage.get_parameter(n).grad - ours[n]).abs().max()) for n in ours)
    worst = torch.tensor([diff])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    med_flat, med_ovl = statistics.median(flat_t), statistics.median(ovl_t)
    return {"flat_s": round(med_flat, 4), "overlapped_s": round(med_ovl, 4), "ratio": round(med_ovl / med_flat, 3),
            "ratio_of_min": round(min(ovl_t) / min(flat_t), 3), "dp_collectives_flat": comms[0],
            "dp_collectives_overlapped": comms[1], "buckets": len(ddp.buckets),
            "loss_flat": round(flat_loss, 6), "loss_overlapped": round(ovl_loss, 6),
            "max_grad_diff": float(worst)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a tiny model and few steps (the nox bench session)")
    parser.add_argument("--trace", default="/tmp/vescale_pipe_bench_{name}.json")
    parser.add_argument("--dp", type=int, default=0, help="pp x dp ranks: overlapped (DDP stages) against flat dp "
                        "reduction, instead of vescale against torch.distributed.pipelining")
    parser.add_argument("--bucket-mb", type=float, default=2.0, help="DDP bucket size (--dp)")
    parser.add_argument("--tie", action="store_true", help="tie the embedding to the head (--dp)")
    args = parser.parse_args()
    cfg = {"microbatches": args.microbatches, "microbatch_size": 4, "seq": 128, "vocab": 1024, "d_model": 256,
           "layers": 4 * args.pp, "warmup": 2, "steps": args.steps, "threads": 1, "trace": args.trace}
    if args.small:
        cfg.update(seq=32, d_model=64, vocab=256, warmup=1, steps=3)
    if args.dp:
        cfg.update(pp=args.pp, dp=args.dp, bucket_mb=args.bucket_mb, tie=args.tie)
    from vescale.core.launch import spawn

    t = time.time()
    result = spawn(_rank_dp, args.pp * args.dp, cfg) if args.dp else spawn(_rank, args.pp, cfg)
    result["config"] = {"pp": args.pp, **{k: v for k, v in cfg.items() if k != "trace"}}
    result["wall_s"] = round(time.time() - t, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
