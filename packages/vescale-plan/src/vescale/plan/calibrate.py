"""Measure this machine's rates for the cost model: matmul FLOP/s per rank and collective latency and bandwidth per
group size, written as a ``--hardware`` file (``python -m vescale.plan --calibrate FILE``).

The probe runs on ``world_size`` local ranks at once (:func:`vescale.core.launch.spawn`: gloo on CPU, NCCL with a GPU
per rank), so each rank's matmul rate is what it gets while the others compute too, as in a job. Per group size
``g`` (2 .. ``world_size``, ranks ``0 .. g-1``): the median time of a one-element ``all_reduce`` (latency) and of a
``bandwidth_mb`` all-reduce, as ring bus bandwidth ``2 (g - 1) / g x bytes / (time - latency)``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

__all__ = ["calibrate", "probe"]


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe(matmul_size: int = 512, bandwidth_mb: float = 4.0, reps: int = 10) -> dict:
    """Run on every rank of an initialised process group; returns (on every rank) the slowest rank's matmul rate
    and, per group size, the collective latency and bus bandwidth (see the module docstring). Collectives: every
    rank takes part in creating each group and in one ``all_gather_object``; the timed all-reduces run on the
    group's ranks only."""
    import torch
    import torch.distributed as dist

    from vescale.core.launch import rank_device

    device, world, rank = rank_device(), dist.get_world_size(), dist.get_rank()
    a = torch.randn(matmul_size, matmul_size, device=device)
    b = torch.randn(matmul_size, matmul_size, device=device)

    def matmul() -> None:
        for _ in range(4):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()

    matmul()
    dist.barrier()
    tflops = 4 * 2 * matmul_size ** 3 / _median_time(matmul, reps) / 1e12
    groups = {}
    small = torch.ones(1, device=device)
    big = torch.ones(int(bandwidth_mb * 2**20 / 4), device=device)
    for g in range(2, world + 1):
        group = dist.new_group(list(range(g)))
        if rank >= g:
            continue
        dist.all_reduce(big, group=group)  # warm: the group's connections are made on first use
        latency = _median_time(lambda: dist.all_reduce(small, group=group), reps)  # noqa: B023 - called here
        t = _median_time(lambda: dist.all_reduce(big, group=group), max(reps // 2, 3))  # noqa: B023
        bus = 2 * (g - 1) / g * big.numel() * 4
        groups[g] = {"latency_s": latency, "gbps": bus / max(t - latency, 1e-9) / 1e9}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"tflops": tflops, "groups": groups})
    return {"matmul_tflops_per_rank": min(r["tflops"] for r in gathered),
            "groups": {g: gathered[0]["groups"][g] for g in sorted(gathered[0]["groups"])}}


def _probe_rank(matmul_size: int, bandwidth_mb: float) -> dict:
    return probe(matmul_size, bandwidth_mb)


def calibrate(path: str | Path, *, world_size: int = 2, matmul_size: int = 512, bandwidth_mb: float = 4.0) -> dict:
    """Probe ``world_size`` local ranks and write ``path``: the :class:`~vescale.plan.HardwareModel` fields (every
    dim's bandwidth is the largest group's bus bandwidth, the latency its one-element all-reduce), ``memory_gb``
    (this machine's memory over the ranks) and ``calibration`` (the raw measurements). Returns what it wrote."""
    from vescale.core.launch import spawn

    if world_size < 2:
        raise ValueError(f"calibrate needs world_size >= 2 to time collectives, got {world_size}")
    measured = spawn(_probe_rank, world_size, matmul_size, bandwidth_mb)
    top = measured["groups"][max(measured["groups"])]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world_size
    out = {"device_tflops": measured["matmul_tflops_per_rank"], "collective_latency_s": top["latency_s"],
           **{f"{d}_gbps": top["gbps"] for d in ("tp", "dp", "cp", "ep", "pp")}, "memory_gb": round(memory, 2),
           "calibration": {"world_size": world_size, "matmul_size": matmul_size, "bandwidth_mb": bandwidth_mb,
                           **measured}}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    return out
