"""Zero-bubble backward split: BI then BW gives bitwise the gradients of one plain backward, and BI touches no
parameter gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from vescale.core.testing.models import GPT, GPTConfig
from vescale.pipe._backward import backward_input, backward_weight


@pytest.mark.parametrize("tied", [False, True])  # tied: a weight used twice in the stage takes the fallback path
def test_split_backward_is_bitwise(tied):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=48, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=16,
                          tie_embeddings=tied))
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 48, (2, 8))

    def stage(m, h):  # a middle stage: input activations in, activations out; the head reuses the embedding
        cos, sin = m.rotary(8, h.device)
        for layer in m.layers:
            h = layer(h, cos, sin)
        return m.lm_head(m.norm(h)) + m.embed(tokens).sum()

    h0 = model.embed(tokens).detach()
    grad_out = torch.randn(2, 8, 48)
    x_ref = h0.clone().requires_grad_()
    stage(twin, x_ref).backward(grad_out)

    x = h0.clone().requires_grad_()
    out = stage(model, x)
    (gx,), pending = backward_input([out], [grad_out], [x])
    assert all(p.grad is None for p in model.parameters())  # BI computed no weight gradient
    assert torch.equal(gx, x_ref.grad)
    # one call per parameter use (2 x (7 linears + 2 norms) + norm + head + embedding), or one fallback call
    assert len(pending.calls) == (1 if tied else 21)
    backward_weight(pending)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
