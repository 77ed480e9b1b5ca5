"""Async save: training steps run while the save is in flight, and the checkpoint holds the values at save time.

Writing is slowed (each data file write sleeps 0.5 s first) so that the overlap is certain, not a race: the
test asserts the save is still in flight after the training steps and that the loaded values equal, bitwise, the
full tensors taken when ``save`` returned, not the later ones.
"""

from __future__ import annotations

import os

from vescale.core.testing import multi_rank


def _model(seed):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))


def _parallel(seed):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from vescale.core.mesh import init_mesh

    m = _model(seed)
    parallelize_module(m, init_mesh({"tp": dist.get_world_size()})["tp"], {"0": ColwiseParallel(),
                                                                          "2": RowwiseParallel()})
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _train(m, opt, steps):
    import torch

    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(state):
    from vescale.checkpoint._state import flatten

    return {k: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
            for k, t in flatten(state).tensors.items()}


@multi_rank(world_sizes=[2])
def test_async_save_overlaps_training(tmp_path):
    import time

    import torch

    from vescale import checkpoint
    from vescale.checkpoint import _save, _snapshot, _storage

    m, opt = _parallel(0)
    _train(m, opt, 1)
    state = {"model": m, "optim": opt, "step": 1}
    path = os.path.join(tmp_path, "ckpt")

    write, copy_slice = _storage.Storage.write_file, _snapshot._COPY_SLICE

    def slow_write(self, *args, **kwargs):
        time.sleep(0.5)
        return write(self, *args, **kwargs)

    _storage.Storage.write_file = slow_write
    try:
        handle = checkpoint.save(path, state, async_save=True)
        at_save = _full(state)
        _train(m, opt, 2)  # overlaps the write
        state["step"] = 3
        in_flight = not handle.done()
        after = _full(state)
        plan = _save._cached
        _snapshot._COPY_SLICE = 64  # two threads snapshot in 64-byte slices
        handle2 = checkpoint.save(path + "2", state, async_save=True, threads=2)  # waits for the first, reuses
        # the plan
        assert handle.done() and _save._cached is plan
        handle2.wait()
    finally:
        _storage.Storage.write_file = write
        _snapshot._COPY_SLICE = copy_slice
    assert in_flight, "the save finished before the training steps; the overlap was not exercised"
    handle.wait()

    m2, opt2 = _parallel(1)
    fresh = {"model": m2, "optim": opt2, "step": None}
    checkpoint.load(path, fresh)
    assert fresh["step"] == 1
    loaded = _full(fresh)
    assert any(not torch.equal(at_save[k], after[k]) for k in at_save)  # training changed the live values
    for k in at_save:
        assert torch.equal(loaded[k], at_save[k]), f"{k}: async checkpoint does not hold the values at save time"
    checkpoint.load(path + "2", fresh)
    assert fresh["step"] == 3
    loaded = _full(fresh)
    for k in after:
        assert torch.equal(loaded[k], after[k]), k


@multi_rank(world_sizes=[2])
def test_async_save_replans_when_one_rank_changes(tmp_path):
    """Rank 0's cached plan still fits its own state, so it snapshots before the ranks agree; rank 1 gained a key,
    so they plan again and rank 0's early snapshot is discarded. The checkpoint holds the values bitwise."""
    import torch
    import torch.distributed as dist

    from vescale import checkpoint
    from vescale.checkpoint import _save

    rank = dist.get_rank()
    m, opt = _parallel(0)
    _train(m, opt, 1)
    state = {"model": m, "optim": opt}
    checkpoint.save(os.path.join(tmp_path, "a"), state, async_save=True).wait()
    plan = _save._cached
    changed = {**state, "gained": torch.arange(10000.0)} if rank == 1 else state  # moves replicas to rank 0
    expected = _full(changed)
    checkpoint.save(os.path.join(tmp_path, "b"), changed, async_save=True).wait()
    assert _save._cached is not plan, "the ranks did not plan again"
    if rank == 0:
        assert _save._cached.mine != plan.mine, "rank 0 writes the same boxes: the replan was not exercised"

    m2, opt2 = _parallel(1)
    fresh = {"model": m2, "optim": opt2, **({"gained": torch.zeros(10000)} if rank == 1 else {})}
    checkpoint.load(os.path.join(tmp_path, "b"), fresh)
    loaded = _full(fresh)
    assert loaded.keys() == expected.keys()
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), k


