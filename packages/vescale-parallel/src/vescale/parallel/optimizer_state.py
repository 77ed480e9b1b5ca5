""":class:`~vescale.parallel.DistributedOptimizer`'s state through the sharded-state protocol of
:mod:`vescale.core.sharded_state`, so that a checkpoint saves and loads it without knowing the class.

:func:`sharded_state_dict` lists, under the keys a ``torch.optim`` optimizer's state has in a checkpoint:

- ``state.<fqn>.<name>``: each per-parameter state tensor of this rank's flat piece ``[lo, hi)`` of the parameter's
  (TP-local) flattened tensor, as a :class:`~vescale.core.sharded_state.ShardedTensor` of the parameter's *global*
  shape: the piece split into boxes of the TP-local tensor (:func:`~vescale.core.sharded_state.flat_range_boxes`),
  placed where the TP-local tensor's data sits in the global one (its boxes there: one for ``Shard``, one per chunk
  for ``InterleavedShard``, so a box crossing chunks is cut). Scalar state (``step``) is a one-box 0-d sharded
  tensor, a replica on every rank holding a piece; other values are kept as values.
- ``master.<fqn>``: the fp32 master piece of a low-precision parameter, laid out the same way.
- ``param_groups.<fqn>``: that parameter's group hyper-parameters (a dict value), on every rank.

All tensors are marked ``updated_by_step``. The boxes' data are views of the optimizer's own state, so a load fills
them in place; :func:`load_sharded_state_dict` then applies the loaded hyper-parameters and scalar values.
Because the keys and boxes are those of the global parameters, a checkpoint of one dp size (or of a plain
optimizer) loads into any other.

Expert parallelism (DDP's ``data_dims=("ep",)``) needs nothing more: a piece is a range of what its rank's bucket
holds, whatever ranks the bucket is sharded over. A dense parameter (``Replicate`` on ep, its buckets sharded over
the flattened dp x ep ranks) is a flat range of the whole tensor on that dim; an expert parameter (``Shard(0)`` on
ep, its buckets sharded over dp) has the local tensor of its ep rank's experts, so the placement above (the DTensor's
local chunks, over every mesh dim of the parameter: ep and tp, interleaved or not) places the piece at its experts.
Such a checkpoint loads on another ep size, without tp and on one process
(``integration_tests/test_checkpoint_experts.py``, dp2 x ep2 and ep2 x tp2).

A plain parameter marked as a box of a global tensor (:func:`vescale.core.sharded_state.mark_piece` with
``global_shape`` and ``offsets``: an ep rank's ``[E / ep, ...]`` experts kept by
:func:`~vescale.parallel.keep_local_experts` in a pipeline stage) is placed the same way: its pieces' boxes are in
the global tensor's coordinates (shifted by the mark's offsets) and of its global shape, so the state loads into
DTensor experts, another pp x ep split or one process.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from vescale.core.sharded_state import Box, ShardedTensor, flat_range_boxes, init_optimizer_state, piece_of
from vescale.dtensor.layout import local_chunks
from vescale.parallel.errors import ZeroError

if TYPE_CHECKING:
    from vescale.parallel.optimizer import DistributedOptimizer, _Piece

__all__ = ["sharded_state_dict", "load_sharded_state_dict", "init_sharded_state"]


# parameter -> ((placements, shape), chunks): the layout of a parameter does not change between saves, and
# local_chunks walks every index of each dim in Python
_CHUNKS: WeakIdKeyDictionary = WeakIdKeyDictionary()

#: (global offset, local offset, size) of one box of a TP-local tensor in its global parameter
_LocalBox = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _global_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of the global tensor ``p`` is (part of): a DTensor's own, a placed plain piece's, else ``p``'s."""
    mark = piece_of(p) if not isinstance(p, DTensor) else None
    return mark.global_shape if mark is not None and mark.placed else tuple(p.shape)


def _tp_chunks(piece: _Piece) -> list[_LocalBox]:
    """The boxes of the global parameter its TP-local tensor holds, each with where it sits in the local tensor: one
    for a plain tensor (at its mark's offsets when it is a placed piece of a global tensor) or a ``Shard``, several
    for an interleaved placement (``InterleavedShard``: one per chunk)."""
    p, local_shape = piece.slot.param, tuple(piece.slot.local_shape)
    if not isinstance(p, DTensor):
        mark = piece_of(p)
        at = mark.offsets if mark is not None and mark.placed else (0,) * len(local_shape)
        return [(at, (0,) * len(local_shape), local_shape)]
    layout = (tuple(p.placements), tuple(p.shape))
    cached = _CHUNKS.get(p)
    if cached is not None and cached[0] == layout:
        return cached[1]
    chunks = [(tuple(c.global_offset), tuple(c.local_offset), tuple(c.size))
              for c in local_chunks(p.shape, p.device_mesh, p.placements)]
    if any(len(size) != len(local_shape) for _, _, size in chunks) or sum(
            math.prod(size) for _, _, size in chunks) != math.prod(local_shape):
        raise ZeroError(f"parameter {piece.fqn!r} (placements {p.placements}): its local boxes "
                        f"{[(g, s) for g, _, s in chunks]} do not tile its local shape {local_shape}; its ZeRO state "
                        "cannot be mapped to global boxes")
    _CHUNKS[p] = (layout, chunks)
    return chunks


