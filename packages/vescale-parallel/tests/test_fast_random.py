"""The fast path never draws random numbers on local tensors (:mod:`vescale.parallel.fast.random_guard`).

A Llama whose MLP is made random in a way no ``*dropout*`` config field shows (a literal ``F.dropout``, noise from a
helper the code walk cannot see, an ``nn.Dropout`` child, a router-like ``multinomial``) trains on tp2 exactly as
one device does under vescale's counter RNG (loss and every gradient, two steps), because that MLP takes the DTensor
path: refused at installation when its code names a random function, else after its first training call recorded
the random op (a ``multinomial`` there raises ``UndrawnRandomError``, naming it). The attention blocks and the
unchanged model still take the fast path. Without the guard the first two cases run the MLP locally on torch's
per-rank generator and differ from one device.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _llama():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return tf.LlamaForCausalLM(cfg).train()


def _noise(x):
    """Random noise from a helper outside transformers: invisible to the code walk, seen at run time."""
    import torch

    return x + 0.1 * torch.randn_like(x)


def _forward_literal_dropout(self, x):
    import torch.nn.functional as F

    return self.down_proj(F.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x), p=0.3, training=self.training))


def _forward_helper_noise(self, x):
    return self.down_proj(_noise(self.act_fn(self.gate_proj(x))) * self.up_proj(x))


def _forward_dropout_child(self, x):
    return self.down_proj(self.drop(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


def _forward_router(self, x):
    import torch

    h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
    pick = torch.multinomial(h.detach().flatten(0, 1).softmax(-1), 1)  # a sampled route, as a stochastic router
    return self.down_proj(h) + 0.0 * pick.sum()


def _train(model, tokens, labels, steps: int = 2):
    """Per step: the loss and every parameter's full gradient (the gradients then cleared)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from vescale.dtensor import random as vrandom

    vrandom.manual_seed(7)
    out = []
    for _ in range(steps):
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone())
                 for n, p in model.named_parameters()}
        model.zero_grad()
        out.append((loss.detach(), grads))
    return out


@multi_rank(world_sizes=[2])
def test_random_mlp_takes_the_dtensor_path_and_matches_one_device():
    import copy

    import pytest
    import torch
    import transformers as tf

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import random as vrandom
    from vescale.dtensor.errors import UndrawnRandomError
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import FastBlock, FastLayer, FastModel

    mesh = init_mesh({"tp": 2})
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
    mlp_cls = tf.models.llama.modeling_llama.LlamaMLP

    def case(forward, *, child: bool = False):
        torch.manual_seed(0)
        ref = _llama()
        if child:
            for layer in ref.model.layers:
                layer.mlp.drop = torch.nn.Dropout(0.3)
        saved = mlp_cls.forward
        mlp_cls.forward = forward  # the class's forward: transformers' structure and names, other code
        try:
            par = parallelize_module(copy.deepcopy(ref), mesh, llama_plan(mesh))
            got = _train(par, tokens, labels)
            with vrandom.single_device():
                want = _train(ref, tokens, labels)
        finally:
            mlp_cls.forward = saved
        for (loss, grads), (ref_loss, ref_grads) in zip(got, want):
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
            for name, grad in ref_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, name=name: f"{name}: {m}")
        assert not any(grad.eq(want[0][1][n]).all() for n, grad in want[1][1].items() if "mlp" in n)  # masks differ
        return par

    # a literal F.dropout: the code walk refuses the MLP at installation; attention still runs locally
    par = case(_forward_literal_dropout)
    assert not isinstance(par.model.layers[0].mlp.forward, FastBlock)
    assert not isinstance(par.model.layers[0].forward, FastLayer) and not isinstance(par.forward, FastModel)
    assert [layer.self_attn.forward.local_calls for layer in par.model.layers] == [1, 1]

    # an nn.Dropout child: not a recognised block
    par = case(_forward_dropout_child, child=True)
    assert not isinstance(par.model.layers[0].mlp.forward, FastBlock)

    # noise from a helper the walk cannot see: installed, its first training call records the draw, then the model,
    # the layers and the MLPs stay on DTensors while the attention blocks run locally
    par = case(_forward_helper_noise)
    mlp = par.model.layers[0].mlp.forward
    assert isinstance(mlp, FastBlock) and mlp.local_calls == 0 and mlp.random.found[True], mlp.random.found
    assert par.forward.random.found[True] and par.forward.local_calls == 0
    assert [layer.forward.local_calls for layer in par.model.layers] == [0, 0]
    assert [layer.self_attn.forward.local_calls for layer in par.model.layers] == [1, 1]

    # a random op the counter RNG does not draw: refused by name on the DTensor path, never drawn locally
    saved = mlp_cls.forward
    mlp_cls.forward = _forward_router
    try:
        par = parallelize_module(_llama(), mesh, llama_plan(mesh))
        vrandom.manual_seed(7)
        with pytest.raises(UndrawnRandomError, match="multinomial"):
            par(input_ids=tokens, use_cache=False)
    finally:
        mlp_cls.forward = saved

    # unchanged: the model (so every layer and block) runs locally after its first (probed) training call
    torch.manual_seed(0)
    par = parallelize_module(_llama(), mesh, llama_plan(mesh))
    _train(par, tokens, labels)
    assert isinstance(par.forward, FastModel) and par.forward.local_calls == 1
    assert par.forward.random.found == {True: (), False: None}