def _slow_background_copy(seconds):
    """Delay the background part of async snapshots by ``seconds``; returns the function that undoes it."""
    import time

    from vescale.checkpoint import _snapshot

    copy = _snapshot.copy_deferred

    def slow(deferred):
        time.sleep(seconds)
        return copy(deferred)

    _snapshot.copy_deferred = slow
    return lambda: setattr(_snapshot, "copy_deferred", copy)


@multi_rank(world_sizes=[2])
def test_async_snapshot_is_fenced_by_the_next_optimizer_step(tmp_path):
    """Parameters and optimizer state are copied after ``save`` returns (the copy is delayed 0.5 s); the next
    ``optimizer.step()`` waits for it, while a BatchNorm's running stats, which the next forward changes, were
    copied before ``save`` returned. The checkpoint holds the values at save time, bitwise."""
    import torch
    from torch import nn

    from vescale import checkpoint

    m, _ = _parallel(0)
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8)
    opt = torch.optim.AdamW(list(m.parameters()) + list(norm.parameters()), lr=1e-2)

    def step(i):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        norm(m(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    state = {"model": m, "norm": norm, "optim": opt}
    undo = _slow_background_copy(0.5)
    try:
        handle = checkpoint.save(os.path.join(tmp_path, "ckpt"), state, async_save=True)
        snapshot_pending = not handle.snapshot_done()
        at_save = _full(state)
        step(1)  # the forward changes the running stats at once; the step waits for the copy
        waited = handle.fence_wait_s
        handle.wait()
    finally:
        undo()
    assert snapshot_pending, "save returned after copying everything: the background copy was not exercised"
    assert waited > 0.2, f"optimizer.step() did not wait for the background copy ({waited:.3f} s)"
    after = _full(state)
    assert not torch.equal(at_save["norm.running_mean"], after["norm.running_mean"])
    assert not torch.equal(at_save["model.0.weight"], after["model.0.weight"])

    m2, _ = _parallel(1)
    norm2 = nn.BatchNorm1d(8)
    fresh = {"model": m2, "norm": norm2, "optim": torch.optim.AdamW(list(m2.parameters()) + list(norm2.parameters()))}
    checkpoint.load(os.path.join(tmp_path, "ckpt"), fresh)
    loaded = _full(fresh)
    assert loaded.keys() == at_save.keys()
    for k in at_save:
        assert torch.equal(loaded[k], at_save[k]), f"{k}: async checkpoint does not hold the values at save time"


@multi_rank(world_sizes=[2])
def test_async_save_fails_when_a_parameter_changes_before_its_copy(tmp_path):
    """Rank 0 changes a parameter in place (not through an optimizer step) while its copy is pending: the save
    fails on every rank naming the tensor, and the previous checkpoint at the same path still loads, bitwise."""
    import pytest
    import torch
    import torch.distributed as dist

    from vescale import checkpoint
    from vescale.checkpoint.errors import CheckpointError

    m, opt = _parallel(0)
    _train(m, opt, 1)
    state = {"model": m, "optim": opt}
    path = os.path.join(tmp_path, "ckpt")
    checkpoint.save(path, state)
    before = _full(state)
    undo = _slow_background_copy(0.5)
    try:
        handle = checkpoint.save(path, state, async_save=True)
        if dist.get_rank() == 0:
            with torch.no_grad():
                m[0].weight.add_(1.0)
        with pytest.raises(CheckpointError, match=r"model\.0\.weight.*wait_snapshot"):
            handle.wait()
    finally:
        undo()
    m2, opt2 = _parallel(1)
    fresh = {"model": m2, "optim": opt2}
    checkpoint.load(path, fresh)
    loaded = _full(fresh)
    for k in before:
        assert torch.equal(loaded[k], before[k]), k
