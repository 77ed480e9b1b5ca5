"""Gradient-norm clipping over any mix of plain tensors, DTensors, ZeRO shards and pipeline stages.

The norm is the one a single device computes over the whole model: every gradient element counts exactly once.

- A plain tensor's gradient is complete on this rank and identical on the ranks that replicate it (single device,
  plain DDP): it counts once, with no communication.
- A DTensor gradient is summed (``|g|^p``) over the mesh dims where it is ``Shard``; ``Replicate`` dims count once;
  ``Partial`` dims are reduced first.
- A plain tensor marked as a piece of a larger tensor (:func:`vescale.core.sharded_state.mark_piece` with
  ``groups``: a ZeRO shard, which :class:`~vescale.parallel.DistributedOptimizer` marks over dp and its parameter's
  TP dims; an ep rank's plain experts, which :func:`~vescale.parallel.keep_local_experts` marks over ep) is summed
  over those groups.
- ``pp_group``: each pipeline stage holds different parameters; their partial sums are added over that group.
- A parameter held by several pipeline stages (a tied embedding on the first and last stage) has, after the engine
  summed it over pp, the same gradient on each; it counts once: every holder but one is marked
  ``mark_piece(p, counts_in_norm=False)`` (``PipeEngine`` marks its ``tied_copies()``), which :func:`grad_norm`
  leaves out and :func:`clip_grad_norm_` still scales. A ZeRO piece of such a parameter is marked so too.

Collectives: one all-reduce per mesh dim involved (in name order, so every rank agrees), plus one over
``pp_group``. Every rank of a group must pass the same kinds of parameters (as in torch DDP).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from vescale.core.sharded_state import mark_piece, piece_of
from vescale.core.torch_internals import local_tensor

__all__ = ["clip_grad_norm_", "grad_norm", "is_tied_copy", "mark_sharded", "mark_tied_copy"]

#: names kept for one release, each a wrapper over vescale.core.sharded_state that warns (DeprecationWarning)
DEPRECATED = ("is_tied_copy", "mark_sharded", "mark_tied_copy")


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"vescale.parallel.clip_grad.{old} is deprecated and will be removed in the next release; use "
                  f"vescale.core.sharded_state.{new}", DeprecationWarning, stacklevel=3)


def mark_tied_copy(tensor: torch.Tensor) -> torch.Tensor:
    """Deprecated: ``vescale.core.sharded_state.mark_piece(tensor, counts_in_norm=False)``, which this calls (with a
    ``DeprecationWarning``). Returns ``tensor``."""
    _deprecated("mark_tied_copy(t)", "mark_piece(t, counts_in_norm=False)")
    return mark_piece(tensor, counts_in_norm=False)


def is_tied_copy(tensor: torch.Tensor) -> bool:
    """Deprecated: whether ``vescale.core.sharded_state.piece_of(tensor)`` says ``counts_in_norm=False`` (with a
    ``DeprecationWarning``)."""
    _deprecated("is_tied_copy(t)", "piece_of(t).counts_in_norm")
    return not _counts_in_norm(tensor)


def mark_sharded(tensor: torch.Tensor, groups: Mapping[str, dist.ProcessGroup]) -> torch.Tensor:
    """Deprecated: ``vescale.core.sharded_state.mark_piece(tensor, groups=groups)``, which this calls (with a
    ``DeprecationWarning``). Returns ``tensor``."""
    _deprecated("mark_sharded(t, groups)", "mark_piece(t, groups=groups)")
    return mark_piece(tensor, groups=groups)


def _counts_in_norm(t: torch.Tensor) -> bool:
    piece = piece_of(t)
    return piece is None or piece.counts_in_norm


def _dtensor_groups(t: DTensor) -> tuple[tuple[str, dist.ProcessGroup], ...]:
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(f"mesh{tuple(mesh.shape)}.dim{i}" for i in range(mesh.ndim))
    # Anything that is neither Replicate nor Partial splits the tensor (Shard, _StridedShard from FSDP2 over TP,
    # ragged shards); some of those answer False to is_shard().
    return tuple(sorted((names[i], mesh.get_group(i)) for i, pl in enumerate(t.placements)
                        if not pl.is_replicate() and not pl.is_partial()))


def _grad_piece(p: torch.Tensor) -> tuple[torch.Tensor | None, tuple]:
    """(local gradient tensor, ((dim name, group), ...) to sum over) for a parameter or shard ``p``."""
    g = p.grad
    if g is None:
        return None, ()
    if isinstance(g, DTensor):
        if any(isinstance(pl, Partial) for pl in g.placements):
            g = g.redistribute(g.device_mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
        return local_tensor(g), _dtensor_groups(g)
    piece = piece_of(p)
    return g, piece.groups if piece is not None else ()


def grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0, *,
              pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients of ``parameters`` as one device would compute it (a 0-d fp32 tensor).

    Partial results are keyed by the names of the mesh dims they must be summed over, so that the ranks of a group
    agree on what each entry of the all-reduced vector means whatever their coordinates. Tensors marked
    ``mark_piece(t, counts_in_norm=False)`` are left out (another pipeline stage counts their gradient).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    parts: dict[tuple[str, ...], list[torch.Tensor]] = {}
    by_name: dict[str, dist.ProcessGroup] = {}
    device = param_device = None
    for p in parameters:
        param_device = param_device or p.device
        if not _counts_in_norm(p):
            continue
        g, groups = _grad_piece(p)
        if g is None:
            continue
        device = g.device
        names = []
        for name, group in groups:
            if dist.get_world_size(group) == 1:
                continue
            seen = by_name.setdefault(name, group)
            if seen is not group and _ranks(seen) != _ranks(group):
                raise ValueError(f"mesh dim name {name!r} stands for two process groups on this rank "
                                 f"(ranks {_ranks(seen)} and {_ranks(group)}); name the dims apart")
            names.append(name)
        g = g.detach().float()
        if g.numel() == 0:
            val = torch.zeros((), device=g.device)
        elif inf:
            val = g.abs().max()
        else:
            val = torch.linalg.vector_norm(g, norm_type) ** norm_type
        parts.setdefault(tuple(sorted(names)), []).append(val)
    # a rank holding no gradient (a pipeline stage whose parameters got none) still joins the collectives below, on
    # the device its backend needs (NCCL refuses CPU tensors)
    device = device or param_device or _group_device(pp_group)
    keys = sorted(parts)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    if keys:
        vec = torch.stack([torch.stack(parts[k]).max() if inf else torch.stack(parts[k]).sum() for k in keys])
        for name in sorted(by_name):
            mask = torch.tensor([name in k for k in keys], device=device)
            reduced = torch.where(mask, vec, torch.zeros_like(vec))
            dist.all_reduce(reduced, op=op, group=by_name[name])
            vec = torch.where(mask, reduced, vec)
        total = vec.max() if inf else vec.sum()
    else:
        total = torch.zeros((), device=device)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, op=op, group=pp_group)
    return total if inf else total ** (1.0 / norm_type)


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device of tensors a collective on ``group`` takes: the current CUDA device for NCCL, else the CPU."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0, *,
                    pp_group: dist.ProcessGroup | None = None, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the global norm before clipping.

    Same arithmetic as :func:`torch.nn.utils.clip_grad_norm_` (coefficient ``max_norm / (norm + 1e-6)`` clamped to
    1), with the norm computed by :func:`grad_norm` over every mesh involved. Raises ``RuntimeError`` for a
    non-finite norm when ``error_if_nonfinite``.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(params, norm_type, pp_group=pp_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()})")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        g, _ = _grad_piece(p) if not isinstance(p.grad, DTensor) else (local_tensor(p.grad), ())
        if g is not None:
            g.mul_(coef.to(g.dtype))
    return total
