"""The sharded-state protocol's helpers: flat ranges as boxes (checked exhaustively against numpy indexing on small
shapes), ShardedTensor's checks, recognising implementers, and the one annotation of a plain piece (mark_piece /
piece_of: merging marks, refusing a box that does not fit)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from vescale.core.errors import VescaleError
from vescale.core.sharded_state import (
    Box,
    BoxPlacement,
    GlobalPiece,
    ShardedStateError,
    ShardedStateful,
    ShardedTensor,
    flat_range_boxes,
    is_box_placement,
    is_sharded_stateful,
    mark_piece,
    piece_of,
)


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (3, 1, 2), (2, 0, 3)])
def test_flat_range_boxes_tile_every_range(shape):
    total = math.prod(shape)
    index = np.arange(total).reshape(shape)
    for start, end in itertools.combinations_with_replacement(range(total + 1), 2):
        boxes = flat_range_boxes(start, end, shape)
        assert len(boxes) <= 2 * len(shape) - 1
        covered = []
        for offsets, lengths, flat in boxes:
            block = index[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
            assert block.shape == lengths and block.size > 0
            # a box's elements are consecutive in flat order from its flat start
            assert list(block.reshape(-1)) == list(range(flat, flat + block.size)), (shape, start, end, offsets)
            covered += list(block.reshape(-1))
        assert covered == list(range(start, end)), (shape, start, end)


def test_flat_range_boxes_scalar_and_errors():
    assert flat_range_boxes(0, 1, ()) == [((), (), 0)]
    assert flat_range_boxes(0, 0, ()) == []
    with pytest.raises(ShardedStateError, match=r"\[2, 9\) is not inside a tensor of shape \(2, 4\)"):
        flat_range_boxes(2, 9, (2, 4))


def test_sharded_tensor_checks_its_boxes():
    data = torch.zeros(2, 3)
    ShardedTensor((4, 3), torch.float32, [Box((2, 0), (2, 3), data)])
    with pytest.raises(ShardedStateError, match=r"'w' of shape \(4, 3\): boxes\[0\] .* reaches outside it"):
        ShardedTensor((4, 3), torch.float32, [Box((3, 0), (2, 3), data)], name="w")
    with pytest.raises(ShardedStateError, match=r"data of shape \(2, 3\), not its lengths \(1, 3\)"):
        ShardedTensor((4, 3), torch.float32, [Box((0, 0), (1, 3), data)])
    with pytest.raises(ShardedStateError, match="dtype torch.float32, not torch.float16"):
        ShardedTensor((4, 3), torch.float16, [Box((0, 0), (2, 3), data)])
    with pytest.raises(ShardedStateError, match="not one per dim"):
        ShardedTensor((4, 3), torch.float32, [Box((0,), (2, 3), data)])
    assert issubclass(ShardedStateError, VescaleError) and issubclass(ShardedStateError, ValueError)


class _Holder:
    def sharded_state_dict(self):
        return {}

    def load_sharded_state_dict(self, state):
        pass


class _Placement:
    def local_boxes(self, global_shape, coordinate, local):
        return []


def test_implementers_are_recognised_by_interface():
    assert is_sharded_stateful(_Holder()) and isinstance(_Holder(), ShardedStateful)
    assert not is_sharded_stateful(_Holder) and not is_sharded_stateful(object())
    assert is_box_placement(_Placement()) and isinstance(_Placement(), BoxPlacement)
    assert not is_box_placement(object())


def test_mark_piece_records_and_merges():
    t = torch.nn.Parameter(torch.zeros(2, 3))
    assert piece_of(t) is None
    g_ep, g_tp, g_ep2 = object(), object(), object()  # stand-ins for process groups (only their identity matters)
    assert mark_piece(t, global_shape=[8, 3], offsets=[4, 0], groups={"ep": g_ep}) is t
    assert piece_of(t) == GlobalPiece((8, 3), (4, 0), (("ep", g_ep),), True) and piece_of(t).placed
    mark_piece(t, groups={"tp": g_tp})  # the box is kept, the groups are merged (sorted by name)
    assert piece_of(t).global_shape == (8, 3) and piece_of(t).offsets == (4, 0)
    assert piece_of(t).groups == (("ep", g_ep), ("tp", g_tp)) and piece_of(t).counts_in_norm
    mark_piece(t, counts_in_norm=False, groups={"ep": g_ep2})  # a dim named again takes the new group
    assert piece_of(t).group_map == {"ep": g_ep2, "tp": g_tp} and not piece_of(t).counts_in_norm
    mark_piece(t, offsets=(6, 0))  # one field alone; counts_in_norm stays False
    assert piece_of(t).offsets == (6, 0) and piece_of(t).global_shape == (8, 3) and not piece_of(t).counts_in_norm
    assert piece_of(t.detach()) is None and piece_of(t[0]) is None  # the mark is on the object itself

    flat = mark_piece(torch.zeros(5), groups={"dp": g_ep})  # a flat shard: groups only, no box
    assert piece_of(flat).global_shape is None and not piece_of(flat).placed and piece_of(flat).offsets is None
    scalar = mark_piece(torch.zeros(()), global_shape=(), offsets=())
    assert piece_of(scalar).global_shape == () and piece_of(scalar).placed


def test_mark_piece_refuses_a_box_that_does_not_fit():
    t = torch.zeros(2, 3)
    with pytest.raises(ShardedStateError, match=r"shape \(2, 3\) at offsets \(7, 0\) does not fit .* \(8, 3\)"):
        mark_piece(t, global_shape=(8, 3), offsets=(7, 0))  # rows 7..8 reach outside 8 rows
    with pytest.raises(ShardedStateError, match="does not fit"):
        mark_piece(t, global_shape=(8, 3), offsets=(-1, 0))
    with pytest.raises(ShardedStateError, match="does not fit"):
        mark_piece(t, global_shape=(8, 3, 1), offsets=(0, 0, 0))  # one global size per dim of the tensor
    with pytest.raises(ShardedStateError, match="does not fit"):
        mark_piece(t, global_shape=(8, 3), offsets=(0,))
    with pytest.raises(ShardedStateError, match="needs both global_shape and offsets"):
        mark_piece(t, global_shape=(8, 3))
    with pytest.raises(ShardedStateError, match="keyed by mesh dim name"):
        mark_piece(t, groups={0: object()})
    assert piece_of(t) is None  # nothing recorded by a refused mark
    mark_piece(t, global_shape=(4, 3), offsets=(2, 0))
    with pytest.raises(ShardedStateError, match=r"at offsets \(3, 0\)"):
        mark_piece(t, offsets=(3, 0))  # checked against the earlier mark's global shape
    assert piece_of(t).offsets == (2, 0)  # the earlier mark is kept
