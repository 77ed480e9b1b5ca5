"""A save that fails on one rank only (its disk full: ``OSError(ENOSPC)`` from its data-file write): every rank raises
the same ``CheckpointError`` naming that rank's file, none hangs (the outcome is agreed before rank 0 commits), the
checkpoint is not committed, and the previous checkpoint at the same path still loads, bitwise. Sync and async."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from vescale import checkpoint
from vescale.core.testing import multi_rank


def _state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)  # "mine" differs per rank: each rank writes its own data
    return {"shared": torch.randn(64, 8, generator=g), f"mine{rank}": torch.randn(32, generator=g) + rank, "step": seed}


@multi_rank(world_sizes=[2])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_on_one_rank_raises_everywhere_naming_the_file(tmp_path, async_save):
    import torch.distributed as dist

    from vescale.checkpoint import _storage

    rank, path = dist.get_rank(), os.path.join(tmp_path, "ckpt")
    old = _state(rank, 1)
    checkpoint.save(path, old)
    write = _storage.Storage.write_file

    def full_disk(self, name, header, pieces, pool):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.where(name))

    if rank == 1:
        _storage.Storage.write_file = full_disk
    try:
        with pytest.raises(checkpoint.CheckpointError) as failed:
            checkpoint.save(path, _state(rank, 2), async_save=async_save).wait(timeout=120)
    finally:
        _storage.Storage.write_file = write
    message = str(failed.value)  # the same on both ranks: rank 1's file and its errno
    assert f"saving {path} failed: rank 1 failed writing {path}/data-" in message, message
    assert "-r00001.safetensors" in message and "No space left on device" in message, message
    dist.barrier()
    fresh = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in old.items()}
    checkpoint.load(path, fresh)
    for key, value in old.items():
        assert torch.equal(fresh[key], value) if isinstance(value, torch.Tensor) else fresh[key] == value, key
    checkpoint.save(path, _state(rank, 3))  # the failure left nothing behind that stops the next save
    checkpoint.load(path, fresh)
    assert fresh["step"] == 3 and torch.equal(fresh["shared"], _state(rank, 3)["shared"])
