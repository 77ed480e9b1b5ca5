"""Activation checkpointing with dropout under vescale's counter RNG: bitwise equal to the same run without it.

Reference: the same model, seed and data with no checkpointing at all (nothing of
:mod:`vescale.parallel.activation_checkpoint` applied, no ``torch.utils.checkpoint`` call), on the same mesh. Each
mode checkpoints every block: :func:`checkpoint_activations` ``"full"`` and ``"selective"``, and a user's own plain
``torch.utils.checkpoint`` around each block's forward, ``use_reentrant=False`` and ``True``. Two SGD steps:
every parameter gradient of both steps is ``torch.equal`` to the reference (step 2 sees the parameters step 1
updated and the dropout masks drawn after a checkpointed step), and vescale's RNG state after each step is the
reference's. Models: vescale's test GPT (a plain ``nn.Module``, dropout 0.1 on attention probabilities, residual
and MLP outputs) and a tiny Hugging Face Llama with ``attention_dropout=0.1``; single process and tp=2 (pooled ranks,
the models' TP plans). Without the replay in :mod:`vescale.dtensor.random` every checkpointed mode fails: the
recompute draws the next counter values (other masks) and the RNG state runs ahead.
"""

from __future__ import annotations

import functools

import pytest

MODES = ["full", "selective", "torch", "torch_reentrant"]


def _model(kind: str):
    import torch

    torch.manual_seed(0)
    if kind == "gpt":
        from vescale.core.testing.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, ffn_hidden=64, max_seq_len=16,
                             dropout=0.1)).train()
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.1, attn_implementation="eager")
    return tf.LlamaForCausalLM(cfg).train()


def _torch_checkpointed(forward, reentrant: bool, *args, **kwargs):
    """What a user writes: plain ``torch.utils.checkpoint`` around a block (keyword arguments bound for reentrant)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=reentrant)


def _apply(model, kind: str, mode: str) -> None:
    from vescale.parallel import checkpoint_activations

    if mode in ("full", "selective"):
        checkpoint_activations(model, mode)
    elif mode != "none":
        layers = model.layers if kind == "gpt" else model.model.layers
        for block in layers:
            block.forward = functools.partial(_torch_checkpointed, block.forward, mode == "torch_reentrant")


def _train(kind: str, mode: str, mesh=None, steps: int = 2, seed: int = 7):
    """Per step: ({param name: full gradient}, loss, vescale RNG state after the step)."""
    import torch

    from vescale.core.testing.models import cross_entropy
    from vescale.dtensor import random as vrandom

    model = _model(kind)
    if mesh is not None:
        from vescale.parallel import PLANS, parallelize_module

        parallelize_module(model, mesh, PLANS[kind](mesh, dp=None) if kind == "gpt" else PLANS[kind](mesh))
    _apply(model, kind, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    targets = torch.randint(0, 64, (2, 8), generator=g)
    out = []
    vrandom.manual_seed(seed)
    for _ in range(steps):
        with vrandom.single_device():
            logits = model(tokens) if kind == "gpt" else model(input_ids=tokens, use_cache=False).logits
            loss = cross_entropy(logits, targets)
            loss.backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in model.named_parameters()}
        out.append((grads, loss.detach().clone(), vrandom.get_state()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _compare(kind: str, mesh=None, modes=tuple(MODES)) -> list[str]:
    """Failures (empty when every mode is bitwise equal to no checkpointing)."""
    import torch

    ref = _train(kind, "none", mesh)
    failures = []
    for mode in modes:
        got = _train(kind, mode, mesh)
        for step, ((g_ref, l_ref, s_ref), (g, loss, s)) in enumerate(zip(ref, got)):
            if s != s_ref:
                failures.append(f"{kind} {mode} step {step}: RNG state {s} != {s_ref}")
            if not torch.equal(loss, l_ref):
                failures.append(f"{kind} {mode} step {step}: loss {loss.item()} != {l_ref.item()}")
            for name, grad in g.items():
                if not torch.equal(grad, g_ref[name]):
                    diff = (grad - g_ref[name]).abs().max().item()
                    failures.append(f"{kind} {mode} step {step}: grad {name} differs (max {diff:.3g})")
    return failures


def _ranks_compare(kind: str):
    from vescale.core.mesh import init_mesh

    # The GPT block builds its causal mask (torch.ones) inside the block: a plain torch.utils.checkpoint recomputes
    # it outside the parallelized root's factory capture, so under TP only checkpoint_activations (which re-enters
    # the capture for the recompute) runs it; Llama's mask is built outside its blocks.
    modes = ("full", "selective") if kind == "gpt" else tuple(MODES)
    return _compare(kind, init_mesh({"tp": 2}), modes)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_single_process_bitwise(kind):
    failures = _compare(kind)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_tp2_bitwise(kind, ranks):
    for failures in ranks(_ranks_compare, 2, kind):
        assert not failures, "\n".join(failures[:20])


def test_reference_masks_are_active():
    """The comparisons above can fail: the masks matter (another seed, other gradients), so a recompute that drew
    fresh values could not pass them."""
    import torch

    (ref, _, _), = _train("gpt", "none", steps=1)
    (other, _, _), = _train("gpt", "none", steps=1, seed=8)
    assert any(not torch.equal(other[n], ref[n]) for n in ref)


def _nested_and_in_flight(reseed: bool):
    """Two microbatches in flight (both forwards, then backwards in reverse order), each through nested regions
    (a reentrant region inside a non-reentrant one), reseeding at every step when ``reseed``."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from vescale.dtensor import random as vrandom

    torch.manual_seed(0)
    lin = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def inner(h):
        return torch.nn.functional.dropout(lin[1](h), 0.3) * 2

    def outer(h, ckpt):
        h = torch.nn.functional.dropout(lin[0](h), 0.3)
        h = checkpoint(inner, h, use_reentrant=True) if ckpt else inner(h)
        return torch.nn.functional.dropout(lin[2](h).relu(), 0.3)

    def run(ckpt):
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(2)]
        grads, states = [], []
        vrandom.manual_seed(3)
        for _ in range(2):
            if reseed:
                vrandom.manual_seed(3)
            with vrandom.single_device():
                losses = [(checkpoint(outer, x, ckpt, use_reentrant=False) if ckpt else outer(x, False)).square().sum()
                          for x in xs]
                for loss in reversed(losses):
                    loss.backward()
            grads.append([p.grad.clone() for p in lin.parameters()] + [x.grad.clone() for x in xs])
            states.append(vrandom.get_state())
            for p in list(lin.parameters()) + xs:
                p.grad = None
        return grads, states

    return run(False), run(True)


