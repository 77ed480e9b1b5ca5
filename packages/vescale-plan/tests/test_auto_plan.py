"""auto_plan on unmodified models: logits and gradients equal the single-device run, and communication per step is
no more than the hand-written Megatron-style plan's (vescale.parallel.plans).

Tolerance, not bitwise: fp32, rtol 1e-5 (atol 1e-6 on logits, 1e-5 on gradients of O(1) size): tensor parallelism
changes the order of the reductions.
"""

from __future__ import annotations

import pytest
import torch

from vescale.core.testing import multi_rank

MODELS = ["gpt", "llama", "qwen2", "mistral", "mixtral", "gpt2"]


def build(name: str):
    """A tiny model of family ``name``, seeded: the same weights on every rank and every call."""
    import transformers as T

    torch.manual_seed(0)
    if name == "gpt":
        from vescale.core.testing.models import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=64))
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              attn_implementation="eager", bos_token_id=0, eos_token_id=0,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    config = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "mistral": T.MistralConfig}.get(name)
    if config is not None:
        return {"llama": T.LlamaForCausalLM, "qwen2": T.Qwen2ForCausalLM,
                "mistral": T.MistralForCausalLM}[name](config(**common))
    return T.MixtralForCausalLM(T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))


def logits_of(model, name: str, ids: torch.Tensor) -> torch.Tensor:
    return model(ids) if name == "gpt" else model(input_ids=ids, use_cache=False).logits


def hand_plan(name: str, mesh, sequence_parallel: bool):
    from vescale.parallel import plans

    builder = plans.llama_plan if name == "mistral" else plans.PLANS[name]
    return builder(mesh, sequence_parallel=sequence_parallel)


def run_step(name: str, model, plan, mesh, ids, weight):
    """One forward/backward on ``model`` parallelized with ``plan``; returns logits, full grads, CommCounter."""
    from vescale.parallel import parallelize_module
    from vescale.plan import CommCounter

    parallelize_module(model, mesh, plan)
    with CommCounter() as comm:
        logits = logits_of(model, name, ids)
        (logits * weight).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return logits, grads, comm


def _check_model(name: str, shape: dict, sequence_parallel: bool):
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.plan import auto_plan

    mesh = init_mesh(shape)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 8), generator=gen)
    ref = build(name)
    ref_logits = logits_of(ref, name, ids)
    weight = torch.randn(ref_logits.shape, generator=gen)
    (ref_logits * weight).sum().backward()

    dp = shape.get("dp", 1)
    rank_dp = dist.get_rank() // shape["tp"] if dp > 1 else 0
    local = slice(rank_dp * 4 // dp, (rank_dp + 1) * 4 // dp)

    model = build(name)
    example = None if name == "gpt" else {"input_ids": ids[local]}  # HF models: called by keyword, planned so
    plan = auto_plan(model, mesh, sequence_parallel=sequence_parallel, example_kwargs=example)
    logits, grads, comm = run_step(name, model, plan, mesh, ids[local], weight[local])
    torch.testing.assert_close(logits, ref_logits[local], rtol=1e-5, atol=1e-6)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(ref_grads), name
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{name} {n}: {m}")
    # the plan actually shards: every column/row/vocab/head decision is a sharded parameter on the tp dim
    sharded = {d.fqn for d in plan.decisions if d.kind == "parameter" and d.role != "replicated"}
    assert len(sharded) >= 7 * 2, (name, sorted(sharded))
    for n, p in model.named_parameters():
        assert (n in sharded) == any(not pl.is_replicate() for pl in p.placements), n

    _, _, hand = run_step(name, build(name), hand_plan(name, mesh, sequence_parallel), mesh, ids[local],
                          weight[local])
    assert 0 < comm.total <= hand.total and comm.total_bytes <= hand.total_bytes, (name, dict(comm.counts),
                                                                                 dict(hand.counts))
    return dict(comm.counts), comm.total_bytes, dict(hand.counts), hand.total_bytes


@pytest.mark.parametrize("name", MODELS)
@multi_rank(world_sizes=[2, 4])
def test_auto_plan_matches_single_device(world_size, name):
    shape = {"tp": 2} if world_size == 2 else {"dp": 2, "tp": 2}
    _check_model(name, shape, sequence_parallel=True)



def _gpt(**kw):
    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, ffn_hidden=64), **kw}))


