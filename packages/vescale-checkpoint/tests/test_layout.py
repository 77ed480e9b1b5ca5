"""Box arithmetic: intersections of boxes and the slices selecting one inside another.

(Flat ranges as boxes are ``vescale.core.sharded_state.flat_range_boxes``, tested in vescale-core; a ragged
placement's boxes are ``RaggedShard.local_boxes``, tested in vescale-dtensor.)
"""

from __future__ import annotations

import torch

from vescale.checkpoint._layout import intersect, relative


def test_box_intersection_and_relative_slices():
    full = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    inner = full[1:2, 1:3]  # the box at (1, 1, 0) of lengths (1, 2, 4)
    assert torch.equal(inner[relative(((1, 2, 0), (1, 1, 4)), (1, 1, 0))], full[1:2, 2:3])
    assert intersect(((0, 2), (4, 4)), ((2, 0), (4, 3))) == ((2, 2), (2, 1))
    assert intersect(((0,), (2,)), ((2,), (2,))) is None
    assert intersect(((), ()), ((), ())) == ((), ())
