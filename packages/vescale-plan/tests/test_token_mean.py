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

import pytest

from vescale.core.testing import multi_rank

BATCH, SEQ, VOCAB = 8, 16, 64


def _gpt():
    import torch

    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=SEQ))


def _mixtral():
    import torch
    import transformers as T

    torch.manual_seed(0)
    return T.MixtralForCausalLM(T.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, num_local_experts=4,
                                                num_experts_per_tok=2, attn_implementation="eager"))


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


def _run(model_fn, mesh: dict, **spec_kw) -> None:
    import torch
    import torch.nn.functional as F

    from vescale.core.testing.reference import progression_batch
    from vescale.plan import ParallelSpec, build

    inputs, targets = progression_batch(11, BATCH, SEQ, VOCAB)
    targets = uneven_targets(targets)
    ref = model_fn()
    out = ref(input_ids=inputs, use_cache=False).logits if hasattr(ref, "config") else ref(inputs)
    ref_loss = F.cross_entropy(out.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref_loss.backward()
    named = dict(ref.named_parameters())
    par = build(model_fn(), ParallelSpec(mesh=mesh, **spec_kw), batch_size=BATCH, seq_len=SEQ)
    what = f"{mesh} {spec_kw}"
    for num_tokens in (None, int((targets != -100).sum())):  # counted by an all-reduce, or given by the caller
        for p in par.parameters():
            p.grad = None
        if par.ddp is not None:
            par.ddp.zero_grad()
        loss = par.forward_backward(par.shard_batch(inputs), par.shard_batch(targets), num_tokens=num_tokens)
        torch.testing.assert_close(par.global_loss(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=what)
        grads = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in par.grads().items()}
        assert grads, what
        for n, g in grads.items():
            torch.testing.assert_close(g, named[n].grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{what} num_tokens={num_tokens} {n}")


@multi_rank(world_sizes=[2])
@pytest.mark.parametrize("mesh", [{"dp": 2}, {"cp": 2}])
def test_token_mean_dp2_cp2(world_size, mesh):
    _run(_gpt, mesh)


@multi_rank(world_sizes=[4])
def test_token_mean_dp2_tp2_grad_accum2(world_size):
    _run(_gpt, {"dp": 2, "tp": 2}, tp_plan="gpt", grad_accum=2)


@multi_rank(world_sizes=[4])
def test_token_mean_pp2_dp2_microbatches(world_size):
    _run(_gpt, {"pp": 2, "dp": 2}, microbatches=2)


@multi_rank(world_sizes=[4])
def test_token_mean_dp2_ep2(world_size):
    _run(_mixtral, {"dp": 2, "ep": 2})


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
