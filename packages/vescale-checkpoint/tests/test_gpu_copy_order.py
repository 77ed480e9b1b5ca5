"""CUDA device-to-host snapshot copies with several I/O threads are complete before their bytes are written and
checksummed (needs CUDA; skipped without it, so the CPU-only CI never runs these).

Each case saves many CUDA tensors (so there are several copies for the threads) with ``threads=4`` while a stream
other than the copies' is busy, then loads the checkpoint into CPU tensors and compares bitwise with what the
tensors held when ``save`` was called:

- async: parameters and optimizer state are copied in the background on a side stream; the default stream is kept
  busy right after ``save`` returns (copies issued from pool threads on the default stream would wait behind that
  work while only the side stream was synchronised, and the writer would write a half-filled host buffer);
- sync: the tensors are written on a side stream and saved with it current (copies on another stream would not wait
  for those writes).
"""

from __future__ import annotations

import pytest
import torch

from vescale import checkpoint


def _busy(device: str = "cuda") -> torch.Tensor:
    """Queue a few hundred milliseconds of work on the current stream, touching nothing saved."""
    x = torch.randn(4096, 4096, device=device)
    for _ in range(30):
        x = x @ x
        x = x / x.norm()
    return x


@pytest.mark.gpu
def test_async_background_copies_with_threads_complete_before_the_write(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(16, 512, device="cuda")).square().mean().backward()
    opt.step()
    expect = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    expect_sq = {n: opt.state[p]["exp_avg_sq"].cpu().clone() for n, p in model.named_parameters()}
    handle = checkpoint.save(tmp_path / "ckpt", {"model": model, "optim": opt}, async_save=True, threads=4)
    _busy()  # on the default stream, right after save returned
    handle.wait()
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    checkpoint.load(tmp_path / "ckpt", {"model": fresh, "optim": fresh_opt})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expect[k]), k
    for n, p in fresh.named_parameters():
        assert torch.equal(fresh_opt.state[p]["exp_avg_sq"], expect_sq[n]), n


@pytest.mark.gpu
def test_sync_copies_with_threads_follow_the_callers_stream(tmp_path):
    side = torch.cuda.Stream()
    tensors = {f"t{i}": torch.zeros(1 << 20, device="cuda") for i in range(12)}
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        x = _busy()  # the values are ready only after this work on the side stream
        for i, t in enumerate(tensors.values()):
            t.copy_(x.reshape(-1)[: t.numel()] + i)
        checkpoint.save(tmp_path / "ckpt", dict(tensors), threads=4)
    torch.cuda.synchronize()
    expect = {k: t.cpu() for k, t in tensors.items()}
    loaded = {k: torch.empty(1 << 20) for k in tensors}
    checkpoint.load(tmp_path / "ckpt", loaded)
    for k in tensors:
        assert torch.equal(loaded[k], expect[k]), k
