"""The planner's cost model against measurement: step time, memory per term and bytes per mesh dim, estimated
(``vescale.plan.estimate_spec``, the given spec priced as the planner prices a candidate) and measured on gloo CPU
ranks for the same spec, with the ratio.

    python tools/bench/planner_accuracy.py [--hardware FILE] [--small] [--steps 3] [--rounds 2] [--table]

Every cell is one spec of world 2 or 4 (dp, tp, pp and their pairs, ZeRO 0-2) on tools/models.py's ``llama`` (an
unmodified transformers Llama: hidden 256, 4 layers, 8 / 4 heads, vocab 512, fp32), batch 8 x 64 tokens, built by
``vescale.plan.build`` on pooled ranks (``vescale.core.testing``) as tools/train.py builds it. Measured on each rank:

* parameters, gradients, optimizer state: exact bytes of the live tensors (``vescale.plan.dry_run.rank_bytes``);
* activations: the peak bytes autograd keeps saved during one forward-backward (``saved_tensors_hooks``; storages
  counted once, parameters' own storages left out): what the cost model's activation term prices;
* communication: one step's collectives (``vescale.core.comm.count_comms``), turned from the bytes each rank hands in
  into ring bytes on the wire, as the cost model counts them (all-reduce ``2 (n-1)/n``, reduce-scatter ``(n-1)/n``,
  all-gather ``n-1`` times the input); pipeline sends are point-to-point, not collectives, and are not counted;
* step time: the median over ``--steps`` timed steps of the slowest rank's forward-backward + optimizer step, the
  least of ``--rounds`` rounds over all cells (outside load only ever slows a step down).

Memory terms take the largest rank (what decides whether a mesh fits); ratios are estimate / measured. The hardware
model is ``--hardware FILE`` (a ``python -m vescale.plan --calibrate`` file) for every cell, or by default one
calibration per world size, measured first on that many ranks (``vescale.plan.calibrate``: on a CPU the ranks share
the cores, so a rank's matmul rate depends on how many run). Also printed: the Spearman rank
correlation of estimated against measured step time over the cells, and per world size the measured step of the
cell the estimate ranks first against the best measured cell.

Prints one JSON object (``--table`` also a Markdown table on stderr). Timings are of a shared CPU: noisy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

MODEL, BATCH, SEQ = "llama", 8, 64
CELLS = [  # (mesh, zero)
    ({"dp": 2}, 0), ({"dp": 2}, 1), ({"tp": 2}, 0), ({"pp": 2}, 0),
    ({"dp": 4}, 2), ({"dp": 2, "tp": 2}, 1), ({"tp": 4}, 0), ({"pp": 2, "dp": 2}, 1), ({"pp": 2, "tp": 2}, 0),
]
SMALL = [({"dp": 2}, 1), ({"tp": 2}, 0), ({"pp": 2}, 0), ({"dp": 2, "tp": 2}, 1), ({"pp": 2, "tp": 2}, 0)]


class SavedBytes:
    """Peak bytes of the tensors autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``), each
    storage counted once while some saved slot holds it; storages in ``exclude`` (the parameters') not counted."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.live, self.refs, self.peak = exclude, 0, {}, 0

    def _pack(self, t):
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type == "meta" or not local.numel():
            return t
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude:
            return t
        holder = _Held(t)
        if key not in self.refs:
            self.refs[key] = 0
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(holder, self._release, key, storage.nbytes())
        return holder

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t if isinstance(h, _Held) else h)


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t) -> None:
        self.t = t


def _wire(key: str, name: str, nbytes: float, mesh: dict[str, int]) -> float:
    n = 1
    for d in key.split(","):
        n *= mesh.get(d, 1)
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter_tensor": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_gather_into_tensor": n - 1, "all_gather": n - 1, "all_to_all_single": (n - 1) / n}.get(name, 0.0)
    return factor * nbytes


