"""The protocol of sharded state: what an object whose state is split across ranks shows a consumer (a checkpoint).

A consumer that knows only this module can save and load any sharded object without knowing its class: vescale's
ZeRO ``DistributedOptimizer``, a DTensor with vescale's ``RaggedShard`` placement, or a user's own object.

- :class:`ShardedTensor`: one logical tensor split across ranks, seen from one rank: its global shape and dtype, and
  the :class:`Box` es of it this rank holds. Each box is ``offsets`` / ``lengths`` in the global tensor and ``data``,
  a tensor of shape ``lengths`` and that dtype. *Reading* the state reads ``data``; *loading* copies into ``data`` in
  place (so ``data`` is normally a view of the holder's own storage). Boxes of one rank do not overlap; boxes held
  by several ranks with the same offsets and lengths are replicas (a consumer writes one of them); together the
  ranks' boxes cover the global tensor.
- :class:`ShardedStateful`: an object with ``sharded_state_dict()`` and ``load_sharded_state_dict(state)``. The dict
  is flat: each key (dots allowed, ``"state.0.weight.exp_avg"``) names one entry, a :class:`ShardedTensor`, a plain
  tensor (this rank holds the whole tensor, as a replica) or a JSON-able value (a dict or list is one value). To
  load, the consumer fills every box's ``data`` (and every plain tensor) in place, assigns each loaded value into
  the same dict (a dict or list value is updated in place), then calls ``load_sharded_state_dict`` with that dict:
  the object applies what is not a view of its storage (hyper-parameters, scalars, copies it handed out). Every
  rank lists the keys it holds; a key may be missing on ranks that hold nothing of it. An object may also define
  ``init_sharded_state()``: create lazily built state (a fresh optimizer's) if there is none yet, else do nothing,
  without collectives; a consumer calls it before a load when the checkpoint holds state (keys under ``state.``)
  for the object.
- :class:`BoxPlacement`: a DTensor placement that torch cannot split with its own ``_split_tensor`` rule (a ragged
  flat shard) says which boxes a rank's local tensor holds: ``local_boxes(global_shape, coordinate, local)``. It
  must be the only placement of its DTensor that is not ``Replicate``.

:func:`flat_range_boxes` maps a contiguous range of a flattened tensor (a ZeRO shard) to boxes, and
:func:`init_optimizer_state` builds a ``torch.optim`` optimizer's lazy state, for implementers and consumers.

A plain tensor that is a piece of a global tensor says so once, with :func:`mark_piece` (read back with
:func:`piece_of`, a :class:`GlobalPiece`): which box of which global tensor it is, over which mesh dims the global
tensor is split, and whether it counts in norms (a tied copy another holder counts does not). Gradient norms, DDP,
ZeRO and checkpoints read that one annotation.

``import vescale.core.sharded_state`` does not import torch; ``data`` is any ``torch.Tensor``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vescale.core.errors import VescaleError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Box",
    "ShardedTensor",
    "ShardedStateful",
    "BoxPlacement",
    "ShardedStateError",
    "flat_range_boxes",
    "is_sharded_stateful",
    "is_box_placement",
    "init_optimizer_state",
    "GlobalPiece",
    "mark_piece",
    "piece_of",
]


class ShardedStateError(VescaleError, ValueError):
    """A :class:`ShardedTensor` or :class:`Box` is inconsistent (a box outside the global shape, data of the wrong
    shape or dtype)."""


@dataclass
class Box:
    """One box of a global tensor held on this rank: ``offsets`` and ``lengths`` per global dim, and ``data``, a
    tensor of shape ``lengths`` holding that box (read to save, copied into to load)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    data: Any  # torch.Tensor

    def __post_init__(self) -> None:
        self.offsets = tuple(int(o) for o in self.offsets)
        self.lengths = tuple(int(n) for n in self.lengths)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


