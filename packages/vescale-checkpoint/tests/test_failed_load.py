"""A load that fails changes nothing: a damaged shard that only rank 1 reads, or a read error on rank 1 alone,
makes every rank raise (naming the file and the tensor) with every rank's model, optimizer and values bitwise as
they were; the repaired checkpoint then loads the saved values exactly. A one-pass load (``atomic=False``) of the
damaged checkpoint also raises on every rank, and sets no value. Also: a save whose directory cannot be
created on one rank fails on every rank instead of leaving the others waiting."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint import CheckpointError, CorruptCheckpointError
from vescale.core.testing import multi_rank


def _build(seed: int):
    """A column-parallel linear over 2 ranks (weight and bias Shard(0)), a buffer, AdamW with state, values."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from vescale.core.mesh import init_mesh

    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 128)
    model.register_buffer("scale", torch.arange(3.0) + seed)
    parallelize_module(model, init_mesh({"tp": 2})["tp"], ColwiseParallel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 16) * (seed + 1)).sum().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():  # few distinct values: the weight's shards compress (zstd) when asked to
        model.weight.copy_(torch.round(model.weight * 4) / 4)
    return {"model": model, "optim": opt, "step": 10 + seed, "extra": {"seen": [seed]}}


def _snapshot(state: dict) -> dict:
    """Bitwise copies of everything a load may write: local tensors, optimizer state and hyperparameters, values."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    opt = state["optim"]
    return {
        "model": {k: local(v) for k, v in state["model"].state_dict().items()},
        "optim": [{k: local(v) if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
                  for g in opt.param_groups for p in g["params"]],
        "lr": [g["lr"] for g in opt.param_groups],
        "step": state["step"], "extra": json.dumps(state["extra"]),
    }


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        return torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y

    return (all(eq(a["model"][k], b["model"][k]) for k in a["model"]) and a["lr"] == b["lr"]
            and all(eq(s[k], t[k]) for s, t in zip(a["optim"], b["optim"]) for k in s)
            and a["step"] == b["step"] and a["extra"] == b["extra"])


@multi_rank(world_sizes=[2])
def test_a_failed_load_changes_nothing_on_any_rank(tmp_path):
    import torch.distributed as dist

    from vescale.checkpoint import _storage

    rank = dist.get_rank()
    for compress in (False, True):
        path = os.path.join(tmp_path, f"ckpt{int(compress)}")
        state = _build(seed=0)
        saved = _snapshot(state)
        checkpoint.save(path, state, compress=compress)
        state = _build(seed=1)  # the job moved on: every tensor and value differs from the checkpoint's
        state["optim"].param_groups[0]["lr"] = 0.5
        current = _snapshot(state)
        assert not _same(current, saved)

        # damage one byte of rank 1's rows of the weight: rank 1's file, a shard only rank 1 reads
        with open(os.path.join(path, "metadata.json")) as f:
            meta = json.load(f)
        (shard,) = [s for s in meta["tensors"]["model.weight"]["shards"] if s["offsets"] == [64, 0]]
        assert shard["file"].endswith("r00001.safetensors") and shard["codec"] == ("zstd" if compress else "raw")
        file = os.path.join(path, shard["file"])
        dist.barrier()
        if rank == 0:
            with open(file, "r+b") as f:
                f.seek((shard["start"] + shard["end"]) // 2)
                good = f.read(1)
                f.seek((shard["start"] + shard["end"]) // 2)
                f.write(bytes([good[0] ^ 0x5A]))
        dist.barrier()
        for dedup in (False, True):  # every rank reading, or one reader sending
            with pytest.raises(CorruptCheckpointError, match=rf"{shard['file']}.*tensor 'model.weight'"):
                checkpoint.load(path, state, dedup_reads=dedup)
            assert _same(_snapshot(state), current), (rank, compress, dedup)
        for dedup in (False, True):  # in one pass: raised on every rank too, no value or hyperparameter set
            with pytest.raises(CorruptCheckpointError, match=rf"{shard['file']}.*tensor 'model.weight'"):
                checkpoint.load(path, state, dedup_reads=dedup, atomic=False)
            after = _snapshot(state)
            assert [after[k] for k in ("lr", "step", "extra")] == [current[k] for k in ("lr", "step", "extra")]
        state = _build(seed=1)  # tensors may hold some loaded bytes now: the job's state again
        state["optim"].param_groups[0]["lr"] = 0.5
        dist.barrier()
        if rank == 0:
            with open(file, "r+b") as f:
                f.seek((shard["start"] + shard["end"]) // 2)
                f.write(good)
        dist.barrier()

        # a read error other than corruption, on rank 1 only: agreed on, raised everywhere, nothing written
        read_into, open_read = _storage.Storage.read_into, _storage.Storage._open_read

        def failing(self, name, *args):
            raise PermissionError(13, "Permission denied", self.where(name))

        if rank == 1:  # every read (read_into) and every local open (_open_read) fails
            _storage.Storage.read_into = _storage.Storage._open_read = failing
        try:
            with pytest.raises(CheckpointError, match=r"Permission denied.*tensor 'model\."):
                checkpoint.load(path, state)
        finally:
            _storage.Storage.read_into, _storage.Storage._open_read = read_into, open_read
        assert _same(_snapshot(state), current)

        checkpoint.load(path, state)  # repaired: the saved values, bitwise
        assert _same(_snapshot(state), saved), (rank, compress)


@multi_rank(world_sizes=[2])
def test_a_save_that_cannot_create_its_directory_on_one_rank_fails_everywhere(tmp_path):
    import torch.distributed as dist

    from vescale.checkpoint import _storage

    rank = dist.get_rank()
    path = os.path.join(tmp_path, "ckpt")
    state = _build(seed=0)
    makedirs = _storage.Storage.makedirs

    def failing(self):
        raise OSError(30, "Read-only file system", self.url)

    if rank == 1:
        _storage.Storage.makedirs = failing
    try:
        with pytest.raises(CheckpointError, match="rank 1 could not prepare .*Read-only file system"):
            checkpoint.save(path, state)
    finally:
        _storage.Storage.makedirs = makedirs
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    checkpoint.save(path, state)
    fresh = _build(seed=1)
    checkpoint.load(path, fresh)
    assert _same(_snapshot(fresh), _snapshot(state))


@multi_rank(world_sizes=[2])
def test_a_damaged_byte_in_the_last_chunk_of_a_large_shard_changes_nothing(tmp_path):
    """Shards of several checksum chunks on the local same-layout path: one flipped byte in the last chunk of
    rank 1's row shard (checked by rank 1 alone), or in the last chunk of a replicated tensor (both ranks read it,
    its chunks checked by one or the other), fails the load on both ranks with every target bitwise unchanged."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from vescale.checkpoint.format import CHUNK_BYTES
    from vescale.core.mesh import init_mesh

    rank = dist.get_rank()
    mesh = init_mesh({"tp": 2})
    cols = CHUNK_BYTES // 4  # one row of fp32 is one chunk: each shard below spans 3 chunks
    gen = torch.Generator().manual_seed(0)
    saved = {"rows": torch.randn(6, cols, generator=gen), "rep": torch.randn(3, cols, generator=gen)}
    placements = {"rows": [Shard(0)], "rep": [Replicate()]}
    path = os.path.join(tmp_path, "ckpt")
    checkpoint.save(path, {k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) for k, v in saved.items()})
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    rows = [s for s in meta["tensors"]["rows"]["shards"] if s["offsets"] == [3, 0]]
    (rep,) = meta["tensors"]["rep"]["shards"]
    for key, shard in (("rows", rows[0]), ("rep", rep)):
        assert len(shard["crc32"]) == 3 and shard["codec"] == "raw", shard
        state = {k: distribute_tensor(torch.full(v.shape, -1.0), mesh, placements[k], src_data_rank=None)
                 for k, v in saved.items()}
        before = {k: v.to_local().clone() for k, v in state.items()}
        at = shard["end"] - 5  # in the last chunk, near the shard's end
        dist.barrier()
        if rank == 0:
            with open(os.path.join(path, shard["file"]), "r+b") as f:
                f.seek(at)
                good = f.read(1)
                f.seek(at)
                f.write(bytes([good[0] ^ 0x01]))
        dist.barrier()
        with pytest.raises(CorruptCheckpointError, match=rf"{shard['file']} is damaged.*tensor '{key}'"):
            checkpoint.load(path, state)
        for k, v in state.items():
            assert torch.equal(v.to_local(), before[k]), (rank, key, k)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(path, shard["file"]), "r+b") as f:
                f.seek(at)
                f.write(good)
        dist.barrier()
        checkpoint.load(path, state)  # repaired: the saved values, each rank's own rows
        mine = {"rows": saved["rows"][3 * rank:3 * rank + 3], "rep": saved["rep"]}
        for k, v in state.items():
            assert torch.equal(v.to_local(), mine[k]), (rank, key, k)
