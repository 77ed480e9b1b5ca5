"""Skip an optimizer step whose loss or gradients are not finite on some rank, on every rank alike.

:func:`skip_nonfinite_steps` guards an optimizer in place: a plain ``torch.optim`` optimizer (DDP, tensor parallel,
FSDP2 / ZeRO 3 over DTensor shards, pipeline stages) or a :class:`~vescale.parallel.DistributedOptimizer` (ZeRO 1/2,
bf16 masters). Its ``step()`` first looks at what this rank's update would read (the local gradients, or the
DistributedOptimizer's reduced pieces, and the loss given to :meth:`StepGuard.observe_loss`), then agrees with every
other rank through one all-reduce (MAX) of a one-element flag over ``group`` (default: the world). When any rank saw
a NaN or an infinity, no rank steps: parameters, master weights and optimizer state (Adam's ``step`` too) stay
bitwise as they were, and the next good step is the step one device takes without the bad batch.

A rank-local check is not enough: a NaN in one tensor-parallel shard's gradient, or in one ZeRO rank's piece, is seen
by that rank only, and a rank that skipped while the others stepped would leave the replicas apart for good.

Other per-step agreements ride on the same all-reduce (:meth:`StepGuard.carry`): a
:class:`vescale.core.PreemptionGuard`'s stop flag goes in the same tensor, so a guarded, preemptible loop pays one
small all-reduce per step, not two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from vescale.core.torch_internals import local_tensor
from vescale.parallel.errors import NonFiniteStepError

__all__ = ["StepGuard", "skip_nonfinite_steps", "NonFiniteStepError"]


class StepGuard:
    """The non-finite check of one optimizer's steps (see the module docstring); made by :func:`skip_nonfinite_steps`.

    ``max_consecutive``: consecutive bad steps skipped before the next one raises :class:`NonFiniteStepError` (on
    every rank, after skipping it too, so the state is still the last good step's); 0 raises at the first; None never.
    Counters: ``skipped`` (bad steps so far), ``consecutive`` (the current run of them), ``last_skipped``.
    """

    def __init__(self, optimizer: Any, step: Callable[..., Any], *, max_consecutive: int | None = 3,
                 group: dist.ProcessGroup | None = None) -> None:
        if max_consecutive is not None and max_consecutive < 0:
            raise ValueError(f"max_consecutive={max_consecutive} must be >= 0 (or None: never stop)")
        self.optimizer, self._step, self.max_consecutive, self.group = optimizer, step, max_consecutive, group
        self.skipped = self.consecutive = 0
        self.last_skipped = False
        self._loss: torch.Tensor | None = None
        self._riders: list[Any] = []

    def carry(self, rider: Any) -> None:
        """Agree ``rider``'s flag in :meth:`check`'s all-reduce from now on: ``rider.local_flag()`` (a float, this
        rank's) goes in as one more element, and ``rider.agreed(value)`` gets the MAX over ``group`` after it (a
        :class:`vescale.core.PreemptionGuard` is such a rider; its ``should_stop`` then issues no collective of its
        own). ``rider`` must agree over the same ranks as this guard."""
        if not (callable(getattr(rider, "local_flag", None)) and callable(getattr(rider, "agreed", None))):
            raise TypeError(f"{type(rider).__name__} has no local_flag()/agreed(value): it cannot ride on the guard's "
                            "all-reduce")
        self._riders.append(rider)

    def gradients(self) -> list[torch.Tensor]:
        """This rank's gradient tensors the update reads: the DistributedOptimizer's reduced pieces (after finishing
        the DDP reduction), else each parameter's ``.grad`` (a DTensor's local shard). Views: writing into one
        changes what the step would apply."""
        ddp = getattr(self.optimizer, "ddp", None)
        if ddp is not None and hasattr(self.optimizer, "pieces"):
            ddp.finish_grad_sync()
            return [pc.grad for pc in self.optimizer.pieces.values() if pc.hi > pc.lo]
        return [local_tensor(p.grad) for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Count ``loss`` (this rank's) in the next step's check: a non-finite one skips the step too."""
        self._loss = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))

    def check(self) -> bool:
        """Whether every rank of ``group`` has a finite loss (when observed) and finite gradients. A collective: one
        all-reduce (MAX) of ``1 + len(riders)`` float32 over ``group``, on the gradients' device (NCCL: a CUDA
        tensor); each rider (:meth:`carry`) learns its agreed flag from it."""
        grads = self.gradients()
        device = grads[0].device if grads else _default_device()
        bad = torch.zeros((), dtype=torch.float32, device=device)
        if grads:  # a norm (fp32) is NaN or inf exactly when some element is, or when it overflows
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            bad = bad + (~torch.isfinite(norms)).any().float()
        if self._loss is not None:
            bad = bad + (~torch.isfinite(self._loss.detach().float())).any().float().to(device)
        self._loss = None
        flags = torch.stack([bad.reshape(()), *(torch.tensor(float(r.local_flag()), device=device)
                                               for r in self._riders)]) if self._riders else bad
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        values = flags.tolist() if self._riders else [float(flags)]
        for rider, value in zip(self._riders, values[1:]):
            rider.agreed(value)
        return values[0] == 0.0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The guarded ``optimizer.step``: :meth:`check`, then the optimizer's own step, or nothing (counted) when
        some rank saw a non-finite value; past ``max_consecutive`` bad steps in a row it raises
        :class:`NonFiniteStepError` instead (the state untouched)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.observe_loss(loss)
        if self.check():
            self.consecutive, self.last_skipped = 0, False
            result = self._step()
            return loss if closure is not None else result
        self.skipped, self.consecutive, self.last_skipped = self.skipped + 1, self.consecutive + 1, True
        if self.max_consecutive is not None and self.consecutive > self.max_consecutive:
            raise NonFiniteStepError(
                f"{self.consecutive} consecutive steps had a non-finite loss or gradient norm on some rank (more than "
                f"max_bad_steps={self.max_consecutive}); every rank skipped them, so parameters and optimizer state "
                "are the last good step's")
        return loss


def skip_nonfinite_steps(optimizer: Any, *, max_consecutive: int | None = 3,
                         group: dist.ProcessGroup | None = None) -> StepGuard:
    """Guard ``optimizer`` in place: its ``step()`` becomes :meth:`StepGuard.step` (a step every rank skips when any
    rank's loss or gradients are not finite); the guard is also ``optimizer.step_guard``. Returns the guard.

    ``optimizer``: a ``torch.optim.Optimizer`` or a :class:`~vescale.parallel.DistributedOptimizer`. ``group``: the
    ranks that agree (default: all; every rank of it must call ``step`` each step). Collective per step: one
    one-element all-reduce over ``group``.
    """
    if getattr(optimizer, "step_guard", None) is not None:
        raise ValueError(f"{type(optimizer).__name__} is already guarded (optimizer.step_guard)")
    guard = StepGuard(optimizer, optimizer.step, max_consecutive=max_consecutive, group=group)
    optimizer.step = guard.step  # the instance's step shadows the class's (torch's hooks run inside the original)
    optimizer.step_guard = guard
    return guard


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
