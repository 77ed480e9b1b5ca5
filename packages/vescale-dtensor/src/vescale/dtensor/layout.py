"""Where a rank's local elements sit in the global tensor, for every placement vescale knows, without communication.

Used by the RNG (global element indices), deferred materialisation (local slices) and placement validation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from vescale.core import torch_internals
from vescale.core.torch_internals import StridedShard as _StridedShard
from vescale.dtensor.errors import PlacementError
from vescale.dtensor.placements import RaggedShard

__all__ = ["validate_placements", "local_dim_indices", "global_flat_index", "local_shape", "local_slice", "Chunk",
           "local_chunks", "contiguous_stride", "smallest_shard", "relaid_as_declared"]


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The stride of a contiguous tensor of ``shape``, by torch's rule (a size-0 or size-1 dim counts as 1)."""
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def relaid_as_declared(x):
    """``x`` (a DTensor) with its local tensor laid out in memory in the order its declared (global) strides give:
    ``x`` itself when they agree, else a DTensor over a re-laid copy (same values; differentiable).

    DTensor derives an output's strides from the op's meta kernel, which for some kernels disagrees with what the
    kernel returns (CPU attention of a transposed query; an elementwise backward of a transposed gradient). The
    DTensor then declares one memory order and holds another, and a local ``view`` that its declared strides allow
    fails. Anything that is not a DTensor is returned as it is.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return x
    local = x.to_local()
    order = sorted(range(x.ndim), key=lambda d: (-x.stride(d), d))  # outermost first, as declared
    if [local.stride(d) for d in order] == sorted((local.stride(d) for d in order), reverse=True):
        return x
    inverse = sorted(range(x.ndim), key=order.__getitem__)
    relaid = local.permute(order).contiguous().permute(inverse)
    return DTensor.from_local(relaid, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def smallest_shard(size: int, parts: int) -> int:
    """The size of the smallest piece ``Shard`` gives when a dim of ``size`` is split into ``parts`` (torch's chunk
    rule: pieces of ``ceil(size / parts)``, the last ones short or empty; 6 over 4 is 2, 2, 2, 0)."""
    return max(0, size - -(-size // parts) * (parts - 1))


def validate_placements(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                        what: str = "tensor") -> tuple[Placement, ...]:
    """Check ``placements`` against ``shape`` and ``mesh``; return them with negative shard dims normalised.

    Raises :class:`PlacementError` naming ``what``, the shape, the placement and the mesh dim: wrong count, a dim out
    of range, an interleaved dim not divisible by its ``interleaved_size``, an ``InterleavedShard`` followed by another
    shard of the same dim, or a ``RaggedShard`` combined with any non-``Replicate`` placement. Pure local check: every
    rank raises the same error before any collective.
    """
    shape = tuple(shape)
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise PlacementError(f"{what} of shape {shape}: {len(placements)} placements {placements} for a "
                             f"{mesh.ndim}-d mesh {tuple(mesh.shape)} (mesh_dim_names={mesh.mesh_dim_names})")
    out: list[Placement] = []
    interleaved_dims: dict[int, int] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            dim = p.dim + len(shape) if p.dim < 0 else p.dim
            if not 0 <= dim < len(shape):
                raise PlacementError(f"{what} of shape {shape}: {p!r} on mesh dim {mesh_dim} names tensor dim "
                                     f"{p.dim}, out of range")
            if dim in interleaved_dims:
                raise PlacementError(f"{what} of shape {shape}: {p!r} on mesh dim {mesh_dim} shards dim {dim} after "
                                     f"an InterleavedShard on mesh dim {interleaved_dims[dim]}; unsupported")
            if isinstance(p, _StridedShard):
                from vescale.dtensor.placements import InterleavedShard

                size = torch_internals.split_factor(p)
                if shape[dim] % size:
                    raise PlacementError(f"{what} of shape {shape}: dim {dim} of size {shape[dim]} is not divisible "
                                         f"by interleaved_size {size} ({p!r} on mesh dim {mesh_dim})")
                interleaved_dims[dim] = mesh_dim
                p = InterleavedShard(dim, size) if dim != p.dim or isinstance(p, InterleavedShard) else p
            elif dim != p.dim:
                p = Shard(dim)
        elif isinstance(p, RaggedShard):
            p.unit_len(shape)  # raises on indivisible
            if len(p.local_units) != mesh.size(mesh_dim):
                raise PlacementError(f"{what} of shape {shape}: {p!r} on mesh dim {mesh_dim} has "
                                     f"{len(p.local_units)} local_units for a mesh dim of size {mesh.size(mesh_dim)}")
            others = [q for i, q in enumerate(placements) if i != mesh_dim and not isinstance(q, Replicate)]
            if others:
                raise PlacementError(f"{what} of shape {shape}: {p!r} on mesh dim {mesh_dim} can only be combined "
                                     f"with Replicate, got {placements}")
        elif not isinstance(p, (Replicate, Partial)):
            raise PlacementError(f"{what}: unknown placement {p!r} on mesh dim {mesh_dim}")
        out.append(p)
    return tuple(out)


def _coordinate(mesh: DeviceMesh) -> list[int]:
    coord = mesh.get_coordinate()
    if coord is None:
        raise PlacementError(f"this rank is not part of mesh {mesh}")
    return list(coord)


def local_dim_indices(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                      coordinate: Sequence[int] | None = None) -> list[torch.Tensor]:
    """For each tensor dim, the global indices (int64, 1-D) this rank holds along it.

    Valid for ``Shard``/``InterleavedShard``/``Replicate``/``Partial`` placements (the local tensor is then the
    outer product of these index sets). Applies the mesh dims left to right, exactly as torch shards.
    """
    coord = list(coordinate) if coordinate is not None else _coordinate(mesh)
    idx = [torch.arange(n, dtype=torch.int64) for n in shape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            dim = p.dim
            as_dim0 = (_StridedShard(0, split_factor=torch_internals.split_factor(p)) if isinstance(p, _StridedShard)
                       else Shard(0))
            pieces, _ = torch_internals.split_tensor(as_dim0, idx[dim], mesh.size(mesh_dim), with_padding=False,
                                                     contiguous=True)
            idx[dim] = pieces[coord[mesh_dim]] if coord[mesh_dim] < len(pieces) else idx[dim][:0]
        elif isinstance(p, RaggedShard):
            raise PlacementError("local_dim_indices: RaggedShard has no per-dim index sets; use global_flat_index")
    return idx


def local_shape(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
    """Shape of the local tensor this rank (or ``coordinate``) holds for a global ``shape``."""
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            coord = list(coordinate) if coordinate is not None else _coordinate(mesh)
            return p.local_shape(shape, coord[mesh_dim])
    return tuple(len(i) for i in local_dim_indices(shape, mesh, placements, coordinate))


def global_flat_index(shape: Sequence[int], mesh: DeviceMesh | None = None,
                      placements: Sequence[Placement] | None = None) -> torch.Tensor:
    """Row-major global index (int64) of each local element, shaped like the local tensor. No communication.

    With no mesh, the index of every element of a plain tensor of ``shape`` (``arange(numel).view(shape)``).
    Memory is proportional to the local shard, never to the global tensor.
    """
    shape = tuple(int(s) for s in shape)
    if mesh is None:
        return torch.arange(math.prod(shape), dtype=torch.int64).view(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            k = len(p.dims)
            start, end = p.local_range(shape, _coordinate(mesh)[mesh_dim])
            inner = math.prod(shape[k:])
            flat = torch.arange(start * inner, end * inner, dtype=torch.int64)
            return flat.view((end - start, *shape[k:]))
    idx = local_dim_indices(shape, mesh, placements)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out = torch.zeros((), dtype=torch.int64)
    for d, (ix, st) in enumerate(zip(idx, strides)):
        view = [1] * len(shape)
        view[d] = len(ix)
        out = out + (ix * st).view(view)
    return out.expand(tuple(len(i) for i in idx)).contiguous() if shape else out


def local_slice(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """The local piece of a global tensor ``full`` for this rank (a copy; no communication)."""
    for p in placements:
        if isinstance(p, RaggedShard):
            return full.reshape(-1)[global_flat_index(full.shape, mesh, placements).reshape(-1)].view(
                local_shape(full.shape, mesh, placements))
    out = full
    for d, ix in enumerate(local_dim_indices(full.shape, mesh, placements)):
        if len(ix) != full.shape[d]:
            out = out.index_select(d, ix)
    return out.clone() if out is full else out


class Chunk(NamedTuple):
    """One contiguous box of a rank's local tensor: ``size`` elements per dim starting at ``global_offset`` in the
    global tensor and at ``local_offset`` in the local tensor. For ``RaggedShard`` the offsets refer to the tensor
    viewed as ``(prod(shape[:k]), *shape[k:])`` (its ``dims`` flattened)."""

    global_offset: tuple[int, ...]
    local_offset: tuple[int, ...]
    size: tuple[int, ...]


def _runs(ix: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values in a 1-d index array: (global start, local start, length)."""
    vals = ix.tolist()
    runs: list[tuple[int, int, int]] = []
    for pos, v in enumerate(vals):
        if runs and runs[-1][0] + runs[-1][2] == v:
            g, loc, n = runs[-1]
            runs[-1] = (g, loc, n + 1)
        else:
            runs.append((v, pos, 1))
    return runs


def local_chunks(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                 coordinate: Sequence[int] | None = None) -> list[Chunk]:
    """The boxes that make up this rank's (or ``coordinate``'s) local tensor: what a checkpoint needs to reshard
    any placement, including ``InterleavedShard`` (one box per interleaved chunk) and uneven ``Shard``.

    Together the boxes cover the local tensor exactly once. Empty local tensors give no boxes.
    """
    shape = tuple(int(s) for s in shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            coord = list(coordinate) if coordinate is not None else _coordinate(mesh)
            k = len(p.dims)
            start, end = p.local_range(shape, coord[mesh_dim])
            rest = shape[k:]
            if end == start:
                return []
            return [Chunk((start, *(0,) * len(rest)), (0, *(0,) * len(rest)), (end - start, *rest))]
    idx = local_dim_indices(shape, mesh, placements, coordinate)
    if any(len(i) == 0 for i in idx):
        return []
    per_dim = [_runs(i) for i in idx]
    return [Chunk(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
            for combo in itertools.product(*per_dim)]
