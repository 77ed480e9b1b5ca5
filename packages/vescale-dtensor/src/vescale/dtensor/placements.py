"""vescale's extra placements: :class:`InterleavedShard` (fused weights) and :class:`RaggedShard` (flat ZeRO buffers).

Both are :class:`torch.distributed.tensor.placement_types.Placement` objects, so they sit in a DTensor's
``placements`` next to torch's ``Shard``/``Replicate``/``Partial``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement

# PyTorch's private ``_StridedShard`` computes exactly the interleaved layout (split the dim into ``split_factor``
# chunks, shard each chunk over the mesh dim).
from vescale.core.sharded_state import Box, flat_range_boxes
from vescale.core.torch_internals import StridedShard as _StridedShard
from vescale.core.torch_internals import split_factor as _split_factor
from vescale.dtensor.errors import PlacementError

__all__ = ["InterleavedShard", "RaggedShard", "is_interleaved", "interleaved_size", "as_interleaved"]


class InterleavedShard(_StridedShard):
    """Shard dim ``dim`` seen as ``interleaved_size`` equal chunks; rank ``r`` of the mesh dim holds piece ``r`` of
    every chunk, concatenated in chunk order.

    For a fused ``qkv`` weight of shape ``[3 * h, d]``, ``InterleavedShard(0, 3)`` on a tp mesh dim of size 2 gives
    rank 0 the rows ``[q0, k0, v0]`` and rank 1 ``[q1, k1, v1]`` - what column-parallel attention needs.
    The dim size must be divisible by ``interleaved_size``; each chunk is split like :class:`Shard` (so chunks that
    do not divide by the mesh size give uneven pieces).

    It *is* torch's ``_StridedShard(dim, split_factor=interleaved_size)``: torch's redistribution, ``full_tensor``
    and sharding propagation handle it, and equality with ``_StridedShard`` holds both ways. Placements that torch
    produces from ops are plain ``_StridedShard``; use :func:`is_interleaved` / :func:`as_interleaved` to read them.

    Limitation: a tensor dim may carry at most one ``InterleavedShard``, and no ``Shard`` of the same dim may follow it
    on a later mesh dim (torch cannot redistribute those layouts correctly); :func:`vescale.dtensor.distribute_tensor`
    and :func:`vescale.dtensor.from_local` raise :class:`PlacementError` for them.
    """

    def __init__(self, dim: int, interleaved_size: int) -> None:
        if not isinstance(interleaved_size, int) or interleaved_size < 1:
            raise PlacementError(f"InterleavedShard(dim={dim}): interleaved_size must be a positive int, "
                                 f"got {interleaved_size!r}")
        super().__init__(dim, split_factor=interleaved_size)

    @property
    def interleaved_size(self) -> int:
        """Number of equal chunks the sharded dim is seen as."""
        return _split_factor(self)

    def __repr__(self) -> str:
        return f"InterleavedShard(dim={self.dim}, interleaved_size={self.interleaved_size})"

    def __str__(self) -> str:
        return f"IS({self.dim}, {self.interleaved_size})"

    def __reduce__(self):
        return (InterleavedShard, (self.dim, self.interleaved_size))


def is_interleaved(placement: Placement) -> bool:
    """True for an :class:`InterleavedShard` or a torch ``_StridedShard`` (the same layout)."""
    return isinstance(placement, _StridedShard)


def interleaved_size(placement: Placement) -> int:
    """The ``interleaved_size`` of an interleaved placement (``split_factor`` of a ``_StridedShard``)."""
    if not is_interleaved(placement):
        raise PlacementError(f"{placement!r} is not an interleaved placement")
    return _split_factor(placement)


def as_interleaved(placement: Placement) -> Placement:
    """Return ``placement`` with any ``_StridedShard`` re-labelled as the equal :class:`InterleavedShard`."""
    if isinstance(placement, _StridedShard) and not isinstance(placement, InterleavedShard):
        return InterleavedShard(placement.dim, _split_factor(placement))
    return placement


class RaggedShard(Placement):
    """Contiguous, possibly unequal pieces of a flattened tensor, one per coordinate of the mesh dim.

    ``dims`` are the leading tensor dims that are flattened (``(0,)`` for a flat buffer, ``(0, 1)`` for a matrix
    flattened whole); their product of sizes is split into ``sum(local_units)`` equal units and coordinate ``r`` holds
    units ``sum(local_units[:r]) .. sum(local_units[:r + 1])``. The local tensor has shape
    ``(local_units[r] * unit_len, *shape[len(dims):])`` where ``unit_len = prod(shape[dims]) // sum(local_units)``.
    A unit count of 0 gives an empty local piece. This is the layout of a ZeRO flat optimizer shard.

    torch does not know this placement: use :func:`vescale.dtensor.redistribute` (to and from ``Replicate`` and
    ``Shard``), :func:`vescale.dtensor.full_tensor`, the elementwise and norm helpers of
    :mod:`vescale.dtensor.ragged`. Only one mesh dim may be ragged; the others must be ``Replicate``.
    """

    def __init__(self, dims: Sequence[int] | int, local_units: Sequence[int]) -> None:
        super().__init__()
        dims = (dims,) if isinstance(dims, int) else tuple(int(d) for d in dims)
        units = tuple(int(u) for u in local_units)
        if not dims or dims != tuple(range(len(dims))):
            raise PlacementError(f"RaggedShard: dims must be the leading dims (0, 1, ..., k-1), got {dims}")
        if not units or any(u < 0 for u in units) or sum(units) == 0:
            raise PlacementError(f"RaggedShard: local_units must be non-negative with a positive sum, got {units}")
        self.dims = dims
        self.local_units = units

    def unit_len(self, shape: Sequence[int]) -> int:
        """Length (in rows of the flattened ``dims``) of one unit for a tensor of global ``shape``."""
        if len(shape) < len(self.dims):
            raise PlacementError(f"{self!r} needs at least {len(self.dims)} dims, got shape {tuple(shape)}")
        rows = math.prod(shape[: len(self.dims)])
        total = sum(self.local_units)
        if rows % total:
            raise PlacementError(f"{self!r}: the flattened dims {self.dims} of shape {tuple(shape)} hold {rows} rows, "
                                 f"not divisible into {total} units")
        return rows // total

    def local_range(self, shape: Sequence[int], coordinate: int) -> tuple[int, int]:
        """``[start, end)`` rows of the flattened ``dims`` held at mesh-dim ``coordinate``."""
        unit = self.unit_len(shape)
        start = sum(self.local_units[:coordinate]) * unit
        return start, start + self.local_units[coordinate] * unit

    def local_shape(self, shape: Sequence[int], coordinate: int) -> tuple[int, ...]:
        """Shape of the local piece at mesh-dim ``coordinate`` for a tensor of global ``shape``."""
        start, end = self.local_range(shape, coordinate)
        return (end - start, *tuple(shape)[len(self.dims):])

    def local_boxes(self, global_shape: Sequence[int], coordinate: int, local) -> list[Box]:
        """The boxes of the global tensor that the local tensor ``local`` at ``coordinate`` holds, as
        :class:`vescale.core.sharded_state.Box` es whose ``data`` are views of ``local`` (the
        :class:`~vescale.core.sharded_state.BoxPlacement` protocol, through which a checkpoint reads and loads ragged
        DTensors): the row range of the flattened ``dims`` split into at most ``2 * len(dims) - 1`` boxes, the
        trailing dims whole. Empty boxes are left out."""
        shape = tuple(int(s) for s in global_shape)
        k = len(self.dims)
        start, end = self.local_range(shape, coordinate)
        rest = shape[k:]
        if tuple(local.shape) != (end - start, *rest):
            raise PlacementError(f"{self!r} at coordinate {coordinate} of global shape {shape}: local tensor of shape "
                                 f"{tuple(local.shape)}, expected {(end - start, *rest)}")
        boxes = []
        for offsets, lengths, flat in flat_range_boxes(start, end, shape[:k]):
            n = math.prod(lengths)
            data = local[flat - start:flat - start + n].view(*lengths, *rest)
            boxes.append(Box(offsets + (0,) * len(rest), lengths + rest, data))
        return [b for b in boxes if b.numel > 0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedShard) and (self.dims, self.local_units) == (other.dims, other.local_units)

    def __hash__(self) -> int:
        return hash(("RaggedShard", self.dims, self.local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS({self.dims}, {self.local_units})"

    def __reduce__(self):
        return (RaggedShard, (self.dims, self.local_units))
