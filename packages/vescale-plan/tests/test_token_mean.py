"""``Parallelized.forward_backward`` on targets with ignored positions (-100): the loss and the gradients are one
device's mean over the trained tokens of the whole global batch, on dp2, cp2, dp2 x tp2 with grad_accum=2,
pp2 x dp2 and dp2 x ep2, with very uneven counts (batch rank 0's rows fully ignored, so a micro-step, a pipeline
microbatch and a dp rank train no token; cp chunks of one row differ).

The reference is the unmodified model on one process: ``F.cross_entropy(..., ignore_index=-100)`` of the whole
global batch, mean reduction, one backward. Gradients are compared whole (DTensors gathered; with pp this rank's
stage), rtol 1e-5 (the parallel run sums the tokens in another order). A per-rank or per-micro-step mean (the old
normalisation) misses by a factor between 0.3 and 3 on these batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vescale.core.testing import multi_rank

sys.path.insert(0, str(Path(__file__).parent))  # (importlib mode: the shared fixtures by this folder's path)
from _doc_fixtures import BATCH, MODELS, SEQ, VOCAB, assert_matches, logits, one_device  # noqa: E402


def uneven_targets(targets):
    """The targets with very uneven ignored positions: the first quarter of the rows (batch rank 0 of up to 4)
    fully ignored, row 2 one trained token, rows 4-5 their middle positions (cp's inner chunks) ignored, rows 6-7
    their last three."""
    y = targets.clone()
    y[: BATCH // 4] = -100
    y[2, 1:] = -100
    y[4:6, 4:12] = -100
    y[6:, -3:] = -100
    return y


def _run(model: str, mesh: dict, **spec_kw) -> None:
    from vescale.core.testing.reference import progression_batch
    from vescale.plan import ParallelSpec, build

    inputs, targets = progression_batch(11, BATCH, SEQ, VOCAB)
    targets = uneven_targets(targets)
    ref, _, ref_loss = one_device(MODELS[model], lambda m: logits(m, inputs), targets)
    par = build(MODELS[model](), ParallelSpec(mesh=mesh, **spec_kw), batch_size=BATCH, seq_len=SEQ)
    for num_tokens in (None, int((targets != -100).sum())):  # counted by an all-reduce, or given by the caller
        for p in par.parameters():
            p.grad = None
        if par.ddp is not None:
            par.ddp.zero_grad()
        loss = par.forward_backward(par.shard_batch(inputs), par.shard_batch(targets), num_tokens=num_tokens)
        assert_matches(par, loss, ref, ref_loss, f"{mesh} {spec_kw} num_tokens={num_tokens}")


@multi_rank(world_sizes=[2])
@pytest.mark.parametrize("mesh", [{"dp": 2}, {"cp": 2}])
def test_token_mean_dp2_cp2(world_size, mesh):
    _run("gpt", mesh)


@multi_rank(world_sizes=[4])
def test_token_mean_dp2_tp2_grad_accum2(world_size):
    _run("gpt", {"dp": 2, "tp": 2}, tp_plan="gpt", grad_accum=2)


@multi_rank(world_sizes=[4])
def test_token_mean_pp2_dp2_microbatches(world_size):
    _run("gpt", {"pp": 2, "dp": 2}, microbatches=2)


@multi_rank(world_sizes=[4])
def test_token_mean_dp2_ep2(world_size):
    _run("mixtral", {"dp": 2, "ep": 2})


def test_num_tokens_past_the_batch_is_refused():
    import torch

    from vescale.core.mesh import MeshRoles
    from vescale.plan.token_mean import token_scale

    roles = MeshRoles.of(None)
    targets = torch.zeros(2, 4, dtype=torch.long)
    assert token_scale(targets, roles) is None  # every position trained: the per-row mean, unchanged
    assert token_scale(targets, roles, num_tokens=2) == 0.5
    targets[0] = -100
    assert token_scale(targets, roles) == 0.25
    with pytest.raises(ValueError, match="num_tokens=9: the global batch has 8 target positions"):
        token_scale(targets, roles, num_tokens=9)