@dataclass
class ShardedTensor:
    """One logical tensor of ``global_shape`` and ``dtype``, of which this rank holds ``boxes`` (possibly none).

    ``updated_by_step``: only an optimizer step changes the boxes' data in place (optimizer state, masters), so an
    asynchronous save may copy them after it returns, until the next ``optimizer.step()``; leave it False for data
    that may change at any time. Construction checks every box (inside the shape, ``data`` of shape ``lengths`` and
    dtype ``dtype``) and raises :class:`ShardedStateError` naming ``name`` and the box.
    """

    global_shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    boxes: list[Box] = field(default_factory=list)
    updated_by_step: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        what = f"sharded tensor {self.name!r}" if self.name else "sharded tensor"
        for i, box in enumerate(self.boxes):
            if not isinstance(box, Box):
                raise ShardedStateError(f"{what}: boxes[{i}] is a {type(box).__name__}, not a vescale.core."
                                        "sharded_state.Box")
            if len(box.offsets) != len(self.global_shape) or len(box.lengths) != len(self.global_shape):
                raise ShardedStateError(f"{what} of shape {self.global_shape}: boxes[{i}] has offsets {box.offsets} "
                                        f"and lengths {box.lengths}, not one per dim")
            if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(box.offsets, box.lengths, self.global_shape)):
                raise ShardedStateError(f"{what} of shape {self.global_shape}: boxes[{i}] (offsets {box.offsets}, "
                                        f"lengths {box.lengths}) reaches outside it")
            if tuple(box.data.shape) != box.lengths:
                raise ShardedStateError(f"{what}: boxes[{i}] has data of shape {tuple(box.data.shape)}, not its "
                                        f"lengths {box.lengths}")
            if box.data.dtype != self.dtype:
                raise ShardedStateError(f"{what}: boxes[{i}] has data of dtype {box.data.dtype}, not {self.dtype}")


@runtime_checkable
class ShardedStateful(Protocol):
    """An object whose state is (partly) sharded across ranks; see the module docstring for the contract."""

    def sharded_state_dict(self) -> dict[str, Any]:
        ...

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        ...


@runtime_checkable
class BoxPlacement(Protocol):
    """A DTensor placement that names the boxes a local tensor holds (torch's ``_split_tensor`` cannot)."""

    def local_boxes(self, global_shape: Sequence[int], coordinate: int, local: torch.Tensor) -> list[Box]:
        """The boxes of the global tensor of ``global_shape`` held by the local tensor ``local`` at coordinate
        ``coordinate`` of this placement's mesh dim (every other mesh dim is ``Replicate``), ``data`` views of
        ``local``; empty boxes are left out."""
        ...


@dataclass(frozen=True)
class GlobalPiece:
    """What a plain tensor is a piece of (see :func:`mark_piece`).

    ``global_shape`` / ``offsets``: the box of the global tensor this tensor holds (its shape is the box's lengths),
    or None when only ``groups`` is known (a flat ZeRO shard of a flattened tensor). ``groups``: ``(mesh dim name,
    this rank's process group along it)`` pairs, sorted by name, for the dims the global tensor is split over: the
    pieces on the ranks of such a group are disjoint, so a norm sums them over it and a data-parallel reducer does
    not reduce over it. ``counts_in_norm=False``: an identical copy another holder counts (a tied weight's later
    pipeline holders), left out of norms but still clipped.
    """

    global_shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None
    groups: tuple[tuple[str, Any], ...] = ()
    counts_in_norm: bool = True

    @property
    def group_map(self) -> dict[str, Any]:
        """``groups`` as a dict ``{mesh dim name: process group}``."""
        return dict(self.groups)

    @property
    def placed(self) -> bool:
        """Whether the piece knows its box of the global tensor (``global_shape`` and ``offsets``)."""
        return self.global_shape is not None


_PIECE = "_vescale_global_piece"


