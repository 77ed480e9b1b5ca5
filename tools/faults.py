"""Faults injected on purpose into ``tools/train.py``, so that the resilience tests (and a user rehearsing a recovery)
can make a rank slow, a checkpoint write fail or a save hang, through the environment of an unmodified job.

``VESCALE_TRAIN_FAULTS`` holds comma-separated entries (unset or empty: no fault, no cost):

- ``slow=R:S``: rank ``R`` sleeps ``S`` seconds at the start of every step (a straggler).
- ``save_error=R@N``: rank ``R``'s data-file write of checkpoint ``step_N`` raises ``OSError(ENOSPC)`` (a full disk
  on one rank); ``save_error=R`` every save of rank ``R``.
- ``save_stall=N``: every rank writes its data file of ``step_N`` and then blocks (a job killed in this window has
  a partially written, uncommitted checkpoint).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

__all__ = ["ENV_VAR", "Faults"]

ENV_VAR = "VESCALE_TRAIN_FAULTS"


class Faults:
    """The faults of ``text`` (``VESCALE_TRAIN_FAULTS``'s syntax) that concern ``rank``. A context manager: the
    checkpoint-write faults patch ``vescale.checkpoint``'s storage inside ``with`` only (a pooled rank lives on)."""

    def __init__(self, text: str | None, rank: int) -> None:
        self.rank, self.sleep_s = rank, 0.0
        self.save_error: set[int | None] = set()  # checkpoint steps whose write fails here (None: every one)
        self.save_stall: set[int] = set()
        self._original = None
        for entry in filter(None, (e.strip() for e in (text or "").split(","))):
            kind, _, arg = entry.partition("=")
            try:
                if kind == "slow":
                    who, seconds = arg.split(":")
                    self.sleep_s += float(seconds) if int(who) == rank else 0.0
                elif kind == "save_error":
                    who, _, step = arg.partition("@")
                    if int(who) == rank:
                        self.save_error.add(int(step) if step else None)
                elif kind == "save_stall":
                    self.save_stall.add(int(arg))
                else:
                    raise ValueError(kind)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: cannot read {entry!r} (slow=RANK:SECONDS, save_error=RANK[@STEP], "
                                 "save_stall=STEP)") from None

    def before_step(self, step: int) -> None:
        if self.sleep_s:
            time.sleep(self.sleep_s)

    def __enter__(self) -> Faults:
        if not (self.save_error or self.save_stall):
            return self
        from vescale.checkpoint import _storage

        original = self._original = _storage.Storage.write_file
        fails, stalls = self.save_error, self.save_stall

        def write_file(storage, name, header, pieces, pool):
            match = Path(storage.root).name.removeprefix("step_")
            step = int(match) if match.isdigit() else -1
            if None in fails or step in fails:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), storage.where(name))
            original(storage, name, header, pieces, pool)
            if step in stalls:
                time.sleep(3600)

        _storage.Storage.write_file = write_file
        return self

    def __exit__(self, *exc) -> None:
        if self._original is not None:
            from vescale.checkpoint import _storage

            _storage.Storage.write_file = self._original
            self._original = None
