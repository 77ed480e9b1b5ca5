"""auto_plan with dropout: a partial sum is reduced before any random op meets it, so training mode with the model's
own dropout equals one device running vescale's counter RNG (``vescale.dtensor.random.single_device``).

The reference is the unmodified model on one process inside ``random.single_device()`` after
``random.manual_seed(0)``; the parallel run reseeds to 0 after planning and draws the same masks (the counter RNG is
keyed on the global element index), so the comparison is at fp32 reduction-order tolerance (rtol 1e-5), and the
dropout masks themselves are bitwise those of one device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vescale.core.testing import multi_rank

pytest.importorskip("transformers")


def _opt():
    import transformers as T

    torch.manual_seed(0)
    config = T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=64, word_embed_proj_dim=32)
    assert config.dropout > 0  # the config's own default dropout (0.1) is what is run
    return T.OPTForCausalLM(config).train()


@multi_rank(world_sizes=[2])
def test_opt_training_mode_dropout_matches_single_device(world_size):
    """OPT in training mode with its default dropout on tp=2 (with and without sequence parallelism): its MLP runs
    on the flattened sequence, so ``fc2``'s partial output met the residual dropout unreduced (``PlacementError:
    bernoulli: cannot fill a DTensor with a Partial placement``). The plan now reduces it at ``fc2``'s output; logits,
    loss and every gradient equal one device with the same RNG (rtol 1e-5)."""
    from vescale.core.mesh import init_mesh
    from vescale.dtensor import random
    from vescale.parallel import parallelize_module
    from vescale.plan import auto_plan

    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = _opt()
    with torch.no_grad():
        plain = ref.eval()(input_ids=ids).logits
    ref.train()
    random.manual_seed(0)
    with random.single_device():
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
    assert (out.logits - plain).abs().max() > 1e-2  # dropout is active in the reference
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    mesh = init_mesh({"tp": 2})
    for sp in (False, True):
        model = _opt()
        plan = auto_plan(model, mesh, sequence_parallel=sp, example_kwargs={"input_ids": ids, "labels": ids})
        parallelize_module(model, mesh, plan)
        random.manual_seed(0)
        got = model(input_ids=ids, labels=ids)
        got.loss.backward()
        torch.testing.assert_close(got.logits, out.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.loss, out.loss, rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)
        reasons = {d.fqn: d.reason for d in plan.decisions if d.kind == "output"}
        assert "before the random op dropout" in reasons.get("model.decoder.layers.1.fc2", ""), reasons


class _Block(nn.Module):
    """A residual MLP written with functional linears: no module returns the down projection's output."""

    def __init__(self, dropout: nn.Module | None) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(32, 16))
        self.down = nn.Parameter(torch.randn(16, 32))
        self.drop = dropout

    def forward(self, x):
        h = F.linear(torch.tanh(F.linear(x, self.up)), self.down)
        return x + (self.drop(h) if self.drop is not None else F.dropout(h, 0.1, self.training))


class _Model(nn.Module):
    def __init__(self, dropout: nn.Module | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.block = _Block(dropout)
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def test_dropout_module_gets_a_reducing_input_and_functional_dropout_refuses_the_pair():
    """Where no module returns the partial sum before the random op, an ``nn.Dropout`` module around the op gets a
    reducing input boundary; a functional dropout with no module boundary before it gets the pair replicated, with
    the reason (planned for tp=2 from the trace: no mesh needed)."""
    from torch.distributed.tensor import Replicate, Shard

    from vescale.plan import plan_from_trace
    from vescale.plan.trace import trace_model

    plan = plan_from_trace(trace_model(_Model(nn.Dropout(0.1))), ["tp"], {"tp": 2})
    roles = {d.fqn: d.role for d in plan.decisions if d.kind == "parameter"}
    assert roles["block.up"] == "column" and roles["block.down"] == "row"
    assert plan["input"][r"block\.drop"] == [[Replicate()]]

    plan = plan_from_trace(trace_model(_Model(None)), ["tp"], {"tp": 2})
    decisions = {d.fqn: d for d in plan.decisions if d.kind == "parameter"}
    for fqn in ("block.up", "block.down"):
        assert decisions[fqn].role == "replicated", decisions[fqn]
        assert "reach the random op dropout in block" in decisions[fqn].reason, decisions[fqn]
    assert plan["parameter"][r"embed\.weight"] == [Shard(0)]  # the rest stays sharded

    # without dropout (p = 0) the same model keeps its pair sharded: the refusal is about the random op only
    class _NoDrop(_Model):
        def __init__(self) -> None:
            super().__init__(nn.Dropout(0.0))

    roles = {d.fqn: d.role for d in plan_from_trace(trace_model(_NoDrop()), ["tp"], {"tp": 2}).decisions
             if d.kind == "parameter"}
    assert roles["block.down"] == "row"


@multi_rank(world_sizes=[2])
def test_gpt2_training_mode_eager_matches_and_fused_attention_dropout_is_refused(world_size):
    """GPT-2 with its default dropout (attention, residual, embedding: 0.1) in training mode on tp=2: with
    ``attn_implementation="eager"`` (attention dropout through ``nn.Dropout`` on head-sharded probabilities) logits,
    loss and gradients equal one device with the same RNG (rtol 1e-5); with its default SDPA, whose CPU kernel draws
    the attention dropout mask itself, the forward raises ``NotImplementedError`` naming the fix on every rank (it
    crashed on a plain causal mask before)."""
    import transformers as T

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import random
    from vescale.parallel import parallelize_module
    from vescale.plan import auto_plan

    def gpt2(attn: str):
        torch.manual_seed(0)
        config = T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn)
        assert config.attn_pdrop > 0 and config.resid_pdrop > 0 and config.embd_pdrop > 0
        return T.GPT2LMHeadModel(config).train()

    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    mesh = init_mesh({"tp": 2})
    ref = gpt2("eager")
    random.manual_seed(0)
    with random.single_device():
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
    model = gpt2("eager")
    parallelize_module(model, mesh, auto_plan(model, mesh, example_kwargs={"input_ids": ids, "labels": ids}))
    random.manual_seed(0)
    got = model(input_ids=ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.logits, out.logits, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[n].grad, rtol=1e-5, atol=1e-5,
                                   msg=n)

    model = gpt2("sdpa")
    parallelize_module(model, mesh, auto_plan(model, mesh, example_kwargs={"input_ids": ids, "labels": ids}))
    with pytest.raises(NotImplementedError, match="attn_implementation='eager'"):
        model(input_ids=ids, labels=ids)


