""":class:`~vescale.parallel.DistributedOptimizer`'s state through the sharded-state protocol of
:mod:`vescale.core.sharded_state`, so that a checkpoint saves and loads it without knowing the class.

:func:`sharded_state_dict` lists, under the keys a ``torch.optim`` optimizer's state has in a checkpoint:

- ``state.<fqn>.<name>``: each per-parameter state tensor of this rank's flat piece ``[lo, hi)`` of the parameter's
  (TP-local) flattened tensor, as a :class:`~vescale.core.sharded_state.ShardedTensor` of the parameter's *global*
  shape: the piece split into boxes of the TP-local tensor (:func:`~vescale.core.sharded_state.flat_range_boxes`),
  shifted by where that TP-local tensor sits in the global one. Scalar state (``step``) is a one-box 0-d sharded
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
ep, its buckets sharded over dp) has the local tensor of its ep rank's experts, so the shift above (the DTensor's
local chunk offset, over every mesh dim of the parameter: ep and tp) places the piece at its experts. Such a
checkpoint loads on another ep size and on one process (``integration_tests/test_checkpoint_experts.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from vescale.core.sharded_state import Box, ShardedTensor, flat_range_boxes, init_optimizer_state
from vescale.dtensor.layout import local_chunks
from vescale.parallel.errors import ZeroError

if TYPE_CHECKING:
    from vescale.parallel.optimizer import DistributedOptimizer, _Piece

__all__ = ["sharded_state_dict", "load_sharded_state_dict", "init_sharded_state"]


# parameter -> ((placements, shape), offsets): the layout of a parameter does not change between saves, and
# local_chunks walks every index of each dim in Python
_OFFSETS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _tp_offsets(piece: _Piece) -> tuple[int, ...]:
    """Where the parameter's TP-local tensor starts in the global parameter (it must be one box)."""
    p = piece.slot.param
    if not isinstance(p, DTensor):
        return (0,) * p.dim()
    layout = (tuple(p.placements), tuple(p.shape))
    cached = _OFFSETS.get(p)
    if cached is not None and cached[0] == layout:
        return cached[1]
    chunks = local_chunks(p.shape, p.device_mesh, p.placements)
    if len(chunks) != 1 or tuple(chunks[0].size) != tuple(piece.slot.local_shape):
        raise ZeroError(f"parameter {piece.fqn!r} (placements {p.placements}) is not one box of its global tensor "
                        f"holding local shape {tuple(piece.slot.local_shape)}; its ZeRO state cannot be mapped to "
                        "global boxes")
    offsets = tuple(chunks[0].global_offset)
    _OFFSETS[p] = (layout, offsets)
    return offsets


def _flat_piece(piece: _Piece, tensor: torch.Tensor, name: str) -> ShardedTensor:
    """A 1-D tensor holding ``piece``'s ``[lo, hi)`` as boxes of the global parameter, views of ``tensor``."""
    p, local_shape = piece.slot.param, tuple(piece.slot.local_shape)
    shift = _tp_offsets(piece)  # raises ZeroError on every rank alike (the layout is the same everywhere)
    boxes = []
    for offsets, lengths, flat in flat_range_boxes(piece.lo, piece.hi, local_shape):
        n = 1
        for x in lengths:
            n *= x
        data = tensor[flat - piece.lo:flat - piece.lo + n].view(lengths)
        boxes.append(Box(tuple(o + s for o, s in zip(offsets, shift)), lengths, data))
    return ShardedTensor(tuple(p.shape), tensor.dtype, boxes, updated_by_step=True, name=name)


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
