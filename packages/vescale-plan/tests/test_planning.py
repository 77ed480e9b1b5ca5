"""Planning without any process group: the meta trace, roles, divisibility fallbacks, explain, pipeline split and the
cost model. Plans are compared against exact expected placements (no tolerance involved)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from vescale.core.errors import PlanError
from vescale.core.testing.models import GPT, GPTConfig
from vescale.dtensor import InterleavedShard
from vescale.plan import choose_parallelism, explain, pipeline_split, plan_from_trace, trace_model


def _gpt(**kw) -> GPT:
    cfg = dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=64)
    cfg.update(kw)
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))


def _roles(plan) -> dict[str, tuple[str, str]]:
    return {d.fqn: (d.placements, d.role) for d in plan.decisions if d.kind == "parameter"}


def test_llama_on_meta_gets_megatron_roles_without_memory():
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    plan = plan_from_trace(trace_model(model), ["dp", "tp"], {"dp": 2, "tp": 2}, sequence_parallel=True)
    roles = _roles(plan)
    layer = "model.layers.1."
    assert roles[layer + "self_attn.q_proj.weight"] == ("[R, S(0)]", "column")
    assert roles[layer + "self_attn.k_proj.weight"] == ("[R, S(0)]", "column")
    assert roles[layer + "self_attn.o_proj.weight"] == ("[R, S(1)]", "row")
    assert roles[layer + "mlp.gate_proj.weight"] == ("[R, S(0)]", "column")
    assert roles[layer + "mlp.down_proj.weight"] == ("[R, S(1)]", "row")
    assert roles[layer + "input_layernorm.weight"] == ("[R, R]", "replicated")
    assert roles["model.embed_tokens.weight"] == ("[R, S(0)]", "vocab")
    assert roles["lm_head.weight"] == ("[R, S(0)]", "head")
    stream = [Shard(0), Shard(1)]
    assert plan["output"][r"model\.layers\.\d+\.self_attn\.o_proj"] == [stream]
    assert plan["input"][r"model\.layers\.\d+\.self_attn"] == {"hidden_states": [Shard(0), Replicate()]}
    assert plan["output"]["model\\.embed_tokens"] == [stream]
    assert plan["output"][""] == {"logits": [Shard(0), Replicate()]}
    # every layer got the same decisions, so the plan folds layer indices into one pattern
    assert all("layers\\.1" not in k and "layers\\.0" not in k for k in plan["parameter"])


def test_gpt2_fused_qkv_is_interleaved_and_tied_head_shares_the_embedding_placement():
    import transformers as T

    with torch.device("meta"):
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    plan = plan_from_trace(trace_model(model), ["tp"], {"tp": 2}, sequence_parallel=True)
    p = plan["parameter"]
    assert p[r"transformer\.h\.\d+\.attn\.c_attn\.weight"] == [InterleavedShard(1, 3)]
    assert p[r"transformer\.h\.\d+\.attn\.c_attn\.bias"] == [InterleavedShard(0, 3)]
    assert p[r"transformer\.h\.\d+\.attn\.c_proj\.weight"] == [Shard(0)]  # Conv1D: [in, out]
    assert p[r"transformer\.h\.\d+\.mlp\.c_fc\.weight"] == [Shard(1)]
    assert p[r"transformer\.wte\.weight"] == p[r"lm_head\.weight"] == [Shard(0)]
    roles = _roles(plan)
    assert roles["transformer.wpe.weight"] == ("[R]", "replicated")  # indexed by positions made inside forward
    assert roles["transformer.h.0.attn.c_proj.bias"] == ("[R]", "replicated")


def test_indivisible_heads_and_vocab_fall_back_per_parameter_with_reasons():
    plan = plan_from_trace(trace_model(_gpt(n_kv_head=1, vocab_size=65)), ["tp"], {"tp": 2}, sequence_parallel=True)
    by_fqn = {d.fqn: d for d in plan.decisions if d.kind == "parameter"}
    for name in ("wk", "wv"):
        d = by_fqn[f"layers.0.attn.{name}.weight"]
        assert d.role == "replicated" and "1 heads" in d.reason and "tp=2" in d.reason
    assert by_fqn["layers.0.attn.wq.weight"].role == "column"
    assert by_fqn["layers.0.attn.wo.weight"].role == "row"
    assert by_fqn["embed.weight"].role == "replicated" and "vocabulary 65" in by_fqn["embed.weight"].reason
    assert by_fqn["lm_head.weight"].role == "replicated"
    table = explain(plan)
    assert "layers.0.attn.wk.weight" in table and "1 heads (per part) do not divide by tp=2" in table


def test_opaque_module_is_paired_by_shape():
    import transformers as T

    cfg = T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    with torch.device("meta"):
        model = T.MixtralForCausalLM(cfg)
    trace = trace_model(model)
    plan = plan_from_trace(trace, ["tp"], {"tp": 2}, sequence_parallel=True)
    roles = _roles(plan)
    assert "model.layers.0.mlp.experts" in trace.opaque, trace.opaque  # the premise: the trace cannot see inside
    assert roles["model.layers.0.mlp.experts.gate_up_proj"] == ("[IS(1, 2)]", "column")
    assert roles["model.layers.0.mlp.experts.down_proj"] == ("[S(2)]", "row")
    assert roles["model.layers.0.mlp.gate.weight"][1] == "replicated"  # the router
    assert plan_from_trace(trace, ["tp"], {"tp": 32}).decisions  # 48 % 32 != 0: replicated, no error
    assert _roles(plan_from_trace(trace, ["tp"], {"tp": 32}))["model.layers.0.mlp.experts.down_proj"][1] \
        == "replicated"


class _Scale(nn.Module):
    """Not traceable on meta (``int()`` of a tensor) and no projection pair: a module to run whole on plain tensors."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return x * self.weight * (int((x > 0).sum()) % 2 + 1)


