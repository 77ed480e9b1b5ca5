"""vescale.core.blocks: what counts as a model's repeated blocks."""

from __future__ import annotations

import re

import pytest
from torch import nn

from vescale.core.blocks import find_blocks


class _Block(nn.Module):
    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        if experts:
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(experts))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.layers = nn.ModuleList([_Block(experts=2), _Block(), _Block()])


def test_default_is_the_children_of_the_longest_module_list():
    model = _Model()
    found = find_blocks(model)
    assert [fqn for fqn, _ in found] == ["layers.0", "layers.1", "layers.2"]
    assert [b for _, b in found] == list(model.layers)


def test_a_root_module_list_gives_bare_indices_and_ties_go_to_the_first():
    assert [fqn for fqn, _ in find_blocks(nn.ModuleList([nn.Linear(1, 1), nn.Linear(1, 1)]))] == ["0", "1"]
    tie = nn.Module()
    tie.a = nn.ModuleList([nn.ReLU()])
    tie.b = nn.ModuleList([nn.Tanh()])
    assert [fqn for fqn, _ in find_blocks(tie)] == ["a.0"]


def test_every_list_includes_nested_lists_in_module_order():
    fqns = [fqn for fqn, _ in find_blocks(_Model(), every_list=True)]
    assert fqns == ["heads.0", "heads.1", "layers.0", "layers.1", "layers.2", "layers.0.experts.0",
                    "layers.0.experts.1"]


def test_pattern_full_matches_fqns_and_never_the_root():
    model = _Model()
    assert [fqn for fqn, _ in find_blocks(model, r"layers\.\d+\.proj")] == [f"layers.{i}.proj" for i in range(3)]
    assert find_blocks(model, r".*") == [(fqn, m) for fqn, m in model.named_modules() if fqn]
    assert find_blocks(model, "layer") == []  # full match only
    with pytest.raises(re.error):
        find_blocks(model, "(")


def test_no_module_list_finds_nothing():
    assert find_blocks(nn.Sequential(nn.Linear(1, 1))) == []
    assert find_blocks(nn.Sequential(nn.Linear(1, 1)), every_list=True) == []
