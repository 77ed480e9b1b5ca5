"""A PEFT (LoRA) Llama through ``vescale.plan.build`` on tp, pp and dp x tp (ZeRO 1, 2, 3), against one device's PEFT
model.

Each case: the adapters' data-averaged gradients after one step (rtol 1e-5: sums in another order) and the adapters
after two AdamW steps equal one device's; the frozen base weights get no gradient and no optimizer state; and
:func:`vescale.plan.lora.lora_plan` lays the adapters out from their base layers (column-parallel: ``lora_B``
``Shard(0)``; row-parallel: ``lora_A`` ``Shard(1)``). Tiny model (no download), 2 steps, pooled ranks.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

peft = pytest.importorskip("peft")

BATCH, SEQ, VOCAB = 8, 8, 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAMW = {"lr": 0.01, "weight_decay": 0.0}


def _peft_llama(use_cache: bool = True):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=use_cache)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():  # lora_B starts at zero; nonzero makes lora_A's gradient a real check
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def _loss(logits, targets):
    import torch.nn.functional as F

    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _run(mesh: dict, zero: int, tp_plan: str = "llama") -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from vescale.core.testing import reference
    from vescale.plan import ParallelSpec, build

    what = f"{mesh} zero{zero} {tp_plan}"
    cache = "pp" not in mesh  # (a pipeline captures the logits only)
    ref = _peft_llama(cache)
    par = build(_peft_llama(cache), ParallelSpec(mesh=mesh, zero=zero, tp_plan=tp_plan), loss_fn=_loss,
                batch_size=BATCH, seq_len=SEQ)
    opt = par.make_optimizer(torch.optim.AdamW, **ADAMW)
    named = dict(ref.named_parameters())
    trained = {n for n, p in named.items() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained), what
    ref_opt = torch.optim.AdamW([named[n] for n in sorted(trained)], **ADAMW)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    held = {n: p for m in par.modules for n, p in m.named_parameters()}  # (pp: this rank's stage)
    mine = trained & set(held)
    assert mine and all(".lora_" in n or not p.requires_grad for n, p in held.items()), what
    assert len(par.parameters()) == len(mine), what  # what the optimizer and clipping see
    if par.ddp is not None:  # gradient buckets: the adapters only (no frozen weight is reduced)
        assert {slot.fqn for slot in par.ddp.slots.values()} == mine, what
    for name, p in held.items():  # the adapters' layout, derived from their base layer's
        if "tp" in mesh and isinstance(p, DTensor) and ".lora_" in name:
            tp = p.placements[p.device_mesh.mesh_dim_names.index("tp")]
            column = any(f".{c}." in name for c in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
            want = "lora_B" if column else "lora_A"
            assert (tp.is_shard() and tp.dim == (0 if column else 1)) == (f".{want}." in name), (what, name, tp)
    for step in range(2):
        inputs, targets = reference.progression_batch(4000 + step, BATCH, SEQ, VOCAB)
        opt.zero_grad()
        par.forward_backward(par.shard_batch(inputs), par.shard_batch(targets))
        grads = par.grads()
        ref_opt.zero_grad()
        _loss(ref(input_ids=inputs), targets).backward()
        assert set(grads) == mine, (what, sorted(set(grads) ^ mine)[:4])
        if step == 0:
            for n in mine:
                torch.testing.assert_close(full(grads[n]), named[n].grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{what} grad {n}")
            for n, p in held.items():
                assert p.grad is None or ".lora_" in n, f"{what}: frozen {n} has a gradient"
        opt.step()
        ref_opt.step()
    from vescale.plan.lora import has_adapters

    assert has_adapters(par.held) and set(par.state()["model"]) == mine, what  # a checkpoint: the adapters only
    for n, p in held.items():
        torch.testing.assert_close(full(p), named[n].detach(), rtol=1e-5, atol=1e-6, msg=f"{what} after 2 steps {n}")


@multi_rank(world_sizes=[2])
def test_lora_tp2_and_pp2():
    _run({"tp": 2}, 0)
    _run({"tp": 2}, 0, tp_plan="auto")
    _run({"pp": 2}, 0)


@multi_rank(world_sizes=[4])
def test_lora_dp2_tp2_zero1_2_3():
    _run({"dp": 2, "tp": 2}, 1)
    _run({"dp": 2, "tp": 2}, 2)
    _run({"dp": 2, "tp": 2}, 3)


def test_lora_plan_derives_adapters_and_explains():
    """One process: a hand plan of the unwrapped Llama, its PEFT model's plan (base entries kept, adapters derived,
    boundaries moved to the LoRA layers and the inner model's root), and explain()'s rows for them."""
    from torch.distributed.tensor import Replicate, Shard

    from vescale.plan import explain
    from vescale.plan.lora import lora_plan

    plan = {"parameter": {r"model\.layers\.\d+\.self_attn\.q_proj\.weight": [Shard(0)],
                          r"model\.layers\.\d+\.self_attn\.o_proj\.weight": [Shard(1)]},
            "input": {"": [[Replicate()]]},
            "output": {r"model\.layers\.\d+\.self_attn\.o_proj": [[Replicate()]]}}
    got = lora_plan(_peft_llama(), plan)
    layer = r"base_model\.model\.model\.layers\.0\.self_attn"
    params = got["parameter"]
    assert params[rf"{layer}\.q_proj\.base_layer\.weight"] == [Shard(0)]
    assert params[rf"{layer}\.q_proj\.lora_A\.default\.weight"] == [Replicate()]
    assert params[rf"{layer}\.q_proj\.lora_B\.default\.weight"] == [Shard(0)]
    assert params[rf"{layer}\.o_proj\.lora_A\.default\.weight"] == [Shard(1)]
    assert params[rf"{layer}\.o_proj\.lora_B\.default\.weight"] == [Replicate()]
    assert params[rf"{layer}\.k_proj\.lora_B\.default\.weight"] == [Replicate()]  # base not in the plan
    assert set(got["output"]) == {rf"{layer}\.o_proj", r"base_model\.model\.model\.layers\.1\.self_attn\.o_proj"}
    assert set(got["input"]) == {r"base_model\.model"}
    text = explain(got)
    row = next(line for line in text.splitlines() if "layers.0.self_attn.o_proj.lora_A" in line)
    assert "adapter" in row and "lora_A of model.layers.0.self_attn.o_proj.weight [S(1)]" in row, row
