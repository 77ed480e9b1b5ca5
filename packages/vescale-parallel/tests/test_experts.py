"""Expert parallelism (:func:`vescale.parallel.parallelize_experts`) against the same model on one process.

Unmodified Hugging Face MoE models (Mixtral: fused experts, separate top-k router; Qwen2-MoE: plus a shared expert and
``norm_topk_prob``), fp32, with the model's own loss and its load-balancing loss (``output_router_logits=True``,
``router_aux_loss_coef=0.1``). The reference is the untouched model on the whole batch in this process (its experts
run by Hugging Face's eager loop, nothing of :mod:`vescale.parallel.experts` involved). Each rank passes its own
examples (``Shard(0)`` over dp and ep); its logits, the loss, the aux loss and every parameter's gradient
(``full_tensor()``, placements equal to the parameter's) must match at ``rtol=1e-5``. Meshes: ep=2, ep=4, ep2 x tp2
(``mixtral_plan``: attention and each expert's FFN tensor-parallel, with and without sequence parallelism) and dp2 x
ep2. (The checkpoint resharded across ep sizes is in ``integration_tests/test_checkpoint_vescale_types.py``: this
package's own test session does not install vescale-checkpoint.)
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _build(kind: str, seed: int = 0):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
                  output_router_logits=True, router_aux_loss_coef=0.1, experts_implementation="eager")
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)).train()
    cfg = tf.Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, norm_topk_prob=True)
    return tf.Qwen2MoeForCausalLM(cfg).train()


def _batch():
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (4, 8), generator=g)
    labels = torch.randint(0, 64, (4, 8), generator=g)
    labels[1, 5:] = -100
    return tokens, labels


def _my_part(mesh):
    """(index, count) of this rank's part of the batch: Shard(0) over dp then ep, in mesh order."""
    names = tuple(mesh.mesh_dim_names)
    index, count = 0, 1
    for n in names:
        if n in ("dp", "ep"):
            index = index * mesh.size(names.index(n)) + mesh.get_local_rank(n)
            count *= mesh.size(names.index(n))
    return index, count


