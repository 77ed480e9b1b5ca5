"""Box arithmetic: every row-major flat range of a tensor splits into boxes whose views hold exactly its elements."""

from __future__ import annotations

import math

import torch

from vescale.checkpoint._layout import flat_range_pieces, intersect, relative


def test_flat_ranges_split_into_exact_boxes():
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3)]:
        full = torch.arange(math.prod(shape)).reshape(shape)
        n = full.numel()
        for start in range(n + 1):
            for end in range(start, n + 1):
                local = full.reshape(-1)[start:end].clone()
                pieces = flat_range_pieces(local, start, end, shape, ())
                assert sum(p.numel for p in pieces) == end - start, (shape, start, end)
                for p in pieces:
                    box = tuple(slice(o, o + n) for o, n in zip(p.offsets, p.lengths))
                    assert torch.equal(full[box], p.view), (shape, start, end, p.offsets, p.lengths)
                    assert p.view.data_ptr() >= local.data_ptr()  # a view into local, not a copy


def test_flat_ranges_with_trailing_dims_and_box_intersection():
    full = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    local = full.reshape(6, 4)[1:5]
    pieces = flat_range_pieces(local, 1, 5, (2, 3), (4,))
    assert [(p.offsets, p.lengths) for p in pieces] == [((0, 1, 0), (1, 2, 4)), ((1, 0, 0), (1, 2, 4))]
    for p in pieces:
        assert torch.equal(full[relative((p.offsets, p.lengths), (0, 0, 0))], p.view)
    assert intersect(((0, 2), (4, 4)), ((2, 0), (4, 3))) == ((2, 2), (2, 1))
    assert intersect(((0,), (2,)), ((2,), (2,))) is None
    assert intersect(((), ()), ((), ())) == ((), ())
