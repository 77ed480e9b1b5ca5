"""PreemptionGuard: a signal to one rank stops every rank at the same step, through one flag all-reduce."""

from __future__ import annotations

import os
import signal

import pytest

from vescale.core.preemption import PreemptionGuard, forward_signals, signal_number
from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[2])
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(world_size):
    import torch.distributed as dist

    stops = []
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionGuard(["SIGTERM", "USR1"]) as guard:
        for step in range(6):
            if step == 2 and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is told
            stops.append(guard.should_stop())
    assert stops == [False, False, True, True, True, True]
    assert guard.received == (signal.SIGUSR1 if dist.get_rank() == 1 else None)
    assert signal.getsignal(signal.SIGUSR1) is before  # the previous handler is back


@multi_rank(world_sizes=[2])
def test_every_n_calls_agrees_on_the_same_call(world_size):
    import torch.distributed as dist

    with PreemptionGuard(["SIGUSR1"], every=3) as guard:
        stops = []
        for step in range(7):
            if step == 1 and dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGUSR1)
            stops.append(guard.should_stop())
    assert stops == [False, False, False, True, True, True, True]


def test_signal_names():
    assert signal_number("term") == signal.SIGTERM and signal_number("SIGUSR1") == signal.SIGUSR1
    with pytest.raises(ValueError, match="SIGNOPE"):
        signal_number("SIGNOPE")
    with pytest.raises(ValueError, match="every"):
        PreemptionGuard(every=0)


def _child(conn) -> None:
    got = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    conn.send("ready")
    while not got:
        signal.pause()
    conn.send(got[0])


def test_a_launcher_forwards_the_signal_to_its_children():
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # no torch in the child: a cheap process
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there,), daemon=True)
    child.start()
    try:
        assert here.poll(60) and here.recv() == "ready"
        before = signal.getsignal(signal.SIGUSR1)
        with forward_signals(["SIGUSR1"], to=[child]):  # not the session's pooled ranks, also children here
            os.kill(os.getpid(), signal.SIGUSR1)  # to the launcher: it survives, the child gets it
            assert here.poll(60) and here.recv() == signal.SIGUSR1
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        child.join(10)
        child.kill()


_BLOCKED_RANK = r"""
import os, sys, time, torch, torch.distributed as dist
from vescale.core.preemption import PreemptionGuard
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method="tcp://127.0.0.1:" + sys.argv[2])
if dist.get_rank() == 1:  # the peer that never joins the collective (as a dead one would not)
    time.sleep(120)
with PreemptionGuard(["SIGTERM"], grace=float(sys.argv[3])) as guard:
    print("blocked", flush=True)
    dist.all_reduce(torch.ones(1))  # blocks in C++: no Python handler runs until it returns
    print("returned", guard.should_stop(), flush=True)
"""


def test_a_signal_to_a_rank_blocked_in_a_collective_exits_after_the_grace():
    """Rank 0 waits in an all-reduce that rank 1 never joins; a SIGTERM to it, never agreed, ends it with status
    128 + SIGTERM after ``grace`` (without it the rank would wait for the collective timeout, then be SIGKILLed)."""
    import subprocess
    import sys

    from vescale.core.launch import free_port

    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", _BLOCKED_RANK, str(r), port, "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        assert ranks[0].stdout.readline().strip() == "blocked"
        ranks[0].send_signal(signal.SIGTERM)
        _, err = ranks[0].communicate(timeout=120)  # a hang guard, not a timing
        assert ranks[0].returncode == 128 + signal.SIGTERM, err
        assert "SIGTERM received and no stop agreed within 1 s" in err, err
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_a_signal_never_agreed_goes_to_the_previous_handler_on_exit():
    """The block ends (here without a should_stop; in a job, a collective error after a peer died) with a signal
    noted but not agreed: leaving the guard raises it again, and the default action ends the process."""
    import subprocess
    import sys

    code = ("import os, signal\nfrom vescale.core.preemption import PreemptionGuard\n"
            "with PreemptionGuard(['SIGUSR1']):\n    os.kill(os.getpid(), signal.SIGUSR1)\nprint('survived')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGUSR1 and "survived" not in done.stdout, (done.returncode, done.stderr)