class _Experts(nn.Module):
    """A projection pair in data-dependent code (runs on local shards) with a ``_Scale`` inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(32, 16))
        self.w_out = nn.Parameter(torch.randn(16, 32))
        self.norm = _Scale(16)

    def forward(self, x):
        h = self.norm(x.tanh())  # an input computed here: only the norm receives it
        k = int((h > 0).sum()) % 2 + 1  # before the projections: the trace never sees them (paired by shape)
        return F.linear(F.linear(h, self.w_in).relu(), self.w_out) * k


class _NestedOpaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.moe = _Experts()
        self.post = _Scale(16)
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(self.post(h + self.moe(x=h)))  # by keyword, as JetMoE calls its attention


def test_a_module_that_would_nest_local_runs_gets_no_whole_run_entries():
    """An opaque module with every parameter replicated runs whole (a ``local`` entry, a full input, a replicated
    output) unless it lies inside (or contains) another module run on local tensors: then it gets none of those
    entries, not even the full input a whole run needs (which used to be left behind), and a note says why. A module
    run on local shards gets its input full when called by keyword too (it was only for a positional argument)."""
    trace = trace_model(_NestedOpaque())
    assert {"moe", "moe.norm", "post"} <= set(trace.opaque), trace.opaque  # the premise: none of them traceable
    plan = plan_from_trace(trace, ["tp"], {"tp": 2})
    assert _roles(plan)["moe.w_in"][1] == "column" and _roles(plan)["moe.w_out"][1] == "row"
    assert plan["local"] == {"moe": {"x": [Partial()]}, "post": [None]}, plan["local"]
    assert plan["input"].get("post") == [[Replicate()]], plan["input"]  # the whole run gets its full input
    assert not [k for sec in ("input", "output", "local") for k in plan[sec] if "norm" in k], plan
    assert plan["input"].get("moe") == {"x": [Replicate()]}, plan["input"]
    notes = [d.reason for d in plan.decisions if d.fqn == "moe.norm" and d.kind != "parameter"]
    assert notes == ["all parameters replicated, but it nests with moe, which also runs on local tensors: keeps its "
                     "DTensor run"], notes


def test_trace_leaves_the_model_untouched_and_explain_lists_hand_plans():
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=1, n_head=4, tie_embeddings=True))
    before = {n: p for n, p in model.named_parameters()}
    trace = trace_model(model)
    assert {n: p for n, p in model.named_parameters()} == before
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert trace.aliases["embed.weight"] == ["embed.weight", "lm_head.weight"]
    plan = plan_from_trace(trace, ["tp"], {"tp": 2}, sequence_parallel=True)
    roles = _roles(plan)
    assert roles["embed.weight"][0] == roles["lm_head.weight"][0] == "[S(0)]"
    text = explain({"parameter": {r"embed\.weight": [Shard(0)]}, "output": {"": [[Replicate()]]}})
    assert "hand-written plan" in text and "embed\\.weight" in text and "[S(0)]" in text
    assert "<root>" in text and "[[R]]" in text


def test_pipeline_split_balances_blocks_and_charges_embeddings_to_the_ends():
    model = _gpt(n_layer=8)
    trace = trace_model(model)
    split = pipeline_split(model, trace, 4)
    assert split.split_points == ["layers.2", "layers.4", "layers.6"]
    assert sum(split.stage_params) == sum(p.numel() for p in model.parameters())
    big_vocab = _gpt(n_layer=8, vocab_size=4096)
    split = pipeline_split(big_vocab, trace_model(big_vocab), 4)
    first = int(split.split_points[0].split(".")[1])
    last = 8 - int(split.split_points[-1].split(".")[1])
    assert first < 2 and last < 2, split  # the huge embedding / head stages get fewer blocks
    with pytest.raises(PlanError, match="cannot make 9 pipeline stages"):
        pipeline_split(model, trace, 9)


def test_cost_model_prefers_tp_and_zero_when_memory_is_tight():
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    trace = trace_model(model)
    loose = choose_parallelism(model, 8, batch_size=8, seq_len=2048, trace=trace)
    tight = choose_parallelism(model, 8, batch_size=8, seq_len=2048, memory_budget_gb=40, trace=trace)
    assert tight.chosen.fits and tight.chosen.memory_gb <= 40
    assert loose.chosen.step_s <= tight.chosen.step_s
    shapes = {(c.pp, c.dp, c.tp, c.zero_stage) for c in loose.candidates if c.cp == 1}
    assert (1, 8, 1, 0) in shapes and (1, 1, 8, 0) in shapes and (2, 2, 2, 0) in shapes
    assert all(z == 0 for pp, dp, _, z in shapes if dp == 1)  # ZeRO only where there are data ranks to shard over
    assert (2, 2, 2, 1) in shapes and (2, 2, 2, 3) not in shapes  # with pp: ZeRO 1/2 per stage, no ZeRO 3 priced
    assert all(c.pp == 1 and c.zero_stage < 3 for c in loose.candidates if c.cp > 1)  # cp: no pp, no ZeRO-3
    only2 = choose_parallelism(model, 8, batch_size=8, seq_len=2048, trace=trace, zero_stages=(2,), fixed={"pp": 1})
    assert {(c.dp * c.cp > 1, c.zero_stage) for c in only2.candidates} == {(True, 2), (False, 0)}
    with pytest.raises(PlanError, match="zero_stages"):
        choose_parallelism(model, 8, trace=trace, zero_stages=(4,))
    by = {(c.pp, c.dp, c.tp, c.zero_stage): c for c in loose.candidates if c.cp == 1}
    assert by[(1, 8, 1, 1)].memory_gb < by[(1, 8, 1, 0)].memory_gb  # ZeRO-1 shards optimizer states
    assert by[(1, 1, 8, 0)].tp_bytes > 0 and by[(1, 8, 1, 0)].tp_bytes == 0
    none = choose_parallelism(model, 8, batch_size=8, seq_len=2048, memory_budget_gb=1, trace=trace)
    assert not none.chosen.fits and "no candidate fits" in str(none)
    if tight.chosen.pp > 1:
        assert tight.split is not None and len(tight.split.split_points) == tight.chosen.pp - 1


def test_pipeline_split_points_drive_vescale_pipe_split():
    """The split points are what ``vescale.pipe.split`` takes: the stages, chained, compute the model's logits
    (tolerance rtol 1e-6: the same ops, captured as a graph)."""
    from vescale.pipe import split

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=4, n_head=4, ffn_hidden=64))
    ids = torch.randint(0, 64, (2, 8))
    points = pipeline_split(model, trace_model(model, (ids,)), 2).split_points
    assert points == ["layers.2"]
    stages = split(model, split_points=points, example_inputs=(ids,))
    out = stages[0](ids)
    for stage in stages[1:]:
        out = stage(*out)
    torch.testing.assert_close(out, model(ids), rtol=1e-6, atol=1e-7)


def test_auto_parallelize_refuses_a_batch_that_does_not_fill_the_microbatches():
    """Checked before any mesh or collective: batch 2 cannot feed pp=2's default 4 microbatches."""
    from vescale.plan import auto_parallelize

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, ffn_hidden=64))
    with pytest.raises(PlanError, match="batch_size 2 does not divide into dp=1 x 4 microbatches for pp=2"):
        auto_parallelize(model, world_size=4, batch_size=2, seq_len=8, fixed={"pp": 2, "tp": 2})
    result = auto_parallelize(model, world_size=4, batch_size=4, seq_len=8, fixed={"pp": 2, "tp": 2}, apply=False)
    assert not result.report.applied and result.engine is None and result.report.split.split_points == ["layers.1"]
