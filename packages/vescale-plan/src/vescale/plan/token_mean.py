"""The loss of a step as one device's mean over the trained tokens of the whole global batch, on every mesh.

Targets may hold ignored positions (``IGNORE_INDEX``, -100, as ``F.cross_entropy`` and transformers use). One device
takes ``sum of token losses / N`` with ``N`` the trained tokens of the whole batch; averaging every rank's (or
micro-step's, microbatch's, cp chunk's) own mean instead is wrong when their counts differ. :func:`token_scale` counts
``N`` once per step and returns ``R / N`` (``R``: the ranks DDP / FSDP2 average gradients over, ``dense_grads``), so
that each rank backpropagating ``its token sum x R / N`` leaves after the average one device's gradient, and the mean
over ``dense_grads`` of what the ranks return (``Parallelized.global_loss``) is one device's loss. When every target
position is trained it returns None: the caller keeps the per-row mean arithmetic (bitwise as before, no count).
Collectives: one int64 all-reduce over the batch ranks (dp, ep) unless the caller gives ``num_tokens``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["IGNORE_INDEX", "token_scale", "token_sum"]

IGNORE_INDEX = -100


def token_scale(targets: torch.Tensor, roles: Any, num_tokens: int | torch.Tensor | None = None) -> float | None:
    """``R / N`` for a step whose rank-local targets (this rank's rows, whole rows before any cp slice) are
    ``targets``; None when every target position of the global batch is trained.

    ``N``: ``num_tokens`` (the global batch's trained-token count, which a caller holding the global batch knows),
    else counted here (one all-reduce over ``roles.batch``). ``R``: ``roles.dense_grads.size``. A step with no
    trained token at all gives ``R`` (zero loss and gradients, where ``F.cross_entropy`` gives NaN).
    """
    positions = targets.numel() * roles.batch.size  # every batch rank holds as many rows (shard_batch)
    if num_tokens is None:
        count = (targets != IGNORE_INDEX).sum().to(torch.int64).reshape(1)
        if roles.batch.size > 1:
            dist.all_reduce(count, group=roles.batch.group)
        num_tokens = int(count.item())
    num_tokens = int(num_tokens)
    if not 0 <= num_tokens <= positions:
        raise ValueError(f"num_tokens={num_tokens}: the global batch has {positions} target positions "
                         f"({roles.batch.size} batch ranks x targets {tuple(targets.shape)})")
    if num_tokens == positions:
        return None
    return roles.dense_grads.size / max(num_tokens, 1)


def _takes_reduction(loss_fn: Callable) -> bool:
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False
    return "reduction" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def token_sum(loss_fn: Callable[..., torch.Tensor], output: Any, targets: torch.Tensor) -> torch.Tensor:
    """The sum of the per-token losses of ``output`` against ``targets`` (ignored positions add 0):
    ``loss_fn(output, targets, reduction="sum")`` when ``loss_fn`` takes ``reduction``, else its mean times the
    trained-token count (such a ``loss_fn`` must then give a finite mean for rows with no trained token)."""
    if _takes_reduction(loss_fn):
        return loss_fn(output, targets, reduction="sum")
    return loss_fn(output, targets) * (targets != IGNORE_INDEX).sum()
