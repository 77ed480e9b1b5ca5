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
    store = _elastic_attempt_store(seconds)
    if store is None:
        dist.init_process_group(backend, timeout=timedelta(seconds=seconds))
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size,
                                timeout=timedelta(seconds=seconds))
    return dist.get_rank(), dist.get_world_size()


#: Where rank 0 of each start of a torchelastic worker group publishes that start's key prefix in the agent's store.
_ATTEMPT_KEY = "vescale/launch/attempt"


def _elastic_attempt_store(timeout_s: float):
    """The key-value store this start of a torchrun worker group shares, or None outside torchrun's shared store.

    torchrun (c10d rendezvous) gives every restart of the workers the agent's one TCPStore and no per-restart key
    prefix (``TORCHELASTIC_RESTART_COUNT`` is counted per agent and differs between agents when one restarted for a
    failure and another for the membership change), so a restarted group can read a dead worker's address from the
    previous start and fail to connect. Here rank 0 publishes a fresh random prefix; every other rank adopts a
    prefix only once rank 0 answered its own fresh token under it, so a prefix left by a dead rank 0 is never taken.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    import torch.distributed as dist

    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    prefix = agree_attempt_prefix(agent, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout_s)
    return dist.PrefixStore(prefix, agent)


def agree_attempt_prefix(store: Any, rank: int, world_size: int, timeout_s: float, *, poll_s: float = 0.5) -> str:
    """Agree, through ``store`` (which may hold keys of earlier starts of the same ranks), on a key prefix that is
    new to this start: rank 0 makes it; every other rank takes it after rank 0 acknowledged that rank's fresh token.

    Rank 0 waits for every rank's token (so it returns after all ranks joined); a rank that read a stale prefix
    (rank 0 of an earlier start, now dead) gets no acknowledgement and reads the key again every ``poll_s`` seconds.
    Raises ``TimeoutError`` after ``timeout_s`` seconds without agreement.
    """
    import time
    import uuid

    if rank == 0:
        prefix = f"vescale/launch/{uuid.uuid4().hex}/"
        store.set(_ATTEMPT_KEY, prefix)
        for r in range(1, world_size):
            store.wait([f"{prefix}hello/{r}"], timedelta(seconds=timeout_s))
            token = store.get(f"{prefix}hello/{r}").decode()
            store.set(f"{prefix}ack/{r}/{token}", "1")
        return prefix
    token, deadline = uuid.uuid4().hex, time.monotonic() + timeout_s
    store.wait([_ATTEMPT_KEY], timedelta(seconds=timeout_s))
    while True:
        prefix = store.get(_ATTEMPT_KEY).decode()
        store.set(f"{prefix}hello/{rank}", token)
        try:
            store.wait([f"{prefix}ack/{rank}/{token}"], timedelta(seconds=poll_s))
            return prefix
        except Exception as exc:  # no answer under this prefix yet: a dead rank 0's, or a slow live one's
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank 0 of this start did not answer through the launcher's store "
                                   f"within {timeout_s:.0f} s (last prefix {prefix!r})") from exc


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
