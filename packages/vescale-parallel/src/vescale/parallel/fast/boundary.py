"""Crossing a fast block's boundary: DTensor arguments and parameters to local tensors, local results to DTensors.

Contract: every crossing keeps autograd exact. An input becomes its local tensor with the gradient placements the
DTensor path's kernel would produce there (``to_local(grad_placements=...)``); a parameter becomes its local shard,
its gradient partial on the mesh dims where the input shards the batch; a local result becomes a DTensor through
:class:`FromLocal`, whose backward brings the incoming gradient to the placements the DTensor path hands back there.
Arguments other than the input must need no gradient (:func:`arguments_apply` checks), so they cross without an
autograd node. No collective here, except a gradient redistribution in :class:`FromLocal`'s backward.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.core import torch_internals
from vescale.parallel.collectives import local_grad
from vescale.parallel.factory import capture_paused
from vescale.parallel.fast.context import FastPathContext

__all__ = ["CACHE_KEYS", "FromLocal", "to_local", "heads", "batch_or_replicated", "current_params", "localized",
           "local_parameters", "arguments_apply"]

CACHE_KEYS = ("past_key_values", "cache")  # the KV cache keyword (renamed in transformers 5)


class FromLocal(torch.autograd.Function):
    """A local result as a DTensor of ``placements``; the gradient is taken as ``grad_placements`` (what the DTensor
    path's kernel receives there) and handed back as its local tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh, placements: tuple, grad_placements: tuple) -> DTensor:
        ctx.mesh, ctx.grad_placements = mesh, grad_placements
        return DTensor.from_local(x, mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        return local_grad(grad, ctx.mesh, ctx.grad_placements), None, None, None


def to_local(t: Any, placements: tuple) -> Any:
    """A DTensor's local tensor under ``placements`` (redistributed there first if it is placed otherwise)."""
    if not isinstance(t, DTensor):
        return t
    if tuple(t.placements) != placements:
        t = t.redistribute(t.device_mesh, placements)
    return t.to_local()


def heads(placements: tuple, k: int) -> tuple:
    """Placements of a per-head tensor ``[batch, heads, ...]``: heads sharded on ``k``, the batch as the input's."""
    return tuple(Shard(1) if i == k else p for i, p in enumerate(placements))


def batch_or_replicated(placements, k: int) -> bool:
    """Replicated on mesh dim ``k``, and replicated or batch-sharded (``Shard(0)``, rows computed independently) on
    every other: a sequence-sharded input (context parallelism) needs attention across ranks, which only the DTensor
    path does."""
    return isinstance(placements[k], Replicate) and all(
        type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in placements)


def current_params(module: nn.Module, mesh, entries: list[tuple]) -> list[tuple] | None:
    """``(owner, attr, dtensor)`` for each ``(child, attr, placements)`` entry as the module holds it now, or None if
    one is no longer a DTensor on ``mesh`` with those placements (replaced since it was checked)."""
    found = []
    for child, attr, placements in entries:
        owner = getattr(module, child)
        t = getattr(owner, attr)
        if not isinstance(t, DTensor) or t.device_mesh != mesh or tuple(t.placements) != placements:
            return None
        found.append((owner, attr, t))
    return found


def localized(args: tuple, kwargs: dict, x: DTensor, grad_in) -> tuple[tuple, dict]:
    """The arguments as local tensors: the input ``x`` differentiably (its gradient taken as ``grad_in``), the others
    (which need no gradient: checked) as they are."""

    def local(v: Any) -> Any:
        if v is x:
            return x.to_local(grad_placements=grad_in)
        if isinstance(v, DTensor):
            return torch_internals.local_tensor(v)
        if isinstance(v, (tuple, list)) and any(isinstance(t, DTensor) for t in v):
            items = [local(t) for t in v]
            return type(v)(items) if isinstance(v, list) else tuple(items)
        return v

    return tuple(local(a) for a in args), {key: local(v) for key, v in kwargs.items()}


@contextlib.contextmanager
def local_parameters(params: list[tuple], placements: tuple, context: FastPathContext):
    """Within, each ``(owner, attr, dtensor)`` reads as its local tensor (gradient: the parameter's own placements, but
    partial where the input ``placements`` shard the batch), the plan's hooks of ``context``'s model stand aside and
    factory capture is paused (yielding the capture mode, for the cache). An instance attribute shadows the module's
    registered parameter (Python finds instance attributes before ``nn.Module.__getattr__`` looks in the parameters),
    so the module, its parameters and its state dict stay as they are; much cheaper than reparametrizing the module."""
    sharded = {i for i, p in enumerate(placements) if isinstance(p, Shard)}
    shadowed = []
    grad = torch.is_grad_enabled()
    context.depth += 1
    try:
        for owner, attr, t in params:
            # without autograd (a decode step) no gradient placements matter: the stored shard, no autograd node
            vars(owner)[attr] = torch_internals.local_tensor(t) if not grad else t.to_local(grad_placements=[
                Partial() if i in sharded and isinstance(p, Replicate) else p for i, p in enumerate(t.placements)])
            shadowed.append((owner, attr))
        with capture_paused() as mode:
            yield mode
    finally:
        context.depth -= 1
        for owner, attr in shadowed:
            del vars(owner)[attr]


def arguments_apply(args: tuple, kwargs: dict, x: DTensor, mesh) -> bool:
    """Every tensor argument but the input ``x`` is a DTensor on ``mesh`` placed like ``x`` and needs no gradient (its
    local tensor is then what the rank computes with), and a KV cache, if any, has an ``update`` method."""
    placements = tuple(x.placements)
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if not isinstance(t, torch.Tensor) or t is x:
                continue
            if t.requires_grad or not isinstance(t, DTensor) or t.device_mesh != mesh:
                return False
            if tuple(t.placements) != placements:
                return False
    for key in CACHE_KEYS:
        cache = kwargs.get(key)
        if cache is not None and not callable(getattr(cache, "update", None)):
            return False
    return True
