"""Cost of one multi-rank test body: vescale's pooled ranks against a fresh torch.multiprocessing.spawn per test.

    python tools/bench/harness.py [--world-size 4] [--calls 50] [--small]

Prints one JSON object: pool start-up (paid once per pytest session), the warm per-call cost of an empty body and of
a body doing one all_reduce, the cost of the PyTorch-native way (spawn N processes + init_process_group per test),
and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch.multiprocessing as tmp

from vescale.core.launch import free_port
from vescale.core.testing import run_on_ranks, shutdown_pools


def _empty() -> None:
    return None


def _all_reduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _native_rank(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    _all_reduce()
    dist.destroy_process_group()



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--native-calls", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="fewer repetitions (the nox bench session)")
    args = parser.parse_args()
    if args.small:
        args.calls, args.native_calls = 20, 2
    n = args.world_size

    t0 = time.perf_counter()
    run_on_ranks(_empty, n)
    start = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.calls):
        run_on_ranks(_empty, n)
    empty = (time.perf_counter() - t0) / args.calls
    t0 = time.perf_counter()
    for _ in range(args.calls):
        run_on_ranks(_all_reduce, n)
    pooled = (time.perf_counter() - t0) / args.calls
    shutdown_pools()

    t0 = time.perf_counter()
    for _ in range(args.native_calls):
        tmp.spawn(_native_rank, args=(n, free_port()), nprocs=n, join=True)
    native = (time.perf_counter() - t0) / args.native_calls

    print(json.dumps({
        "world_size": n,
        "pool_start_s": round(start, 3),
        "pooled_empty_call_s": round(empty, 5),
        "pooled_all_reduce_call_s": round(pooled, 5),
        "torch_spawn_per_test_s": round(native, 3),
        "ratio_pooled_over_torch_spawn": round(pooled / native, 5),
    }))


if __name__ == "__main__":
    main()
