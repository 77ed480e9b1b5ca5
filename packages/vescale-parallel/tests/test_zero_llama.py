"""An unmodified Hugging Face LlamaForCausalLM (tiny, random init) trained 20 AdamW steps with DDP and ZeRO 1/2 on
dp=2 matches the single-process run: losses relative 1e-5 per step, final weights ``allclose`` (fp32)."""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

STEPS, BATCH, SEQ, VOCAB, LR = 20, 4, 16, 64, 3e-3


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def _batch(step: int):
    import torch

    g = torch.Generator().manual_seed(3000 + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, x, y):
    import torch.nn.functional as F

    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _run(model, opt, rows: slice):
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = _loss(model, x[rows], y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.fixture(scope="module")
def ref():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _llama()
        losses = _run(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), slice(None))
        return [x.item() for x in losses], {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(before)


@multi_rank(world_sizes=[2])
def test_hf_llama_zero_matches_single_device(world_size, ref):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one intra-op thread per rank is fastest on a busy 2-core machine
    try:
        _llama_body(ref)
    finally:
        torch.set_num_threads(before)


def _llama_body(ref):
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    want_losses, want_state = ref
    mesh = init_mesh({"dp": 2})
    rank = dist.get_rank()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    for stage in (0, 2):
        model = DistributedDataParallel(_llama(), mesh, DDPOptions(bucket_size_mb=0.01, zero_stage=stage))
        if stage == 0:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        else:
            opt = DistributedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1),
                                       zero_stage=2)
        losses = torch.stack(_run(model, opt, rows))
        dist.all_reduce(losses)
        for step, (g, w) in enumerate(zip((losses / 2).tolist(), want_losses)):
            assert abs(g - w) <= 1e-5 * abs(w), f"zero{stage} step {step}: loss {g} vs single device {w}"
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, want_state[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
