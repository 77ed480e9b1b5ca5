"""CUDA tensors: async save snapshots into pinned host memory; load fills CUDA tensors (skipped without CUDA)."""

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
    handle = checkpoint.save(tmp_path / "ckpt", state, async_save=True)
    with torch.no_grad():
        model.weight.add_(1.0)  # after the snapshot: must not reach the checkpoint
    handle.wait()
    fresh = torch.nn.Linear(64, 32).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    checkpoint.load(tmp_path / "ckpt", {"model": fresh, "optim": fresh_opt, "step": 0})
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), expect[k]), k
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(fresh_opt.state[p]["exp_avg"], opt.state[q]["exp_avg"])