def _run_case(kind: str, dims: dict, *, plan: str | None = None, sp: bool = False):
    import copy

    import torch
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel import mixtral_plan, parallelize_experts

    mesh = init_mesh(dims)
    ref = _build(kind)
    par = copy.deepcopy(ref)
    tokens, labels = _batch()
    ref_out = ref(input_ids=tokens, labels=labels)
    ref_out.loss.backward()

    parallelize_experts(par, mesh, mixtral_plan(mesh, sequence_parallel=sp) if plan == "mixtral" else None)
    i, n = _my_part(mesh)
    out = par(input_ids=tokens.chunk(n)[i], labels=labels.chunk(n)[i])
    out.loss.backward()

    what = f"{kind} {dims} plan={plan} sp={sp}"
    torch.testing.assert_close(out.logits, ref_out.logits.chunk(n)[i], rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    ref_params = dict(ref.named_parameters())
    assert [k for k, _ in par.named_parameters()] == list(ref_params)
    ep = mesh.mesh_dim_names.index("ep")
    for name, p in par.named_parameters():
        is_expert = ".experts." in name
        # each rank holds E/ep experts: the parameter is Shard(0) on ep exactly for the experts
        assert isinstance(p.placements[ep], Shard) is is_expert, (name, p.placements)
        assert tuple(p.grad.placements) == tuple(p.placements), (name, p.grad.placements, p.placements)
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


@multi_rank(world_sizes=[2])
def test_ep2_matches_single_device():
    _run_case("mixtral", {"ep": 2})


@multi_rank(world_sizes=[4])
def test_ep4_ep_tp_dp_ep_match_single_device():
    _run_case("qwen2_moe", {"ep": 4})
    _run_case("mixtral", {"ep": 2, "tp": 2}, plan="mixtral")
    _run_case("mixtral", {"ep": 2, "tp": 2}, plan="mixtral", sp=True)
    _run_case("mixtral", {"dp": 2, "ep": 2})


def _tiny_moe(dim: int = 8, num_experts: int = 4):
    """A hand-written MoE with the Hugging Face shape but none of its classes: a dense layer, then a block whose
    router returns ``(logits, top-2 weights, top-2 index)`` and whose experts own one stacked ``[E, D, D]`` weight.
    Its inputs are made positive and its router's rows for experts >= 2 negative, so every token picks experts 0
    and 1: on ep=2, rank 1 receives no token at all."""
    import torch
    from torch import nn

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.rand(num_experts, dim) + 0.5
            w[2:] *= -1
            self.weight = nn.Parameter(w)

        def forward(self, x):
            logits = x @ self.weight.t()
            top = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
            return logits, top.values / top.values.sum(dim=-1, keepdim=True), top.indices

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = num_experts
            self.weight = nn.Parameter(torch.randn(num_experts, dim, dim) / dim**0.5)

        def forward(self, x, index, weights):
            out = torch.zeros_like(x)
            for e in range(self.num_experts):
                token, slot = torch.where(index == e)
                out.index_add_(0, token, (x[token] @ self.weight[e]) * weights[token, slot, None])
            return out

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.experts = Router(), Experts()

        def forward(self, h):
            flat = h.reshape(-1, h.shape[-1])
            _, weights, index = self.router(flat)
            return self.experts(flat, index, weights).reshape(h.shape)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.moe = nn.Linear(dim, dim), Block()

        def forward(self, x):
            return self.moe(self.proj(x).abs() + 0.1)

    torch.manual_seed(0)
    return Model()


@multi_rank(world_sizes=[2])
def test_any_router_experts_module_and_a_rank_with_no_tokens():
    import copy

    import torch
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_experts

    mesh = init_mesh({"ep": 2})
    ref = _tiny_moe()
    par = copy.deepcopy(ref)
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(2))
    ref_out = ref(x)
    ref_out.pow(2).sum().backward()
    assert torch.count_nonzero(ref.moe.experts.weight.grad[2:]) == 0  # experts 2 and 3 are never hit
    plan = {"input": {"": [[Shard(0)]]}, "output": {"": [[Shard(0)]]}}
    parallelize_experts(par, mesh, plan)
    r = mesh.get_local_rank("ep")
    out = par(x.chunk(2)[r])
    out.pow(2).sum().backward()  # each rank's part of the sum: the gradients are those of the whole sum
    torch.testing.assert_close(out, ref_out.chunk(2)[r], rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_find_experts_by_structure():
    from vescale.parallel import find_experts

    found = find_experts(_build("qwen2_moe"))
    assert [(e.fqn, e.num_experts) for e in found] == [(f"model.layers.{i}.mlp.experts", 8) for i in range(2)]
    assert found[0].params == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    import transformers as tf

    dense = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=4))
    assert find_experts(dense) == []


@multi_rank(world_sizes=[2])
def test_errors_before_any_collective():
    import transformers as tf

    from vescale.core.mesh import init_mesh
    from vescale.parallel import ExpertParallelError, parallelize_experts
    from vescale.parallel.experts import expert_parallel_plan

    with pytest.raises(ExpertParallelError, match=r"mesh dim 'ep' but the mesh has dims \['tp'\]"):
        parallelize_experts(_build("mixtral"), init_mesh({"tp": 2}))
    dense = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ExpertParallelError, match="LlamaForCausalLM has no experts module"):
        parallelize_experts(dense, init_mesh({"ep": 2}))
    model = _build("mixtral")
    model.model.layers[1].mlp.experts.gate_up_proj.data = model.model.layers[1].mlp.experts.gate_up_proj.data[:3]
    model.model.layers[1].mlp.experts.down_proj.data = model.model.layers[1].mlp.experts.down_proj.data[:3]
    model.model.layers[1].mlp.gate.weight.data = model.model.layers[1].mlp.gate.weight.data[:3]
    with pytest.raises(ExpertParallelError, match=r"model\.layers\.1\.mlp\.experts has 3 experts, not divisible"):
        expert_parallel_plan(model, init_mesh({"ep": 2}))
    mesh = init_mesh({"ep": 2})
    model = parallelize_experts(_build("mixtral"), mesh)
    with pytest.raises(ExpertParallelError, match=r"\['model\.layers\.0\.mlp\.experts', .* already distributed"):
        parallelize_experts(model, mesh)
