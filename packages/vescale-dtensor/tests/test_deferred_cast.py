"""A dtype cast of a deferred model (``with record_deferred(m): m.to(torch.bfloat16)``), and other ops recorded after
``deferred_init``: materialised whole it is bitwise the one-device fp32 init (eager, under ``single_device()``) cast
to bf16; materialised as shards, each rank computes only its shard of the fp32 init and casts it, bitwise the slice
of that reference. The reference is built without deferred init at all."""

from __future__ import annotations

import pytest
import torch

from vescale.core.testing import multi_rank


def _cfg():
    from vescale.core.testing.models import GPTConfig

    return GPTConfig(vocab_size=32, d_model=32, n_layer=2, n_head=4, n_kv_head=2, tie_embeddings=True)


def _eager_reference(seed: int, reinit_norm: bool = False) -> torch.nn.Module:
    """The one-device build: fp32 init under vescale's RNG, then cast to bf16 (then the same re-init, when asked)."""
    from vescale.core.testing.models import GPT
    from vescale.dtensor import random as R

    R.manual_seed(seed)
    with R.single_device():
        ref = GPT(_cfg()).to(torch.bfloat16)
        if reinit_norm:
            torch.nn.init.normal_(ref.norm.weight, 1.0, 0.5)
    return ref


def _deferred_bf16(seed: int, reinit_norm: bool = False) -> torch.nn.Module:
    from vescale.core.testing.models import GPT
    from vescale.dtensor import deferred_init, record_deferred
    from vescale.dtensor import random as R

    R.manual_seed(seed)
    m = deferred_init(GPT, _cfg())
    with record_deferred(m) as same:
        assert same is m
        m.to(torch.bfloat16)
        if reinit_norm:
            torch.nn.init.normal_(m.norm.weight, 1.0, 0.5)  # a random op after the cast draws its own RNG numbers
    assert all(t.is_meta and t.dtype == torch.bfloat16 for t in (*m.parameters(), *m.buffers()))
    return m


@pytest.mark.parametrize("reinit", [False, True])
def test_cast_deferred_model_materializes_to_the_cast_fp32_init(reinit):
    from vescale.dtensor import materialize

    ref = _eager_reference(11, reinit)
    m = materialize(_deferred_bf16(11, reinit))
    want = dict(ref.named_parameters()) | dict(ref.named_buffers())
    got = dict(m.named_parameters()) | dict(m.named_buffers())
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[name]), name
    assert m.lm_head.weight is m.embed.weight  # tied stays tied through the cast
    assert torch.all(m.norm.weight == 1) != reinit  # (the re-init happened)


def test_ops_outside_record_deferred_are_refused_naming_the_fix():
    from torch import nn

    from vescale.dtensor import DeferredInitError, deferred_init, materialize, record_deferred

    m = deferred_init(nn.Linear, 4, 3)
    m.to(torch.bfloat16)  # not recorded: materialize cannot know these meta tensors' values
    with pytest.raises(DeferredInitError, match=r"weight.*record_deferred"):
        materialize(m)
    with pytest.raises(DeferredInitError, match="record_deferred: Linear was not built by deferred_init"):
        with record_deferred(nn.Linear(2, 2)):
            pass


@multi_rank(world_sizes=[2])
def test_cast_deferred_model_materializes_shards_bitwise(world_size):
    """tp=2: row, column and tied shards of the bf16 model are bitwise the slices of the cast one-device init, and each
    rank computed only its shards (``report["sharded"]``), casting its shard of the fp32 init; also through
    ``replicate_over`` (shards, then all-gathered)."""
    from vescale.dtensor import DTensor, Shard, init_device_mesh, materialize
    from vescale.dtensor import random as R
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref = _eager_reference(13, reinit_norm=True)
    want = dict(ref.named_parameters(remove_duplicate=False)) | dict(ref.named_buffers())
    plan = {"embed.weight": (Shard(0),), "lm_head.weight": (Shard(0),), "norm.weight": (Shard(0),)}
    for i in range(2):
        plan[f"layers.{i}.attn.wq.weight"] = (Shard(0),)
        plan[f"layers.{i}.attn.wo.weight"] = (Shard(1),)
        plan[f"layers.{i}.mlp.w_up.weight"] = (Shard(0),)
        plan[f"layers.{i}.mlp.w_down.weight"] = (Shard(1),)
    report = {}
    m = materialize(_deferred_bf16(13, reinit_norm=True), mesh, plan, report=report)
    for name, t in m.named_parameters(remove_duplicate=False):
        assert isinstance(t, DTensor) and t.dtype == torch.bfloat16, name
        assert tuple(t.placements) == tuple(plan.get(name, t.placements)), name
        assert torch.equal(t.to_local(), local_slice(want[name].detach(), mesh, t.placements)), name
    assert m.lm_head.weight is m.embed.weight
    # every parameter was computed as its shard: the cast did not force a whole fp32 tensor on any rank
    assert set(report["sharded"]) == set(want) - {"inv_freq"} and report["full"] == ["inv_freq"]
    assert torch.equal(m.inv_freq, want["inv_freq"])

    whole = materialize(_deferred_bf16(13, reinit_norm=True), replicate_over=mesh)
    for name, t in (dict(whole.named_parameters(remove_duplicate=False)) | dict(whole.named_buffers())).items():
        assert not isinstance(t, DTensor) and torch.equal(t, want[name]), name
    R.uninstall()  # the pooled ranks serve other packages' tests too
