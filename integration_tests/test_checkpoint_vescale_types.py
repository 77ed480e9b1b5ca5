"""vescale's own types, recognised when installed: RaggedShard / InterleavedShard DTensors, ZeRO DistributedOptimizer,
experts distributed over ``ep`` (``vescale.parallel.parallelize_experts``).

An integration test: vescale-checkpoint does not depend on vescale-dtensor or vescale-parallel, so its own session
cannot run these. All comparisons are bitwise against the global tensors saved, except the ZeRO-vs-single-device
optimizer state, which is checked to 1e-6 relative (the same elementwise AdamW on flat pieces instead of whole
tensors).
"""

from __future__ import annotations

import os

import torch

from vescale import checkpoint
from vescale.core.testing import run_on_ranks

FULL = torch.arange(30, dtype=torch.float32).reshape(6, 5)


def _ragged_save(path: str) -> None:
    from vescale.core.mesh import init_mesh
    from vescale.dtensor import InterleavedShard, RaggedShard, distribute_tensor

    mesh = init_mesh({"dp": 2})["dp"]
    state = {"ragged": distribute_tensor(FULL, mesh, [RaggedShard((0, 1), (3, 2))]),
             "interleaved": distribute_tensor(FULL, mesh, [InterleavedShard(0, 3)])}
    checkpoint.save(path, state)


def _ragged_load(path: str) -> None:
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import RaggedShard, distribute_tensor, full_tensor

    mesh = init_mesh({"dp": 2})["dp"]
    zeros = torch.zeros(6, 5)
    state = {"ragged": distribute_tensor(zeros, mesh, [Shard(1)]),
             "interleaved": distribute_tensor(zeros, mesh, [RaggedShard((0,), (1, 2))])}
    checkpoint.load(path, state, dedup_reads=True)
    assert torch.equal(state["ragged"].full_tensor(), FULL)
    assert torch.equal(full_tensor(state["interleaved"]), FULL)


def test_ragged_and_interleaved_dtensors(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_ragged_save, 2, path)
    run_on_ranks(_ragged_load, 2, path)
    plain = {"ragged": torch.zeros(6, 5), "interleaved": torch.zeros(6, 5)}
    checkpoint.load(path, plain)
    assert torch.equal(plain["ragged"], FULL) and torch.equal(plain["interleaved"], FULL)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))


def _zero(dp: int):
    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    mesh = init_mesh({"dp": dp})["dp"]
    ddp = DistributedDataParallel(_net(), mesh, DDPOptions(bucket_size_mb=0.0003))  # several buckets
    return ddp, DistributedOptimizer(ddp, torch.optim.AdamW, zero_stage=1, lr=1e-2, weight_decay=0.1)


def _zero_save(path: str) -> None:
    ddp, opt = _zero(2)
    for i in range(2):
        ddp(_batch(i)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, {"model": ddp, "optim": opt, "step": 2})


def _zero_reshard(src: str, dst: str) -> None:
    ddp, opt = _zero(4)  # fresh: no optimizer state yet, built by the load
    state = {"model": ddp, "optim": opt, "step": 0}
    checkpoint.load(src, state)
    assert state["step"] == 2
    checkpoint.save(dst, state)


def test_zero_optimizer_reshards_to_any_dp_and_to_plain(tmp_path):
    a, b = str(tmp_path / "zero2"), str(tmp_path / "zero4")
    run_on_ranks(_zero_save, 2, a)
    # single-device reference: the same steps with a plain AdamW
    net = _net()
    ref = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(2):
        net(_batch(i)).square().mean().backward()
        ref.step()
        ref.zero_grad()
    keys = set(checkpoint.inspect(a)["tensors"])
    assert "optim.state.0.weight.exp_avg" in keys and "optim.state.2.bias.exp_avg_sq" in keys

    def plain_load(path):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        checkpoint.load(path, {"model": model, "optim": opt, "step": 0})
        return model, opt

    model, opt = plain_load(a)
    for p, q in zip(model.parameters(), net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][name], ref.state[q][name], rtol=1e-6, atol=1e-9)
        assert float(opt.state[p]["step"]) == 2.0
    assert opt.param_groups[0]["lr"] == 1e-2

    run_on_ranks(_zero_reshard, 4, a, b)  # dp 2 -> dp 4, saved again from dp 4
    model4, opt4 = plain_load(b)
    for p, q in zip(model.parameters(), model4.parameters()):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][name], opt4.state[q][name]), name
    assert os.path.exists(os.path.join(b, "metadata.json"))


