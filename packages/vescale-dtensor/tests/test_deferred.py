"""deferred_init / materialize: the full materialisation equals the eager build under ``single_device()``
(bitwise), and sharded materialisation of an unmodified transformers LlamaForCausalLM on tp=2 and dp x tp = 2x2
creates local shards bitwise equal to the slices of that reference, computing only the shards."""

from __future__ import annotations

import pytest
import torch

from vescale.core.testing import multi_rank


def _llama_config(tie: bool = False):
    import transformers

    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=tie)


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("tie", [False, True])
def test_full_materialize_equals_eager_llama(tie):
    import transformers

    from vescale.dtensor import deferred_init, is_deferred, materialize
    from vescale.dtensor import random as R

    R.manual_seed(5)
    m = deferred_init(transformers.LlamaForCausalLM, _llama_config(tie))
    assert is_deferred(m) and all(p.is_meta for p in m.parameters())
    materialize(m)
    assert not is_deferred(m)
    R.manual_seed(5)
    with R.single_device():
        ref = transformers.LlamaForCausalLM(_llama_config(tie))
    got, want = _state(m), _state(ref)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == tie
    # HF's _init_weights ran (std 0.02 normal), not only nn.Linear's kaiming init
    assert abs(m.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.005
    x = torch.randint(0, 64, (2, 7))
    assert torch.equal(m(x).logits, ref(x).logits)


def test_full_materialize_equals_eager_gpt():
    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.dtensor import deferred_init, materialize
    from vescale.dtensor import random as R

    cfg = GPTConfig(vocab_size=32, d_model=32, n_layer=1, n_head=4, tie_embeddings=True)
    R.manual_seed(2)
    m = materialize(deferred_init(GPT, cfg))
    R.manual_seed(2)
    with R.single_device():
        ref = GPT(cfg)
    for (k, a), (_, b) in zip(sorted(_state(m).items()), sorted(_state(ref).items())):
        assert torch.equal(a, b), k
    assert torch.equal(m.inv_freq, ref.inv_freq)


def test_adopted_part_materializes_its_tensors_bitwise():
    """A part of a deferred model (a shadow copy without the head, holding uninitialised CPU tensors and a constant
    buffer of its own) adopts the model's meta tensors and init record: materialising it gives exactly the
    single-device values of those FQNs, keeps its own constant, and leaves the model deferred for other parts."""
    import copy

    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.dtensor import adopt_deferred, deferred_init, is_deferred, materialize
    from vescale.dtensor import random as R
    from vescale.dtensor.errors import DeferredInitError

    cfg = GPTConfig(vocab_size=32, d_model=32, n_layer=2, n_head=4, tie_embeddings=False)
    R.manual_seed(3)
    model = deferred_init(GPT, cfg)
    R.manual_seed(3)
    with R.single_device():
        ref = _state(GPT(cfg))
    part = copy.deepcopy(model).to_empty(device="cpu")
    del part.lm_head
    part.register_buffer("lifted", torch.arange(4.0))  # a constant only the part has
    assert adopt_deferred(part, model) is part
    assert all(p.is_meta for p in part.parameters()) and is_deferred(part)
    materialize(part)
    got = _state(part)
    assert torch.equal(got.pop("lifted"), torch.arange(4.0))
    assert got and not any(k.startswith("lm_head") for k in got)
    for k, v in got.items():
        assert torch.equal(v, ref[k]), k
    assert is_deferred(model) and model.lm_head.weight.is_meta

    stray = copy.deepcopy(model).to_empty(device="cpu")
    stray.extra = torch.nn.Linear(2, 2)
    with pytest.raises(DeferredInitError, match=r"extra\.weight, extra\.bias"):
        adopt_deferred(stray, model)
    with pytest.raises(DeferredInitError, match="not built by deferred_init"):
        adopt_deferred(part, part)


def test_materialize_errors_name_the_fqn():
    import torch.nn as nn

    from vescale.dtensor import DeferredInitError, deferred_init, materialize

    with pytest.raises(DeferredInitError, match="not built by deferred_init"):
        materialize(nn.Linear(2, 2))
    m = deferred_init(nn.Linear, 4, 3)
    with pytest.raises(DeferredInitError, match="without a mesh"):
        materialize(m, placements={"weight": ()})


def _plan(mesh_ndim):
    from vescale.dtensor import InterleavedShard, RaggedShard, Replicate, Shard

    def pl(*p):
        return tuple(p) if mesh_ndim == 1 else (Shard(0),) + tuple(p) if p[0] != Replicate() else (Replicate(),) + p

    plan = {}
    for i in range(2):
        pre = f"model.layers.{i}."
        plan[pre + "self_attn.q_proj.weight"] = pl(Shard(0))
        plan[pre + "self_attn.k_proj.weight"] = pl(Shard(0))
        plan[pre + "self_attn.v_proj.weight"] = pl(Shard(0))
        plan[pre + "self_attn.o_proj.weight"] = pl(Shard(1))
        plan[pre + "mlp.gate_proj.weight"] = pl(InterleavedShard(0, 2))
        plan[pre + "mlp.up_proj.weight"] = pl(Shard(0))
        plan[pre + "mlp.down_proj.weight"] = pl(Shard(1))
    plan["model.embed_tokens.weight"] = pl(Shard(1))
    plan["lm_head.weight"] = pl(Shard(0))
    if mesh_ndim == 1:
        plan["model.norm.weight"] = (RaggedShard((0,), (1, 3)),)  # uneven flat pieces: 8 and 24 of 32
    return plan


@multi_rank(world_sizes=[2, 4])
def test_sharded_materialize_llama_bitwise(world_size):
    import torch
    import transformers

    from vescale.dtensor import (
        DTensor,
        Replicate,
        deferred_init,
        distribute_tensor,
        full_tensor,
        init_device_mesh,
        materialize,
    )
    from vescale.dtensor import random as R
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (2,) if world_size == 2 else (2, 2),
                            mesh_dim_names=("tp",) if world_size == 2 else ("dp", "tp"))
    R.manual_seed(17)
    ref = materialize(deferred_init(transformers.LlamaForCausalLM, _llama_config()))
    R.manual_seed(17)
    m = deferred_init(transformers.LlamaForCausalLM, _llama_config())
    plan = _plan(mesh.ndim)
    report = {}
    materialize(m, mesh, plan, report=report)
    ref_state = dict(ref.named_parameters()) | dict(ref.named_buffers())
    for name, b in m.named_buffers():  # buffers left out of the plan stay plain tensors
        assert not isinstance(b, DTensor) and torch.equal(b, ref_state[name]), name
    for name, t in m.named_parameters():
        assert isinstance(t, DTensor), name
        assert tuple(t.placements) == tuple(plan.get(name, t.placements)), name
        want = local_slice(ref_state[name].detach(), mesh, t.placements)
        assert torch.equal(t.to_local(), want), name
    assert torch.equal(full_tensor(m.model.norm.weight), ref.model.norm.weight)  # the ragged one
    # every parameter computed only its shard; only the (plain, whole) rotary buffers were computed whole
    assert report["full"] == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert set(plan) <= set(report["sharded"])
    # the sharded weights compute: a column-parallel up_proj matches the reference (tolerance: matmul blocking differs)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    xd = distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)
    y = torch.nn.functional.linear(xd, m.model.layers[0].mlp.up_proj.weight).full_tensor()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, ref.model.layers[0].mlp.up_proj.weight))
    R.uninstall()  # the pooled ranks serve other packages' tests too


