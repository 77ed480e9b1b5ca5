"""Starting distributed programs: spawn local ranks, or join the ranks torchrun started.

``spawn`` is for programs that start their own ranks (the training CLI on CPU, notebooks, scripts); ``init_distributed``
is for programs started by ``torchrun``, which already set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ... .
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from vescale.core._workers import WorkerGroup, default_backend

__all__ = ["spawn", "init_distributed", "default_backend", "free_port"]


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
          timeout: float = 3600.0) -> Any:
    """Run ``fn(*args)`` on ``world_size`` fresh local processes and return rank 0's result.

    Each process joins one process group (``backend`` defaults to ``nccl`` when there is a GPU per rank, else
    ``gloo``; with ``nccl`` rank r uses ``cuda:r``) before ``fn`` runs and leaves it after. ``fn`` must be a
    module-level function (it is sent to the ranks by reference) and ``args`` must be picklable.

    Raises :class:`~vescale.core.errors.RankError` naming the first rank that raised (with that rank's traceback) or
    whose process died, and :class:`~vescale.core.errors.RankTimeoutError` naming the ranks still running after
    ``timeout`` seconds; in both cases every rank process has been stopped when the call returns.
    """
    with WorkerGroup(world_size, backend=backend) as group:
        return group.run(fn, args, timeout=timeout)[0]


def init_distributed(backend: str | None = None, timeout: float = 1800.0) -> tuple[int, int]:
    """Join the process group described by the launcher's environment (torchrun); return ``(rank, world_size)``.

    Idempotent: an already initialised default group is kept. Without ``WORLD_SIZE`` in the environment this makes a
    one-rank group, so the same program runs as a plain ``python`` script. With ``nccl`` the current CUDA device is
    set to ``LOCAL_RANK``.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or default_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a local test server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
