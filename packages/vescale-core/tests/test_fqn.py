"""vescale.core.fqn: full-match semantics, first match wins, unmatched patterns are errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vescale.core.errors import PlanError
from vescale.core.fqn import match_plan

FQNS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "lm_head.weight",
]


def test_full_match_not_search():
    got = match_plan({r"model\.layers\.\d+\.mlp\.up_proj\.weight": "col"}, FQNS)
    assert sorted(got) == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    # "up_proj" alone would be found by re.search but must not full-match anything.
    with pytest.raises(PlanError, match="match no FQN"):
        match_plan({"up_proj": "col"}, FQNS)


def test_first_pattern_in_plan_order_wins():
    plan = {r"model\.layers\.1\..*": "specific", r"model\.layers\.\d+\..*": "generic"}
    got = match_plan(plan, FQNS)
    assert got["model.layers.1.mlp.down_proj.weight"].value == "specific"
    assert got["model.layers.0.mlp.up_proj.weight"].value == "generic"
    assert got["model.layers.0.mlp.up_proj.weight"].pattern == r"model\.layers\.\d+\..*"
    assert "lm_head.weight" not in got


def test_unmatched_patterns_all_listed_with_suggestions():
    plan = {r"model\.layers\.\d+\.mlp\.up_prj\.weight": 1, r"lm_haed\.weight": 2, r"lm_head\.weight": 3}
    with pytest.raises(PlanError) as info:
        match_plan(plan, FQNS, what="tp plan")
    msg = str(info.value)
    assert "tp plan has 2 pattern(s)" in msg
    assert "up_prj" in msg and "lm_haed" in msg
    assert "closest: lm_head.weight" in msg
    assert "model.layers.0.mlp.up_proj.weight" in msg


def test_allow_unmatched_and_bad_regex():
    assert match_plan({"nothing": 1}, FQNS, allow_unmatched=True) == {}
    with pytest.raises(PlanError, match="not a valid regex"):
        match_plan({"layers.(": 1}, FQNS)
    with pytest.raises(PlanError, match="must be a regex string"):
        match_plan({3: 1}, FQNS)


@given(st.lists(st.from_regex(r"[a-z]{1,4}(\.[a-z0-9]{1,4}){0,3}", fullmatch=True), min_size=1, max_size=20,
                unique=True))
def test_literal_patterns_match_exactly_themselves(fqns):
    import re

    plan = {re.escape(f): i for i, f in enumerate(fqns)}
    got = match_plan(plan, fqns)
    assert {f: m.value for f, m in got.items()} == {f: i for i, f in enumerate(fqns)}
