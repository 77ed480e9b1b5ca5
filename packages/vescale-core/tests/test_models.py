"""The reference GPT: shapes, causality, tied weights, init statistics, learnability."""

from __future__ import annotations

import math

import pytest
import torch

from vescale.core.testing.models import GPT, GPTConfig, cross_entropy


def test_shapes_and_fqns():
    cfg = GPTConfig(vocab_size=100, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    model = GPT(cfg)
    tokens = torch.randint(0, 100, (3, 10))
    assert model(tokens).shape == (3, 10, 100)
    names = dict(model.named_parameters())
    assert names["layers.1.attn.wk.weight"].shape == (2 * 8, 32)
    assert names["layers.0.mlp.w_gate.weight"].shape == (cfg.ffn_hidden, 32)
    assert cfg.ffn_hidden == 96


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    a = torch.randint(0, 256, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 256
    torch.testing.assert_close(model(a)[:, :8], model(b)[:, :8], rtol=0, atol=0)
    assert not torch.equal(model(a)[:, 8:], model(b)[:, 8:])


def test_tied_embeddings_share_one_parameter():
    model = GPT(GPTConfig(tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_init_std_follows_depth_scaling():
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=256, n_layer=8, n_head=4)
    model = GPT(cfg)
    assert abs(model.layers[0].attn.wq.weight.std().item() - 0.02) < 0.002
    assert abs(model.layers[0].attn.wo.weight.std().item() - 0.02 / math.sqrt(16)) < 0.0005


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="max_seq_len"):
        GPT(GPTConfig(max_seq_len=4))(torch.zeros(1, 5, dtype=torch.long))


def test_loss_falls_when_trained():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, d_model=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(64).remainder(16).view(2, 32)  # a fully predictable sequence
    losses = []
    for _ in range(30):
        loss = cross_entropy(model(data[:, :-1]), data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
