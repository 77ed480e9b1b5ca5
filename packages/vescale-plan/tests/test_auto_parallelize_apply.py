"""auto_parallelize builds what it chooses for cp, ep and ZeRO-3, and each equals one device.

One small case each on 2 ranks (fp32, rtol 1e-5: the parallel runs reorder reductions): the loss (averaged as the
result's notes say) and every parameter's gradient (gathered) against the single-device step on the global batch:

* cp=2 (``context_parallel`` + DDP over cp) on an eager Llama, the model's own loss with labels;
* ep=2 (``parallelize_experts``) on a Mixtral with 4 experts, each rank its half of the rows, loss x ``loss_scale``;
* dp=2 ZeRO-3 (``fully_shard_dp``) on the in-repo GPT.
"""

from __future__ import annotations

import torch

from vescale.core.testing import multi_rank


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _llama():
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            attn_implementation="eager"))


def _mixtral():
    import transformers as T

    torch.manual_seed(0)
    return T.MixtralForCausalLM(T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, num_local_experts=4,
                                                num_experts_per_tok=2, attn_implementation="eager"))


def _gpt():
    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, ffn_hidden=64))


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", None) if p.grad is None else p.grad
        out[name] = _full(grad).clone()
    return out


@multi_rank(world_sizes=[2])
def test_auto_parallelize_applies_cp(world_size):
    import torch.distributed as dist

    from vescale.plan import auto_parallelize

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    ref = _llama()
    ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    result = auto_parallelize(_llama(), world_size=world_size, batch_size=2, seq_len=16, fixed={"cp": 2},
                              zero_stages=(0,))
    assert result.report.chosen.dims == {"cp": 2} and result.report.applied
    loss = result.module(input_ids=result.shard_batch(ids), labels=result.shard_batch(ids)).loss
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / 2, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    grads = _grads(result.model)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_sizes=[2])
def test_auto_parallelize_applies_ep(world_size):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from vescale.plan import auto_parallelize, language_model_loss

    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
    ref = _mixtral()
    ref_loss = language_model_loss(ref(input_ids=ids, use_cache=False), targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    result = auto_parallelize(_mixtral(), world_size=world_size, batch_size=2, seq_len=8, fixed={"ep": 2},
                              example_kwargs={"input_ids": ids})
    assert result.report.chosen.dims == {"ep": 2} and result.loss_scale == 0.5
    loss = language_model_loss(result.module(input_ids=result.shard_batch(ids)), result.shard_batch(targets))
    (loss * result.loss_scale).backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / 2, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    experts = sum(isinstance(p, DTensor) and p.placements[0].is_shard() for p in result.model.parameters())
    assert experts == 4  # gate_up_proj and down_proj of 2 layers: Shard(0) over ep
    grads = _grads(result.model)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_sizes=[2])
def test_auto_parallelize_applies_zero3(world_size):
    import torch.distributed as dist
    import torch.nn.functional as F

    from vescale.plan import auto_parallelize, language_model_loss

    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
    ref = _gpt()
    ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    result = auto_parallelize(_gpt(), world_size=world_size, batch_size=4, seq_len=8, fixed={"dp": 2},
                              zero_stages=(3,))
    assert result.report.chosen.zero_stage == 3 and result.ddp is None
    opt = result.make_optimizer(torch.optim.AdamW, lr=1e-2)
    assert isinstance(opt, torch.optim.AdamW)
    loss = language_model_loss(result.module(result.shard_batch(ids)), result.shard_batch(targets))
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / 2, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    sharded = 0
    for name, p in result.model.named_parameters():
        sharded += p.to_local().numel() < p.numel()
        torch.testing.assert_close(_full(p.grad), ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert sharded > 0  # FSDP2 holds shards: parameters, gradients (and so the optimizer states) over dp
