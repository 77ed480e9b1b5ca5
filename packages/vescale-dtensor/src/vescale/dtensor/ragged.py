"""Operations on DTensors with a :class:`RaggedShard` placement (ZeRO flat buffers): gather, elementwise, norms.

torch's sharding propagation does not know ``RaggedShard``, so these helpers work on the local pieces directly.
Two ragged DTensors are compatible when they have the same mesh, placements and global shape.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale.core import torch_internals
from vescale.dtensor.errors import PlacementError
from vescale.dtensor.layout import local_slice
from vescale.dtensor.placements import RaggedShard

__all__ = ["ragged_full_tensor", "ragged_map", "ragged_norm", "ragged_total_norm"]


def _ragged_dim(dtensor: DTensor) -> tuple[int, RaggedShard]:
    for mesh_dim, p in enumerate(dtensor.placements):
        if isinstance(p, RaggedShard):
            return mesh_dim, p
    raise PlacementError(f"expected a DTensor with a RaggedShard placement, got {dtensor.placements}")


def ragged_full_tensor(dtensor: DTensor) -> torch.Tensor:
    """All-gather a ragged DTensor into the global tensor on every rank (one padded ``all_gather``).

    Differentiable: the backward of the gathered tensor's gradient is this rank's piece of it, placed like
    ``dtensor`` (no communication: every rank holds the whole gradient, as for torch's ``full_tensor``)."""
    _ragged_dim(dtensor)
    return _RaggedFullTensor.apply(dtensor)


class _RaggedFullTensor(torch.autograd.Function):
    """The gather of :func:`ragged_full_tensor` as an autograd function (torch's ``to_local`` backward rejects
    ``RaggedShard``, so the gradient is wrapped with the input's spec directly)."""

    @staticmethod
    def forward(ctx, dtensor: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = torch_internals.dtensor_spec(dtensor)
        return _gather(dtensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        spec = ctx.spec
        local = local_slice(grad, spec.mesh, spec.placements).contiguous()
        return DTensor(local, copy.copy(spec), requires_grad=False)


def _gather(dtensor: DTensor) -> torch.Tensor:
    mesh_dim, p = _ragged_dim(dtensor)
    mesh = dtensor.device_mesh
    shape = tuple(dtensor.shape)
    unit = p.unit_len(shape)
    inner = math.prod(shape[len(p.dims):])
    max_rows = max(p.local_units) * unit
    local = torch_internals.local_tensor(dtensor).detach().reshape(-1)
    padded = torch.zeros(max_rows * inner, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    out = torch.empty(mesh.size(mesh_dim) * padded.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(out, padded, group=mesh.get_group(mesh_dim))
    pieces = [out[r * padded.numel(): r * padded.numel() + n * unit * inner] for r, n in enumerate(p.local_units)]
    return torch.cat(pieces).view(shape)


def _check_same(ts: Sequence[DTensor]) -> None:
    first = ts[0]
    for t in ts[1:]:
        if (t.device_mesh, tuple(t.placements), t.shape) != (first.device_mesh, tuple(first.placements), first.shape):
            raise PlacementError(f"ragged op: operands differ: {first.placements} {tuple(first.shape)} vs "
                                 f"{t.placements} {tuple(t.shape)}")


def ragged_map(fn: Callable[..., torch.Tensor], *tensors: DTensor) -> DTensor:
    """Apply an elementwise ``fn`` to the local pieces of ragged DTensors with equal layouts; same layout out.

    ``fn`` must be elementwise (output element i depends only on input elements i) and shape preserving, which makes
    the result equal to ``fn`` on the global tensors. No communication.
    """
    _check_same(tensors)
    out = fn(*[t.to_local() for t in tensors])
    first = tensors[0]
    if out.shape != first.to_local().shape:
        raise PlacementError(f"ragged_map: fn changed the local shape {tuple(first.to_local().shape)} -> "
                             f"{tuple(out.shape)}; it must be elementwise")
    return DTensor.from_local(out, first.device_mesh, first.placements, shape=first.shape, stride=first.stride())


def _pow_sum(local: torch.Tensor, norm_type: float) -> torch.Tensor:
    x = local.detach().to(torch.float64 if local.dtype == torch.float64 else torch.float32).abs()
    if math.isinf(norm_type):
        return x.max() if x.numel() else torch.zeros((), dtype=x.dtype, device=x.device)
    return (x ** norm_type).sum()


def ragged_total_norm(tensors: Sequence[DTensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm over all elements of several ragged DTensors, as a plain scalar on every rank.

    One ``all_reduce`` over the ragged mesh dim (sum of ``|x|^p``, or max for ``inf``). Matches
    ``torch.linalg.vector_norm`` of the concatenated global tensors up to floating-point summation order. This is
    what gradient clipping of ZeRO shards needs.
    """
    if not tensors:
        return torch.zeros(())
    mesh_dim, _ = _ragged_dim(tensors[0])
    mesh = tensors[0].device_mesh
    parts = [_pow_sum(t.to_local(), norm_type) for t in tensors]
    acc = torch.stack(parts).max() if math.isinf(norm_type) else torch.stack(parts).sum()
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    dist.all_reduce(acc, op=op, group=mesh.get_group(mesh_dim))
    return acc if math.isinf(norm_type) else acc ** (1.0 / norm_type)


def ragged_norm(dtensor: DTensor, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` vector norm of one ragged DTensor (see :func:`ragged_total_norm`)."""
    return ragged_total_norm([dtensor], norm_type)
