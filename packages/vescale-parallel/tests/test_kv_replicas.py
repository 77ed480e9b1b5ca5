"""GQA/MQA with fewer key/value heads than tp ranks (:mod:`vescale.parallel.kv_replicas`): k/v projections replicated
over the ranks that share a kv head, each rank's KV cache holding only that head.

Against the unmodified model on one process: greedy ``generate()`` (dynamic and static cache, left padding) and seeded
sampling token for token; the training loss's gradients of every parameter (the replicated k/v weights' included),
with and without the KV cache in the training call. Llama with 2 kv heads on tp=4 and Qwen2 (q/k/v biases) with one kv
head (MQA) on tp=2 and on dp2 x tp2 (each dp rank its own rows of the batch). ``parallelize_module`` sets the cache up
by itself; an explicit ``replicate_kv_heads`` afterwards is a no-op. Refusals: head counts that neither divide nor
replicate (by ``parallelize_module``'s planning check too), and a plan that splits k/v inside a head.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6
CASES = {"llama": ({"tp": 4}, 2), "qwen2": ({"tp": 2}, 1), "qwen2-dp": ({"dp": 2, "tp": 2}, 1)}  # (mesh, kv heads)


def _build(kind: str, kv: int):
    import transformers as tf

    config, model = (tf.Qwen2Config, tf.Qwen2ForCausalLM) if kind == "qwen2" else (tf.LlamaConfig,
                                                                                   tf.LlamaForCausalLM)
    return model(config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=kv, max_position_embeddings=64, pad_token_id=0)).eval()


@multi_rank(world_sizes=[4])
def test_llama_two_kv_heads_on_tp4_match_one_device():
    _check("llama")


@multi_rank(world_sizes=[2])
def test_qwen2_one_kv_head_on_tp2_match_one_device():
    _check("qwen2")


@multi_rank(world_sizes=[4])
def test_qwen2_one_kv_head_on_dp2_x_tp2_match_one_device():
    _check("qwen2-dp")


def _check(kind: str) -> None:
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh
    from vescale.parallel import PLANS, parallelize_module, replicate_kv_heads
    from vescale.parallel.kv_replicas import kv_replicated_modules

    dims, kv = CASES[kind]
    kind = kind.removesuffix("-dp")
    mesh = init_mesh(dims)
    tp = dims["tp"]
    torch.manual_seed(0)
    ref = _build(kind, kv)
    par = parallelize_module(copy.deepcopy(ref), mesh, PLANS[kind](mesh, num_key_value_heads=kv))
    # parallelize_module sets up both layers' attention itself: the generation below checks the cache holds one kv
    # head per rank without any other call
    assert kv_replicated_modules(par) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for name in ("k_proj", "v_proj"):
        w = getattr(par.model.layers[0].self_attn, name).weight
        assert all(p.is_replicate() for p in w.placements), w.placements

    dp = dims.get("dp", 1)
    rank = mesh.get_local_rank("dp") if dp > 1 else 0
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 9, 10, 11, 12], [0, 3, 4, 8, 9], [2, 3, 4, 5, 6]])[:2 * dp]
    mask = (ids != 0).long()
    mine = slice(2 * rank, 2 * rank + 2)
    kw = dict(max_new_tokens=5, pad_token_id=0)
    for extra in ({}, {"cache_implementation": "static"}):
        want = ref.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw, **extra)[mine]
        out = par.generate(input_ids=ids[mine], attention_mask=mask[mine], do_sample=False,
                           return_dict_in_generate=True, **kw, **extra)
        assert torch.equal(out.sequences, want), (extra, out.sequences, want)
        keys = out.past_key_values.layers[0].keys
        # one kv head per rank: the cache's global value repeats each kv head over the tp ranks that share it
        assert isinstance(keys, DTensor) and keys.shape[1] == tp and keys.to_local().shape[1] == 1, keys.shape
        assert keys.to_local().shape[0] == 2
    # an explicit call (older callers) counts the modules set up and wraps nothing twice: the rest still matches
    assert replicate_kv_heads(par, mesh) == 2
    assert kv_replicated_modules(par) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    hooks = par.model.layers[0].self_attn._forward_pre_hooks.values()
    assert sum(type(h).__name__ == "_Wrap" for h in hooks) == 1
    sample = dict(do_sample=True, top_k=10, top_p=0.9, temperature=0.7, **kw)
    torch.manual_seed(3)
    want = ref.generate(input_ids=ids[mine], attention_mask=mask[mine], **sample)
    torch.manual_seed(3)
    got = par.generate(input_ids=ids[mine], attention_mask=mask[mine], **sample)
    assert torch.equal(got, want), (got, want)

    labels = torch.randint(0, 64, ids.shape, generator=torch.Generator().manual_seed(1))
    ref.train()
    par.train()
    for use_cache in (False, True):
        ref.zero_grad()
        par.zero_grad()
        ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=use_cache).loss.backward()
        par(input_ids=ids[mine], attention_mask=mask[mine], labels=labels[mine], use_cache=use_cache).loss.backward()
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), par.named_parameters()):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(g, p_ref.grad, rtol=RTOL, atol=ATOL, msg=f"{name} (use_cache={use_cache})")


def test_kv_head_layout_refuses_what_neither_divides_nor_replicates():
    from vescale.core.errors import PlanError
    from vescale.parallel.kv_replicas import kv_head_layout

    assert kv_head_layout(4, 2) == "shard" and kv_head_layout(2, 4) == "replicate" and kv_head_layout(1, 8) == \
        "replicate"
    with pytest.raises(PlanError, match=r"num_key_value_heads=3 and tp=2"):
        kv_head_layout(3, 2)
    with pytest.raises(PlanError, match=r"num_key_value_heads=2 and tp=3"):
        kv_head_layout(2, 3)


def test_planned_kv_replicas_refuses_heads_that_cannot_replicate():
    """``parallelize_module``'s check (pure, before any collective): k/v replicated and q sharded over 3 ranks with 2 kv
    heads (6 query heads) cannot keep one kv head per rank: refused naming the module and both counts; the same plan
    over 4 ranks (2 ranks share each kv head) is set up; k/v sharded by rows (split inside a head) is left alone."""
    import transformers as tf
    from torch.distributed.tensor import Replicate, Shard

    from vescale.core.errors import PlanError
    from vescale.parallel.kv_replicas import planned_kv_replicas

    class Mesh:  # only the size of each mesh dim is read
        def __init__(self, n: int) -> None:
            self.n = n

        def size(self, dim: int = 0) -> int:
            return self.n

    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2))
    attn = "model.layers.0.self_attn"
    plan = {f"{attn}.q_proj.weight": (Shard(0),), f"{attn}.k_proj.weight": (Replicate(),),
            f"{attn}.v_proj.weight": (Replicate(),)}
    with pytest.raises(PlanError, match=rf"{attn}: .*num_key_value_heads=2 and tp=3"):
        planned_kv_replicas(model, Mesh(3), plan)
    model.config.num_attention_heads = 8
    assert planned_kv_replicas(model, Mesh(4), plan) == [(attn, 0)]
    rows = {**plan, f"{attn}.k_proj.weight": (Shard(0),), f"{attn}.v_proj.weight": (Shard(0),)}
    assert planned_kv_replicas(model, Mesh(4), rows) == []


@multi_rank(world_sizes=[2])
def test_replicate_kv_heads_refuses_k_split_inside_a_head():
    import copy

    import torch

    from vescale.core.errors import PlanError
    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module, replicate_kv_heads

    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    par = parallelize_module(copy.deepcopy(_build("llama", 1)), mesh, llama_plan(mesh))  # k/v by rows: half a head
    with pytest.raises(PlanError, match=r"num_key_value_heads=1 is fewer than tp=2.*k_proj \[Shard\(dim=0\)\]"):
        replicate_kv_heads(par, mesh)
