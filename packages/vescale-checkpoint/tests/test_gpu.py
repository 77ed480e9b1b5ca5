"""CUDA tensors: async save copies into pinned host memory on a side stream, fenced by the next optimizer step;
load fills CUDA tensors (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from vescale import checkpoint


@pytest.mark.gpu
def test_cuda_state_round_trip(tmp_path):
    model = torch.nn.Linear(64, 32).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "step": 1}
    expect = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    expect_avg = {n: opt.state[p]["exp_avg"].cpu().clone() for n, p in model.named_parameters()}
    handle = checkpoint.save(tmp_path / "ckpt", state, async_save=True)
    model(torch.randn(8, 64, device="cuda")).sum().backward()  # runs while the parameters are copied on a side
    opt.step()  # stream; waits for that copy before changing them
    handle.wait_snapshot()
    with torch.no_grad():
        model.weight.add_(1.0)  # after the snapshot: must not reach the checkpoint
    handle.wait()
    fresh = torch.nn.Linear(64, 32).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    checkpoint.load(tmp_path / "ckpt", {"model": fresh, "optim": fresh_opt, "step": 0})
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), expect[k]), k
    for n, p in fresh.named_parameters():
        assert torch.equal(fresh_opt.state[p]["exp_avg"].cpu(), expect_avg[n]), n
