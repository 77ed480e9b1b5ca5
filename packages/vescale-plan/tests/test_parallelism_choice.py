"""choose_parallelism over pp x dp x cp x ep x tp and ZeRO 0-3 (no process group; meta models, 4 layers).

(a) a long-sequence Llama (eager attention: the S^2 term) includes cp; (b) a Mixtral-shaped model includes ep;
(c) a dense model restricted to dp=8 whose states do not fit ZeRO 1/2 in the budget gets ZeRO-3; (d) a
short-sequence dense model keeps the choice the cost model makes without cp and ZeRO-3. Each choice is explained
with its numbers (explain_choice)."""

from __future__ import annotations

import torch

from vescale.plan import choose_parallelism, explain_choice, trace_model

LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4, num_attention_heads=32,
             num_key_value_heads=8)


def _meta(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


def test_long_sequence_gets_cp_short_keeps_its_choice():
    import transformers as T

    model = _meta(T.LlamaForCausalLM, T.LlamaConfig(**LLAMA, attn_implementation="eager"))
    trace = trace_model(model)
    long = choose_parallelism(model, 8, batch_size=1, seq_len=32768, memory_budget_gb=40, trace=trace)
    assert long.chosen.fits and long.chosen.cp > 1, str(long)
    without = [c for c in long.candidates if c.cp == 1]
    assert not any(c.fits for c in without)  # the S^2 term: nothing without cp fits 40 GB
    text = explain_choice(long)
    assert f"cp={long.chosen.cp}" in text and "eager" in text and "best without cp" in text
    short = choose_parallelism(model, 8, batch_size=8, seq_len=1024, memory_budget_gb=40, trace=trace)
    old = choose_parallelism(model, 8, batch_size=8, seq_len=1024, memory_budget_gb=40, trace=trace, max_cp=1,
                             zero_stages=(0, 1, 2))
    assert short.chosen.cp == 1 and short.chosen.dims == old.chosen.dims
    assert short.chosen.zero_stage == old.chosen.zero_stage


def test_mixtral_shaped_model_gets_ep():
    import transformers as T

    model = _meta(T.MixtralForCausalLM, T.MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                                                        num_hidden_layers=4, num_attention_heads=16,
                                                        num_key_value_heads=8, num_local_experts=8,
                                                        num_experts_per_tok=2))
    report = choose_parallelism(model, 8, batch_size=8, seq_len=1024, memory_budget_gb=4, trace=trace_model(model))
    assert report.chosen.fits and report.chosen.ep > 1, str(report)
    assert report.shape.experts == 8 and report.shape.top_k == 2 and report.chosen.ep_bytes > 0
    assert f"ep={report.chosen.ep}" in explain_choice(report)


def test_states_too_big_for_zero1_get_zero3():
    import transformers as T

    model = _meta(T.LlamaForCausalLM, T.LlamaConfig(**LLAMA))
    trace = trace_model(model)
    report = choose_parallelism(model, 8, batch_size=8, seq_len=256, memory_budget_gb=4, trace=trace,
                                fixed={"dp": 8})
    assert report.chosen.fits and report.chosen.zero_stage == 3, str(report)
    assert not any(c.fits for c in report.candidates if c.zero_stage < 3)
    assert "ZeRO-3" in explain_choice(report) and "best with ZeRO 0-2" in explain_choice(report)
    roomy = choose_parallelism(model, 8, batch_size=8, seq_len=256, memory_budget_gb=6, trace=trace, fixed={"dp": 8})
    assert roomy.chosen.zero_stage == 2  # enough room: ZeRO-3's extra gathers are not worth it
