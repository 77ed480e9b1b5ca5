"""Where a rank's local tensor data sits in the global tensor: a list of boxes, each with its local view.

A plain tensor is one box covering the whole tensor. A DTensor's local shard is found by sharding an index vector
per tensor dimension with the placements' own ``_split_tensor`` (the same rule DTensor uses to split data), in the
order DTensor applies them, so any shard-like placement that follows torch's protocol is understood: ``Shard``,
uneven shards, torch's private ``_StridedShard`` (FSDP2 + TP) and vescale's interleaved placements. A dimension
whose kept indices are not contiguous (strided, interleaved) yields several boxes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from vescale.checkpoint.errors import UnsupportedStateError
from vescale.core import torch_internals

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
    ragged = [(m, p) for m, p in enumerate(t.placements) if _is_ragged(p)]
    if ragged:
        return _ragged_pieces(t, key, ragged, coord)
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


def _is_ragged(placement) -> bool:
    # vescale.dtensor.RaggedShard (ZeRO flat shards), recognised by its documented interface so that this package
    # needs no import of vescale.dtensor.
    return hasattr(placement, "local_range") and hasattr(placement, "local_units") and hasattr(placement, "dims")


def _ragged_pieces(t, key: str, ragged: list, coord: list[int]) -> list[Piece]:
    """Boxes of a DTensor whose leading dims are flattened and split in contiguous, unequal row ranges."""
    if len(ragged) != 1 or any(not p.is_replicate() for m, p in enumerate(t.placements) if m != ragged[0][0]):
        raise UnsupportedStateError(f"DTensor {key!r}: placements {t.placements} have a RaggedShard with other "
                                    "non-Replicate placements, which vescale.checkpoint cannot map to boxes")
    mesh_dim, placement = ragged[0]
    shape = tuple(t.shape)
    k = len(placement.dims)
    start, end = placement.local_range(shape, coord[mesh_dim])
    rest = shape[k:]
    local = t.to_local().detach().reshape(end - start, *rest)
    return flat_range_pieces(local, start, end, shape[:k], rest)


def flat_range_pieces(local: torch.Tensor, start: int, end: int, lead: tuple[int, ...], rest: tuple[int, ...]
                      ) -> list[Piece]:
    """Boxes of the row-major range ``[start, end)`` of the flattened ``lead`` dims, with views into ``local``
    (which holds exactly those rows, shape ``(end - start, *rest)``); trailing ``rest`` dims are whole."""
    pieces = []
    for offsets, lengths, flat in _flat_boxes(start, end, lead):
        n = math.prod(lengths)
        view = local[flat - start: flat - start + n].reshape(*lengths, *rest)
        pieces.append(Piece(offsets + (0,) * len(rest), lengths + rest, view))
    return [p for p in pieces if p.numel > 0]


def _flat_boxes(s: int, e: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split the row-major element range ``[s, e)`` of ``shape`` into boxes: (offsets, lengths, flat start)."""
    if s >= e:
        return []
    if len(shape) == 1:
        return [((s,), (e - s,), s)]
    inner = math.prod(shape[1:])
    boxes = []
    row, last = s // inner, e // inner
    if s % inner:
        head_end = min(e, (row + 1) * inner)
        boxes += [((row, *o), (1, *n), f + row * inner)
                  for o, n, f in _flat_boxes(s - row * inner, head_end - row * inner, shape[1:])]
        row += 1
        if head_end == e:
            return boxes
    if last > row:
        boxes.append(((row,) + (0,) * (len(shape) - 1), (last - row, *shape[1:]), row * inner))
    if e % inner and last >= row:
        boxes += [((last, *o), (1, *n), f + last * inner) for o, n, f in _flat_boxes(0, e - last * inner, shape[1:])]
    return boxes
