"""Starting distributed programs: spawn local ranks, or join the ranks torchrun started.

``spawn`` is for programs that start their own ranks (the training CLI on CPU, notebooks, scripts); ``init_distributed``
is for programs started by ``torchrun``, which already set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ... .
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from vescale.core._workers import WorkerGroup, _function_ref, _resolve, default_backend
from vescale.core.watchdog import collective_timeout as collective_timeout_s

__all__ = ["spawn", "init_distributed", "default_backend", "torchrun_device", "rank_device", "free_port"]

#: Where ``spawn`` sends its job instead of starting processes: ``runner(task, world_size, args, backend=, timeout=)``
#: returning rank 0's result. None (the default): fresh processes. The test harness sets it
#: (``vescale.core.testing.spawn_on_pool``) so that a program's own ``main`` runs on the session's warm ranks.
_spawn_runner: Callable[..., Any] | None = None


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
          timeout: float = 3600.0, collective_timeout: float | None = None) -> Any:
    """Run ``fn(*args)`` on ``world_size`` fresh local processes and return rank 0's result.

    Each process joins one process group (``backend`` defaults to ``nccl`` when there is a GPU per rank, else
    ``gloo``; with ``nccl`` rank r uses ``cuda:r``) before ``fn`` runs and leaves it after. ``fn`` must be a
    module-level function (it is sent to the ranks by reference) and ``args`` must be picklable. A collective of
    the default group that waits longer than ``collective_timeout`` seconds (default ``$VESCALE_COLLECTIVE_TIMEOUT``,
    else 300; see :mod:`vescale.core.watchdog`) raises on the ranks that wait in it.

    Raises :class:`~vescale.core.errors.RankError` naming the first rank that raised (with that rank's traceback) or
    whose process died, and :class:`~vescale.core.errors.RankTimeoutError` naming the ranks still running after
    ``timeout`` seconds; in both cases every rank process has been stopped when the call returns.
    """
    seconds = collective_timeout_s(collective_timeout)  # a bad value fails here, before any rank starts
    task = functools.partial(_run_with_collective_timeout, _function_ref(fn), seconds)
    task.__qualname__ = getattr(fn, "__qualname__", repr(fn))  # what the group's errors name
    if _spawn_runner is not None:
        return _spawn_runner(task, world_size, args, backend=backend, timeout=timeout)
    with WorkerGroup(world_size, backend=backend) as group:
        return group.run(task, args, timeout=timeout)[0]


def _run_with_collective_timeout(ref: tuple, seconds: float, *args: Any) -> Any:
    """On a rank: set the default group's collective timeout, then run the function ``ref`` names."""
    from vescale.core.watchdog import set_collective_timeout

    set_collective_timeout(seconds)
    return _resolve(ref)(*args)


def init_distributed(backend: str | None = None, timeout: float | None = None, *,
                     collective_timeout: float | None = None) -> tuple[int, int]:
    """Join the process group described by the launcher's environment (torchrun); return ``(rank, world_size)``.

    Idempotent: an already initialised default group is kept. Without ``WORLD_SIZE`` in the environment this makes a
    one-rank group, so the same program runs as a plain ``python`` script. With ``nccl`` the current CUDA device is
    set to ``LOCAL_RANK``. The default group's collectives time out after ``collective_timeout`` seconds (``timeout``
    is its older name; default ``$VESCALE_COLLECTIVE_TIMEOUT``, else 300; see :mod:`vescale.core.watchdog`).
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
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_rank = os.environ.get("LOCAL_RANK")
    device = torchrun_device(None if local_rank is None else int(local_rank), local_world, gpus,
                             explicit_backend=backend)
    backend = backend or ("nccl" if device is not None else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(device if device is not None else 0)
    seconds = collective_timeout_s(collective_timeout if collective_timeout is not None else timeout)
    dist.init_process_group(backend, timeout=timedelta(seconds=seconds))
    return dist.get_rank(), dist.get_world_size()


def torchrun_device(local_rank: int | None, local_world: int, gpus: int, *,
                    explicit_backend: str | None = None) -> int | None:
    """The CUDA device index a launcher's process uses (None: no GPU, gloo on the CPU), from its ``LOCAL_RANK``,
    the node's process count ``LOCAL_WORLD_SIZE`` and the GPUs this process sees.

    A GPU per process on the node: device ``LOCAL_RANK``. One visible GPU: device 0 (schedulers that give each
    process its own ``CUDA_VISIBLE_DEVICES``). No GPU: None. Refused with a :class:`~vescale.core.errors.MeshError`,
    unless a backend was chosen explicitly: some GPUs but fewer than the node's processes (sharing them would be a
    silent fallback to gloo, or two ranks on one GPU), and a GPU run without ``LOCAL_RANK`` (every rank would take
    GPU 0).
    """
    from vescale.core.errors import MeshError

    if gpus == 0:
        return None
    if local_rank is None:
        if local_world > 1 and explicit_backend is None:
            raise MeshError(f"{gpus} GPU(s) visible and LOCAL_WORLD_SIZE={local_world}, but LOCAL_RANK is not set: "
                            "launch with torchrun (which sets it) or set LOCAL_RANK per process")
        return 0
    if gpus >= local_world:
        return local_rank
    if gpus == 1:
        return 0
    if explicit_backend is not None:
        return local_rank % gpus
    raise MeshError(f"{local_world} processes on this node (LOCAL_WORLD_SIZE) but {gpus} GPUs visible: start one "
                    f"process per GPU (--nproc-per-node {gpus}), give each process its own GPU "
                    "(CUDA_VISIBLE_DEVICES), or pass backend='gloo' to run on the CPU")


def rank_device(group: Any = None):
    """This rank's device: where its model, batches and the tensors of its collectives over ``group`` live.

    NCCL (``group``'s backend, default the default group's) takes CUDA tensors only: ``cuda:<current device>``
    (set to the local rank by :func:`init_distributed` / :func:`spawn`). Any other backend (gloo), or no
    initialised process group: the CPU. Local; no collective.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a local test server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