def _zero_async_save(sync_path: str, async_path: str) -> float:
    import time

    from vescale.checkpoint import _snapshot

    ddp, opt = _zero(2)

    def step(i):
        ddp(_batch(i)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    state = {"model": ddp, "optim": opt, "step": 1}
    checkpoint.save(sync_path, state)
    copy = _snapshot.copy_deferred
    _snapshot.copy_deferred = lambda deferred: (time.sleep(0.5), copy(deferred))
    try:
        handle = checkpoint.save(async_path, state, async_save=True)
        step(1)  # ZeRO's step runs the wrapped torch optimizer's step, which waits for the background copy
        handle.wait()
    finally:
        _snapshot.copy_deferred = copy
    return handle.fence_wait_s


def test_zero_optimizer_async_save_is_fenced_by_its_step(tmp_path):
    """An async save of a ZeRO-1 model + optimizer, with the next step right after it and the background copy
    delayed: the step waits, and the checkpoint equals, bitwise, a synchronous save taken just before."""
    a, b = str(tmp_path / "sync"), str(tmp_path / "async")
    waited = min(run_on_ranks(_zero_async_save, 2, a, b))
    assert waited > 0.2, f"the ZeRO step did not wait for the background copy ({waited:.3f} s)"
    info = checkpoint.inspect(a)["tensors"]
    assert checkpoint.inspect(b)["tensors"].keys() == info.keys()
    loaded = []
    for path in (a, b):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        checkpoint.load(path, {"model": model, "optim": opt, "step": 0})
        loaded.append((model, opt))
    (m1, o1), (m2, o2) = loaded
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o1.state[p][name], o2.state[q][name]), name


def _mixtral(seed: int):
    """A tiny unmodified Mixtral (4 experts, top-2) from ``seed``."""
    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(seed)


def _ep_save_trained(path: str) -> dict:
    """One SGD step on ep=2 (so the values are not the init), then save; return the whole parameters."""
    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_experts

    mesh = init_mesh({"ep": 2})
    model = parallelize_experts(_mixtral(0), mesh)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    i = mesh.get_local_rank("ep")
    model(input_ids=tokens.chunk(2)[i], labels=tokens.chunk(2)[i]).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    checkpoint.save(path, {"model": model}).wait()
    return {k: p.detach().full_tensor() for k, p in model.named_parameters()}


def _ep4_load(path: str) -> dict:
    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_experts

    model = parallelize_experts(_mixtral(7), init_mesh({"ep": 4}))
    checkpoint.load(path, {"model": model})
    return {k: p.detach().full_tensor() for k, p in model.named_parameters()}


def test_expert_parallel_checkpoint_reshards_across_ep_sizes(tmp_path):
    """Saved on ep=2 after a step, loaded bitwise on ep=4 and into the plain model on one process."""
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_ep_save_trained, 2, path)[0]
    assert not torch.equal(saved["model.layers.0.mlp.experts.gate_up_proj"],
                           _mixtral(0).model.layers[0].mlp.experts.gate_up_proj.detach())
    for loaded in run_on_ranks(_ep4_load, 4, path):
        assert loaded.keys() == saved.keys()
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), f"ep=4 {k}"
    plain = _mixtral(7)
    checkpoint.load(path, {"model": plain})
    for k, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[k]), f"1 process {k}"