@pytest.mark.parametrize("reseed", [False, True])
def test_nested_regions_and_microbatches_in_flight(reseed):
    import torch

    (ref_grads, ref_states), (grads, states) = _nested_and_in_flight(reseed)
    assert states == ref_states
    for step_ref, step in zip(ref_grads, grads):
        for a, b in zip(step_ref, step):
            assert torch.equal(a, b)


def test_recompute_with_other_random_calls_is_refused():
    """A region whose recompute draws what its forward did not (dropout switched on after the forward) raises."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from vescale.dtensor import random as vrandom

    drop = torch.nn.Dropout(0.5).eval()
    lin = torch.nn.Linear(4, 4)
    vrandom.manual_seed(0)
    with vrandom.single_device():
        for reentrant in (False, True):
            drop.eval()
            out = checkpoint(lambda h: lin(drop(h)), torch.randn(2, 4, requires_grad=True), use_reentrant=reentrant)
            drop.train()
            with pytest.raises(vrandom.CheckpointReplayError, match="made only 0"):
                out.sum().backward()


def test_api_errors():
    import torch

    from vescale.parallel import ActivationCheckpointError, checkpoint_activations, checkpointed_blocks

    model = _model("gpt")
    with pytest.raises(ActivationCheckpointError, match="unknown policy 'half'"):
        checkpoint_activations(model, "half")
    with pytest.raises(ActivationCheckpointError, match="blocks='nope'"):
        checkpoint_activations(model, blocks="nope")
    with pytest.raises(ActivationCheckpointError, match="no nn.ModuleList"):
        checkpoint_activations(torch.nn.Linear(2, 2))
    with pytest.raises(ActivationCheckpointError, match="aten op overloads"):
        checkpoint_activations(model, ["mm"])
    checkpoint_activations(model, "full", blocks=r"layers\.\d+\.mlp")
    assert checkpointed_blocks(model) == ["layers.0.mlp", "layers.1.mlp"]
    with pytest.raises(ActivationCheckpointError, match="'layers.0.mlp' .* already checkpointed"):
        checkpoint_activations(model, "selective", blocks=r"layers\.0\.mlp")
    keys = list(_model("gpt").state_dict())
    assert list(model.state_dict()) == keys  # FQNs unchanged


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_blocks_compile(policy):
    """checkpoint_activations then compile_parallel (dropout off, as compile mode requires): dynamo traces torch's
    checkpoint into each block's graph; gradients equal the eager model without checkpointing (aot_eager backend,
    so the comparison is bitwise)."""
    import copy

    import torch

    from vescale.core.testing.models import cross_entropy
    from vescale.parallel import checkpoint_activations, compile_parallel

    ref = _model("gpt")
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model = copy.deepcopy(ref)
    compile_parallel(checkpoint_activations(model, policy), backend="aot_eager")
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    cross_entropy(model(tokens), tokens).backward()
    cross_entropy(ref(tokens), tokens).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_pipeline_stages_bitwise(policy):
    """Graph-captured pipeline stages (``whole=True``: one region per stage) with dropout on: gradients and the RNG
    state equal the same stages without checkpointing."""
    pytest.importorskip("vescale.pipe")  # not a dependency of vescale-parallel (isolated installs skip this)
    import torch

    from vescale.core.testing.models import cross_entropy
    from vescale.dtensor import random as vrandom
    from vescale.parallel import checkpoint_activations
    from vescale.pipe import split

    def run(ckpt: bool):
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        stages = split(_model("gpt"), num_stages=2, example_inputs=(tokens,))
        if ckpt:
            for stage in stages:
                checkpoint_activations(stage, policy, whole=True)
        vrandom.manual_seed(3)
        with vrandom.single_device():
            cross_entropy(stages[1](*stages[0](tokens)), tokens).backward()
        return [(n, p.grad) for s in stages for n, p in s.named_parameters()], vrandom.get_state()

    (ref, ref_state), (got, state) = run(False), run(True)
    assert state == ref_state and ref_state[1] > 0  # dropout drew inside the stages
    for (name, a), (_, b) in zip(ref, got):
        assert torch.equal(a, b), name
