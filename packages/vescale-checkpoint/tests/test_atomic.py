"""A rank killed in the middle of a save: the previous checkpoint at the same path still loads, bitwise.

Fresh processes (``vescale.core.launch.spawn``) so that the kill does not disturb the pooled test ranks. Rank 1
writes the header and first tensor of its new data file, then SIGKILLs itself; rank 0 finishes writing and waits
for it; spawn stops the group. The directory then holds the new, partial data files next to the old complete
checkpoint, which still loads (here in the test process, without a process group) and verifies.
"""

from __future__ import annotations

import os

import pytest
import torch

from vescale import checkpoint
from vescale.core.errors import RankError
from vescale.core.launch import spawn


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(128, 64, generator=g), "b": torch.randn(128, 64, generator=g), "step": seed}


def _save_then_die(path: str) -> None:
    import signal

    import torch.distributed as dist

    from vescale.checkpoint import _storage

    checkpoint.save(path, _state(1))
    dist.barrier()
    if dist.get_rank() == 1:
        write = _storage.Storage.write_file

        def write_half_then_die(self, name, header, pieces, pool):
            write(self, name, header, pieces[:1], pool)
            os.kill(os.getpid(), signal.SIGKILL)

        _storage.Storage.write_file = write_half_then_die
    checkpoint.save(path, _state(2))


def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(RankError, match=r"rank 1|rank\(s\) \[1\]"):
        spawn(_save_then_die, 2, path, timeout=120)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len({f.split("-")[1] for f in files}) == 2, files  # the killed save's files are there, uncommitted
    fresh = _state(0)
    checkpoint.load(path, fresh)
    expect = _state(1)
    assert fresh["step"] == 1
    assert torch.equal(fresh["a"], expect["a"]) and torch.equal(fresh["b"], expect["b"])
    checkpoint.verify(path)