def _rank_cell(spec_json: str, steps: int) -> dict:
    """One cell on this rank: build, one warm step (activations measured), one counted step, ``steps`` timed."""
    import models
    import torch
    import torch.distributed as dist

    from vescale.core.comm import count_comms
    from vescale.dtensor import deferred_init
    from vescale.dtensor import random as vescale_random
    from vescale.plan import ParallelSpec, build
    from vescale.plan.dry_run import rank_bytes

    spec = ParallelSpec.from_json(spec_json)
    torch.manual_seed(0)
    vescale_random.manual_seed(0)
    par = build(deferred_init(models.create, MODEL), spec, batch_size=BATCH, seq_len=SEQ)
    opt = par.make_optimizer(torch.optim.AdamW, lr=1e-4)
    vocab = models.model_spec(MODEL).vocab_size
    params = {p.to_local().untyped_storage().data_ptr() if hasattr(p, "to_local") else p.untyped_storage().data_ptr()
              for m in par.modules for p in m.parameters()}

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        tokens = par.shard_batch(torch.randint(vocab, (BATCH, SEQ + 1), generator=g))
        opt.zero_grad(set_to_none=False)
        par.forward_backward(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        opt.step()

    saved = SavedBytes(params)
    with saved.hooks():
        step(0)
    with count_comms(par.mesh) as comms:
        step(1)
    times = []
    for i in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(2 + i)
        times.append(time.perf_counter() - t0)
    wire: dict[str, float] = {}
    for key, v in comms.summary().get("per_dim", {}).items():
        for name, b in v["bytes"].items():
            dim = "dp" if "dp" in key.split(",") and len(key.split(",")) > 1 else key  # world group: DDP's
            wire[dim] = wire.get(dim, 0.0) + _wire(key, name, b, dict(spec.mesh))
    return {**rank_bytes(par, opt), "activations": saved.peak, "wire": wire, "step_s": times}


def _estimate(spec, hw):
    import models
    import torch

    from vescale.plan import estimate_spec

    with torch.device("meta"):
        model = models.create(MODEL)
    return estimate_spec(model, spec, batch_size=BATCH, seq_len=SEQ, hw=hw)


def _spearman(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else None


def _ratio(est: float, got: float) -> float | None:
    return round(est / got, 3) if got else None


def run(cells, hws: dict, steps: int, rounds: int = 1) -> list[dict]:
    """Measure and estimate every ``(mesh, zero)`` of ``cells`` (``hws``: the hardware model per world size)."""
    from vescale.core.testing import run_on_ranks
    from vescale.plan import ParallelSpec

    specs = [ParallelSpec(mesh=mesh, zero=zero, microbatches=4 if "pp" in mesh else 0) for mesh, zero in cells]
    measured: list[list] = [[] for _ in specs]
    for _ in range(rounds):  # all cells once per round: a burst of outside load hits one round of a cell
        for k, spec in enumerate(specs):
            per_rank = run_on_ranks(_rank_cell, spec.world_size, spec.to_json(), steps)
            measured[k].append((statistics.median(max(r["step_s"][i] for r in per_rank) for i in range(steps)),
                                per_rank))
    rows = []
    for (mesh, zero), spec, runs in zip(cells, specs, measured):
        world = spec.world_size
        c = _estimate(spec, hws[world])
        step_s = min(t for t, _ in runs)
        per_rank = runs[0][1]  # bytes are the same every round (a later round's rebuild reuses the pool's groups)
        got = {k: max(r[k] for r in per_rank) for k in ("parameters", "gradients", "optimizer", "activations")}
        wire = {d: max(r["wire"].get(d, 0.0) for r in per_rank) for d in ("tp", "dp")}
        est = {"parameters": c.weights_gb * 2**30, "gradients": c.grads_gb * 2**30, "optimizer": c.states_gb * 2**30,
               "activations": c.activations_gb * 2**30}
        est_wire = {"tp": c.tp_bytes, "dp": c.dp_bytes}  # (pp: point-to-point sends, not counted)
        rows.append({
            "mesh": mesh, "zero": zero, "world": world,
            "step_s": {"estimate": c.step_s, "measured": step_s, "ratio": _ratio(c.step_s, step_s),
                       "estimate_compute_s": c.compute_s, "estimate_comm_s": c.comm_s},
            "memory_mb": {k: {"estimate": round(est[k] / 2**20, 3), "measured": round(got[k] / 2**20, 3),
                              "ratio": _ratio(est[k], got[k])} for k in est},
            "wire_mb": {d: {"estimate": round(est_wire[d] / 2**20, 3), "measured": round(wire[d] / 2**20, 3),
                            "ratio": _ratio(est_wire[d], wire[d])} for d in ("tp", "dp")
                        if est_wire[d] or wire[d]},
        })
        print(f"planner_accuracy: {mesh} zero {zero}: step est {c.step_s * 1e3:.1f} ms, measured "
              f"{step_s * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table: estimate / measured (ratio) per term."""
    def cell(v: dict) -> str:
        return f"{v['estimate']:.2f} / {v['measured']:.2f} ({v['ratio']})" if v else "-"

    out = ["| mesh | ZeRO | step ms est / meas (ratio) | params MB | grads MB | optimizer MB | activations MB "
           "| tp wire MB | dp wire MB |", "|" + " --- |" * 9]
    for r in rows:
        s = r["step_s"]
        mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
        out.append(f"| {mesh} | {r['zero']} | {s['estimate'] * 1e3:.1f} / {s['measured'] * 1e3:.1f} ({s['ratio']}) | "
                   + " | ".join(cell(r["memory_mb"][k]) for k in ("parameters", "gradients", "optimizer",
                                                                  "activations"))
                   + " | " + " | ".join(cell(r["wire_mb"].get(d, {})) for d in ("tp", "dp")) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default=None, help="a --calibrate file for every cell (default: calibrate "
                        "on each world size first)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all cells (the least step time kept)")
    parser.add_argument("--small", action="store_true", help="five cells of world 2 and 4 (the nox bench session)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per cell")
    parser.add_argument("--table", action="store_true", help="also print a Markdown table to stderr")
    args = parser.parse_args()
    from vescale.plan.cli import _hardware

    cells = SMALL if args.small else CELLS
    worlds = sorted({math.prod(mesh.values()) for mesh, _ in cells})
    paths = {w: args.hardware for w in worlds}
    if args.hardware is None:
        from vescale.core.testing import spawn_on_pool
        from vescale.plan.calibrate import calibrate

        tmp = Path(tempfile.mkdtemp(prefix="vescale-calibration-"))
        with spawn_on_pool():  # on the bench's own pooled ranks
            for w in worlds:
                paths[w] = str(tmp / f"world{w}.json")
                calibrate(paths[w], world_size=w)
    hws = {w: _hardware(p)[0] for w, p in paths.items()}
    rows = run(cells, hws, args.steps, args.rounds)
    measured = [r["step_s"]["measured"] for r in rows]
    estimated = [r["step_s"]["estimate"] for r in rows]
    choice = {}
    for world in sorted({r["world"] for r in rows}):
        mine = [r for r in rows if r["world"] == world]
        if len(mine) < 2:
            continue
        first = min(mine, key=lambda r: r["step_s"]["estimate"])
        best = min(mine, key=lambda r: r["step_s"]["measured"])
        choice[world] = {"estimate_first": first["mesh"] | {"zero": first["zero"]},
                         "measured_best": best["mesh"] | {"zero": best["zero"]},
                         "first_over_best": round(first["step_s"]["measured"] / best["step_s"]["measured"], 3)}
    out = {"model": MODEL, "batch": BATCH, "seq_len": SEQ,
           "hardware": {w: json.loads(Path(p).read_text()) for w, p in paths.items()},
           "cells": rows, "spearman_step": _spearman(estimated, measured), "choice": choice}
    print(json.dumps(out))
    if args.table:
        print(table(rows), file=sys.stderr)
    from vescale.core.testing import shutdown_pools

    shutdown_pools()


if __name__ == "__main__":
    main()
