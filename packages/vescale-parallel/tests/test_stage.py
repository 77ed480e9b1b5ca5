"""parallelize_stage: parameter-only tensor parallelism of a stage module (here a whole GPT standing in for a
captured pipeline stage), embeddings kept replicated; logits and gradients equal the single-device run (fp32,
tolerance rtol 1e-5: tp changes the order of reductions)."""

from __future__ import annotations

import pytest
import torch

from vescale.core.testing import multi_rank


def _gpt():
    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, ffn_hidden=64))


@multi_rank(world_sizes=[2])
def test_parallelize_stage_matches_single_device(world_size):
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh
    from vescale.parallel import gpt_plan, parallelize_stage

    mesh = init_mesh({"tp": 2})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ref, model = _gpt(), _gpt()
    parallelize_stage(model, mesh, gpt_plan(mesh), replicated=["embed.weight"])
    params = dict(model.named_parameters())
    assert params["embed.weight"].placements[0].is_replicate()
    assert params["layers.0.attn.wq.weight"].placements[0].is_shard(0)
    assert params["layers.0.attn.wo.weight"].placements[0].is_shard(1)
    out = model(ids)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    expected = ref(ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    expected.square().mean().backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_parallelize_stage_needs_a_parameter_section():
    from vescale.core.errors import PlanError
    from vescale.parallel import parallelize_stage

    with pytest.raises(PlanError, match="'parameter' section"):
        parallelize_stage(torch.nn.Linear(2, 2), None, {"output": {}})
