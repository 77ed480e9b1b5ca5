"""A tp model cast after ``parallelize_module`` (``model.to(torch.bfloat16)`` swaps each DTensor parameter, and torch
then keeps running the post-accumulate-grad hook of the old tensor): the gradients still come out laid out as their
parameters (the ``Partial`` gradients of sequence-parallel norm weights reduced), without DDP, equal to the same bf16
model on one process."""

from __future__ import annotations

from vescale.core.testing import multi_rank

# bf16 keeps 8 significant bits, and the tp run adds in another order than one process: the bound of the integration
# matrix's bf16 cells (integration_tests/test_train_matrix.py, BF16_GRAD_TOL: about 70 rounded stages, two runs),
# per parameter on the norm of the local difference relative to the local reference. A gradient left Partial holds
# one rank's share of the sum on each rank: off by about its own size, 30 times the bound.
BF16_GRAD_TOL = 2**-5


def _llama():
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                            attn_implementation="eager")
    return tf.LlamaForCausalLM(config).train()


def _loss(model, tokens, labels):
    import torch.nn.functional as F

    logits = model(input_ids=tokens, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


@multi_rank(world_sizes=[2])
def test_grads_keep_param_placements_after_a_cast_following_parallelize(world_size):
    import copy

    import torch

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import DTensor
    from vescale.dtensor.layout import local_slice
    from vescale.parallel import PLANS, parallelize_module

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    ref = _llama()
    par = copy.deepcopy(ref)
    ref.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
    _loss(ref, tokens, labels).backward()

    parallelize_module(par, mesh, PLANS["llama"](mesh, sequence_parallel=True))
    before = {name: id(p) for name, p in par.named_parameters()}
    par.to(torch.bfloat16)  # swaps every DTensor parameter in place (same Parameter objects, new tensors)
    assert {name: id(p) for name, p in par.named_parameters()} == before
    for _ in range(2):  # a second step hooks nothing twice and still lays the gradients out
        par.zero_grad(set_to_none=True)
        _loss(par, tokens, labels).backward()
        want = dict(ref.named_parameters())
        partial_norms = 0
        for name, p in par.named_parameters():
            assert isinstance(p, DTensor) and p.dtype == torch.bfloat16, name
            grad = p.grad
            assert isinstance(grad, DTensor), name
            assert tuple(grad.placements) == tuple(p.placements), (name, grad.placements, p.placements)
            ref_local = local_slice(want[name].grad, mesh, p.placements)
            rel = float((grad.to_local().float() - ref_local.float()).norm() / ref_local.float().norm())
            assert rel <= BF16_GRAD_TOL, f"{name}: off by {rel:.3g} in norm (bound {BF16_GRAD_TOL})"
            partial_norms += "layernorm" in name or name == "model.norm.weight"
        assert partial_norms == 5  # the sequence-parallel norms, whose gradients are Partial until the hook runs
