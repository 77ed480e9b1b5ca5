"""A PEFT (LoRA, attention projections) Mixtral through ``vescale.plan.build`` on ep2, dp2 x ep2 and ep2 x tp2, against
one device's PEFT model (plain peft + torch on the global batch).

Each case: the loss, every adapter's gradient after one step and the adapters after two AdamW steps equal one
device's (rtol 1e-5: sums in another order); the frozen base weights (the experts, ``Shard(0)`` over ep, included)
get no gradient, no optimizer state and no gradient buckets. Each data rank (dp x ep) runs its own rows. Adapters on
the experts' stacked parameters (peft ``target_parameters``) are refused on ep by name, and LoRA on cp is refused.
Tiny model, pooled ranks.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

peft = pytest.importorskip("peft")

BATCH, SEQ, VOCAB = 8, 8, 128
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAMW = {"lr": 0.01, "weight_decay": 0.0}


def _peft_mixtral(experts: bool = False):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                        num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager", use_cache=False)
    extra = {"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]} if experts else {}
    model = get_peft_model(MixtralForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, **extra))
    with torch.no_grad():  # lora_B starts at zero; nonzero makes lora_A's gradient a real check
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def _loss(logits, targets):
    import torch.nn.functional as F

    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _run(mesh: dict, zero: int = 0, experts: bool = False, tp_plan: str = "auto") -> None:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from vescale.core.testing import reference
    from vescale.plan import ParallelSpec, build

    what = f"{mesh} zero{zero} experts={experts} {tp_plan}"
    ref = _peft_mixtral(experts)
    par = build(_peft_mixtral(experts), ParallelSpec(mesh=mesh, zero=zero, tp_plan=tp_plan), loss_fn=_loss,
                batch_size=BATCH, seq_len=SEQ)
    opt = par.make_optimizer(torch.optim.AdamW, **ADAMW)
    named = dict(ref.named_parameters())
    trained = {n for n, p in named.items() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained), what
    ref_opt = torch.optim.AdamW([named[n] for n in sorted(trained)], **ADAMW)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    held = dict(par.model.named_parameters())
    assert set(held) == set(named), what
    assert {n for n, p in held.items() if p.requires_grad} == trained, what
    assert len(par.parameters()) == len(trained), what
    if par.ddp is not None:  # gradient buckets: the adapters only (no frozen weight is reduced)
        assert {slot.fqn for slot in par.ddp.slots.values()} == trained, what
    for name, p in held.items():
        dims = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        if "experts" in name:  # the frozen experts: this ep rank's rows
            assert p.placements[dims.index("ep")] == Shard(0), (what, name, p.placements)
        elif "tp" in mesh and ".lora_" in name:  # the adapters' layout, derived from their base layer's
            tp = p.placements[dims.index("tp")]
            column = any(f".{c}." in name for c in ("q_proj", "k_proj", "v_proj"))
            want = "lora_B" if column else "lora_A"
            assert (tp.is_shard() and tp.dim == (0 if column else 1)) == (f".{want}." in name), (what, name, tp)
    for step in range(2):
        inputs, targets = reference.progression_batch(4000 + step, BATCH, SEQ, VOCAB)
        opt.zero_grad()
        loss = par.forward_backward(par.shard_batch(inputs), par.shard_batch(targets))
        grads = par.grads()
        ref_opt.zero_grad()
        ref_loss = _loss(ref(input_ids=inputs), targets)
        ref_loss.backward()
        torch.testing.assert_close(par.global_loss(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=what)
        assert set(grads) == trained, (what, sorted(set(grads) ^ trained)[:4])
        if step == 0:
            for n in trained:
                torch.testing.assert_close(full(grads[n]), named[n].grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{what} grad {n}")
            for n, p in held.items():
                assert p.grad is None or ".lora_" in n, f"{what}: frozen {n} has a gradient"
        opt.step()
        ref_opt.step()
    state = opt.state_dict()["state"]
    assert len(state) == len(trained), what  # no optimizer state for the frozen base
    for n, p in held.items():
        torch.testing.assert_close(full(p), named[n].detach(), rtol=1e-5, atol=1e-6, msg=f"{what} after 2 steps {n}")


@multi_rank(world_sizes=[2])
def test_lora_mixtral_ep2():
    from vescale.plan import SpecError

    _run({"ep": 2})
    with pytest.raises(SpecError, match=r"experts' stacked parameters \('base_model\.model\.model\.layers\.0\.mlp"
                                        r"\.experts'.*refused on ep=2"):
        _run({"ep": 2}, experts=True)
    from vescale.plan import ParallelSpec, build

    with pytest.raises(SpecError, match=r"LoRA \(peft\) model on cp=2 is refused"):
        build(_peft_mixtral(), ParallelSpec(mesh={"cp": 2}), loss_fn=_loss, batch_size=BATCH, seq_len=SEQ)


@multi_rank(world_sizes=[4])
def test_lora_mixtral_dp2_ep2_and_ep2_tp2():
    _run({"dp": 2, "ep": 2})
    _run({"ep": 2, "tp": 2}, tp_plan="mixtral")