def _flat_piece(piece: _Piece, tensor: torch.Tensor, name: str) -> ShardedTensor:
    """A 1-D tensor holding ``piece``'s ``[lo, hi)`` as boxes of the global parameter, views of ``tensor``: each box
    of the flat range in the TP-local tensor, cut where it crosses the local tensor's boxes of the global one."""
    p, local_shape = piece.slot.param, tuple(piece.slot.local_shape)
    chunks = _tp_chunks(piece)  # raises ZeroError on every rank alike (the layout is the same everywhere)
    boxes = []
    for offsets, lengths, flat in flat_range_boxes(piece.lo, piece.hi, local_shape):
        data = tensor[flat - piece.lo:flat - piece.lo + math.prod(lengths)].view(lengths)
        for global_offset, local_offset, size in chunks:
            start = [max(o, lo) for o, lo in zip(offsets, local_offset)]
            end = [min(o + n, lo + s) for o, n, lo, s in zip(offsets, lengths, local_offset, size)]
            if any(e <= s for s, e in zip(start, end)):
                continue
            boxes.append(Box(tuple(g + s - lo for g, s, lo in zip(global_offset, start, local_offset)),
                             tuple(e - s for s, e in zip(start, end)),
                             data[tuple(slice(s - o, e - o) for s, e, o in zip(start, end, offsets))]))
    return ShardedTensor(_global_shape(p), tensor.dtype, boxes, updated_by_step=True, name=name)


def _hparams(group: dict) -> dict[str, Any]:
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
            for k, v in group.items() if k != "params"}


def sharded_state_dict(opt: DistributedOptimizer) -> dict[str, Any]:
    """This rank's state of ``opt`` as a flat sharded state dict (see the module docstring)."""
    out: dict[str, Any] = {}
    for fqns, group in zip(opt._group_fqns, opt.optimizer.param_groups):
        for fqn in fqns:
            out[f"param_groups.{fqn}"] = _hparams(group)
    for piece in opt.pieces.values():
        if piece.hi == piece.lo:  # this rank holds nothing of the parameter
            continue
        for name, value in opt.optimizer.state.get(piece.master, {}).items():
            key = f"state.{piece.fqn}.{name}"
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.hi - piece.lo:
                out[key] = _flat_piece(piece, value, key)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                out[key] = ShardedTensor((), value.dtype, [Box((), (), value)], updated_by_step=True, name=key)
            elif isinstance(value, torch.Tensor):
                raise ZeroError(f"optimizer state {key} has shape {tuple(value.shape)}, neither the flat piece "
                                f"({piece.hi - piece.lo} elements) nor a scalar; it cannot be mapped to boxes")
            else:
                out[key] = value
        if not piece.aliased:
            out[f"master.{piece.fqn}"] = _flat_piece(piece, piece.master, f"master.{piece.fqn}")
    return out


@torch.no_grad()
def load_sharded_state_dict(opt: DistributedOptimizer, sd: dict[str, Any]) -> None:
    """Apply what a load of :func:`sharded_state_dict`'s dict filled but could not write in place: the group
    hyper-parameters and the non-tensor state values (tensors were filled in place)."""
    for fqns, group in zip(opt._group_fqns, opt.optimizer.param_groups):
        for fqn in fqns:
            for k, v in sd.get(f"param_groups.{fqn}", {}).items():
                if isinstance(group.get(k), torch.Tensor):
                    group[k].fill_(v)
                else:
                    group[k] = v
    for piece in opt.pieces.values():
        st = opt.optimizer.state.get(piece.master, {}) if piece.hi > piece.lo else {}
        for name in list(st):
            value = sd.get(f"state.{piece.fqn}.{name}", st[name])
            if not isinstance(value, (ShardedTensor, torch.Tensor)):
                st[name] = value


def init_sharded_state(opt: DistributedOptimizer) -> None:
    """Create the wrapped optimizer's lazily built state (no-op when it has some), without collectives."""
    if not opt.optimizer.state:
        init_optimizer_state(opt.optimizer)
