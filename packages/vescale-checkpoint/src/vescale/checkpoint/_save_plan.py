"""Who writes which box of a checkpoint: the write plan every rank computes identically from what all ranks hold.

Every rank describes the boxes it holds (:func:`describe`); identical boxes held by several ranks (replicas) are
written once, by the holder with the fewest bytes assigned so far, largest boxes first, so writing is spread evenly
(:func:`assign_writers`). ``save`` caches the resulting :class:`WritePlan` and reuses it while the state keeps the same
structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vescale.checkpoint._layout import Piece, local_pieces
from vescale.checkpoint._state import Flat
from vescale.checkpoint.errors import CheckpointError
from vescale.checkpoint.format import dtype_from_name, dtype_name

__all__ = ["WritePlan", "describe", "assign_writers", "numel"]


@dataclass
class WritePlan:
    """The cached outcome of planning: the state's ``signature`` it holds for, the boxes this rank writes, the
    global tensor table, and the host buffer an async save stages into (reused while the plan holds)."""

    signature: str
    mine: list[tuple[str, tuple[int, ...]]]   # (key, offsets) this rank writes, in file order
    tensors: dict[str, dict[str, Any]]          # key -> {"dtype", "shape"}
    staging: torch.Tensor | None = None


def describe(flat: Flat, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, list[Piece]],
                                                                     dict[str, torch.dtype]]:
    """Per key: [dtype name, global shape, boxes held here] (what ranks exchange), the local pieces, the dtypes."""
    desc, pieces, dtypes = {}, {}, {}
    entries = [(k, list(t.shape), t.dtype, local_pieces(t, k)) for k, t in tensors.items()]
    entries += [(k, shape, dtype, ps) for k, (shape, dtype, ps) in flat.boxes.items()]
    for key, shape, dtype, ps in entries:
        pieces[key] = ps
        dtypes[key] = dtype
        desc[key] = [dtype_name(dtype, key), shape, [[list(p.offsets), list(p.lengths)] for p in ps]]
    return desc, pieces, dtypes


def assign_writers(descs: list[dict[str, Any]], rank: int) -> tuple[list, dict]:
    """The (key, offsets) boxes ``rank`` writes and the global tensor table; identical on every rank."""
    tensors: dict[str, dict[str, Any]] = {}
    holders: dict[tuple[str, tuple, tuple], list[int]] = {}
    problems = []
    for r, desc in enumerate(descs):
        for key, (dt, shape, boxes) in desc.items():
            info = tensors.setdefault(key, {"dtype": dt, "shape": shape})
            if (info["dtype"], info["shape"]) != (dt, shape):
                problems.append(f"{key}: rank {r} has {dt}{shape}, another rank {info['dtype']}{info['shape']}")
            for offs, lens in boxes:
                holders.setdefault((key, tuple(offs), tuple(lens)), []).append(r)
    if problems:
        raise CheckpointError("ranks disagree on the global dtype/shape of saved tensors:\n  " + "\n  ".join(problems))
    covered: dict[str, int] = {}
    for key, _, lens in holders:
        n = 1
        for x in lens:
            n *= x
        covered[key] = covered.get(key, 0) + n
    for key, info in tensors.items():
        total = 1
        for x in info["shape"]:
            total *= x
        if covered.get(key, 0) != total and total:
            raise CheckpointError(f"tensor {key!r} of shape {info['shape']}: the ranks' shards cover "
                                  f"{covered.get(key, 0)} of {total} elements (overlapping or missing shards)")
    load = [0] * len(descs)
    mine = []
    itemsize = {k: torch.empty(0, dtype=dtype_from_name(v["dtype"])).element_size() for k, v in tensors.items()}
    order = sorted(holders, key=lambda b: (-numel(b[2]) * itemsize[b[0]], b[0], b[1]))
    for box in order:
        writer = min(holders[box], key=lambda r: (load[r], r))
        load[writer] += numel(box[2]) * itemsize[box[0]]
        if writer == rank:
            mine.append((box[0], box[1]))
    return mine, tensors


def numel(lengths: tuple[int, ...]) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n

