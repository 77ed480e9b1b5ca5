"""``spawn_on_pool``: ``launch.spawn`` runs its job on the pooled ranks, as a fresh rank would, and leaves them as
they were."""

from __future__ import annotations

import os

import pytest

from vescale.core import launch
from vescale.core.errors import RankError
from vescale.core.testing import pool_pids, run_on_ranks, spawn_on_pool


def _world_timeout() -> float:
    """The default group's collective timeout in seconds (torch exposes it only on the gloo backend's options)."""
    import torch
    import torch.distributed as dist

    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _job(offset: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": t.item(), "pid": os.getpid(), "cwd": os.getcwd(),
            "env": os.environ.get("SPAWN_ON_POOL_TEST"), "world": os.environ["WORLD_SIZE"],
            "timeout": _world_timeout()}


def _state() -> tuple:
    return os.getcwd(), os.environ.get("SPAWN_ON_POOL_TEST"), _world_timeout()


def _raise() -> None:
    raise ValueError("job failed")


def test_spawn_runs_on_the_pool_in_the_callers_directory_and_environment(tmp_path, monkeypatch):
    before = run_on_ranks(_state, 2)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPAWN_ON_POOL_TEST", "from the caller")
    with spawn_on_pool():
        got = launch.spawn(_job, 2, 10, collective_timeout=42)
    assert got["rank"] == 0 and got["sum"] == 0 + 1 + 2 * 10  # rank 0's result, after a collective of both
    assert got["pid"] in pool_pids(2)  # a pooled rank, not a fresh process
    assert got["cwd"] == str(tmp_path) and got["env"] == "from the caller" and got["world"] == "2"
    assert got["timeout"] == 42
    assert run_on_ranks(_state, 2) == before  # directory, environment and collective timeout put back
    assert launch._spawn_runner is None


def test_a_failing_job_raises_and_the_pool_serves_the_next(tmp_path, monkeypatch):
    before = run_on_ranks(_state, 2)
    monkeypatch.chdir(tmp_path)
    with spawn_on_pool(), pytest.raises(RankError, match="job failed"):
        launch.spawn(_raise, 2)
    assert run_on_ranks(_state, 2) == before
    with pytest.raises(ValueError, match="cannot run on the test pool"), spawn_on_pool():
        launch.spawn(_raise, 2, backend="nccl")
