"""vescale.core.launch: spawn returns rank 0's result, names a failing rank, never hangs."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import pytest

from vescale.core.errors import RankError, RankTimeoutError
from vescale.core.launch import spawn
from vescale.core.testing import fails_if_hung


def _gather_ranks(tag):
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([dist.get_rank()]))
    return [(int(t.item()), tag) for t in out]


def _raise_on_last():
    import torch.distributed as dist

    if dist.get_rank() == dist.get_world_size() - 1:
        raise KeyError("last rank fails")


def _sleep_forever():
    time.sleep(3600)


def test_spawn_returns_rank0_result():
    assert spawn(_gather_ranks, 3, "x") == [(0, "x"), (1, "x"), (2, "x")]


def test_spawn_world_size_one():
    assert spawn(_gather_ranks, 1, "solo") == [(0, "solo")]


def test_spawn_failure_names_rank():
    with pytest.raises(RankError, match="rank 2 of 3 raised") as info:
        spawn(_raise_on_last, 3)
    assert "KeyError: 'last rank fails'" in info.value.remote_traceback


def test_spawn_timeout_is_an_error_not_a_hang():
    """Both ranks sleep past the timeout: a RankTimeoutError names both, with what they were running, and their
    processes are gone when spawn returns."""
    children = {p.pid for p in multiprocessing.active_children()}  # e.g. the test harness's pools
    with fails_if_hung(300), pytest.raises(RankTimeoutError) as info:
        spawn(_sleep_forever, 2, timeout=2)
    assert info.value.ranks == [0, 1]
    assert "_sleep_forever: rank(s) [0, 1] of 2 did not finish in time" in str(info.value)
    assert {p.pid for p in multiprocessing.active_children()} <= children


def test_spawn_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        spawn(_gather_ranks, 0, "x")


def test_spawn_from_a_script_main(tmp_path):
    """A function defined in a script's __main__ runs on the ranks (the training CLI's case)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from vescale.core.launch import spawn

        def main(scale):
            t = torch.tensor([float(dist.get_rank() + 1) * scale])
            dist.all_reduce(t)
            return t.item()

        if __name__ == "__main__":
            print("RESULT", spawn(main, 2, 10.0))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RESULT 30.0" in out.stdout


def test_init_distributed_without_launcher_makes_one_rank_group(tmp_path):
    code = textwrap.dedent("""
        import os
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            os.environ.pop(k, None)
        from vescale.core.launch import init_distributed
        print(init_distributed(), init_distributed())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(0, 1) (0, 1)"


def test_init_distributed_under_torchrun():
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from vescale.core.launch import init_distributed
        rank, world = init_distributed()
        t = torch.ones(1); dist.all_reduce(t)
        print(f"R{rank}/{world}={t.item()}")
        dist.destroy_process_group()
    """)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "R0/2=2.0" in out.stdout and "R1/2=2.0" in out.stdout



def test_torchrun_device_choice():
    """The device each torchrun process takes, for the GPU layouts a launcher can give (run on the CPU: the choice
    is the function ``init_distributed`` calls)."""
    import pytest

    from vescale.core.errors import MeshError
    from vescale.core.launch import torchrun_device

    assert torchrun_device(3, 8, 0) is None  # no GPU: gloo on the CPU
    assert torchrun_device(3, 8, 8) == 3  # a GPU per process
    assert torchrun_device(3, 8, 1) == 0  # the scheduler gave each process its own GPU
    assert torchrun_device(None, 1, 1) == 0  # a plain `python` run on a GPU host
    with pytest.raises(MeshError, match="8 processes on this node.*4 GPUs visible"):
        torchrun_device(3, 8, 4)  # was: a silent fallback to gloo
    assert torchrun_device(5, 8, 4, explicit_backend="nccl") == 1
    with pytest.raises(MeshError, match="LOCAL_RANK is not set"):
        torchrun_device(None, 4, 4)  # was: every rank on GPU 0


def test_restarted_group_agrees_on_a_fresh_prefix_despite_a_dead_rank0s_keys():
    """A torchrun restart shares the agent's store with the previous start: rank 1 reading first finds the dead
    rank 0's prefix (with that start's hello/ack keys) and must not take it; every rank ends on rank 0's new one."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from vescale.core.launch import _ATTEMPT_KEY, agree_attempt_prefix, free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    stale = "vescale/launch/dead/"
    server.set(_ATTEMPT_KEY, stale)
    for r in (1, 2):  # the previous start's whole handshake, answered by the rank 0 that is gone now
        server.set(f"{stale}hello/{r}", "old")
        server.set(f"{stale}ack/{r}/old", "1")
    results: dict[int, str] = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        results[r] = agree_attempt_prefix(client, r, 3, 20.0, poll_s=0.1)

    late = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in late:
        t.start()
    time.sleep(0.5)  # ranks 1 and 2 read the stale prefix and wait for an answer that never comes
    first = threading.Thread(target=rank, args=(0,))
    first.start()
    for t in (*late, first):
        t.join(30)
    assert set(results) == {0, 1, 2} and results[0] != stale
    assert results[1] == results[2] == results[0]


def test_prefix_agreement_times_out_by_name_without_rank0():
    from datetime import timedelta

    import torch.distributed as dist

    from vescale.core.launch import _ATTEMPT_KEY, agree_attempt_prefix, free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    server.set(_ATTEMPT_KEY, "vescale/launch/dead/")
    with pytest.raises(TimeoutError, match="rank 1: rank 0 of this start did not answer"):
        agree_attempt_prefix(server, 1, 2, 1.0, poll_s=0.2)
