"""Bad plans raise a PlanError naming the pattern, FQN, shape, placements or mesh dim, before any collective.

Every check runs on rank 0 only while rank 1 waits at a barrier: had ``parallelize_module`` started a collective
before raising, rank 0 would hang and the test would time out. After each failed call the module must be untouched.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank


def _model():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.proj = nn.Linear(6, 5)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight  # tied

        def forward(self, x):
            return self.head(torch.tanh(self.emb(x)))

    return Net()


def _expect(mesh, plan, *needles):
    import pytest

    from vescale.core.errors import PlanError
    from vescale.parallel import parallelize_module

    model = _model()
    with pytest.raises(PlanError) as info:
        parallelize_module(model, mesh, plan)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in error message:\n{message}"
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters()), "a failed call changed the module"
    assert not model._forward_hooks and not model._forward_pre_hooks


@multi_rank(world_sizes=[2])
def test_bad_plans_fail_clearly_before_any_collective():
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard

    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"tp": 2})
    if dist.get_rank() == 0:
        # a pattern that matches nothing names itself and the closest FQN
        _expect(mesh, {"parameter": {r"proj\.wieght": [Shard(0)]}}, repr(r"proj\.wieght"), "proj.weight")
        # a shard that does not divide: pattern, FQN, shape, dim size, mesh dim
        _expect(mesh, {"parameter": {r"proj\.weight": [Shard(0)]}},
                r"'proj\\.weight'", "'proj.weight'", "(5, 6)", "size 5", "does not divide", "'tp' of size 2")
        # wrong number of placements for the mesh
        _expect(mesh, {"parameter": {r"proj\.weight": [Shard(0), Replicate()]}},
                "'proj.weight'", "2 placement(s)", "1-dim mesh(tp=2)")
        # not placements at all / a Partial parameter / a dim the tensor does not have
        _expect(mesh, {"parameter": {r"proj\.weight": ["Shard(0)"]}}, "'proj.weight'", "not a Placement")
        _expect(mesh, {"parameter": {r"proj\.weight": [Partial()]}}, "'proj.weight'", "Partial", "'tp'")
        _expect(mesh, {"parameter": {r"proj\.bias": [Shard(1)]}}, "'proj.bias'", "Shard(dim=1)", "(5,)")
        # tied parameters given different placements name both FQNs
        _expect(mesh, {"parameter": {r"emb\.weight": [Shard(0)], r"head\.weight": [Shard(1)]}},
                "'emb.weight'", "'head.weight'", "tied")
        # plan layout errors
        _expect(mesh, {"params": {}}, "unknown plan section", "'params'")
        _expect(mesh, {"input": {r"pro": [[Replicate()]]}}, "'input'", "'pro'", "match no FQN", "proj")
        _expect(mesh, {"output": {"proj": [[Replicate(), Replicate()]]}}, "'output'", "'proj'", "2 placement(s)")
        _expect(mesh, {"local": {"": [None]}}, "'local'", "root module")
        # one rule for boundary entries: a bare placements list is refused with the wrapped spelling
        _expect(mesh, {"output": {"proj": [Replicate()]}}, "'output'", "'proj'", "bare placements list",
                "[[Replicate()]]")
        _expect(mesh, {"input": {"proj": {"x": Replicate()}}}, "'input'", "'proj'", "argument 'x'", "Replicate()")
        _expect(mesh, {"input": {1: [None]}}, "'input'", "regex string")
        # the old single "forward" section is refused, its entries shown in the new spelling
        _expect(mesh, {"forward": {"proj.output": [[Replicate()]], "input": [None]}}, "'forward'", "old format",
                "'proj.output' -> plan['output']['proj']", "'input' -> plan['input']['']")
    dist.barrier()


@multi_rank(world_sizes=[2])
def test_values_read_into_python_refused_with_the_line():
    """Model code that reads a sharded tensor's values into Python (JetMoE's router: ``counts.tolist()``) is refused
    with a DataDependentError naming the line, instead of torch's bare subclass error (or, were the values read
    locally, routing by one rank's partial counts: a wrong result)."""
    import pytest
    import torch
    from torch import nn
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_module
    from vescale.parallel.errors import DataDependentError

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(6, 4, bias=False)

        def forward(self, x):
            counts = (self.gate(x) > 0).sum(0)  # tokens per expert, sharded like the gate
            sizes = counts.tolist()
            return x * len(sizes)

    mesh = init_mesh({"tp": 2})
    model = parallelize_module(Router(), mesh, {"parameter": {"gate.weight": [Shard(0)]}})
    with pytest.raises(DataDependentError, match=r"test_plan_errors\.py:\d+ `sizes = counts\.tolist\(\)`"):
        model(torch.randn(3, 6))
