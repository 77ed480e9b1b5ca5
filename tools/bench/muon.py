"""Muon under ZeRO: whole-matrix owners (vescale.parallel.muon) against the naive way, on dp ranks.

    python tools/bench/muon.py [--small] [--world-size 4] [--steps 5] [--zero 1|2]

Both start from the same DDP backward (buckets reduced over dp, ZeRO ``--zero``). The naive way gathers every
matrix's whole gradient on every rank (``ddp.reduced_grads()``: an all-gather per bucket under ZeRO 2, nothing more
under ZeRO 1, whose all-reduce already left it everywhere) and every rank runs ``torch.optim.Muon`` on every matrix
(and AdamW on the rest). The owners' way (:class:`vescale.parallel.DistributedMatrixOptimizer`) gathers each matrix
to its owner only, the owner alone runs Newton-Schulz, the new values go back with ZeRO's parameter all-gather.
Prints one JSON object: per method the median optimizer-step time (max over ranks), the matrix bytes each rank
received per step (measured in the exchanges), and the Muon momentum bytes per rank against the theory (the whole for
the naive way; 1/ranks of it for the owners, up to the cost balance); and the ratios. CPU gloo timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from vescale.core.testing import run_on_ranks


def _model(d: int, layers: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
            self.norm = nn.LayerNorm(d)

        def forward(self, x):
            x = x + self.o(torch.tanh(self.q(x)) * self.k(x) + self.v(x))
            return x + self.down(torch.relu(self.up(self.norm(x))))

    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(layers)))


def _rank(method: str, zero: int, d: int, layers: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedMatrixOptimizer, hidden_matrices

    torch.set_num_threads(1)
    mesh = init_mesh({"dp": dist.get_world_size()})
    net = _model(d, layers)
    names = set(hidden_matrices(net))
    ddp = DistributedDataParallel(net, mesh, DDPOptions(bucket_size_mb=4, zero_stage=zero))
    named = dict(ddp.module.named_parameters())
    mats = [p for n, p in named.items() if n in names]
    rest = [p for n, p in named.items() if n not in names]
    muon_kw, adamw_kw = {"lr": 0.02}, {"lr": 1e-3}
    x = torch.randn(8, d, generator=torch.Generator().manual_seed(dist.get_rank()))
    if method == "owners":
        opt = DistributedMatrixOptimizer(ddp, torch.optim.Muon(mats, **muon_kw), torch.optim.AdamW(rest, **adamw_kw),
                                         zero_stage=zero)
    else:  # every rank a whole copy of every matrix and its momentum
        whole = {n: p.detach().clone() for n, p in named.items()}
        muon = torch.optim.Muon([whole[n] for n in named if n in names], **muon_kw)
        adamw = torch.optim.AdamW([whole[n] for n in named if n not in names], **adamw_kw)
    times, received = [], 0
    for step in range(steps + 1):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        ddp.finish_grad_sync()
        dist.barrier()
        t0 = time.perf_counter()
        if method == "owners":
            opt.step()
            received = opt.matrix.received
        else:
            grads = ddp.reduced_grads()  # ZeRO 2: all-gathers every bucket to every rank
            for n, g in grads.items():
                whole[n].grad = g
            muon.step()
            adamw.step()
            received = sum(grads[n].numel() * 4 for n in names) * (mesh.size() - 1) // mesh.size() if zero == 2 \
                else 0
        if step:  # the first step builds the lazy state
            times.append(time.perf_counter() - t0)
    state = opt.matrix.state_bytes() if method == "owners" else sum(
        v.numel() * v.element_size() for st in muon.state.values() for v in st.values())
    return {"step_s": statistics.median(times), "received_bytes": received, "momentum_bytes": state,
            "matrix_bytes": sum(p.numel() * 4 for p in mats)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="d=128, 2 blocks, 3 steps (a smoke run)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--zero", type=int, default=2, choices=[1, 2])
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.small:
        args.d, args.layers, args.steps = 128, 2, 3
    out: dict = {"world_size": args.world_size, "zero": args.zero, "d": args.d, "layers": args.layers,
                 "matrices": 6 * args.layers, "steps_timed": args.steps}
    for method in ("naive", "owners"):
        ranks = run_on_ranks(_rank, args.world_size, method, args.zero, args.d, args.layers, args.steps)
        total = ranks[0]["matrix_bytes"]
        out[method] = {"step_s": max(r["step_s"] for r in ranks),
                       "received_bytes_per_rank": max(r["received_bytes"] for r in ranks),
                       "momentum_bytes_per_rank": [r["momentum_bytes"] for r in ranks],
                       "momentum_theory_bytes": total if method == "naive" else total // args.world_size}
    out["step_ratio_owners_over_naive"] = out["owners"]["step_s"] / out["naive"]["step_s"]
    naive_bytes = out["naive"]["received_bytes_per_rank"]
    out["bytes_ratio_owners_over_naive"] = out["owners"]["received_bytes_per_rank"] / naive_bytes if naive_bytes \
        else None
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
