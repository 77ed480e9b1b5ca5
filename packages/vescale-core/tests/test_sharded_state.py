"""The sharded-state protocol's helpers: flat ranges as boxes (checked exhaustively against numpy indexing on small
shapes), ShardedTensor's checks, and recognising implementers."""

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
    ShardedStateError,
    ShardedStateful,
    ShardedTensor,
    flat_range_boxes,
    is_box_placement,
    is_sharded_stateful,
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
