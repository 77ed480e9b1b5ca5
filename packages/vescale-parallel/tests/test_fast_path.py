"""The fast path (:class:`vescale.parallel.fast.FastBlock`, :class:`vescale.parallel.fast.FastLayer`): known
attention/MLP blocks, and whole decoder layers whose two blocks qualify, run on local tensors between their plan's
boundaries.

Against the same model on one process (logits, loss, every parameter gradient, greedy tokens) and against the same
parallelized model with the fast path off (``fast_path(False)``: every block on DTensors, the path the rest of the
suite also checks); the fast path must actually run (``local_calls``), keep the KV cache as head-sharded DTensors, and
refuse where it cannot show it computes the same: strict mode, active attention dropout, a subclass of a
known block, a plan entry inside a block.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _llama(dropout: float = 0.0, attn: str = "sdpa"):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                         attention_dropout=dropout, attn_implementation=attn)
    return tf.LlamaForCausalLM(cfg).train()


def _blocks(model):
    from vescale.parallel.fast import FastBlock

    return {fqn: m.forward for fqn, m in model.named_modules() if isinstance(m.forward, FastBlock)}


def _layers(model):
    from vescale.parallel.fast import FastLayer

    return {fqn: m.forward for fqn, m in model.named_modules() if isinstance(m.forward, FastLayer)}


def _step(model, tokens, labels):
    import torch.nn.functional as F

    logits = model(input_ids=tokens, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return logits.detach(), loss.detach()


@multi_rank(world_sizes=[2])
def test_fast_blocks_match_single_device_and_dtensor_path():
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import fast_path

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    ref = _llama()
    fast = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    slow = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    blocks, layers = _blocks(fast), _layers(fast)
    assert sorted(blocks) == [f"model.layers.{i}.{b}" for i in range(2) for b in ("mlp", "self_attn")], blocks
    assert sorted(layers) == ["model.layers.0", "model.layers.1"], layers
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)

    with torch.no_grad():
        fast(input_ids=tokens, use_cache=False)  # probed for random ops (DTensor path)
    ref_logits, ref_loss = _step(ref, tokens, labels)
    logits, loss = _step(fast, tokens, labels)
    assert all(b.local_calls == 1 for b in blocks.values()), {k: b.local_calls for k, b in blocks.items()}
    assert all(layer.local_calls == 1 for layer in layers.values())
    with fast_path(False):
        slow_logits, slow_loss = _step(slow, tokens, labels)
    assert all(b.local_calls == 0 for b in _blocks(slow).values())

    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    # forward: the very local kernels and all-reduces the DTensor path runs, bitwise equal to it; backward: a fast
    # layer all-reduces a block's input gradient before the norm's backward (Megatron's order), where DTensor may
    # carry it as a partial sum further, so gradients agree to rounding
    assert torch.equal(logits, slow_logits) and torch.equal(loss, slow_loss)
    ref_params, slow_params = dict(ref.named_parameters()), dict(slow.named_parameters())
    for name, p in fast.named_parameters():
        assert tuple(p.grad.placements) == tuple(p.placements), name
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(p.grad.to_local(), slow_params[name].grad.to_local(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name} against the DTensor path: {m}")

    # decode: greedy tokens of one device; the KV cache holds DTensors sharded by head, as on the DTensor path
    # (this rank: 4 kv heads / tp 2), though the blocks ran locally
    ref.eval(), fast.eval()
    prompt = tokens[:, :5]
    with torch.no_grad():
        want = ref.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        got = fast.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        cache = fast(input_ids=prompt, use_cache=True).past_key_values
    assert torch.equal(got, want), (got, want)
    assert all(b.local_calls > 1 for b in blocks.values())
    keys = cache.layers[0].keys
    assert isinstance(keys, DTensor) and keys.to_local().shape == (4, 2, 5, 4), (type(keys), keys.shape)
    torch.testing.assert_close(keys.full_tensor(), ref(input_ids=prompt, use_cache=True).past_key_values.layers[0].keys,
                               rtol=RTOL, atol=ATOL)


@multi_rank(world_sizes=[2])
def test_fast_path_refuses_what_it_cannot_show_equal():
    import copy

    import torch
    import transformers as tf
    from torch.distributed.tensor import Replicate

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import distribute_tensor, strict
    from vescale.dtensor import random as vrandom
    from vescale.parallel import llama_plan, parallelize_module

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(1, dims=1)

    # strict mode sees every DTensor op: a block takes the DTensor path there (and still computes one device's MLP)
    ref = _llama()
    par = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    mlp = par.model.layers[0].mlp
    with torch.no_grad():
        mlp(distribute_tensor(x, mesh, [Replicate()]))  # probed for random ops (DTensor path)
    with strict():
        a = mlp(distribute_tensor(x, mesh, [Replicate()]))
    assert mlp.forward.local_calls == 0
    b = mlp(distribute_tensor(x, mesh, [Replicate()]))
    assert mlp.forward.local_calls == 1
    torch.testing.assert_close(a.full_tensor(), ref.model.layers[0].mlp(x), rtol=RTOL, atol=ATOL)
    assert torch.equal(a.full_tensor(), b.full_tensor())

    # a projection's parameter replaced after parallelizing (here: replicated): the checked layout no longer holds
    up = mlp.up_proj
    up.weight = torch.nn.Parameter(distribute_tensor(ref.model.layers[0].mlp.up_proj.weight.detach(), mesh,
                                                     [Replicate()]))
    c = mlp(distribute_tensor(x, mesh, [Replicate()]))
    assert mlp.forward.local_calls == 1
    torch.testing.assert_close(c.full_tensor(), ref.model.layers[0].mlp(x), rtol=RTOL, atol=ATOL)

    # active attention dropout in training: attention refuses, the MLPs (no dropout) still run locally
    # (eager attention: vescale's counter RNG draws the masks; the fused sdpa kernel's dropout is refused on DTensors)
    par = parallelize_module(_llama(dropout=0.1, attn="eager"), mesh, llama_plan(mesh))
    vrandom.manual_seed(3)
    with torch.no_grad():
        par(input_ids=tokens, use_cache=False)  # probed for random ops (DTensor path)
    _step(par, tokens, labels)
    calls = {fqn: b.local_calls for fqn, b in _blocks(par).items()}
    assert calls == {"model.layers.0.self_attn": 0, "model.layers.0.mlp": 1, "model.layers.1.self_attn": 0,
                     "model.layers.1.mlp": 1}, calls
    assert [layer.local_calls for layer in _layers(par).values()] == [0, 0]  # a layer needs both blocks fast

    # a subclass of a known block may compute anything: not installed
    class MyAttention(tf.models.llama.modeling_llama.LlamaAttention):
        pass

    model = _llama()
    for layer in model.model.layers:
        old = layer.self_attn
        layer.self_attn = MyAttention(model.config, old.layer_idx)
    par = parallelize_module(model, mesh, llama_plan(mesh))
    assert sorted(_blocks(par)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert not _layers(par)

    # a plan entry inside a block: the plan wants a boundary there, so the block stays on DTensors
    plan = llama_plan(mesh)
    plan["input"][r"model\.layers\.\d+\.self_attn\.q_proj"] = [[Replicate()]]
    par = parallelize_module(_llama(), mesh, plan)
    assert sorted(_blocks(par)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert not _layers(par)

    # whole layers need replicated block outputs (sequence parallelism reduce-scatters them) and no plan entry at a
    # norm; the blocks alone still run locally there
    par = parallelize_module(_llama(), mesh, llama_plan(mesh, sequence_parallel=True))
    assert len(_blocks(par)) == 4 and not _layers(par)
    plan = llama_plan(mesh)
    plan["output"][r"model\.layers\.0\.input_layernorm"] = [[Replicate()]]
    par = parallelize_module(_llama(), mesh, plan)
    assert len(_blocks(par)) == 4 and sorted(_layers(par)) == ["model.layers.1"]
