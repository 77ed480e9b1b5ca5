"""``RaggedShard.local_boxes`` (the ``BoxPlacement`` protocol through which checkpoints see ragged DTensors): every
coordinate's boxes hold exactly its rows of the flattened leading dims, as views of its local tensor."""

from __future__ import annotations

import math

import pytest
import torch

from vescale.core.sharded_state import is_box_placement
from vescale.dtensor import RaggedShard
from vescale.dtensor.errors import PlacementError


@pytest.mark.parametrize("shape,dims,units", [((2, 3, 4), (0, 1), (1, 3, 2)), ((7,), (0,), (2, 0, 5)),
                                              ((4, 5), (0, 1), (3, 1)), ((3, 2, 2), (0,), (1, 2))])
def test_local_boxes_cover_each_coordinates_rows(shape, dims, units):
    placement = RaggedShard(dims, units)
    assert is_box_placement(placement)
    full = torch.arange(math.prod(shape)).reshape(shape)
    rows = full.reshape(math.prod(shape[:len(dims)]), *shape[len(dims):])
    seen = torch.zeros(shape, dtype=torch.int64)
    for coord in range(len(units)):
        start, end = placement.local_range(shape, coord)
        local = rows[start:end].clone()
        boxes = placement.local_boxes(shape, coord, local)
        assert sum(b.numel for b in boxes) == local.numel()
        for b in boxes:
            where = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))
            assert torch.equal(b.data, full[where])
            assert b.data.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()  # a view
            seen[where] += 1
    assert bool((seen == 1).all())


def test_local_boxes_refuse_a_local_tensor_of_the_wrong_shape():
    with pytest.raises(PlacementError, match=r"local tensor of shape \(3,\), expected \(2,\)"):
        RaggedShard((0,), (2, 5)).local_boxes((7,), 0, torch.zeros(3))
