"""The whole causal LM on local tensors (:class:`vescale.parallel.fast.FastModel`): token ids in, logits out, the
vocab-parallel embedding, rotary embedding, masks, every layer, the final norm and the lm head on this rank's local
tensors with Megatron's explicit collectives.

Against the same model on one process (logits, loss, every parameter gradient, greedy tokens of a padded prompt, a
decode step's logits from the cache) and against the same parallelized model with the fast path off; the fast model
must actually run (``local_calls``), keep the root's boundary (plain logits, or a vocab-sharded DTensor under
``loss_parallel``) and the KV cache as head-sharded DTensors, and stand aside where it cannot show it computes the
same: labels (the loss wants the full vocabulary), strict mode, tied embeddings.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _config(cls_name: str = "LlamaConfig", **extra):
    import transformers as tf

    return getattr(tf, cls_name)(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32, **extra)


def _grads_match(par, ref, slow=None) -> None:
    import torch

    ref_params = dict(ref.named_parameters())
    slow_params = dict(slow.named_parameters()) if slow is not None else {}
    for name, p in par.named_parameters():
        assert tuple(p.grad.placements) == tuple(p.placements), name
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
        if slow is not None:
            torch.testing.assert_close(p.grad.to_local(), slow_params[name].grad.to_local(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name: f"{name} against the DTensor path: {m}")


@multi_rank(world_sizes=[2])
def test_fast_model_matches_single_device_and_dtensor_path():
    import copy

    import torch
    import torch.nn.functional as F
    import transformers as tf
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import FastModel, fast_path

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(_config()).train()
    fast = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    slow = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    assert isinstance(fast.forward, FastModel)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)

    def step(model):
        logits = model(input_ids=tokens).logits  # use_cache from the config: a cache is made and filled
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        return logits.detach(), loss.detach()

    with torch.no_grad():
        fast(input_ids=tokens)  # probed for random ops (DTensor path)
    ref_logits, ref_loss = step(ref)
    logits, loss = step(fast)
    assert fast.forward.local_calls == 1
    with fast_path(False):
        slow_logits, slow_loss = step(slow)
    assert slow.forward.local_calls == 0
    assert type(logits) is torch.Tensor and logits.shape == (4, 8, 64)
    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert torch.equal(logits, slow_logits) and torch.equal(loss, slow_loss)  # forward: bitwise the DTensor path
    _grads_match(fast, ref, slow)

    # decode: greedy tokens of one device for a prompt with a pad token inside (generate masks it), and a decode
    # step's logits from a cache the fast model filled, which holds head-sharded DTensors
    ref.eval(), fast.eval()
    prompt = tokens[:, :5].clone()
    prompt[1, 1] = 0
    with torch.no_grad():
        fast(input_ids=prompt)  # probed for random ops (DTensor path)
    calls = fast.forward.local_calls
    with torch.no_grad():
        want = ref.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        got = fast.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert fast.forward.local_calls == calls + 4
        assert torch.equal(got, want), (got, want)
        out, ref_out = fast(input_ids=prompt, use_cache=True), ref(input_ids=prompt, use_cache=True)
        keys = out.cache.layers[1].keys
        assert isinstance(keys, DTensor) and keys.to_local().shape == (4, 2, 5, 4), (type(keys), keys.shape)
        nxt = tokens[:, 5:6]
        step_logits = fast(input_ids=nxt, cache=out.cache).logits
        ref_step = ref(input_ids=nxt, cache=ref_out.cache).logits
    torch.testing.assert_close(step_logits, ref_step, rtol=RTOL, atol=ATOL)
    keys = out.cache.layers[1].keys
    assert isinstance(keys, DTensor) and keys.to_local().shape == (4, 2, 6, 4), (type(keys), keys.shape)
    torch.testing.assert_close(keys.full_tensor(), ref_out.cache.layers[1].keys, rtol=RTOL, atol=ATOL)


@multi_rank(world_sizes=[4])
def test_fast_model_dp_tp_loss_parallel_qwen2():
    """dp=2 x tp=2, Qwen2 (q/k/v biases), each dp rank its own batch, logits returned vocab-sharded (loss_parallel)."""
    import copy

    import torch
    import transformers as tf
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_module, qwen2_plan, vocab_parallel_cross_entropy
    from vescale.parallel.fast import FastModel

    mesh = init_mesh({"dp": 2, "tp": 2})
    torch.manual_seed(0)
    ref = tf.Qwen2ForCausalLM(_config("Qwen2Config")).train()
    par = parallelize_module(copy.deepcopy(ref), mesh, qwen2_plan(mesh, loss_parallel=True))
    assert isinstance(par.forward, FastModel)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
    ref_logits = ref(input_ids=tokens, use_cache=False).logits
    torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), labels.flatten()).backward()

    dp = mesh.get_local_rank(0)
    rows = slice(2 * dp, 2 * dp + 2)
    with torch.no_grad():
        par(input_ids=tokens[rows], use_cache=False)  # probed for random ops (DTensor path)
    logits = par(input_ids=tokens[rows], use_cache=False).logits
    assert par.forward.local_calls == 1
    assert isinstance(logits, DTensor) and tuple(logits.placements) in {(Shard(0), Shard(2)), (Shard(0), Shard(-1))}
    torch.testing.assert_close(logits.redistribute(mesh, [Shard(0), Replicate()]).to_local(), ref_logits[rows].detach(),
                               rtol=RTOL, atol=ATOL)
    vocab_parallel_cross_entropy(logits, labels[rows]).backward()  # the mean over the global batch
    _grads_match(par, ref)


@multi_rank(world_sizes=[2])
def test_fast_model_stands_aside_where_it_cannot_show_equal():
    import copy

    import torch
    import transformers as tf

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import strict
    from vescale.dtensor.errors import StrictRedistributeError
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import FastLayer, FastModel

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(_config()).train()
    par = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(1, dims=1)

    # labels: Hugging Face's loss wants the full vocabulary; the model's own forward runs (its layers still fast)
    with torch.no_grad():
        par(input_ids=tokens, labels=labels, use_cache=False)  # probed for random ops (DTensor path)
    loss = par(input_ids=tokens, labels=labels, use_cache=False).loss
    ref_loss = ref(input_ids=tokens, labels=labels, use_cache=False).loss
    assert par.forward.local_calls == 0 and par.model.layers[0].forward.local_calls == 1
    torch.testing.assert_close(loss.full_tensor() if hasattr(loss, "full_tensor") else loss, ref_loss,
                               rtol=RTOL, atol=ATOL)

    # strict mode sees every DTensor op: the DTensor path runs, and strict mode objects to the embedding's implicit
    # redistribution there, as without the fast path
    with strict(), pytest.raises(StrictRedistributeError, match="aten.embedding"):
        par(input_ids=tokens, use_cache=False)
    assert par.forward.local_calls == 0

    # a layer checkpointed after parallelizing (its forward replaced): the model stands aside, values as one device
    from vescale.parallel import checkpoint_activations

    checkpoint_activations(par)
    logits = par(input_ids=tokens, use_cache=False).logits
    assert par.forward.local_calls == 0
    torch.testing.assert_close(logits, ref(input_ids=tokens, use_cache=False).logits, rtol=RTOL, atol=ATOL)

    # tied embeddings (one parameter for the embedding and the lm head): not installed, layers still fast
    tied = tf.LlamaForCausalLM(_config(tie_word_embeddings=True))
    par = parallelize_module(tied, mesh, llama_plan(mesh))
    assert not isinstance(par.forward, FastModel) and isinstance(par.model.layers[0].forward, FastLayer)


@multi_rank(world_sizes=[2])
def test_fast_model_decode_cache_and_logits_as_dtensor_path():
    """Decode steps on the fast path (the grown KV cache wrapped below autograd, the logits gathered in one collective)
    against the DTensor path and one device: the cache's DTensors have the same values, placements and
    ``requires_grad``, under ``torch.no_grad`` and in grad mode; under ``loss_parallel`` the logits stay
    vocab-sharded (nothing gathered), without gradient under ``torch.no_grad``."""
    import copy

    import torch
    import transformers as tf
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import fast_path

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(_config()).eval()
    fast = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    slow = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    assert fast.forward.gathered_placements == (Replicate(),)  # the root's entry wants full logits: gathered here
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))

    def decode(model):  # a prompt, then two decode steps from its cache (the second grows a grown cache)
        out = model(input_ids=tokens[:, :5], use_cache=True)
        model(input_ids=tokens[:, 5:6], cache=out.cache)
        return out.cache, model(input_ids=tokens[:, 6:7], cache=out.cache).logits

    with torch.no_grad():
        ref_cache, ref_logits = decode(ref)
        fast(input_ids=tokens, use_cache=False)  # probed for random ops (DTensor path)
    for grad in (False, True):
        calls = fast.forward.local_calls
        with torch.set_grad_enabled(grad):
            cache, logits = decode(fast)
            with fast_path(False):
                slow_cache, slow_logits = decode(slow)
        assert fast.forward.local_calls == calls + 3 and slow.forward.local_calls == 0
        assert type(logits) is torch.Tensor and logits.requires_grad == grad and logits.shape == (2, 1, 64)
        assert torch.equal(logits, slow_logits)
        torch.testing.assert_close(logits.detach(), ref_logits, rtol=RTOL, atol=ATOL)
        for i, (layer, slow_layer) in enumerate(zip(cache.layers, slow_cache.layers)):
            for name in ("keys", "values"):
                got, want = getattr(layer, name), getattr(slow_layer, name)
                where = f"grad={grad} layer {i} {name}"
                assert isinstance(got, DTensor) and tuple(got.placements) == (Shard(1),) == tuple(want.placements), \
                    (where, type(got), getattr(got, "placements", None))
                assert got.shape == want.shape == (2, 4, 7, 4) and got.stride() == want.stride(), where
                assert got.requires_grad == want.requires_grad == grad, (where, got.requires_grad, want.requires_grad)
                assert got.to_local().shape == (2, 2, 7, 4), where
                assert torch.equal(got.full_tensor().detach(), want.full_tensor().detach()), where
                torch.testing.assert_close(got.full_tensor().detach(), getattr(ref_cache.layers[i], name),
                                           rtol=RTOL, atol=ATOL, msg=lambda m, where=where: f"{where}: {m}")

    # loss_parallel: the root keeps the logits vocab-sharded, so the fast model gathers nothing
    sharded = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh, loss_parallel=True))
    assert sharded.forward.gathered_placements is None
    with torch.no_grad():
        sharded(input_ids=tokens, use_cache=False)  # probed for random ops (DTensor path)
        logits = sharded(input_ids=tokens, use_cache=False).logits
        ref_full = ref(input_ids=tokens, use_cache=False).logits
    assert sharded.forward.local_calls == 1
    assert isinstance(logits, DTensor) and tuple(logits.placements) in {(Shard(2),), (Shard(-1),)} \
        and not logits.requires_grad and logits.to_local().shape == (2, 7, 32)
    torch.testing.assert_close(logits.full_tensor(), ref_full, rtol=RTOL, atol=ATOL)
