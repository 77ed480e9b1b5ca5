"""TP/SP of unmodified Hugging Face models (Llama, Qwen2, Mixtral, GPT-2) against the same model on one process.

One multi-rank test per model and world size. World size 2: tp=2 with sequence parallelism, dropout on (vescale's
counter RNG, so masks are the single-device ones bit for bit), and the model's *own* loss (``labels=``) computed
vocab-parallel under :func:`vescale.parallel.loss_parallel`. World size 4: tp=4 plain TP with the models' default
``sdpa`` attention (torch's CPU kernel under vescale's head-sharded rule), gathered logits at the boundary and an
external loss, then a 2x2 dp x tp mesh with SP, dropout and :func:`vocab_parallel_cross_entropy`
with label smoothing. fp32. Logits, loss and every parameter gradient: ``assert_close(rtol=1e-5, atol=1e-6)`` (not
bitwise: sharding reorders reductions); each gradient's placements equal its parameter's.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6
MODELS = ["llama", "qwen2", "mixtral", "gpt2"]


def _build(kind: str, dropout: float, attn: str):
    import transformers as tf

    # 8 heads / 4 kv heads (GQA) and every sharded size divide tp=4.
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=32, attention_dropout=dropout,
                  attn_implementation=attn)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif kind == "mixtral":
        # the eager experts loop (not grouped_mm) is the single-device reference on CPU
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=4,
                                                       num_experts_per_tok=2, experts_implementation="eager"))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                 resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                                 attn_implementation=attn, eos_token_id=0, bos_token_id=0))
    return model.train()


def _run_case(kind: str, mesh_dims: dict, *, sp: bool, dropout: float, mode: str, attn: str = "eager"):
    """``mode``: "hf_loss" (labels= under loss_parallel), "plain" (gathered logits), "vocab" (vocab-parallel CE).
    ``attn``: the model's ``attn_implementation`` ("sdpa": torch's CPU attention kernel, vescale's sharding rule)."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import random as vrandom
    from vescale.parallel import PLANS, loss_parallel, parallelize_module, vocab_parallel_cross_entropy

    mesh = init_mesh(mesh_dims)
    dp = mesh_dims.get("dp", 1)
    torch.manual_seed(0)
    ref = _build(kind, dropout, attn)
    par = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (4, 8), generator=g)
    labels = torch.randint(0, 64, (4, 8), generator=g)
    labels[2, 4:] = -100
    smoothing = 0.1 if mode == "vocab" else 0.0

    vrandom.manual_seed(5)
    with vrandom.single_device():
        ref_out = ref(input_ids=tokens, labels=labels if mode == "hf_loss" else None, use_cache=False)
    ref_logits = ref_out.logits
    if mode == "hf_loss":
        ref_loss = ref_out.loss
    else:
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), label_smoothing=smoothing)
    ref_loss.backward()

    plan = PLANS[kind](mesh, sequence_parallel=sp, loss_parallel=mode != "plain")
    parallelize_module(par, mesh, plan)
    r = mesh.get_local_rank("dp") if dp > 1 else 0
    my_tokens, my_labels = tokens.chunk(dp)[r], labels.chunk(dp)[r]
    vrandom.manual_seed(5)
    if mode == "hf_loss":
        with loss_parallel():
            out = par(input_ids=my_tokens, labels=my_labels, use_cache=False)
        loss, logits = out.loss, out.logits.full_tensor()
        assert type(loss) is torch.Tensor  # the root boundary turns the DTensor loss into a plain tensor
        loss.backward()
        loss_value = loss.detach()
    elif mode == "plain":
        logits = par(input_ids=my_tokens, use_cache=False).logits
        assert type(logits) is torch.Tensor and logits.shape == (4 // dp, 8, 64)
        loss = F.cross_entropy(logits.flatten(0, 1), my_labels.flatten(), reduction="sum") / (labels != -100).sum()
        loss.backward()
        loss_value = loss.detach()
        if dp > 1:
            dist.all_reduce(loss_value, group=mesh.get_group("dp"))
            parts = [torch.empty_like(logits) for _ in range(dp)]
            dist.all_gather(parts, logits.detach().contiguous(), group=mesh.get_group("dp"))
            logits = torch.cat(parts)
    else:
        out_logits = par(input_ids=my_tokens, use_cache=False).logits
        loss = vocab_parallel_cross_entropy(out_logits, my_labels, label_smoothing=smoothing)
        loss.backward()
        logits, loss_value = out_logits.full_tensor(), loss.full_tensor()

    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss_value, ref_loss, rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    assert list(ref_params) == [n for n, _ in par.named_parameters()]
    for name, p in par.named_parameters():
        assert tuple(p.grad.placements) == tuple(p.placements), (name, p.grad.placements, p.placements)
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{kind} {mesh_dims} {name}: {m}")
    return par


@pytest.mark.parametrize("kind", MODELS)
@multi_rank(world_sizes=[2, 4])
def test_hf_model_matches_single_device(kind, world_size):
    if world_size == 2:
        _run_case(kind, {"tp": 2}, sp=True, dropout=0.1, mode="hf_loss")
    else:
        _run_case(kind, {"tp": 4}, sp=False, dropout=0.0, mode="plain", attn="sdpa")
        _run_case(kind, {"dp": 2, "tp": 2}, sp=True, dropout=0.1, mode="vocab")
