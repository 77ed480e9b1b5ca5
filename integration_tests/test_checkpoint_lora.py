"""A PEFT (LoRA) model's checkpoint state (``Parallelized.state``: the adapters and their optimizer state only)
saved from one ZeRO stage loads into another through ``vescale.checkpoint``: dp2 x tp2 ZeRO 1 (flat fp32 shards) into
dp2 x tp2 ZeRO 3 (FSDP2 shards); after one more step on the same batch both hold the same adapters."""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

pytest.importorskip("peft")


def _model():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for p in (p for n, p in model.named_parameters() if "lora_B" in n):
            p.uniform_(-0.1, 0.1)  # (peft starts lora_B at zero: lora_A's gradient would be zero)
    return model


def _next_token_loss(output, targets):
    import torch.nn.functional as F

    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def _reshard(directory: str) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from vescale import checkpoint
    from vescale.core.testing import reference
    from vescale.plan import ParallelSpec, build

    runs = []
    for zero in (1, 3):
        spec = ParallelSpec(mesh={"dp": 2, "tp": 2}, zero=zero, tp_plan="llama")
        par = build(_model(), spec, loss_fn=_next_token_loss, batch_size=8, seq_len=8)
        runs.append((par, par.make_optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.0)))

    def step(par, opt, seed: int) -> None:
        inputs, targets = reference.progression_batch(seed, 8, 8, 64)
        opt.zero_grad()
        par.forward_backward(par.shard_batch(inputs), par.shard_batch(targets))
        opt.step()

    (saved, saved_opt), (loaded, loaded_opt) = runs
    step(saved, saved_opt, 7000)
    checkpoint.save(directory, saved.state(saved_opt))
    result = checkpoint.load(directory, loaded.state(loaded_opt))
    assert not result.missing and not result.mismatched, result
    for par, opt in runs:
        step(par, opt, 7001)
    want, got = saved.state()["model"], loaded.state()["model"]
    assert set(want) == set(got) and want and all(".lora_" in n for n in want)

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    for name in want:
        torch.testing.assert_close(whole(got[name]), whole(want[name]), rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_sizes=[4])
def test_lora_adapters_and_adamw_state_reshard_from_zero1_to_zero3(tmp_path):
    _reshard(str(tmp_path / "adapters"))
