"""A PEFT (LoRA) Llama and a PEFT Mixtral through ``vescale.plan.build`` on tp2 (family and auto plans), pp2 and dp2 x
tp2 (ZeRO 1, 2, 3), against one device's PEFT model (plain peft + torch on the global batch).

Each case: the loss, the adapters' data-averaged gradients after one step (rtol 1e-5: sums in another order) and the
adapters after two AdamW steps equal one device's; the frozen base weights get no gradient, no optimizer state and no
gradient bucket; and :func:`vescale.plan.lora.lora_plan` lays the adapters out from their base layers
(column-parallel: ``lora_B`` ``Shard(0)``; row-parallel: ``lora_A`` ``Shard(1)``). ``_run`` also serves
test_lora_ep.py (the Mixtral on ep). Tiny models (no download), 2 steps, pooled ranks.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

peft = pytest.importorskip("peft")

BATCH, SEQ = 8, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the column-parallel bases (the rest: row-parallel)
ADAMW = {"lr": 0.01, "weight_decay": 0.0}


def _peft(model, targets: list[str], **extra):
    """``model`` wrapped by peft's LoRA (r=4) on ``targets``, with nonzero ``lora_B`` (peft starts it at zero; nonzero
    makes ``lora_A``'s gradient a real check)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def _peft_llama(use_cache: bool = True):
    """A seeded 2-layer Llama (vocab 64, GQA 4/2) with adapters on every attention and MLP projection."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=use_cache)
    return _peft(LlamaForCausalLM(cfg), TARGETS)


def _peft_mixtral(use_cache: bool = False, experts: bool = False):
    """A seeded 2-layer Mixtral (vocab 128, 4 experts, top 2) with adapters on the attention projections, and with
    ``experts`` on the experts' stacked parameters too (peft ``target_parameters``)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                        num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager", use_cache=use_cache)
    extra = {"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]} if experts else {}
    return _peft(MixtralForCausalLM(cfg), ATTENTION, **extra)


MODELS = {"llama": _peft_llama, "mixtral": _peft_mixtral}


def _loss(logits, targets):
    import torch.nn.functional as F

    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _run(model: str, mesh: dict, zero: int = 0, tp_plan: str = "auto", experts: bool = False) -> None:
    """Build ``MODELS[model]`` on ``mesh`` and check it against one device's PEFT model over two AdamW steps."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from vescale.core.testing import reference
    from vescale.plan import ParallelSpec, build
    from vescale.plan.lora import has_adapters

    what = f"{model} {mesh} zero{zero} {tp_plan} experts={experts}"
    make = MODELS[model]
    kwargs = {"use_cache": "pp" not in mesh, **({"experts": True} if experts else {})}  # (pp captures the logits only)
    ref = make(**kwargs)
    vocab = ref.get_base_model().config.vocab_size
    par = build(make(**kwargs), ParallelSpec(mesh=mesh, zero=zero, tp_plan=tp_plan), loss_fn=_loss,
                batch_size=BATCH, seq_len=SEQ)
    opt = par.make_optimizer(torch.optim.AdamW, **ADAMW)
    named = dict(ref.named_parameters())
    trained = {n for n, p in named.items() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained), what
    ref_opt = torch.optim.AdamW([named[n] for n in sorted(trained)], **ADAMW)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    held = {n: p for m in par.modules for n, p in m.named_parameters()}  # (pp: this rank's stage)
    assert "pp" in mesh or set(held) == set(named), what
    mine = trained & set(held)
    assert mine and all(".lora_" in n or not p.requires_grad for n, p in held.items()), what
    assert len(par.parameters()) == len(mine), what  # what the optimizer and clipping see
    if par.ddp is not None:  # gradient buckets: the adapters only (no frozen weight is reduced)
        assert {slot.fqn for slot in par.ddp.slots.values()} == mine, what
    rows = {}  # pp x ep: this rank's expert rows of the reference
    for name, p in held.items():
        dims = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        if "ep" in mesh and "experts" in name:  # the frozen experts: this ep rank's rows (pp x ep: plain rows)
            if isinstance(p, DTensor):
                assert p.placements[dims.index("ep")] == Shard(0), (what, name, p.placements)
            else:
                rows[name] = named[name].detach().chunk(par.roles.ep.size)[par.roles.ep.rank]
                assert "pp" in mesh and p.shape == rows[name].shape, (what, name, p.shape)
        elif "tp" in mesh and isinstance(p, DTensor) and ".lora_" in name:  # derived from their base layer's
            tp = p.placements[dims.index("tp")]
            column = any(f".{c}." in name for c in COLUMN)
            want = "lora_B" if column else "lora_A"
            assert (tp.is_shard() and tp.dim == (0 if column else 1)) == (f".{want}." in name), (what, name, tp)
    for step in range(2):
        inputs, targets = reference.progression_batch(4000 + step, BATCH, SEQ, vocab)
        opt.zero_grad()
        loss = par.forward_backward(par.shard_batch(inputs), par.shard_batch(targets))
        grads = par.grads()
        ref_opt.zero_grad()
        ref_loss = _loss(ref(input_ids=inputs), targets)
        ref_loss.backward()
        torch.testing.assert_close(par.global_loss(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=what)
        assert set(grads) == mine, (what, sorted(set(grads) ^ mine)[:4])
        if step == 0:
            for n in mine:
                torch.testing.assert_close(full(grads[n]), named[n].grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{what} grad {n}")
            for n, p in held.items():
                assert p.grad is None or ".lora_" in n, f"{what}: frozen {n} has a gradient"
        opt.step()
        ref_opt.step()
    state = opt.state_dict()["state"]  # no optimizer state for the frozen base (ZeRO 1/2: this rank's share, by FQN)
    owned = {k for k in state if isinstance(k, str)}
    assert owned <= mine and (owned or len(state) == len(mine)), (what, len(state))
    assert has_adapters(par.held) and set(par.state()["model"]) == mine, what  # a checkpoint: the adapters only
    for n, p in held.items():
        want = rows.get(n, named[n].detach())
        torch.testing.assert_close(full(p), want, rtol=1e-5, atol=1e-6, msg=f"{what} after 2 steps {n}")


@multi_rank(world_sizes=[2])
def test_lora_tp2_and_pp2():
    _run("llama", {"tp": 2}, tp_plan="llama")
    _run("llama", {"tp": 2})
    _run("llama", {"pp": 2})
    _run("mixtral", {"tp": 2}, tp_plan="mixtral")
    _run("mixtral", {"tp": 2})
    _run("mixtral", {"pp": 2})


@multi_rank(world_sizes=[4])
def test_lora_dp2_tp2_zero1_2_3():
    for zero in (1, 2, 3):
        _run("llama", {"dp": 2, "tp": 2}, zero, tp_plan="llama")
        _run("mixtral", {"dp": 2, "tp": 2}, zero, tp_plan="mixtral")


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