class _Router(nn.Module):
    """Data-dependent routing (``int()`` of a tensor: not traceable on meta, so opaque) that samples in training."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(32, 16))
        self.w_out = nn.Parameter(torch.randn(16, 32))

    def forward(self, x):
        if self.training:
            x = x * torch.rand_like(x)
        k = int((x > 0).sum()) % 2
        return F.linear(F.linear(x, self.w_in).tanh(), self.w_out) * (k + 1)


class _MoeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.moe = _Router()
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.moe(h))


def test_random_op_inside_an_opaque_module_is_refused_in_training_mode_only():
    """A random op inside a module that runs on local shards as plain tensors (opaque: not traceable on meta) cannot
    draw one device's values: planning it in training mode raises ``PlanError`` naming the op and the module; in
    eval mode (no random op runs) the same model plans, its opaque pair sharded."""
    from vescale.core.errors import PlanError
    from vescale.plan import plan_from_trace
    from vescale.plan.trace import trace_model

    model = _MoeModel()
    with pytest.raises(PlanError, match=r"rand_like in moe .*inside moe"):
        plan_from_trace(trace_model(model.train()), ["tp"], {"tp": 2})
    plan = plan_from_trace(trace_model(model.eval()), ["tp"], {"tp": 2})
    roles = {d.fqn: d.role for d in plan.decisions if d.kind == "parameter"}
    assert roles["moe.w_in"] == "column" and roles["moe.w_out"] == "row", roles


class _ExpertNorm(nn.Module):
    """Ergo's shape: not traceable on meta (``int()`` of a tensor), no projection pair (a per-expert scale only), and
    code that unwraps its own weight when it is a DTensor and indexes it with routing ids."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(4, 16) + 0.5)

    def forward(self, h, ids):
        from torch.distributed.tensor import DTensor

        weight = self.scale.to_local() if isinstance(self.scale, DTensor) else self.scale
        k = int((ids > 1).sum()) % 2
        return h * weight[ids] * (k + 1)


class _ExpertNormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.router = nn.Linear(16, 4)
        self.norm = _ExpertNorm()
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(self.up(h).relu())
        return self.head(h + self.norm(h, self.router(h).argmax(-1)))


@multi_rank(world_sizes=[2])
def test_opaque_module_without_a_pair_runs_whole_and_equals_one_device():
    """An opaque module whose parameters all stay replicated runs whole on plain tensors on every rank (its code may
    ``to_local()`` its own weight and index it with routing ids, as Ergo's expert norm does: on DTensors that was
    ``aten.index.Tensor got mixed torch.Tensor and DTensor``); logits and every gradient equal one device."""
    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_module
    from vescale.plan import auto_plan

    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = _ExpertNormModel()
    model = _ExpertNormModel()
    model.load_state_dict(ref.state_dict())
    out_ref = ref(ids)
    out_ref.square().mean().backward()
    mesh = init_mesh({"tp": 2})
    plan = auto_plan(model, mesh, example_args=(ids,))
    assert any(d.kind == "local" and d.fqn == "norm" for d in plan.decisions), plan.decisions
    parallelize_module(model, mesh, plan)
    out = model(ids)
    full = out.full_tensor() if hasattr(out, "full_tensor") else out
    full.square().mean().backward()
    torch.testing.assert_close(full, out_ref, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, dict(ref.named_parameters())[n].grad, rtol=1e-5, atol=1e-5, msg=n)
