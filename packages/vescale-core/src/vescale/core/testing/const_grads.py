"""Exact-gradient optimizer tests: a net whose gradients are chosen constants, and its one-device reference.

Optimizer tests (ZeRO pieces, matrix optimizers, low-precision state, their checkpoints) compare a parallel run with
one device *bitwise*. That holds when the gradients are exact in any reduction order, which these helpers arrange:

* :func:`const_grad_net` is a stack of ``nn.Linear`` layers (and optionally a ``LayerNorm``) whose forward is
  ``sum(p * C[fqn])`` over its parameters, so each parameter's gradient is exactly the constant ``C[fqn]``.
* :func:`dyadic_consts` draws those constants: multiples of 1/8 in [-2, 2], one set per (step, rank). A mean of such
  constants over a few ranks is exact in fp32 (and their values in bf16) whatever order a collective sums them in.
* :func:`const_grad_reference` steps one device's optimizers on the dp mean of the ranks' constants, optionally with
  its state rounded to a low-precision dtype between steps (the semantics ``low_precision_state`` promises).
* :func:`const_grad_step` is one parallel step of such a net; :func:`split_matrices`, :func:`shard_weights` and
  :func:`shard_consts` set up the Muon / tensor-parallel variants.

Only torch is needed (the TP helpers use ``torch.distributed.tensor``); nothing here imports a vescale sibling.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ConstGradNet", "const_grad_net", "dyadic_consts", "const_grad_reference", "const_grad_step",
           "split_matrices", "shard_weights", "shard_consts"]


class ConstGradNet(nn.Module):
    """``nn.Linear(n, m)`` named by each key of ``shapes`` (``name -> (m, n)``; a bias on ``"b"`` only), then a
    ``LayerNorm(norm)`` named ``norm`` when ``norm`` is given. ``forward(consts)`` returns ``sum(p * consts[fqn])``
    over the parameters in registration order; a DTensor term is made whole first (``full_tensor``), so a parameter
    sharded over tp with its constant sharded alike gives one device's loss and gradient."""

    def __init__(self, shapes: Mapping[str, tuple[int, int]], norm: int | None = None) -> None:
        super().__init__()
        for name, (m, n) in shapes.items():
            setattr(self, name, nn.Linear(n, m, bias=name == "b"))
        if norm is not None:
            self.norm = nn.LayerNorm(norm)

    def forward(self, consts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        total: Any = 0.0
        for name, p in self.named_parameters():
            term = (p * consts[name]).sum()
            total = total + (term.full_tensor() if isinstance(term, DTensor) else term)
        return total


def const_grad_net(shapes: Mapping[str, tuple[int, int]], norm: int | None = None) -> ConstGradNet:
    """A :class:`ConstGradNet` initialised from ``torch.manual_seed(0)`` (the same weights on every call)."""
    torch.manual_seed(0)
    return ConstGradNet(shapes, norm)


def dyadic_consts(net: nn.Module, step: int, rank: int) -> dict[str, torch.Tensor]:
    """The constant gradient of each of ``net``'s parameters (by FQN, its global shape, fp32) for (``step``, ``rank``).

    Entries are ``randint(-16, 17) / 8`` drawn in parameter order from a generator seeded ``1000 * step + rank``, so
    every process draws the same constants for the same (step, rank) and a dp mean of them is exact.
    """
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {name: torch.randint(-16, 17, tuple(p.shape), generator=g).float() / 8
            for name, p in net.named_parameters()}


def _round_state(optimizers: Iterable[torch.optim.Optimizer], dtype: torch.dtype) -> None:
    for opt in optimizers:
        for st in opt.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:  # the scalar ``step`` stays as the optimizer keeps it
                    st[k] = v.to(dtype)


def const_grad_reference(net: nn.Module, optimizers: Sequence[torch.optim.Optimizer], dps: Sequence[int], *,
                         state_dtype: torch.dtype | None = None) -> None:
    """Step ``optimizers`` (over ``net``'s parameters) once per entry of ``dps``, on one device, in place.

    Step ``s`` sets every gradient to the mean of :func:`dyadic_consts` ``(net, s, r)`` over ranks ``r < dps[s]``
    (the data-parallel gradient), then steps each optimizer in turn. With ``state_dtype``, every non-scalar state
    tensor is widened to fp32 before each step and rounded to ``state_dtype`` after it, so the state is held in
    ``state_dtype`` between steps, computed in fp32 within them.
    """
    for step, dp in enumerate(dps):
        consts = [dyadic_consts(net, step, r) for r in range(dp)]
        for name, p in net.named_parameters():
            p.grad = sum(c[name] for c in consts) / dp
        for opt in optimizers:
            if state_dtype is not None:
                _round_state([opt], torch.float32)
            opt.step()
            if state_dtype is not None:
                _round_state([opt], state_dtype)


def const_grad_step(model: nn.Module, optimizer: Any, consts: Mapping[str, torch.Tensor]) -> None:
    """One training step of a (wrapped) :class:`ConstGradNet`: ``zero_grad``, ``model(consts).backward()``, ``step``."""
    optimizer.zero_grad()
    model(consts).backward()
    optimizer.step()


def split_matrices(net: nn.Module, names: Iterable[str]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The weights of the submodules ``names`` (a matrix optimizer's parameters) and every other parameter of
    ``net`` (the element-wise optimizer's), each in registration order."""
    mats = [getattr(net, n).weight for n in names]
    rest = [p for p in net.parameters() if all(p is not m for m in mats)]
    return mats, rest


def shard_weights(net: nn.Module, tp_mesh: Any, placement: Mapping[str, int]) -> None:
    """Replace the weight of each submodule ``name`` in ``placement`` by a DTensor on ``tp_mesh`` placed
    ``[Shard(placement[name])]`` (distributed from rank 0's values); other parameters stay plain tensors."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, dim in placement.items():
        lin = getattr(net, name)
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), tp_mesh, [Shard(dim)]))


def shard_consts(consts: Mapping[str, torch.Tensor], tp_mesh: Any,
                 placement: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """``consts`` with the constant of each weight sharded by :func:`shard_weights` placed as that weight
    (``[Shard(placement[name])]`` on ``tp_mesh``); every other constant unchanged."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    for fqn, c in consts.items():
        module = fqn.split(".")[0]
        shard = fqn.endswith("weight") and module in placement
        out[fqn] = distribute_tensor(c, tp_mesh, [Shard(placement[module])]) if shard else c
    return out
