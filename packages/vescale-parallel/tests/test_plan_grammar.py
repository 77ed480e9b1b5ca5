"""The plan grammar (``check_plan``): pure checks, no process group. ``test_plan_errors.py`` checks the same errors
through ``parallelize_module`` on two ranks (raised before any collective, the module untouched)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from vescale.core.errors import PlanError
from vescale.parallel import PLANS, check_plan


class _Mesh:
    """The two attributes of a DeviceMesh the grammar reads (no process group needed)."""

    def __init__(self, **dims: int) -> None:
        self.mesh_dim_names, self.shape, self.ndim = tuple(dims), tuple(dims.values()), len(dims)


def _refused(plan, *needles, mesh=None) -> str:
    with pytest.raises(PlanError) as info:
        check_plan(plan, mesh)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in error message:\n{message}"
    return message


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_hand_plan_is_in_the_grammar(name, sequence_parallel):
    mesh = _Mesh(dp=2, tp=2)
    plan = PLANS[name](mesh, sequence_parallel=sequence_parallel, loss_parallel=sequence_parallel)
    assert set(plan) <= {"parameter", "input", "output", "local"}
    checked = check_plan(plan, mesh)
    assert "" in checked.input and "" in checked.output  # the root's boundary is named by the pattern ""
    for section in (checked.input, checked.output, checked.local):
        for value in section.values():
            items = value.values() if isinstance(value, dict) else value
            assert all(item is None or (isinstance(item, tuple) and len(item) == 2) for item in items)


def test_checked_plan_keeps_entries_and_normalises_boundaries():
    plan = {"parameter": {r"proj\.weight": [Shard(0)]},
            "input": {"": [[Shard(0)], None], r"blocks\.\d+": {"hidden_states": [Replicate()]}},
            "output": {"proj": [[Partial()]]},
            "local": {"experts": [[Partial()], None]}}
    checked = check_plan(plan, _Mesh(tp=2))
    assert checked.parameter == {r"proj\.weight": [Shard(0)]}
    assert checked.input == {"": [(Shard(0),), None], r"blocks\.\d+": {"hidden_states": (Replicate(),)}}
    assert checked.output == {"proj": [(Partial(),)]}
    assert checked.local == {"experts": [(Partial(),), None]}
    assert check_plan({}).parameter == {} and check_plan({"output": {}}).output == {}


def test_one_rule_for_boundary_entries():
    # a bare placements list is never guessed to mean "the first argument": the error shows the wrapped spelling
    _refused({"output": {"proj": [Shard(1)]}}, "plan section 'output', entry 'proj'", "bare placements list",
             "one item per output", "[[Shard(dim=1)]]")
    _refused({"input": {"": [Shard(0), Replicate()]}}, "plan section 'input', entry ''", "argument",
             "[[Shard(dim=0), Replicate()]]")
    _refused({"local": {"experts": [Partial(), None]}}, "'local'", "'experts'", "bare placements list")
    # a keyword's value is a placements list, never a bare Placement
    _refused({"input": {"attn": {"hidden_states": Replicate()}}}, "'input'", "'attn'", "argument 'hidden_states'",
             "one Placement per mesh dim")
    _refused({"input": {"attn": [["Shard(0)"]]}}, "'attn'", "argument 0", "not a Placement")
    _refused({"output": {"proj": Shard(0)}}, "'output'", "'proj'", "a list (one item per positional output)")


def test_sections_patterns_and_counts():
    _refused([], "a plan is a dict")
    _refused({"params": {}}, "unknown plan section", "'params'")
    _refused({"input": []}, "plan section 'input' must be a dict")
    _refused({"input": {("a",): [None]}}, "plan section 'input'", "regex string")
    _refused({"input": {"a": {0: None}}}, "'a'", "keyword names are strings")
    _refused({"parameter": {"w": Shard(0)}}, "plan section 'parameter', entry 'w'", "one Placement per mesh dim")
    _refused({"local": {"": [None]}}, "plan section 'local', entry ''", "root module cannot be local")
    _refused({"output": {"proj": [[Replicate()]]}}, "'proj'", "output 0", "1 placement(s)", "2-dim mesh(dp=2, tp=2)",
             mesh=_Mesh(dp=2, tp=2))
    check_plan({"output": {"proj": [[Replicate()]]}})  # without a mesh the count is not checked


def test_the_old_forward_section_is_refused_with_the_new_spelling():
    old = {"parameter": {}, "forward": {r"layers\.\d+\.attn.input": [[Replicate()]], r"lm_head\.output": [None],
                                        "output": {"logits": None}, "experts.local": [None]}}
    message = _refused(old, "'forward'", "old format", "'input': {MODULE_REGEX: ...}")
    assert repr(r"layers\.\d+\.attn.input") + " -> plan['input'][" + repr(r"layers\.\d+\.attn") + "]" in message
    assert repr(r"lm_head\.output") + " -> plan['output']['lm_head']" in message  # escaped suffix dot dropped
    assert "'output' -> plan['output']['']" in message and "'experts.local' -> plan['local']['experts']" in message
