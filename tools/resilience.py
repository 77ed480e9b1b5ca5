"""What lets ``tools/train.py`` survive what long runs meet: ``--resume auto`` (the newest complete checkpoint under
``--out``), bad steps (skipped on every rank by ``vescale.parallel.StepGuard``; a checkpoint of the last good state
before giving up), preemption (``vescale.core.PreemptionGuard``: a signal to any rank, a checkpoint, exit 0; its flag
agreed in the guard's all-reduce, one small collective a step for both), failed saves (``--on-save-error``) and slow
ranks (each step's collective waits, ``rank_times``)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from faults import ENV_VAR, Faults
from rank_times import CollectiveWaitClock

__all__ = ["Resilience", "auto_resume", "load_resume", "checkpoints_newest_first", "PREEMPT_GRACE_S"]

#: Seconds after a preemption signal within which every rank must agree to stop, else the rank exits (143 on SIGTERM)
PREEMPT_GRACE_S = 25.0


def checkpoints_newest_first(out: str | Path) -> list[Path]:
    """The ``<out>/ckpt/step_N`` directories, highest N first."""
    found = [(int(m.group(1)), p) for p in Path(out, "ckpt").glob("step_*")
             if p.is_dir() and (m := re.fullmatch(r"step_(\d+)", p.name))]
    return [p for _, p in sorted(found, key=lambda t: t[0], reverse=True)]


def auto_resume(cfg, say: Callable[[str], None]) -> None:
    """``--resume auto``: set ``cfg.resume`` to the newest checkpoint under ``cfg.out`` (default ``runs/latest``) that
    is complete (``metadata.json`` committed) and whole (``vescale.checkpoint.verify(checksums=False)``: schema,
    files, sizes, headers; no data read), and ``cfg.resume_fallbacks`` to the older ones that are, newest first,
    saying which were skipped and why; with none, start fresh in ``cfg.out`` (``cfg.resume`` None, its old outputs
    replaced). Runs before any rank starts. The checksums are checked by the load itself, as it reads
    (:func:`load_resume`): a damaged checkpoint is found there, and the next one loaded instead."""
    from vescale.checkpoint import CheckpointError, verify

    cfg.out = cfg.out or "runs/latest"
    whole = []
    for path in checkpoints_newest_first(cfg.out):
        if not (path / "metadata.json").is_file():
            say(f"--resume auto: skipping {path}: incomplete (no metadata.json: the save did not finish)")
            continue
        try:
            verify(path, checksums=False)
        except (CheckpointError, OSError, ValueError) as exc:
            say(f"--resume auto: skipping {path}: damaged ({str(exc).splitlines()[0]})")
            continue
        whole.append(str(path.resolve()))
    if whole:
        say(f"--resume auto: resuming from {whole[0]}")
        cfg.resume, cfg.resume_fallbacks = whole[0], whole[1:]
        return
    say(f"--resume auto: no complete checkpoint under {cfg.out}/ckpt; starting fresh")
    cfg.resume, cfg.overwrite = None, True


def load_resume(cfg, state: dict, say: Callable[[str], None]) -> tuple[str, dict]:
    """Load ``cfg.resume`` into ``state`` (the model and optimizer just built: nothing to keep, so in one pass,
    ``atomic=False``) and return (the checkpoint loaded, its progress record). A load that finds damage raises
    ``CorruptCheckpointError`` on every rank alike; under ``--resume auto`` the ranks then load the next of
    ``cfg.resume_fallbacks`` (a strict load writes every tensor and value, so nothing of the damaged one stays),
    saying which was skipped; when none is left (every one damaged: no fresh start over a run's checkpoints), or with
    an explicit ``--resume``, the error is raised."""
    from vescale import checkpoint
    from vescale.checkpoint import CorruptCheckpointError

    paths = [cfg.resume, *cfg.resume_fallbacks]
    for i, path in enumerate(paths):
        progress = {"step": 0, "sequences": 0, "data": ""}
        if any(k.startswith("progress") and k.endswith("skipped") for k in checkpoint.inspect(path)["values"]):
            progress["skipped"] = 0  # the run's bad steps so far (checkpoints written before it was kept lack it)
        try:
            checkpoint.load(path, {**state, "progress": progress}, atomic=False)
            return path, progress
        except CorruptCheckpointError as exc:
            if i + 1 < len(paths):
                say(f"--resume auto: skipping {path}: damaged ({str(exc).splitlines()[0]}); "
                    f"resuming from {paths[i + 1]}")
            elif len(paths) == 1:
                raise
            else:  # never a silent fresh start over a run's checkpoints
                raise CorruptCheckpointError(f"--resume auto: every complete checkpoint under {cfg.out}/ckpt is "
                                             f"damaged (move them aside to start fresh); the oldest, {path}: {exc}"
                                             ) from exc
    raise ValueError("load_resume: no checkpoint to load (cfg.resume is empty)")


class Resilience:
    """The loop's side on this rank: saves (async, one in flight), the bad-step count of ``par.step_guard`` (carried
    across a resume in the checkpoint's progress record), the preemption agreement (in the guard's all-reduce), the
    collective-wait clock and the faults of ``VESCALE_TRAIN_FAULTS`` (``faults.py``). ``progress(n)`` is what a
    checkpoint after ``n`` steps records (step, data position; ``skipped`` is added). ``release()`` (in a ``finally``)
    puts back the signal handlers and patches, whatever the loop raised."""

    def __init__(self, cfg, par, optimizer, state: dict, progress: Callable[[int], dict], out: Path,
                 log: Callable[[str], None] = print, rank: int = 0) -> None:
        from vescale.core import PreemptionGuard

        self.optimizer, self.state, self.progress, self.out, self.par = optimizer, state, progress, out, par
        self.log, self.on_save_error, self.save_errors = log, cfg.on_save_error, 0
        self.guard = par.step_guard  # make_optimizer(skip_nonfinite=True)'s: the loss and gradients checked
        if self.guard is None:
            raise ValueError("Resilience needs the optimizer of par.make_optimizer(..., skip_nonfinite=True)")
        self.faults = Faults(os.environ.get(ENV_VAR), rank)  # parsed before anything is patched
        # grace: a rank blocked in a collective whose peer died never agrees to stop; it exits 25 s after the signal,
        # before the launcher's SIGKILL (torchrun, Kubernetes: 30 s), so that a restart does not wait for it
        self.preempt = PreemptionGuard(["SIGTERM"] + ([cfg.preempt_signal] if cfg.preempt_signal else []),
                                       grace=PREEMPT_GRACE_S).__enter__()
        self.guard.carry(self.preempt)  # the stop flag rides on the bad-step all-reduce: one collective a step
        self.faults.__enter__()
        self.clock = CollectiveWaitClock().__enter__()
        self.pending, self.saved_at = None, None
        self.step_s: list[float] = []
        self.wait_s: list[float] = []
        self._t0 = 0.0

    def resumed(self, progress: dict) -> None:
        """Take the bad-step count of the checkpoint's ``progress`` record (the run's total goes on from it)."""
        self.guard.skipped = int(progress.get("skipped", 0))

    def begin_step(self, step: int) -> None:
        self.clock.take()
        self._t0 = time.perf_counter()
        self.faults.before_step(step)  # a straggler's sleep is part of its step

    def end_step(self) -> float:
        """This step's seconds (since :meth:`begin_step`); its collective waits are kept for the per-rank table."""
        dt = time.perf_counter() - self._t0
        self.step_s.append(dt)
        self.wait_s.append(self.clock.take())
        return dt

    def save(self, steps: int, *, wait: bool = False) -> None:
        """Checkpoint ``<out>/ckpt/step_<steps>`` (async; the previous save finished first). Collective."""
        from vescale import checkpoint

        self.finish()
        if self.saved_at == steps:
            return
        self.pending = checkpoint.save(self.out / "ckpt" / f"step_{steps}", {**self.state, "progress": {
            **self.progress(steps), "skipped": self.guard.skipped}}, async_save=True)
        self.saved_at = steps
        if wait:
            self.finish(final=True)

    def finish(self, *, final: bool = False) -> None:
        """Wait for the save in flight. One that failed on some rank (every rank gets the same error, naming the
        file) raises with ``--on-save-error stop`` or when ``final`` (the save a stop waits for); else warns."""
        from vescale.checkpoint import CheckpointError

        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.wait()
        except CheckpointError as exc:
            self.save_errors += 1
            if self.on_save_error == "stop" or final:
                raise
            self.log(f"WARNING: checkpoint {pending.path} failed, training goes on (--on-save-error continue); "
                     f"the newest complete checkpoint is the one before it. {str(exc).splitlines()[0]}")

    def step(self, step: int) -> None:
        """``optimizer.step()``; when it gives up on bad steps, first a checkpoint of the last good state (the
        weights before the skipped steps, the data position after them), then the error."""
        from vescale.parallel import NonFiniteStepError

        try:
            self.optimizer.step()
        except NonFiniteStepError as exc:
            self.save(step + 1, wait=True)
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

    def release(self) -> None:
        """The signal handlers, the fault patches and the clock's patches back as they were (idempotent)."""
        self.clock.__exit__(None, None, None)
        self.faults.__exit__(None, None, None)
        self.preempt.__exit__(None, None, None)

    def close(self) -> None:
        """Finish the save in flight (``--on-save-error`` applies), then :meth:`release`."""
        try:
            self.finish()
        finally:
            self.release()

