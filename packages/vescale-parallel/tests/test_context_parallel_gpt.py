"""Context parallelism of a model with its own attention arithmetic (the causal-attention hook) against one process.

The in-repo GPT (``vescale.core.testing.models``: attention written out op by op, called through its
``causal_attention`` method, rotary tables from ``positions``) runs unmodified under
:func:`vescale.parallel.context_parallel`. Each rank's loss is the mean next-token loss of its own positions (equal
counts per rank), so the mean over cp ranks of the losses and of the gradients is one device's. Checked against the
same model on one process, fp32 ``rtol=1e-5``: logits (gathered back into sequence order), loss, every gradient.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _case(dims: dict, checkpointed: bool = False):
    import copy

    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.core.testing.models import GPT, GPTConfig, cross_entropy
    from vescale.parallel import context_parallel, gather_sequence
    from vescale.parallel.context_parallel import local_positions

    mesh = init_mesh(dims)
    cp_mesh = sub_mesh(mesh, "cp")
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=32)).train()
    par = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref_logits = ref(x)
    cross_entropy(ref_logits, y).backward()

    context_parallel(par, cp_mesh)
    if checkpointed:  # the recompute in backward must attend over the whole sequence again
        from vescale.parallel import checkpoint_activations

        checkpoint_activations(par, "full")
    logits = par(x)
    loss = cross_entropy(logits, y[:, local_positions(x.shape[1], cp, rank)])
    loss.backward()
    torch.testing.assert_close(gather_sequence(logits.detach(), cp_mesh), ref_logits.detach(), rtol=RTOL, atol=ATOL)
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_mesh.get_group())
    torch.testing.assert_close(total / cp, cross_entropy(ref_logits, y).detach(), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp_mesh.get_group())
        torch.testing.assert_close(grad / cp, ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{dims} {name}: {m}")


@pytest.mark.parametrize("checkpointed", [False, True])
@multi_rank(world_sizes=[2])
def test_gpt_cp2_matches_single_device(checkpointed):
    _case({"cp": 2}, checkpointed)


def _refusals():
    import torch
    from torch import nn

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.parallel import ContextParallelError, context_parallel

    messages = []
    with pytest.raises(ContextParallelError) as info:  # no transformers config, no causal_attention method
        context_parallel(nn.Sequential(nn.Linear(4, 4)), init_mesh({"cp": 2}))
    messages.append(str(info.value))
    model = context_parallel(GPT(GPTConfig(vocab_size=64, d_model=32, n_head=4, dropout=0.1)).train(),
                             init_mesh({"cp": 2}))
    with pytest.raises(ContextParallelError) as info:
        model(torch.zeros(1, 16, dtype=torch.long))
    messages.append(str(info.value))
    with pytest.raises(ContextParallelError) as info:
        model(torch.zeros(1, 6, dtype=torch.long))
    messages.append(str(info.value))
    return messages


@multi_rank(world_sizes=[2])
def test_hook_refusals_name_the_reason():
    messages = _refusals()
    assert "causal_attention(q, k, v)" in messages[0]
    assert "dropout" in messages[1]
    assert "not divisible by 2 x cp = 4" in messages[2]
