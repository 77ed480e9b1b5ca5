"""The pooled multi-rank harness: results, failures with rank ids, timeouts with recovery, pool reuse."""

from __future__ import annotations

import os
import time

import pytest

from vescale.core.errors import RankError, RankTimeoutError
from vescale.core.testing import fails_if_hung, multi_rank, pool_pids, run_on_ranks


def _rank_and_sum(offset):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.getpid()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    results = run_on_ranks(_rank_and_sum, world_size, 10)
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size for r in results)
    expected = sum(range(world_size)) + 10 * world_size
    assert all(r[2] == expected for r in results)
    assert len({r[3] for r in results}) == world_size  # one process per rank


def _fail_on(rank_to_fail):
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} says hello")
    if dist.get_rank() == rank_to_fail:
        raise ValueError(f"boom on rank {rank_to_fail}")
    return "ok"


def test_failure_names_the_rank_and_its_traceback():
    with pytest.raises(RankError) as info:
        run_on_ranks(_fail_on, 4, 2)
    err = info.value
    assert err.rank == 2
    assert "rank 2 of 4 raised" in str(err)
    assert "ValueError: boom on rank 2" in err.remote_traceback
    assert "_fail_on" in err.remote_traceback
    assert "rank 2 says hello" in str(err)  # captured output of the failing rank is shown


def test_pool_is_reused_after_a_clean_failure():
    run_on_ranks(_rank_and_sum, 4, 0)  # a warm pool, whatever ran before this test
    before = pool_pids(4)
    assert len(before) == 4
    with pytest.raises(RankError, match="rank 2 of 4 raised"):
        run_on_ranks(_fail_on, 4, 2)
    # The ranks that did not fail finished their task: the same processes and group run the next calls.
    assert pool_pids(4) == before
    assert run_on_ranks(_fail_on, 4, -1) == ["ok"] * 4
    assert [r[2] for r in run_on_ranks(_rank_and_sum, 4, 0)] == [6.0] * 4
    assert pool_pids(4) == before


def _hang_on(rank_to_hang):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == rank_to_hang:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)  # the other ranks wait here for the hung one
    return t.item()


def test_hung_rank_times_out_then_pool_recovers():
    run_on_ranks(_rank_and_sum, 2, 0)
    old = pool_pids(2)
    with fails_if_hung(300), pytest.raises(RankTimeoutError) as info:
        run_on_ranks(_hang_on, 2, 1, timeout=3)
    # Only rank 1 hung (rank 0 waits for it in the all-reduce): both are named, and the message says why.
    assert info.value.ranks == [0, 1]
    assert "rank(s) [0, 1] of 2 did not finish in time" in str(info.value)
    assert "_hang_on" in str(info.value)  # the hung rank's Python stack is in the message
    assert pool_pids(2) == []  # the broken group was torn down
    results = run_on_ranks(_rank_and_sum, 2, 0)  # and the next call gets a fresh one
    assert [r[2] for r in results] == [1.0, 1.0]
    assert set(pool_pids(2)).isdisjoint(old)


def _exit_hard():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    return "survived"


def test_dead_rank_is_reported_with_exit_code():
    with pytest.raises(RankError) as info:
        run_on_ranks(_exit_hard, 2)
    assert info.value.rank == 1
    assert "exited with code 7" in str(info.value)
    assert run_on_ranks(_rank_and_sum, 2, 0)[0][2] == 1.0


def test_unpicklable_function_is_rejected_with_a_reason():
    def local():
        return 1

    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(local, 1)


def test_warm_four_rank_overhead_is_small():
    """Not a timing assertion on speed: a warm pool must not respawn processes per call."""
    run_on_ranks(_rank_and_sum, 4, 0)
    pids = pool_pids(4)
    for _ in range(5):
        run_on_ranks(_rank_and_sum, 4, 0)
    assert pool_pids(4) == pids


@multi_rank(world_sizes=[1, 2, 4])
def test_decorated_body_runs_on_every_rank(world_size, tmp_path):
    import torch
    import torch.distributed as dist

    assert dist.get_world_size() == world_size
    t = torch.full((3,), float(dist.get_rank()))
    dist.all_reduce(t)
    assert t.tolist() == [float(sum(range(world_size)))] * 3
    (tmp_path / f"rank{dist.get_rank()}").write_text("x")
    dist.barrier()
    assert len(list(tmp_path.iterdir())) == world_size  # the fixture value reached every rank


@multi_rank(world_sizes=2)
@pytest.mark.parametrize("scale", [2, 3])
def test_decorated_body_takes_pytest_params(scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(scale)])
    dist.all_reduce(t)
    assert t.item() == 2 * scale


def _parent_and_loaded(modules):
    import sys

    return os.getppid(), [m for m in modules if m in sys.modules]


def test_pooled_ranks_are_forked_from_a_server_that_preloaded_torch():
    from vescale.core import testing

    assert testing.START_METHOD == "forkserver"  # the default, unless VESCALE_TEST_START_METHOD says otherwise
    for parent, loaded in run_on_ranks(_parent_and_loaded, 2, testing.PRELOAD):
        assert parent != os.getpid(), "a pooled rank is a child of the test process: spawned, not forked"
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            server = f.read().decode()
        assert "multiprocessing.forkserver" in server, server
        # multiprocessing hands the server its preload list on its command line
        assert all(repr(m) in server for m in testing.PRELOAD), f"the fork server did not preload {testing.PRELOAD}"
        assert loaded == list(testing.PRELOAD)


def test_worker_group_refuses_an_unknown_start_method_or_preload_without_the_fork_server():
    from vescale.core._workers import WorkerGroup

    with pytest.raises(ValueError, match="start_method must be 'spawn' or 'forkserver', got 'fork'"):
        WorkerGroup(2, start_method="fork")
    with pytest.raises(ValueError, match=r"preload \('torch',\) needs start_method='forkserver', got 'spawn'"):
        WorkerGroup(2, preload=("torch",))
