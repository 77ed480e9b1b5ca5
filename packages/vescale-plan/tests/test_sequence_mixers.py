"""State-space and linear-attention mixers (Mamba, Qwen3-Next's gated delta net): ``auto_plan`` keeps them whole.

Their own code mixes along the sequence outside attention (a causal ``conv1d``, a scan), so with sequence parallelism
they must see the whole sequence, and their projections' layouts are not read by the planner's evidence. Before,
auto_plan left them on the sequence shard and the parallel model failed (``shape '[16, 128]' is invalid``); now
the mixer's projections stay replicated with the reason in ``explain()``, its input is gathered, and the model
matches one device (logits, loss and every gradient; ``run_zoo_case`` compares them).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from vescale.core.testing import multi_rank  # noqa: E402


@multi_rank(world_sizes=[2])
def test_mixers_are_kept_whole_and_named_in_explain(world_size):
    from torch.distributed.tensor import Replicate

    from vescale.core.mesh import init_mesh
    from vescale.plan import auto_plan, explain
    from vescale.plan.zoo import _batch, _model

    mesh = init_mesh({"tp": world_size})
    model = _model("mamba", "MambaForCausalLM")
    ids = _batch(2, model.config.vocab_size)
    plan = auto_plan(model, mesh, example_kwargs={"input_ids": ids}, sequence_parallel=True)
    text = explain(plan)
    assert "backbone.layers.0.mixer mixes along the sequence outside attention (conv1d)" in text, text
    # its stream input is gathered (Replicate on tp: the whole sequence) ...
    mixer_inputs = {k: v for k, v in plan["input"].items() if k.endswith("mixer")}
    assert mixer_inputs and all(Replicate() in [p for spec in v.values() for p in spec] if isinstance(v, dict)
                                else Replicate() in v[0] for v in mixer_inputs.values()), plan["input"]
    # ... and none of its parameters is sharded
    sharded = [k for k, v in plan["parameter"].items() if "mixer" in k and any(not isinstance(p, Replicate) for p in v)]
    assert not sharded, sharded


@pytest.mark.parametrize("arch,cls", [("mamba", "MambaForCausalLM"), ("qwen3_next", "Qwen3NextForCausalLM")])
@multi_rank(world_sizes=[2])
def test_mixer_models_match_single_device(world_size, arch, cls):
    from vescale.plan.zoo import run_zoo_case

    result = run_zoo_case(arch, cls, {"tp": world_size})
    assert result.result == "pass", result