@multi_rank(world_sizes=[2])
def test_indivisible_heads_and_vocab_replicate_and_still_match(world_size):
    """kv heads (1) and vocabulary (65) do not divide by tp=2: those parameters are replicated (with reasons), the
    rest stays sharded, and the logits still equal the single-device run (rtol 1e-5); so do the module-tree
    fallback's."""
    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_module
    from vescale.plan import auto_plan

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    mesh = init_mesh({"tp": 2})
    ref, model = _gpt(n_kv_head=1, vocab_size=65), _gpt(n_kv_head=1, vocab_size=65)
    plan = auto_plan(model, mesh)
    roles = {d.fqn: d.role for d in plan.decisions if d.kind == "parameter"}
    assert roles["layers.0.attn.wk.weight"] == "replicated" and roles["embed.weight"] == "replicated"
    assert roles["layers.0.attn.wq.weight"] == "column" and roles["layers.0.mlp.w_down.weight"] == "row"
    parallelize_module(model, mesh, plan)
    torch.testing.assert_close(model(ids), ref(ids), rtol=1e-5, atol=1e-6)

    # the module-tree fallback (used when forward cannot run on meta) shards the same pairs, with no boundaries
    from vescale.plan.auto_plan import _tree_trace, plan_from_trace

    model = _gpt()
    plan = plan_from_trace(_tree_trace(model, "forced for the test", None, None), ["tp"], {"tp": 2})
    roles = {d.fqn: d.role for d in plan.decisions if d.kind == "parameter"}
    assert roles["layers.1.attn.wv.weight"] == "column" and roles["layers.1.attn.wo.weight"] == "row"
    assert roles["embed.weight"] == "vocab" and roles["lm_head.weight"] == "head"
    parallelize_module(model, mesh, plan)
    torch.testing.assert_close(model(ids), _gpt()(ids), rtol=1e-5, atol=1e-6)


@multi_rank(world_sizes=[4])
def test_auto_parallelize_applies_a_plan_that_matches_single_device(world_size):
    """auto_parallelize on a pinned dp x tp = 2 x 2 mesh: estimates ZeRO 0-2, applies the auto plan; each dp rank's
    logits equal the single-device logits of its half of the batch (rtol 1e-5)."""
    from vescale.core.mesh import init_mesh
    from vescale.plan import auto_parallelize

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    mesh = init_mesh({"dp": 2, "tp": 2})
    ref, model = _gpt(), _gpt()
    model, report = auto_parallelize(model, mesh=mesh, batch_size=4, seq_len=8)
    assert report.applied and (report.chosen.pp, report.chosen.dp, report.chosen.tp) == (1, 2, 2)
    assert {c.zero_stage for c in report.candidates} == {0, 1, 2} and "candidates" in str(report)
    r = mesh.get_coordinate()[0]
    torch.testing.assert_close(model(ids[2 * r:2 * r + 2]), ref(ids)[2 * r:2 * r + 2], rtol=1e-5, atol=1e-6)


def transformers_tp_plan(model, mesh) -> dict:
    """transformers' own TP plan (the model's ``_tp_plan``: ``config.base_model_tp_plan`` under ``model.`` plus the
    head's; torch-TP styles) written as a vescale plan: ``colwise`` shards the weight (and bias) on dim 0 with a
    replicated input, ``rowwise`` on dim 1 with a replicated (all-reduced) output, ``embedding_rowwise`` the
    vocabulary with a replicated output, ``colwise_gather_output`` also gathers the output. No sequence parallelism
    (transformers' plan has none)."""
    from torch.distributed.tensor import Replicate, Shard

    rep = [Replicate()]
    params, fwd = {}, {"input": {"input_ids": rep}, "output": {"logits": rep}}
    styles = dict(model._tp_plan)  # the instance's plan: the base model's (prefixed) plus the head's
    for pattern, style in styles.items():
        regex = pattern.replace(".", r"\.").replace("*", r"\d+")
        if style.startswith("colwise"):
            params[regex + r"\.(weight|bias)"] = [Shard(0)]
            fwd[regex + ".input"] = [rep]
            if style == "colwise_gather_output":
                fwd[regex + ".output"] = [rep]
        elif style in ("rowwise", "embedding_rowwise"):
            params[regex + r"\.weight"] = [Shard(0 if style.startswith("embedding") else 1)]
            fwd[regex + ".output"] = [rep]
        else:
            raise AssertionError(f"style {style!r} not translated")
    return {"parameter": params, "forward": fwd}


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
@multi_rank(world_sizes=[2])
def test_no_more_comm_than_transformers_tp_plan(world_size, name):
    """Without sequence parallelism on tp=2: auto plan logits equal the single-device run (rtol 1e-5), and its
    collectives and bytes per step are no more than transformers' own ``base_model_tp_plan``'s."""
    from vescale.core.mesh import init_mesh
    from vescale.plan import auto_plan

    mesh = init_mesh({"tp": 2})
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 8), generator=gen)
    ref = build(name)
    ref_logits = logits_of(ref, name, ids)
    weight = torch.randn(ref_logits.shape, generator=gen)
    model = build(name)
    plan = auto_plan(model, mesh, sequence_parallel=False, example_kwargs={"input_ids": ids})
    logits, _, auto = run_step(name, model, plan, mesh, ids, weight)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    theirs_model = build(name)
    theirs_logits, _, theirs = run_step(name, theirs_model, transformers_tp_plan(theirs_model, mesh), mesh, ids,
                                        weight)
    torch.testing.assert_close(theirs_logits, ref_logits, rtol=1e-5, atol=1e-6)  # the translation is faithful
    assert 0 < auto.total <= theirs.total and auto.total_bytes <= theirs.total_bytes, (dict(auto.counts),
                                                                                 dict(theirs.counts))
