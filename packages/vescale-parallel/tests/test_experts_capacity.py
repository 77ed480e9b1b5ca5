"""Expert parallelism with a capacity factor (``parallelize_experts(..., capacity_factor=cf)``), its own mode.

The rule (documented in :mod:`vescale.parallel.experts`): each expert takes at most ``C = ceil(cf * N * k / E)`` of
the ``N`` tokens of each rank's batch, keeping the first ``C`` (token, choice) pairs that chose it in choice-major
order (all first choices in token order, then the second choices); a dropped pair adds nothing to its token's output.

The reference here is written in this file: the drop rule as a plain Python loop over each ep rank's rows, applied to
the untouched Hugging Face model on one process (its eager experts) by zeroing the router weights of the dropped
pairs, which is what dropping means for the output and every gradient. Compared (fp32, rtol 1e-5): logits, loss,
load-balancing loss and every parameter's gradient, on ep=2, for a factor that drops pairs (asserted) and for a
large one that drops none.
"""

from __future__ import annotations

import math

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _keep_reference(index, num_experts: int, capacity_factor: float):
    """The drop rule, one pair at a time: choice-major, token order, each expert up to its capacity."""
    import torch

    n, k = index.shape
    capacity = math.ceil(capacity_factor * n * k / num_experts)
    taken = [0] * num_experts
    keep = torch.zeros(n, k, dtype=torch.bool)
    for j in range(k):
        for t in range(n):
            e = int(index[t, j])
            if taken[e] < capacity:
                keep[t, j] = True
                taken[e] += 1
    return keep


@pytest.mark.parametrize("cf", [0.25, 0.5, 1.0, 1.5, 8.0])
def test_capacity_keep_is_the_documented_rule(cf):
    import torch

    from vescale.parallel import capacity_keep

    g = torch.Generator().manual_seed(3)
    for n, k, e in [(16, 2, 4), (7, 3, 8), (1, 1, 2), (32, 2, 8)]:
        # skewed routing so that some experts overflow
        index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
        index = torch.where(torch.rand(n, k, generator=g) < 0.5, index % 2, index) if k == 1 else index
        got = capacity_keep(index, e, cf)
        assert torch.equal(got, _keep_reference(index, e, cf)), (n, k, e, cf)
        assert int(torch.bincount(index[got], minlength=e).max()) <= math.ceil(cf * n * k / e)


def _build():
    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(0, output_router_logits=True, router_aux_loss_coef=0.1)


def _with_reference_drops(model, ep: int, capacity_factor: float, dropped: list[int]):
    """Wrap each experts module of the one-process model: per ep rank's rows, zero the dropped pairs' weights."""
    import torch

    for layer in model.model.layers:
        experts = layer.mlp.experts
        orig = experts.forward

        def forward(hidden, index, weights, *, orig=orig, num=experts.num_experts):
            keep = torch.cat([_keep_reference(part, num, capacity_factor) for part in index.chunk(ep)])
            dropped.append(int((~keep).sum()))
            return orig(hidden, index, weights * keep)

        experts.forward = forward
    return model


@multi_rank(world_sizes=[2])
def test_capacity_factor_matches_the_reference_drop_rule():
    import copy

    import torch

    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_experts

    mesh = init_mesh({"ep": 2})
    r = mesh.get_local_rank("ep")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (4, 8), generator=g)
    labels = torch.randint(0, 64, (4, 8), generator=g)
    base = _build()
    plain = copy.deepcopy(base)
    plain_loss = plain(input_ids=tokens, labels=labels).loss
    for cf, drops in ((0.75, True), (8.0, False)):
        dropped: list[int] = []
        ref = _with_reference_drops(copy.deepcopy(base), 2, cf, dropped)
        ref_out = ref(input_ids=tokens, labels=labels)
        ref_out.loss.backward()
        assert (sum(dropped) > 0) is drops, (cf, dropped)
        # dropping changes the result, so matching the reference is not matching the no-drop model
        assert (abs(ref_out.loss.item() - plain_loss.item()) > 1e-4) is drops
        par = parallelize_experts(copy.deepcopy(base), mesh, capacity_factor=cf)
        out = par(input_ids=tokens.chunk(2)[r], labels=labels.chunk(2)[r])
        out.loss.backward()
        what = f"capacity_factor={cf}"
        torch.testing.assert_close(out.logits, ref_out.logits.chunk(2)[r], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, what=what: f"{what}: {m}")
        torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, rtol=RTOL, atol=ATOL)
        ref_params = dict(ref.named_parameters())
        for name, p in par.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name, what=what: f"{what} {name}: {m}")


@multi_rank(world_sizes=[2])
def test_capacity_factor_must_be_positive():
    from vescale.core.mesh import init_mesh
    from vescale.parallel import ExpertParallelError, parallelize_experts

    for bad in (0, -1.0, "1"):
        with pytest.raises(ExpertParallelError, match="capacity_factor must be a positive number or None"):
            parallelize_experts(_build(), init_mesh({"ep": 2}), capacity_factor=bad)
