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