def mark_piece(tensor: Any, *, global_shape: Sequence[int] | None = None, offsets: Sequence[int] | None = None,
               groups: Mapping[str, Any] | None = None, counts_in_norm: bool | None = None) -> Any:
    """Record on ``tensor`` (a ``torch.Tensor`` or ``nn.Parameter``) what global tensor it is a piece of; returns
    ``tensor``.

    ``global_shape`` and ``offsets`` (given together, or once each across marks): ``tensor`` is the box
    ``offsets`` / ``tensor.shape`` of a global tensor of ``global_shape``. ``groups``: ``{mesh dim name: this rank's
    process group along it}`` for the dims the global tensor is split over (every rank must use the same name for
    the same dim). ``counts_in_norm``: False for a copy another holder counts in norms. Fields not given keep what
    an earlier mark said; ``groups`` are merged with earlier ones, by dim name. Raises :class:`ShardedStateError`,
    leaving the earlier mark as it was, when the box does not fit (one offset and one global size per dim of
    ``tensor``, the box inside the global shape) or a group is not named by a string. No collective.
    """
    old = piece_of(tensor) or GlobalPiece()
    shape = tuple(int(n) for n in global_shape) if global_shape is not None else old.global_shape
    at = tuple(int(o) for o in offsets) if offsets is not None else old.offsets
    local = tuple(int(n) for n in tensor.shape)
    if (shape is None) != (at is None):
        raise ShardedStateError(f"a piece of shape {local} needs both global_shape and offsets, got global_shape "
                                f"{shape} and offsets {at}")
    if shape is not None and (len(shape) != len(local) or len(at) != len(local)
                              or any(o < 0 or o + n > s for o, n, s in zip(at, local, shape))):
        raise ShardedStateError(f"a piece of shape {local} at offsets {at} does not fit a global tensor of shape "
                                f"{shape}")
    new = dict(groups or {})
    bad = [name for name in new if not isinstance(name, str)]
    if bad:
        raise ShardedStateError(f"mark_piece groups are keyed by mesh dim name (a str), got {bad}")
    merged = {**old.group_map, **new}
    piece = GlobalPiece(shape, at, tuple(sorted(merged.items(), key=lambda kv: kv[0])),
                        old.counts_in_norm if counts_in_norm is None else bool(counts_in_norm))
    setattr(tensor, _PIECE, piece)
    return tensor


def piece_of(tensor: Any) -> GlobalPiece | None:
    """What :func:`mark_piece` recorded on ``tensor`` (the object itself: a view or a ``detach()`` of it carries no
    mark), or None."""
    return getattr(tensor, _PIECE, None)


def is_sharded_stateful(obj: Any) -> bool:
    """Whether ``obj`` implements :class:`ShardedStateful` (both methods callable); classes themselves do not."""
    return (not isinstance(obj, type) and callable(getattr(obj, "sharded_state_dict", None))
            and callable(getattr(obj, "load_sharded_state_dict", None)))


def is_box_placement(placement: Any) -> bool:
    """Whether a DTensor placement implements :class:`BoxPlacement` (cheaper than ``isinstance`` on the protocol,
    which a checkpoint asks for every placement of every tensor)."""
    return callable(getattr(placement, "local_boxes", None))


def flat_range_boxes(start: int, end: int, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split the row-major element range ``[start, end)`` of a tensor of ``shape`` into boxes.

    Returns ``(offsets, lengths, flat_start)`` per box in flat order; the boxes tile the range exactly (at most
    ``2 * len(shape) - 1`` of them) and ``flat_start`` is the flat index of each box's first element. For a 0-d
    ``shape`` the range ``[0, 1)`` is the one empty-tuple box. Raises :class:`ShardedStateError` on a range outside
    the tensor.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ShardedStateError(f"flat range [{start}, {end}) is not inside a tensor of shape {shape} "
                                f"({total} elements)")
    if start == end:
        return []
    if not shape:
        return [((), (), 0)]
    return _boxes(start, end, shape)


def _boxes(s: int, e: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    if s >= e:
        return []
    if len(shape) == 1:
        return [((s,), (e - s,), s)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    out = []
    row, last = s // inner, e // inner
    if s % inner:  # a partial first row: recurse into it
        head_end = min(e, (row + 1) * inner)
        out += [((row, *o), (1, *n), f + row * inner)
                for o, n, f in _boxes(s - row * inner, head_end - row * inner, shape[1:])]
        row += 1
        if head_end == e:
            return out
    if last > row:  # whole rows
        out.append(((row,) + (0,) * (len(shape) - 1), (last - row, *shape[1:]), row * inner))
    if e % inner and last >= row:  # a partial last row
        out += [((last, *o), (1, *n), f + last * inner) for o, n, f in _boxes(0, e - last * inner, shape[1:])]
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a ``torch.optim`` optimizer's lazily built state with one step at learning rate 0 on zero gradients.

    Parameters are unchanged (lr 0), gradients are restored to None, and the state tensors get the shapes, dtypes
    and placements a load then fills. Issues no collective of its own (the step of a torch optimizer over DTensors
    may: call it on every rank of their meshes).
    """
    import torch

    saved_lrs = []
    touched = []
    for group in optimizer.param_groups:
        saved_lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                touched.append(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            if lr is not None:
                group["lr"] = lr
        for p in touched:
            p.grad = None
