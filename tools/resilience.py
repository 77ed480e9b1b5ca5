"""What lets ``tools/train.py`` survive what long runs meet: ``--resume auto`` (the newest complete checkpoint under
``--out``), bad steps (skipped on every rank by ``vescale.parallel.StepGuard``; a checkpoint of the last good state
before giving up) and preemption (``vescale.core.PreemptionGuard``: a signal to any rank, a checkpoint, exit 0)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

__all__ = ["Resilience", "auto_resume", "checkpoints_newest_first"]


def checkpoints_newest_first(out: str | Path) -> list[Path]:
    """The ``<out>/ckpt/step_N`` directories, highest N first."""
    found = [(int(m.group(1)), p) for p in Path(out, "ckpt").glob("step_*")
             if p.is_dir() and (m := re.fullmatch(r"step_(\d+)", p.name))]
    return [p for _, p in sorted(found, key=lambda t: t[0], reverse=True)]


def auto_resume(cfg, say: Callable[[str], None]) -> None:
    """``--resume auto``: set ``cfg.resume`` to the newest checkpoint under ``cfg.out`` (default ``runs/latest``) that
    is complete (``metadata.json`` committed) and passes ``vescale.checkpoint.verify`` (every file, size and
    checksum), saying which newer ones were skipped and why; with none, start fresh in ``cfg.out`` (``cfg.resume``
    None, its old outputs replaced). Runs before any rank starts; reads every byte of the checkpoint it accepts."""
    from vescale.checkpoint import CheckpointError, verify

    cfg.out = cfg.out or "runs/latest"
    for path in checkpoints_newest_first(cfg.out):
        if not (path / "metadata.json").is_file():
            say(f"--resume auto: skipping {path}: incomplete (no metadata.json: the save did not finish)")
            continue
        try:
            verify(path)
        except (CheckpointError, OSError, ValueError) as exc:
            say(f"--resume auto: skipping {path}: damaged ({str(exc).splitlines()[0]})")
            continue
        say(f"--resume auto: resuming from {path}")
        cfg.resume = str(path.resolve())
        return
    say(f"--resume auto: no complete checkpoint under {cfg.out}/ckpt; starting fresh")
    cfg.resume, cfg.overwrite = None, True


class Resilience:
    """The loop's side on this rank: saves (async, one in flight), the bad-step count of ``par.step_guard`` and the
    preemption agreement. ``progress(n)`` is what a checkpoint after ``n`` steps records (step, data position)."""

    def __init__(self, cfg, par, optimizer, state: dict, progress: Callable[[int], dict], out: Path) -> None:
        from vescale.core import PreemptionGuard

        self.optimizer, self.state, self.progress, self.out, self.par = optimizer, state, progress, out, par
        self.guard = par.step_guard  # make_optimizer(skip_nonfinite=True)'s: the loss and gradients checked
        if self.guard is None:
            raise ValueError("Resilience needs the optimizer of par.make_optimizer(..., skip_nonfinite=True)")
        self.preempt = PreemptionGuard(["SIGTERM"] + ([cfg.preempt_signal] if cfg.preempt_signal else [])).__enter__()
        self.pending, self.saved_at = None, None

    def save(self, steps: int, *, wait: bool = False) -> None:
        """Checkpoint ``<out>/ckpt/step_<steps>`` (async; the previous save finished first). Collective."""
        from vescale import checkpoint

        self.finish()
        if self.saved_at == steps:
            return
        self.pending = checkpoint.save(self.out / "ckpt" / f"step_{steps}", {**self.state,
                                       "progress": self.progress(steps)}, async_save=True)
        self.saved_at = steps
        if wait:
            self.finish()

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def step(self, step: int) -> None:
        """``optimizer.step()``; when it gives up on bad steps, first a checkpoint of the last good state (the
        weights before the skipped steps, the data position after them), then the error."""
        from vescale.parallel import NonFiniteStepError

        try:
            self.optimizer.step()
        except NonFiniteStepError as exc:
            self.save(step + 1, wait=True)
            self.preempt.__exit__(None, None, None)  # the signal handlers back as they were (a pooled rank lives on)
            raise NonFiniteStepError(f"step {step + 1}: {exc}; last good state saved in "
                                     f"{self.out / 'ckpt' / f'step_{step + 1}'}") from None

    def metrics(self) -> dict:
        """This step's ``skipped`` (bad steps so far) and ``grad_norm`` (when the step clipped and was taken)."""
        norm = getattr(self.optimizer, "grad_norm", None)
        norm = self.par.grad_norm if norm is None else norm
        from report import peak_memory_mb

        record = {"skipped": self.guard.skipped, "memory_mb": round(peak_memory_mb(), 1)}
        if norm is not None and not self.guard.last_skipped:
            record["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        return record

    def should_stop(self, step: int) -> bool:
        """Whether a preemption signal reached any rank (agreed by every rank); if so, checkpoint the ``step + 1``
        steps done and wait for it. Collective."""
        if not self.preempt.should_stop():
            return False
        self.save(step + 1, wait=True)
        return True

    def close(self) -> None:
        self.finish()
        self.preempt.__exit__(None, None, None)

