"""Collectives with a chosen backward, and the one registry vescale's custom operators find their states in.

- :class:`EnterGroup` / :class:`LeaveGroup`: Megatron's ``f`` (identity forward, all-reduce backward) and ``g``
  (all-reduce forward, identity backward) around a tensor-parallel block.
- :class:`GatherLastDim` (:func:`gather_last_dim`): a column-parallel output's last dim all-gathered in rank order;
  backward hands each rank its columns of the gradient.
- :class:`AllToAll` (:func:`all_to_all`): variable-split ``all_to_all_single`` along dim 0; backward the same way
  back.
- :func:`all_gather_along` / :func:`reduce_scatter_along`: one dim gathered over a group, and its transpose (the
  forward and the backward of a custom operator).

Each issues exactly the collective named, on the group it is given. Custom operators (``torch.library``) take no
process group or module: what they need is registered here (:func:`register_op_state`) and travels as the int key
returned, which survives the deep copy the pipeline split traces. Keys count registrations from 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale.core import torch_internals
from vescale.dtensor.api import from_local_nograd

__all__ = ["EnterGroup", "LeaveGroup", "GatherLastDim", "gather_last_dim", "all_gather_last", "AllToAll",
           "all_to_all", "all_gather_along", "reduce_scatter_along", "local_grad", "OpStates", "OP_STATES",
           "register_op_state", "op_state"]


class EnterGroup(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward all-reduces the gradient (each rank's part from its own heads or
    FFN columns) over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LeaveGroup(torch.autograd.Function):
    """Megatron's ``g``: all-reduces partial sums (a row-parallel projection's) over ``group``; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def local_grad(grad: Any, mesh, placements: tuple) -> torch.Tensor:
    """This rank's local piece of ``grad`` laid out as ``placements`` (a DTensor gradient redistributed there first
    if it arrives otherwise; a plain gradient is already local)."""
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != placements:
            grad = grad.redistribute(mesh, placements)
        grad = torch_internals.local_tensor(grad)
    return grad


def all_gather_last(x: torch.Tensor, mesh, k: int) -> torch.Tensor:
    """``x`` of every rank of mesh dim ``k``, concatenated in rank order on the last dim (one all-gather)."""
    n = mesh.size(k)
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=mesh.get_group(k))
    return out.view(n, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


def gather_last_dim(x: torch.Tensor, mesh, k: int, placements: tuple) -> DTensor:
    """This rank's last-dim columns ``x`` gathered over mesh dim ``k``, as a DTensor of ``placements`` (replicated on
    ``k``); through :class:`GatherLastDim` when ``x`` takes a gradient."""
    if x.requires_grad and torch.is_grad_enabled():
        return GatherLastDim.apply(x, mesh, k, placements)
    return from_local_nograd(all_gather_last(x, mesh, k), mesh, placements)


class GatherLastDim(torch.autograd.Function):
    """Megatron's gather of a column-parallel output: forward all-gathers the columns (:func:`all_gather_last`);
    backward hands this rank its columns of the gradient (brought to ``placements`` first if it comes otherwise),
    what DTensor's ``Shard`` -> ``Replicate`` redistribution hands back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh, k: int, placements: tuple) -> DTensor:
        ctx.mesh, ctx.k, ctx.placements, ctx.cols = mesh, k, placements, x.shape[-1]
        return from_local_nograd(all_gather_last(x.detach(), mesh, k), mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        grad = local_grad(grad, ctx.mesh, ctx.placements)
        start = ctx.mesh.get_local_rank(ctx.k) * ctx.cols
        return grad.narrow(-1, start, ctx.cols).contiguous(), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` along dim 0: ``in_splits[r]`` rows of ``x`` go to rank ``r``, ``out_splits[r]`` come
    from it."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` with variable splits along dim 0; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def all_gather_along(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """``x`` of every rank of ``group`` (``size`` ranks) concatenated along ``dim``, rank after rank (one
    all-gather)."""
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((size * local.shape[0], *local.shape[1:]))
    dist.all_gather_single(out, local, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(grad: torch.Tensor, dim: int, group, size: int, rank: int) -> torch.Tensor:
    """The transpose of :func:`all_gather_along`: every rank's ``grad`` of the gathered tensor summed, this rank's
    (``rank``'s) part along ``dim``."""
    whole = grad.movedim(dim, 0).contiguous()
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: sum everywhere, keep this rank's part
        dist.all_reduce(whole, group=group)
        part = whole.chunk(size)[rank]
    else:
        part = whole.new_empty((whole.shape[0] // size, *whole.shape[1:]))
        dist.reduce_scatter_single(part, whole, group=group)
    return part.movedim(0, dim)


class OpStates:
    """The states custom operators find by int key (see the module docstring). ``register`` gives a state equal to
    one registered before that one's key; ``table[len(table)] = state`` registers a new state under the next key."""

    def __init__(self) -> None:
        self._states: list[Any] = []

    def register(self, state: Any) -> int:
        for key, known in enumerate(self._states):
            if known is state or (type(known) is type(state) and known == state):
                return key
        self._states.append(state)
        return len(self._states) - 1

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, key: int) -> Any:
        return self._states[key]

    def __setitem__(self, key: int, state: Any) -> None:
        if key != len(self._states):
            raise KeyError(f"operator state {key}: only the next key ({len(self._states)}) can be registered")
        self._states.append(state)


#: The one registry (context parallelism's cp groups, expert parallelism's operator setups).
OP_STATES = OpStates()


def register_op_state(state: Any) -> int:
    """The key of ``state`` in :data:`OP_STATES` (that of an equal state registered before, else a new one)."""
    return OP_STATES.register(state)


def op_state(key: int) -> Any:
    """The state registered under ``key``."""
    return OP_STATES[key]
