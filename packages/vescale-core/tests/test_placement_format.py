"""vescale.core.placement_format: placements as reports and tables write them."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from vescale.core.placement_format import format_placements


def test_placements_lists_nested_lists_and_mappings():
    assert format_placements([Shard(0), Replicate()]) == "[S(0), R]"
    assert format_placements((Partial(),)) == "[P(sum)]"
    assert format_placements(None) == "None"
    assert format_placements([[Shard(1)], None]) == "[[S(1)], None]"
    assert format_placements({"x": [Replicate()], "mask": None}) == "{x: [R], mask: None}"
    assert format_placements([]) == "[]"
    assert format_placements("given") == "given"
