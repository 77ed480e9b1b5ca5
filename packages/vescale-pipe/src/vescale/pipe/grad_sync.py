"""The gradient side of a pipeline step: the protocol a stage's own dp reducer follows, and the engine's sums.

:class:`StageGradSync` is everything :class:`~vescale.pipe.PipeEngine` needs from a stage wrapper that owns its
stage's data-parallel gradient reduction (``vescale.parallel.DistributedDataParallel`` and
``vescale.parallel.fully_shard_stage``'s ``Zero3Stage`` implement it structurally; vescale-pipe imports neither).
The functions below are the engine's own gradient sums: tied weights over pp (:func:`sum_tied_grads`) and, for
stages without a reducer, one flat average over dp (:func:`average_dp_grads`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from vescale.pipe.timeline import span

__all__ = ["StageGradSync"]


@runtime_checkable
class StageGradSync(Protocol):
    """A pipeline stage wrapper that reduces its stage's gradients over dp itself, as ``PipeEngine`` drives it.

    ``PipeEngine.wrap_stages(wrap)`` treats a returned module with all four members as its stage's reducer (one with
    some but not all of them is refused). The engine then, and only then:

    1. calls :meth:`defer_grad_sync` once, right after wrapping, with the stage's parameters tied to another stage's
       (their gradients are complete only after the engine sums them over pp, after backward);
    2. runs every backward action of the stage in a step under :meth:`no_sync` but the stage's last weight-gradient
       one (its last ``B`` or ``BW``), so the reducer reduces during that last backward, overlapped with the rest;
    3. after the step's tied-weight sum over pp, calls :meth:`finish_grad_sync`, and leaves the stage's parameters out
       of its own flat dp all-reduce.

    ``split_backward``: whether the reduction still happens when the engine splits a backward into ``BI`` (input
    gradients) and ``BW`` (weight gradients) actions; ``False`` makes ``wrap_stages`` refuse the zero-bubble
    schedules (``zb_h1``, ``zbv``) for the stage.
    """

    split_backward: bool

    def no_sync(self) -> AbstractContextManager[None]:
        """A context in which backward only accumulates this stage's gradients locally (no dp collective)."""
        ...

    def defer_grad_sync(self, late: Sequence[nn.Parameter]) -> None:
        """From now on, leave the end of each synchronised backward to :meth:`finish_grad_sync`: reductions may
        still be in flight when backward returns, and the gradients of ``late`` (the stage's tied parameters, which
        the engine completes after backward) must be reduced only in :meth:`finish_grad_sync`."""
        ...

    def finish_grad_sync(self) -> None:
        """Complete the step's dp reduction (launch what is left, wait for all); afterwards the gradients are read."""
        ...


def grad_sync_problem(module: Any) -> str | None:
    """Why ``module`` half-implements :class:`StageGradSync` (the members it lacks), or None (all or none)."""
    members = ("no_sync", "defer_grad_sync", "finish_grad_sync", "split_backward")
    have = [m for m in members if hasattr(module, m)]
    if not have or len(have) == len(members):
        return None
    missing = [m for m in members if m not in have]
    return (f"{type(module).__name__} has {have} but not {missing} of vescale.pipe.StageGradSync: implement all of "
            "it to own the stage's dp reduction, or none")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    """Where ``p``'s accumulated gradient lives, as a local tensor: the ``main_grad`` a dp reducer keeps it in (its
    buffer, when the reducer accumulates in another dtype than the parameter's), else ``.grad``."""
    main = getattr(p, "main_grad", None)
    if main is not None:
        return main
    return None if p.grad is None else _local(p.grad)


def _accumulated(p: torch.Tensor) -> torch.Tensor | None:
    """What ``p``'s gradient holds before a step, as :func:`_grad` reads it; ``None`` when it was cleared.

    A cleared ``.grad`` (``zero_grad(set_to_none=True)``) means nothing is accumulated, even when a dp reducer's
    ``main_grad`` view still holds the last step's values (the reducer overwrites them with the next gradient). Only
    a reducer that keeps the gradient in another dtype than the parameter's holds it in ``main_grad`` alone."""
    main = getattr(p, "main_grad", None)
    if p.grad is None and (main is None or main.dtype == p.dtype):
        return None
    return _grad(p)


def tied_before(shared: Mapping[str, Any], params: Mapping[str, list[nn.Parameter]]) -> dict[str, list]:
    """A copy of what each local copy of every tied weight in ``shared`` holds before a step (None: cleared), so
    that :func:`sum_tied_grads` sums only the step's part over pp."""
    return {n: [None if (g := _accumulated(p)) is None else g.clone() for p in params.get(n, [])] for n in shared}


def sum_tied_grads(shared: Mapping[str, tuple], params: Mapping[str, list[nn.Parameter]], before: Mapping[str, list],
                   group: Any, device: torch.device) -> None:
    """Sum the step's gradients of the parameters several pp ranks hold (tied embeddings) over the pp ``group``.

    ``shared``: ``{name: (local shape, dtype name)}`` of every tied weight in the pipeline (each rank passes the same
    names in the same order); ``params``: this rank's copies by name; ``before``: :func:`tied_before`. A rank without
    a copy contributes zeros. One ``all_reduce`` over ``group`` of the flattened sums, on ``device``."""
    if not shared:
        return
    flat = []
    for name, (shape, dtype) in shared.items():
        ps = params.get(name)
        if ps:
            total = torch.zeros_like(_local(ps[0]))
            for p, old in zip(ps, before[name]):
                g = _grad(p)
                if g is not None:
                    total += g if old is None else g - old
            flat.append(total.reshape(-1))
        else:
            flat.append(torch.zeros(shape, dtype=getattr(torch, dtype), device=device).reshape(-1))
    buf = torch.cat(flat)
    with span("tied grad all_reduce", "collective"):
        dist.all_reduce(buf, group=group)
    offset = 0
    for name, (shape, _) in shared.items():
        n = int(torch.Size(shape).numel())
        for p, old in zip(params.get(name, []), before[name]):
            value = buf[offset:offset + n].view(shape)
            if old is not None:
                value = old + value
            g = _grad(p)
            if g is None:
                p.grad = value.clone()
            else:
                g.copy_(value)
        offset += n


def average_dp_grads(params: Sequence[nn.Parameter], dp_group: Any) -> None:
    """Average the gradients of ``params`` (those holding one) over ``dp_group``: one flat ``all_reduce`` per
    gradient dtype, not overlapped (for stages without a reducer of their own)."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    n = dist.get_world_size(dp_group)
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    with span("dp grad all_reduce", "collective"):
        for ps in by_dtype.values():
            locs = [_local(p.grad) for p in ps]
            buf = torch.cat([g.reshape(-1) for g in locs])
            dist.all_reduce(buf, group=dp_group)
            buf /= n
            offset = 0
            for g in locs:
                g.copy_(buf[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
