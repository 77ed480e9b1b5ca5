"""The local load's early fill: a raw shard read straight into its targets during the check pass, their previous
bytes kept in an undo log. With the log's budget covering all, some or none of the reads, a load fills every target
bitwise, and a load that fails on one rank only (a flipped bit in a chunk another rank reads) leaves every rank's
targets bitwise as they were, early-filled ones included."""

from __future__ import annotations

import os

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint import CorruptCheckpointError
from vescale.checkpoint._reader import chunk_spans, read_metadata
from vescale.checkpoint._storage import Storage
from vescale.checkpoint._undo import UndoLog, undo_budget
from vescale.core.testing import multi_rank


def _state(seed: int, mesh) -> dict:
    """Row-sharded matrices (each rank's part one contiguous byte range of the stored shard), one of uneven rows,
    and a replicated vector; the same global values on every rank."""
    from torch.distributed.tensor import Replicate, Shard

    from vescale.dtensor import distribute_tensor

    g = torch.Generator().manual_seed(seed)
    full = {f"w{i}": torch.randn(64, 48, generator=g) for i in range(4)}
    full["uneven"] = torch.randn(7, 48, generator=g)
    full["bias"] = torch.randn(300, generator=g)
    return {k: distribute_tensor(t, mesh, [Replicate() if k == "bias" else Shard(0)], src_data_rank=None)
            for k, t in full.items()}


def _evict(path: str) -> None:
    """Drop the checkpoint's files from the page cache on every rank (written back first: dirty pages stay)."""
    import torch.distributed as dist

    dist.barrier()
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    dist.barrier()


def _locals(state: dict) -> dict:
    return {k: v.to_local().clone() for k, v in state.items()}


@multi_rank(world_sizes=[2])
@pytest.mark.parametrize("budget", ["all", "some", "none"])
def test_early_fill_loads_bitwise_and_fails_whole(tmp_path, budget):
    import torch.distributed as dist

    from vescale.checkpoint import _data_file, _load
    from vescale.core.mesh import init_mesh

    cap = {"all": 1 << 40, "some": 2 * 32 * 48 * 4, "none": 0}[budget]  # "some": two of the row parts
    logs: list[UndoLog] = []

    class Recording(UndoLog):
        def __init__(self, _budget: int) -> None:
            super().__init__(cap)
            self.saves = 0
            logs.append(self)

        def save(self, target: torch.Tensor) -> None:
            self.saves += 1
            super().save(target)

    chunk_bytes, undo_log = _data_file.CHUNK_BYTES, _load.UndoLog
    _data_file.CHUNK_BYTES, _load.UndoLog = 4096, Recording  # several chunks per shard, dealt between the ranks
    try:
        mesh = init_mesh({"tp": 2})
        path = os.path.join(tmp_path, "ckpt")
        saved = _state(0, mesh)
        checkpoint.save(path, saved)
        expect = _locals(saved)

        state = _state(1, mesh)
        _evict(path)  # early fill is for bytes the page cache does not hold yet
        checkpoint.load(path, state, dedup_reads=False)
        assert all(torch.equal(state[k].to_local(), expect[k]) for k in expect)
        assert (logs[-1].saves > 0) == (budget != "none")  # the budget decides which reads fill early
        held = sum(t.to_local().nbytes for t in state.values())
        assert budget != "some" or cap - logs[-1].left < held  # "some": others filled after the agreement

        # one flipped bit in the last chunk of the replicated vector's shard: one rank checks it, both fill it
        shard = read_metadata(Storage(path))["tensors"]["bias"]["shards"][0]
        lo, _ = chunk_spans(shard)[-1]
        if dist.get_rank() == 0:
            with open(os.path.join(path, shard["file"]), "r+b") as f:
                f.seek(shard["start"] + lo)
                byte = f.read(1)
                f.seek(shard["start"] + lo)
                f.write(bytes([byte[0] ^ 1]))
        dist.barrier()
        state = _state(2, mesh)
        before = _locals(state)
        _evict(path)
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            checkpoint.load(path, state, dedup_reads=False)
        assert (logs[-1].saves > 0) == (budget != "none")
        assert all(torch.equal(state[k].to_local(), before[k]) for k in before)  # every rank, every tensor

        # the page cache holds the files now: a warm load checks and fills in two passes, keeping no copies
        state = _state(3, mesh)
        checkpoint.load(path, state, dedup_reads=False, verify=False)
        assert logs[-1].saves == 0
    finally:
        _data_file.CHUNK_BYTES, _load.UndoLog = chunk_bytes, undo_log


def test_undo_log_restores_and_keeps_its_budget():
    a, b = torch.arange(6.0), torch.arange(4, dtype=torch.int16)
    log = UndoLog(budget=6 * 4 + 4 * 2)
    assert log.admit([a]) and log.admit([b]) and not log.admit([torch.zeros(1)])
    log.save(a)
    log.save(b)
    a.fill_(7)
    b.zero_()
    log.restore()
    assert torch.equal(a, torch.arange(6.0)) and torch.equal(b, torch.arange(4, dtype=torch.int16))


def test_undo_budget_is_off_when_asked(monkeypatch):
    monkeypatch.setenv("VESCALE_CHECKPOINT_EARLY_FILL", "0")
    assert undo_budget(4) == 0
    monkeypatch.delenv("VESCALE_CHECKPOINT_EARLY_FILL")
    if os.path.exists("/proc/meminfo"):
        assert undo_budget(1) >= undo_budget(4) > 0
