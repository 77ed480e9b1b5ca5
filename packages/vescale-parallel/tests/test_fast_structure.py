"""The fast path recognises modules by structure, not by class name (:mod:`vescale.parallel.fast.structure`).

transformers models outside the families the fast path was written against, of the same structure (Granite: its own
multipliers around Llama's layout; Gemma: a ``1 + weight`` RMSNorm and an embedding subclass that scales) run on
local tensors under ``llama_plan`` and compute what one device computes (logits, loss, every gradient) and, in
forward, bitwise what the DTensor path computes. A module of the same structure that transformers does not define
(vescale's own GPT) is not recognised; an active dropout the module draws itself sends it to the DTensor path. Names
that left ``vescale.parallel.local`` still import from there, with a ``DeprecationWarning`` naming the new spelling.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _other_family(name: str):
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    if name == "granite":  # Llama's layout with its own multipliers of the embeddings, residuals, attention, logits
        return tf.GraniteForCausalLM(tf.GraniteConfig(**common, embedding_multiplier=2.0, residual_multiplier=0.5,
                                                      attention_multiplier=0.3, logits_scaling=3.0))
    return tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=8))


@multi_rank(world_sizes=[2])
@pytest.mark.parametrize("family", ["granite", "gemma"])
def test_same_structure_other_family_runs_fast_and_matches_one_device(family):
    import copy

    import torch
    import torch.nn.functional as F

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import FastBlock, FastLayer, FastModel, fast_path

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    ref = _other_family(family).train()
    fast = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    slow = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    # Gemma's embedding is a subclass that scales what it looks up: the whole-model lookup would skip that, so only
    # its layers run locally
    assert isinstance(fast.forward, FastModel) == (family == "granite")
    assert all(isinstance(layer.forward, FastLayer) for layer in fast.model.layers)
    assert all(isinstance(layer.self_attn.forward, FastBlock) and layer.self_attn.forward.kind == "attention"
               and isinstance(layer.mlp.forward, FastBlock) and layer.mlp.forward.kind == "mlp"
               for layer in fast.model.layers)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)

    def step(model):
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        return logits.detach(), loss.detach()

    with torch.no_grad():
        fast(input_ids=tokens, use_cache=False)  # probed for random ops (DTensor path)
    ref_logits, ref_loss = step(ref)
    logits, loss = step(fast)
    assert all(layer.forward.local_calls == 1 for layer in fast.model.layers)
    with fast_path(False):
        slow_logits, slow_loss = step(slow)
    assert all(layer.forward.local_calls == 0 for layer in slow.model.layers)
    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert torch.equal(logits, slow_logits) and torch.equal(loss, slow_loss)  # forward: bitwise the DTensor path
    ref_params = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        assert tuple(p.grad.placements) == tuple(p.placements), name
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@multi_rank(world_sizes=[2])
def test_dropout_in_training_takes_the_dtensor_path():
    """A nonzero dropout of a recognised module's config (here a decoder layer's residual dropout, which the layer
    draws on its activation) sends the call to the DTensor path in training, where vescale's RNG draws one device's
    masks; in eval the fast path runs."""
    import torch
    import transformers as tf

    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_module, qwen2_plan

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    cfg = tf.SeedOssConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                           attention_dropout=0.0, residual_dropout=0.1)
    model = parallelize_module(tf.SeedOssForCausalLM(cfg).train(), mesh, qwen2_plan(mesh))  # (q/k/v biases)
    layer = model.model.layers[0]
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens, use_cache=False)
    assert (model.forward.local_calls, layer.forward.local_calls) == (0, 0)
    model.eval()
    with torch.no_grad():
        model(input_ids=tokens, use_cache=False)  # the first eval call is probed for random ops, on DTensors
        model(input_ids=tokens, use_cache=False)
    assert (model.forward.local_calls, layer.forward.local_calls) == (1, 1)


@multi_rank(world_sizes=[2])
def test_same_structure_outside_transformers_is_not_recognised():
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.parallel import gpt_plan, parallelize_module
    from vescale.parallel.fast import FastBlock, FastLayer, FastModel

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=64, max_seq_len=16))
    parallelize_module(model, mesh, gpt_plan(mesh))
    fast = [fqn for fqn, m in model.named_modules()
            if isinstance(vars(m).get("forward"), (FastBlock, FastLayer, FastModel))]
    assert fast == [], fast


@pytest.mark.parametrize("name", ["FastBlock", "FastLayer", "FastModel", "fast_path"])
def test_moved_names_import_from_the_old_module_with_a_warning(name):
    import vescale.parallel.fast as fast
    import vescale.parallel.local as local

    with pytest.warns(DeprecationWarning, match=rf"vescale\.parallel\.fast\.{name}"):
        got = getattr(local, name)
    assert got is getattr(fast, name)
    with pytest.raises(AttributeError):
        local.FAST_BLOCKS  # noqa: B018 (a name no module outside the package imported: not served)
