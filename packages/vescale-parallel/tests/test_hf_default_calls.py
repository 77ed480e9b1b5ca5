"""An unmodified Hugging Face model called the way its users call it, after ``parallelize_module``, against the same
calls on one process.

The model's defaults stay on: ``use_cache=True`` (the config's default), ``attn_implementation="sdpa"``. Each
data-parallel rank passes its own rows of a left-padded batch (attention mask with zeros) and the single-device
reference runs the whole batch. Checked: logits, the model's own loss (``labels=``) and every parameter gradient
(fp32, rtol 1e-5: sharding reorders reductions); ``return_dict=False``; ``output_hidden_states=True`` (plain tensors
at the boundary); explicit ``position_ids``; prefill plus two decode steps through a ``DynamicCache`` and a
``StaticCache`` passed in, with each rank's cache holding only its own key/value heads; ``generate()`` token for
token (greedy with the dynamic and the static cache; sampling with top-k/top-p under one seed where every rank
holds the whole batch). Meshes: tp=1 (world size 1), tp=2, and dp=2 x tp=2.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6
MESHES = {1: {"tp": 1}, 2: {"tp": 2}, 4: {"dp": 2, "tp": 2}}


def _config():
    import transformers as tf

    # GQA: 4 query heads, 2 key/value heads; the defaults (use_cache=True, sdpa) are left as they are.
    return tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)


def _batch(rows: int):
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (rows, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as a tokenizer pads for generation
    mask[rows - 1, :1] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


@multi_rank(world_sizes=[1, 2, 4])
def test_default_calls_match_single_device(world_size):
    import copy

    import torch
    import transformers as tf
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module

    mesh_dims = MESHES[world_size]
    mesh = init_mesh(mesh_dims)
    dp, tp = mesh_dims.get("dp", 1), mesh_dims["tp"]
    config = _config()
    assert config.use_cache is True
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(config)
    par = copy.deepcopy(ref)
    parallelize_module(par, mesh, llama_plan(mesh))
    rank = mesh.get_local_rank("dp") if dp > 1 else 0
    ids, mask, labels = _batch(2 * dp)
    mine = slice(2 * rank, 2 * rank + 2)

    # The training call, with every default: the cache is built (use_cache=True) and the loss is the model's own.
    ref_out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    ref_out.loss.backward()
    out = par(input_ids=ids[mine], attention_mask=mask[mine], labels=labels[mine])
    assert type(out.logits) is torch.Tensor and type(out.loss) is torch.Tensor
    torch.testing.assert_close(out.logits, ref_out.logits[mine], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=ATOL)
    out.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{mesh_dims} {name}: {m}")

    with torch.no_grad():
        # return_dict=False: the plan names outputs by key; the tuple is the ModelOutput's, as on one device.
        loss, logits = par(input_ids=ids[mine], labels=labels[mine], return_dict=False)[:2]
        ref_loss, ref_logits = ref(input_ids=ids, labels=labels, return_dict=False)[:2]
        torch.testing.assert_close(logits, ref_logits[mine], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)

        # output_hidden_states: every layer's hidden states as plain tensors; the plan names no entry for them, so
        # they are the full tensors (every data-parallel rank's rows), as the root's default says.
        hidden = par(input_ids=ids[mine], output_hidden_states=True).hidden_states
        ref_hidden = ref(input_ids=ids, output_hidden_states=True).hidden_states
        assert len(hidden) == len(ref_hidden) == config.num_hidden_layers + 1
        for h, r in zip(hidden, ref_hidden):
            assert type(h) is torch.Tensor
            torch.testing.assert_close(h, r, rtol=RTOL, atol=ATOL)

        # explicit position_ids (shifted, as for a continued sequence)
        pos = torch.arange(3, 11).expand(ids.shape[0], -1)
        torch.testing.assert_close(par(input_ids=ids[mine], position_ids=pos[mine]).logits,
                                   ref(input_ids=ids, position_ids=pos).logits[mine], rtol=RTOL, atol=ATOL)

        # prefill, then two decode steps through a cache passed in, as generate() does
        for make_cache in (lambda: tf.DynamicCache(config=config),
                           lambda: tf.StaticCache(config=config, max_cache_len=16)):
            cache, ref_cache = make_cache(), make_cache()
            step_mask, step_ids = mask[:, :6], ids[:, :6]
            for step in range(3):
                out = par(input_ids=step_ids[mine], attention_mask=step_mask[mine], past_key_values=cache)
                ref_out = ref(input_ids=step_ids, attention_mask=step_mask, past_key_values=ref_cache)
                torch.testing.assert_close(out.logits, ref_out.logits[mine], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, c=type(cache).__name__, s=step: f"{c} step {s}: {m}")  # noqa: B008
                cache, ref_cache = out.past_key_values, ref_out.past_key_values
                step_ids = ref_out.logits[:, -1:].argmax(-1)
                step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], dim=1)
            keys = cache.layers[0].keys
            assert isinstance(keys, DTensor), type(keys)
            # each rank holds its own rows and its own key/value heads: 1/(dp*tp) of the cache
            assert keys.to_local().shape[:2] == (2, config.num_key_value_heads // tp), keys.to_local().shape
            torch.testing.assert_close(keys.full_tensor(), ref_cache.layers[0].keys, rtol=RTOL, atol=ATOL)

        # generate(): left-padded prompts, greedy through the default (dynamic) and a static cache; sampling draws
        # from torch's generator on every rank alike (same seed, same full logits), so it needs every rank to hold
        # the whole batch (no dp): with dp each rank would draw for its own rows only, a different stream.
        prompts = ids[:, :5].masked_fill(mask[:, :5] == 0, config.pad_token_id)
        settings = [dict(do_sample=False), dict(do_sample=False, cache_implementation="static")]
        if dp == 1:
            settings.append(dict(do_sample=True, top_k=8, top_p=0.9, temperature=0.8))
        for kw in settings:
            torch.manual_seed(11)
            want = ref.generate(input_ids=prompts, attention_mask=mask[:, :5], max_new_tokens=6, **kw)
            torch.manual_seed(11)
            got = par.generate(input_ids=prompts[mine], attention_mask=mask[mine, :5], max_new_tokens=6, **kw)
            assert torch.equal(got, want[mine]), (kw, got, want[mine])
