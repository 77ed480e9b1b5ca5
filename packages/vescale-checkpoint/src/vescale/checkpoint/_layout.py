"""Where a rank's local tensor data sits in the global tensor: a list of boxes, each with its local view.

A plain tensor is one box covering the whole tensor. A DTensor's local shard is found by sharding an index vector
per tensor dimension with the placements' own ``_split_tensor`` (the same rule DTensor uses to split data), in the
order DTensor applies them, so any shard-like placement that follows torch's protocol is understood: ``Shard``,
uneven shards, torch's private ``_StridedShard`` (FSDP2 + TP) and vescale's interleaved placements. A dimension
whose kept indices are not contiguous (strided, interleaved) yields several boxes. A placement torch cannot split
(vescale's ragged ZeRO shards, or a user's own) names its boxes itself through the
:class:`vescale.core.sharded_state.BoxPlacement` protocol (``local_boxes``); this module knows no placement class.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from vescale.checkpoint.errors import UnsupportedStateError
from vescale.core import torch_internals
from vescale.core.errors import VescaleError
from vescale.core.sharded_state import is_box_placement

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


@dataclass
class Piece:
    """One box of the global tensor this rank holds, and the local tensor region holding it (shape == lengths)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    view: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


def is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _shard_like(placement) -> bool:
    # torch's private _StridedShard is not a Shard subclass
    return placement.is_shard() or isinstance(placement, torch_internals.StridedShard)


def _sharding_steps(t) -> list[tuple[int, object]]:
    """(mesh dim, placement) pairs in the order DTensor applies the shardings."""
    spec = torch_internals.dtensor_spec(t)  # shard_order has no public accessor
    placements = t.placements
    order = getattr(spec, "shard_order", None)
    if order and not getattr(spec, "use_strided_shard_as_shard_order", False):
        return [(m, placements[m]) for entry in order for m in entry.mesh_dims]
    return [(m, p) for m, p in enumerate(placements) if _shard_like(p)]


def local_pieces(t: torch.Tensor, key: str) -> list[Piece]:
    """The boxes of the global tensor this rank holds for ``t`` (empty when this rank is outside a DTensor's mesh)."""
    if not is_dtensor(t):
        return [Piece(tuple(0 for _ in t.shape), tuple(t.shape), t)]
    if any(p.is_partial() for p in t.placements):
        raise UnsupportedStateError(f"DTensor {key!r} has Partial placements {t.placements}: reduce it before "
                                    "saving or loading into it")
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return []
    shape = tuple(t.shape)
    local = t.to_local().detach()
    boxed = [(m, p) for m, p in enumerate(t.placements) if is_box_placement(p)]
    if boxed:
        return _boxed_pieces(t, key, boxed, coord, local)
    steps = _sharding_steps(t)
    cache_key = (shape, tuple(mesh.shape), tuple(coord), tuple((m, repr(p)) for m, p in steps))
    runs_per_dim = _RUNS.get(cache_key)
    if runs_per_dim is None:
        runs_per_dim = _local_runs(t, shape, steps, coord)
        if len(_RUNS) > 100_000:
            _RUNS.clear()
        _RUNS[cache_key] = runs_per_dim
    expect = tuple(sum(r[1] for r in runs) for runs in runs_per_dim)
    if expect != tuple(local.shape):
        raise UnsupportedStateError(f"DTensor {key!r}: local shape {tuple(local.shape)} does not match {expect} "
                                    f"derived from placements {t.placements} on mesh {tuple(mesh.shape)} for "
                                    f"global shape {shape}")
    pieces = []
    for combo in itertools.product(*runs_per_dim):
        offsets = tuple(r[0] for r in combo)
        lengths = tuple(r[1] for r in combo)
        view = local[tuple(slice(r[2], r[2] + r[1]) for r in combo)]
        pieces.append(Piece(offsets, lengths, view))
    return [p for p in pieces if p.numel > 0]


# Layouts repeat (every layer's weight has the same shape and placements): their runs are computed once.
_RUNS: dict[tuple, list[list[tuple[int, int, int]]]] = {}


def _local_runs(t, shape: tuple[int, ...], steps: list, coord: list[int]) -> list[list[tuple[int, int, int]]]:
    """Per tensor dim, the runs (global start, length, local start) of indices this rank holds."""
    mesh = t.device_mesh
    index: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in steps:
        dim = placement.dim % len(shape)
        current = index.get(dim, torch.arange(shape[dim]))
        probe = current.reshape([1] * dim + [-1] + [1] * (len(shape) - dim - 1))
        chunks, _ = torch_internals.split_tensor(placement, probe, mesh.size(mesh_dim), with_padding=False)
        mine = chunks[coord[mesh_dim]] if coord[mesh_dim] < len(chunks) else current[:0]
        index[dim] = mine.reshape(-1)
    runs_per_dim = []
    for d in range(len(shape)):
        if d not in index:
            runs_per_dim.append([(0, shape[d], 0)])
        else:
            runs_per_dim.append(_runs(index[d].numpy()) if index[d].numel() else [])
    return runs_per_dim


def _runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: (global start, length, local start)."""
    if idx.size == 0:
        return [(0, 0, 0)]
    breaks = np.nonzero(np.diff(idx) != 1)[0] + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [idx.size]))
    return [(int(idx[s]), int(e - s), int(s)) for s, e in zip(starts, ends)]


def intersect(a: Box, b: Box) -> Box | None:
    """The box common to ``a`` and ``b``, or None when they do not overlap (0-d boxes always overlap)."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def relative(box: Box, within: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices selecting ``box`` inside a tensor that holds the box starting at ``within``."""
    return tuple(slice(o - w, o - w + n) for o, n, w in zip(box[0], box[1], within))


def _boxed_pieces(t, key: str, boxed: list, coord: list[int], local: torch.Tensor) -> list[Piece]:
    """Boxes of a DTensor whose one non-Replicate placement names them
    (:class:`vescale.core.sharded_state.BoxPlacement`)."""
    if len(boxed) != 1 or any(not p.is_replicate() for m, p in enumerate(t.placements) if m != boxed[0][0]):
        raise UnsupportedStateError(f"DTensor {key!r}: placements {t.placements} combine a placement that names its "
                                    "own boxes with other non-Replicate placements, which vescale.checkpoint cannot "
                                    "map to boxes")
    mesh_dim, placement = boxed[0]
    shape = tuple(t.shape)
    try:
        boxes = placement.local_boxes(shape, coord[mesh_dim], local)
    except VescaleError as e:
        raise UnsupportedStateError(f"DTensor {key!r}: {e}") from e
    pieces = []
    for b in boxes:
        if len(b.offsets) != len(shape) or tuple(b.data.shape) != tuple(b.lengths) or any(
                o < 0 or o + n > s for o, n, s in zip(b.offsets, b.lengths, shape)):
            raise UnsupportedStateError(f"DTensor {key!r}: {placement!r} names a box (offsets {b.offsets}, lengths "
                                        f"{b.lengths}, data of shape {tuple(b.data.shape)}) that does not fit "
                                        f"global shape {shape}")
        pieces.append(Piece(tuple(b.offsets), tuple(b.lengths), b.data))
    return [p for p in pieces if p.numel > 0]