class _Views(torch.nn.Module):
    """Init that writes through views: an Embedding padding row, a random block, a strided scalar update."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 6, padding_idx=3)
        self.w = torch.nn.Parameter(torch.empty(6, 4))
        with torch.no_grad():
            self.w.fill_(1.0)
            self.w[1:5, 1:3].normal_(0.0, 2.0)
            self.w[:, ::2].mul_(3.0)
            self.w.t()[1].uniform_(-1.0, 1.0)


@multi_rank(world_sizes=[2, 4])
def test_sharded_materialize_of_view_writes(world_size):
    import torch

    from vescale.dtensor import InterleavedShard, Shard, deferred_init, init_device_mesh, materialize
    from vescale.dtensor import random as R
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (world_size,))
    for plan in ({"emb.weight": (Shard(0),), "w": (Shard(1),)}, {"emb.weight": (Shard(1),), "w": (Shard(0),)},
                 {"emb.weight": (InterleavedShard(0, 2),), "w": (InterleavedShard(0, 2),)}):
        R.manual_seed(4)
        ref = materialize(deferred_init(_Views))
        assert torch.all(ref.emb.weight[3] == 0) and not torch.all(ref.w == ref.w[0, 0])
        R.manual_seed(4)
        m = deferred_init(_Views)
        report = {}
        materialize(m, mesh, plan, report=report)
        assert report["sharded"] == ["emb.weight", "w"] and report["full"] == []
        for name in plan:
            got = m.get_parameter(name)
            want = local_slice(ref.get_parameter(name).detach(), mesh, got.placements)
            assert torch.equal(got.to_local(), want), (name, plan)
    R.uninstall()


def _tied_pair():
    import torch.nn as nn

    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    seq[1].weight = seq[0].weight
    return seq


@multi_rank(world_sizes=[2])
def test_materialize_rejects_bad_plans():
    import pytest
    import torch.nn as nn

    from vescale.dtensor import DeferredInitError, Partial, Shard, deferred_init, init_device_mesh, materialize

    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(DeferredInitError, match=r"\['nope'\]"):
        materialize(deferred_init(nn.Linear, 4, 3), mesh, {"nope": (Shard(0),)})
    with pytest.raises(DeferredInitError, match="weight.*Partial"):
        materialize(deferred_init(nn.Linear, 4, 3), mesh, {"weight": (Partial(),)})
    with pytest.raises(DeferredInitError, match="parameter weight.*out of range"):
        materialize(deferred_init(nn.Linear, 4, 3), mesh, {"weight": (Shard(2),)})
    tied = deferred_init(_tied_pair)
    with pytest.raises(DeferredInitError, match="tied tensors"):
        materialize(tied, mesh, {"0.weight": (Shard(0),), "1.weight": (Shard(1),)})


@multi_rank(world_sizes=[2, 4])
def test_materialize_replicated_over_a_mesh_is_the_whole_reference(world_size):
    """``materialize(m, replicate_over=mesh)``: every rank holds the whole model as plain tensors, bitwise the
    single-device materialisation; parameters whose first dim divides by the mesh size were computed as shards (then
    all-gathered), the rest whole; tied parameters stay one object. A 2-D mesh or a mesh and a plan are refused."""
    import pytest
    import torch

    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.dtensor import (
        DeferredInitError,
        DTensor,
        Shard,
        deferred_init,
        init_device_mesh,
        materialize,
    )
    from vescale.dtensor import random as R

    cfg = GPTConfig(vocab_size=34, d_model=32, n_layer=2, n_head=4, n_kv_head=2, tie_embeddings=True)
    R.manual_seed(9)
    ref = materialize(deferred_init(GPT, cfg))
    mesh = init_device_mesh("cpu", (world_size,))
    R.manual_seed(9)
    m = deferred_init(GPT, cfg)
    report = {}
    assert materialize(m, replicate_over=mesh, report=report) is m
    want = dict(ref.named_parameters()) | dict(ref.named_buffers())
    got = dict(m.named_parameters()) | dict(m.named_buffers())
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert not isinstance(t, DTensor) and not t.is_meta, name
        assert torch.equal(t, want[name]), name
    assert m.lm_head.weight is m.embed.weight
    divisible = {n for n, p in ref.named_parameters(remove_duplicate=False) if p.shape[0] % world_size == 0}
    assert ("embed.weight" in divisible) == (world_size == 2)  # vocab 34: split on 2 ranks, whole on 4
    assert divisible <= set(report["sharded"])  # (replicated parameters are listed too: computed as they are held)
    assert "inv_freq" in report["full"]
    with pytest.raises(DeferredInitError, match="1-D mesh"):
        materialize(deferred_init(GPT, cfg), replicate_over=init_device_mesh("cpu", (2, world_size // 2)))
    with pytest.raises(DeferredInitError, match="not both"):
        materialize(deferred_init(GPT, cfg), mesh, {"embed.weight": (Shard(0),)}, replicate_over=mesh)
    R.uninstall()  # the pooled ranks serve other packages' tests too
