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


@multi_rank(world_sizes=[2])
def test_async_save_fails_when_a_parameter_changes_through_data_before_its_copy(tmp_path):
    """Rank 0 changes two DTensor parameters through ``.data`` (which version counters do not see: the DTensor's
    ``.data``, and its local tensor's) while their copy is pending: the copies' fingerprints differ from those taken
    in ``save``, the save fails on every rank naming both, and the previous checkpoint still loads, bitwise. (Plain
    parameters: ``test_async_save_of_misaligned_and_strided_parameters``.)"""
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
        if dist.get_rank() == 0:  # each rank writes its own shard of both (column and row parallel)
            m[0].weight.data.mul_(0)
            m[2].weight.to_local().data.mul_(0)
        with pytest.raises(CheckpointError, match=r"2 tensors .*: model\.0\.weight, model\.2\.weight\..*wait_snapshot"):
            handle.wait()
    finally:
        undo()
    m2, o2 = _parallel(1)
    fresh = {"model": m2, "optim": o2}
    checkpoint.load(path, fresh)
    loaded = _full(fresh)
    for k in before:
        assert torch.equal(loaded[k], before[k]), k


def test_fingerprint_sees_changes_a_plain_sum_misses():
    """Block sums see a word moved to another block and top-bit flips in two blocks (both leave the plain sum of
    the words as it was), every sign flipped, and one bit flipped in the unaligned bytes at either end; equal bytes
    at the same offset modulo 8 of other storages give equal fingerprints."""
    import torch

    from vescale.checkpoint._snapshot import fingerprint

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(fingerprint(a), fingerprint(b)))

    base = torch.randn(4099, generator=torch.Generator().manual_seed(0))
    src = base[3:4098]  # starts 12 bytes into its storage: 4 unaligned bytes at the head, 4 at the tail
    other = torch.zeros(4099)
    other[1:4096].copy_(src)  # 4 bytes into its storage: the same offset modulo 8
    assert same(src, other[1:4096])

    def changed(edit):
        t = src.clone()  # its own storage, offset 0: no unaligned bytes
        edit(t)
        return t

    def move(t):  # swap two words 200 words apart: the total of the words stays
        w = t[:-1].view(torch.int64)
        w[0], w[200] = w[200].clone(), w[0].clone()

    def top_bits(t):  # the top bit of a word in two blocks: +2**63 twice, 0 modulo 2**64
        w = t[:-1].view(torch.int64)
        w[0] ^= -(2**63)
        w[300] ^= -(2**63)

    for edit in (move, top_bits):
        t = changed(edit)
        assert t[:-1].view(torch.int64).sum() == src.clone()[:-1].view(torch.int64).sum(), "a plain sum would see it"
        assert not same(t, src.clone()), edit.__name__
    assert not same(changed(lambda t: t.neg_()), src.clone())
    for index in (0, -1):  # the unaligned head and tail bytes
        flipped = other.clone()
        flipped.view(torch.int32)[1:4096][index] ^= 1
        assert not same(flipped[1:4096], src), index


def test_async_save_of_misaligned_and_strided_parameters(tmp_path):
    """Parameters that are views copied in the background with a fingerprint: one 4 bytes into a flat buffer (its
    slot is shifted to the same offset modulo 8), and a column block whose rows start 4 bytes off a word (read as
    rows, each with unaligned head and tail bytes); unchanged, they commit as they were. A strided parameter whose
    last dim is not contiguous is copied before ``save`` returns, so a ``.data`` change after it does not reach the
    checkpoint. A ``.data`` change of the first's first element (in its head bytes) and of one element in a middle
    row of the column block (in that row's tail bytes) fails the save naming both."""
    import pytest
    import torch
    from torch import nn

    from vescale import checkpoint
    from vescale.checkpoint._snapshot import fingerprint_rows
    from vescale.checkpoint.errors import CheckpointError

    torch.manual_seed(0)
    flat = torch.randn(1 + 999 + 3)
    m = nn.Module()
    m.a = nn.Parameter(flat[1:1000])
    m.b = nn.Parameter(torch.randn(16, 8).t())
    m.c = nn.Parameter(torch.randn(6, 300)[:, 3:7])
    assert m.a.storage_offset() == 1 and not m.b.is_contiguous() and not m.c.is_contiguous()
    assert (fingerprint_rows(m.a), fingerprint_rows(m.b), fingerprint_rows(m.c)) == (1, None, 6)
    state = {"m": m, "optim": torch.optim.SGD(m.parameters(), lr=0.1)}
    at_save = {k: v.clone() for k, v in m.state_dict().items()}
    undo = _slow_background_copy(0.3)
    try:
        handle = checkpoint.save(os.path.join(tmp_path, "a"), state, async_save=True)
        assert not handle.snapshot_done()
        m.b.data.mul_(0)
        flat.data[0] = 7.0  # the bytes before the piece's: not in its fingerprint
        handle.wait()
        handle = checkpoint.save(os.path.join(tmp_path, "b"), state, async_save=True)
        m.a.data[0] += 1.0
        m.c.data[2, 3] += 1.0
        with pytest.raises(CheckpointError, match=r"2 tensors .*: m\.a, m\.c\. "):
            handle.wait()
    finally:
        undo()
    fresh = nn.Module()
    fresh.a, fresh.b, fresh.c = (nn.Parameter(torch.zeros(999)), nn.Parameter(torch.zeros(8, 16)),
                                 nn.Parameter(torch.zeros(6, 4)))
    checkpoint.load(os.path.join(tmp_path, "a"), {"m": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1)})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_save[k]), k
