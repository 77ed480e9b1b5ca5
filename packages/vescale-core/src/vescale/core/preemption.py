"""Stop a distributed job cleanly on a preemption signal: every rank finishes its step, then all stop together.

A scheduler that preempts a job (Kubernetes, SLURM's ``--signal=USR1@120`` before a time limit, a spot instance
reclaimed) signals the job's processes, often not all of them at once, and sometimes only one. A rank that simply
exited would leave the others waiting in their next collective. :class:`PreemptionGuard` records the signal on the
rank that got it, and :meth:`PreemptionGuard.should_stop`, called by every rank once per step, agrees on it with one
all-reduce (MAX) of a one-element flag, so every rank sees ``True`` at the same step and can checkpoint and exit::

    with PreemptionGuard(["SIGTERM", "SIGUSR1"]) as preempt:
        for step in range(start, steps):
            train_step(step)
            if preempt.should_stop():
                save_checkpoint(step + 1)
                break

A loop that already agrees on something every step can carry the flag in that all-reduce instead
(``vescale.parallel.StepGuard.carry(preempt)``: the bad-step check and the stop flag in one tensor); ``should_stop``
then returns that step's agreed answer without a collective of its own.

A rank blocked in a collective whose peer is gone (the peer died; torchrun then SIGTERMs the survivors before it
restarts the group) never reaches the agreement: with ``grace`` set, a rank that got a signal and has not agreed to
stop within ``grace`` seconds exits at once (status 128 + the signal), instead of holding the restart until the
launcher's SIGKILL (torchrun's and Kubernetes' default: 30 s). The watch runs on a thread woken through
``signal.set_wakeup_fd``, because a main thread blocked in C++ runs no Python signal handler.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PreemptionGuard", "forward_signals", "signal_number"]


def signal_number(name: str | int | signal.Signals) -> signal.Signals:
    """The signal ``name`` names (``"SIGTERM"``, ``"TERM"``, ``"USR1"``, 15); ``ValueError`` naming it otherwise."""
    if isinstance(name, (int, signal.Signals)):
        return signal.Signals(name)
    key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(f"unknown signal {name!r} (e.g. SIGTERM, SIGUSR1)") from None


class PreemptionGuard:
    """Notes the ``signals`` this process receives (inside ``with``) and agrees on them across ranks.

    ``group``: the ranks that agree (default: all). ``every``: :meth:`should_stop` communicates on every ``every``-th
    call only (1: each call; a signal then waits at most ``every`` steps). ``device``: the flag's device (default:
    the current CUDA device under NCCL, else the CPU). ``grace``: seconds after a signal within which every rank must
    have agreed to stop, else this process exits (``os._exit(128 + signal)``; None: wait forever). The handlers
    replace the previous ones for the ``with`` and are restored after it; they must be installed from the main
    thread (Python runs handlers there).
    """

    def __init__(self, signals: Iterable[str | int] = ("SIGTERM",), *, group: dist.ProcessGroup | None = None,
                 every: int = 1, device: torch.device | str | None = None, grace: float | None = None) -> None:
        if every < 1:
            raise ValueError(f"every={every} must be at least 1")
        if grace is not None and not grace > 0:
            raise ValueError(f"grace={grace} must be above 0 seconds (or None: no limit)")
        self.signals = tuple(dict.fromkeys(signal_number(s) for s in signals))
        self.group, self.every, self._device = group, every, device
        self.received: signal.Signals | None = None  # the first signal this process got
        self.stopping = False  # what the last agreement said
        self._calls = 0
        self._carried = False  # agreed() gave this step's answer: should_stop() issues no collective
        self._previous: dict[signal.Signals, object] = {}
        self.grace = grace
        self._settled = threading.Event()  # stop agreed (or the with block left): the grace watch ends
        self._wakeup: tuple[int, int, int] | None = None  # (read end, write end, the previous wakeup fd)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard installs signal handlers: enter it from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)
        if self.grace is not None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._settled.clear()
            self._wakeup = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(read,), daemon=True, name="vescale-preemption-grace").start()
        return self

    def __exit__(self, *exc) -> None:
        """Restore the previous handlers. A signal noted but never agreed as a stop (the block ended first, e.g. on a
        collective error after a peer died) is raised again for them: under a launcher's SIGTERM the default action
        ends the process now instead of after whatever the caller does next (a hang diagnosis, a final wait)."""
        entered = bool(self._previous)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._wakeup is not None:
            read, write, previous = self._wakeup
            self._wakeup = None
            self._settled.set()
            signal.set_wakeup_fd(previous)
            os.close(write)  # the watch reads end-of-file and ends (it closes the read end)
        if entered and self.received is not None and not self.stopping:
            pending, self.received = self.received, None
            signal.raise_signal(pending)

    def _watch(self, read: int) -> None:
        """Grace thread: woken by the C-level signal handler (the wakeup fd gets each signal's number), even while the
        main thread is blocked; after one of ``signals``, exits the process unless a stop is agreed within ``grace``."""
        ours = {int(s) for s in self.signals}
        try:
            while not self._settled.is_set():
                data = os.read(read, 64)
                if not data:
                    return
                hit = next((b for b in data if b in ours), None)
                if hit is None:
                    continue
                if self._settled.wait(self.grace):
                    return
                sys.stderr.write(f"PreemptionGuard: {signal.Signals(hit).name} received and no stop agreed within "
                                 f"{self.grace:g} s (blocked in a collective whose peer is gone?): exiting now\n")
                sys.stderr.flush()
                os._exit(128 + hit)
        finally:
            os.close(read)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def local_flag(self) -> float:
        """This rank's stop flag (1.0 once a signal came): what a carrier's all-reduce (MAX) agrees on."""
        return 0.0 if self.received is None else 1.0

    def agreed(self, value: float) -> None:
        """The MAX of every rank's :meth:`local_flag`, agreed by a carrier's all-reduce (``StepGuard.carry``); the
        next :meth:`should_stop` returns it without communicating."""
        self.stopping = self.stopping or value > 0
        self._carried = True
        if self.stopping:
            self._settled.set()

    def should_stop(self) -> bool:
        """Whether some rank of ``group`` received one of the signals: the same answer on every rank. A collective
        (one all-reduce of one float32) on every ``every``-th call; the calls between return the last answer. After a
        carrier agreed the flag (:meth:`agreed`) since the last call, no collective: that answer."""
        self._calls += 1
        if self._carried:
            self._carried = False
            return self.stopping
        if self.stopping or (self._calls - 1) % self.every:
            return self.stopping
        flag = torch.tensor(0.0 if self.received is None else 1.0, device=self._flag_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.stopping = bool(flag.item() > 0)
        if self.stopping:
            self._settled.set()
        return self.stopping

    def _flag_device(self) -> torch.device:
        if self._device is not None:
            return torch.device(self._device)
        if dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


@contextlib.contextmanager
def forward_signals(signals: Iterable[str | int], to: Iterable[Any] | None = None) -> Iterator[None]:
    """Inside ``with``, each of ``signals`` this process receives is sent on to ``to`` (processes with a ``pid``;
    default: every live ``multiprocessing`` child at the time of the signal) instead of acting here: a launcher that
    started its ranks itself (``vescale.core.spawn``) passes a scheduler's preemption signal on to them, where a
    :class:`PreemptionGuard` stops them cleanly, and the launcher returns their result.
    Main thread only; the previous handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("forward_signals installs signal handlers: enter it from the main thread")

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in multiprocessing.active_children() if to is None else to:
            if child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)

    to = None if to is None else list(to)
    previous = {sig: signal.signal(sig, forward) for sig in dict.fromkeys(signal_number(s) for s in signals)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
