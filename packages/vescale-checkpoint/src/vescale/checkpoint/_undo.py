"""An undo log for targets a load writes before the ranks have agreed that every read is intact.

A checked load must leave the state bitwise as it was when it fails on any rank. Writing a target only after the
agreement means reading each byte twice (once to check it, once to fill the target), and the second pass cannot
start before the slowest rank's disk reads end. Where the memory allows, the local path instead saves a target's
current bytes here, reads the stored bytes straight into the target while the disk is busy anyway, and checks them
there; a failed load puts every saved copy back (:meth:`UndoLog.restore`) before it raises.

The log holds at most ``budget`` bytes of copies (:meth:`UndoLog.admit` is decided before any read, in the order
of the reads, so it is the same decision whatever the thread timing); targets of one load never overlap (each
stored box fills distinct memory), so the order of restoring does not matter, but it is the reverse of saving.
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["UndoLog", "undo_budget"]

# the share of the host's available memory that the copies of all ranks on the host may take together
_MEMORY_SHARE = 0.5


def undo_budget(ranks_on_host: int) -> int:
    """Bytes of copies one rank's undo log may hold: ``_MEMORY_SHARE`` of the host's available memory
    (``MemAvailable`` of ``/proc/meminfo``) divided among the ranks on the host; 0 where that is unknown (not Linux)
    or ``VESCALE_CHECKPOINT_EARLY_FILL=0`` (every target is then filled after the agreement)."""
    if os.environ.get("VESCALE_CHECKPOINT_EARLY_FILL", "1") == "0":
        return 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * _MEMORY_SHARE) // max(1, ranks_on_host)
    except (OSError, ValueError, IndexError):
        pass
    return 0


class UndoLog:
    """Copies of target tensors taken before they are written, to put back if the load fails."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()

    def admit(self, targets: list[torch.Tensor]) -> bool:
        """Whether copies of ``targets`` fit in what is left of the budget (taking their share when they do)."""
        nbytes = sum(t.numel() * t.element_size() for t in targets)
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True

    def save(self, target: torch.Tensor) -> None:
        """Copy ``target``'s current values into the log (call before writing it)."""
        copy = target.detach().clone()
        with self._lock:
            self._saved.append((target, copy))

    def restore(self) -> None:
        """Put every saved copy back into its target, latest first, and empty the log."""
        with torch.no_grad():
            for target, copy in reversed(self._saved):
                target.detach().copy_(copy)
        self._saved.clear()

    def drop(self) -> None:
        """Forget the copies (the load succeeded)."""
        self._saved.clear()
