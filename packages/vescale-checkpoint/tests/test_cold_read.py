"""The cold local read: who checks which checksum chunks.

When several ranks need the same stored bytes, every chunk is checked by exactly one of them, in long runs of
consecutive chunks (each rank reads its share of a file front to back), with the ranks' shares within the plan's run
bound of each other; a rank needing only part of a shard checks only chunks it reads anyway. A local load whose
shards span many chunks fills the targets bitwise and fails whole on one flipped bit.
"""

from __future__ import annotations

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint import CorruptCheckpointError, _load
from vescale.checkpoint._reader import chunk_spans, read_metadata
from vescale.checkpoint._storage import Storage


def _shard(file: str, start: int, rows: int, cols: int, chunk: int, row0: int = 0) -> dict:
    nbytes = rows * cols * 4
    return {"file": file, "start": start, "end": start + nbytes, "offsets": [row0, 0], "lengths": [rows, cols],
            "codec": "raw", "chunk": chunk, "crc32": [0] * -(-nbytes // chunk)}


def _runs(chunks: list[int]) -> list[tuple[int, int]]:
    """Sorted chunk numbers as ``[lo, hi)`` runs of consecutive ones."""
    runs: list[list[int]] = []
    for c in chunks:
        if runs and runs[-1][1] == c:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1])
    return [(lo, hi) for lo, hi in runs]


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_chunks_checked_once_in_long_runs(world):
    chunk, cols = 1 << 20, 1 << 16  # one row of fp32 is 256 KiB: four rows per chunk
    tensors = {f"t{i}": {"dtype": "float32", "shape": [256, cols],
                         "shards": [_shard("f0", i * (64 << 20), 256, cols, chunk)]} for i in range(8)}
    meta = {"tensors": tensors, "values": {}}
    request = {"tensors": {k: ["float32", [256, cols], [[[0, 0], [256, cols]]]] for k in tensors}, "values": []}
    reads = _load._plan([request] * world, meta, set(), dedup=False)  # every rank needs every tensor whole

    checked = sorted((rd.key, i) for rd in reads for i in rd.chunks)
    assert checked == sorted((k, i) for k in tensors for i in range(64))  # each chunk once
    share = {r: [(rd.key, rd.shard["start"], i) for rd in reads if rd.reader == r for i in rd.chunks]
             for r in range(world)}
    loads = [len(v) * chunk for v in share.values()]
    assert max(loads) - min(loads) <= _load._RUN_BYTES + chunk, loads
    for r, mine in share.items():
        order = sorted(start // chunk + i for _, start, i in mine)  # chunk numbers in the file
        runs = _runs(order)
        # runs of the plan's run bound (32 MiB) or more; dealt one by one, every run was one chunk
        assert len(runs) < 512 // 32 and min(hi - lo for lo, hi in runs[:-1]) >= _load._RUN_BYTES // chunk, (r, runs)


def test_two_ranks_each_needing_half_check_their_own_chunks():
    chunk, cols = 1 << 12, 1 << 10  # 4 KiB chunks, 4 KiB rows
    tensors = {"w": {"dtype": "float32", "shape": [64, cols], "shards": [_shard("f0", 0, 64, cols, chunk)]}}
    meta = {"tensors": tensors, "values": {}}
    requests = [{"tensors": {"w": ["float32", [64, cols], [[[32 * r, 0], [32, cols]]]]}, "values": []}
                for r in range(2)]
    reads = _load._plan(requests, meta, set(), dedup=False)
    by_rank = {rd.reader: sorted(rd.chunks) for rd in reads}
    assert by_rank == {0: list(range(32)), 1: list(range(32, 64))}  # nobody reads a byte only to check it


def test_a_local_load_in_runs_fills_bitwise_and_fails_whole(tmp_path, monkeypatch):
    from vescale.checkpoint import _data_file

    monkeypatch.setattr(_data_file, "CHUNK_BYTES", 4096)
    g = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(64, 100, generator=g), "b": torch.randn(3000, generator=g).bfloat16()}
    path = tmp_path / "ckpt"
    checkpoint.save(path, {k: v.clone() for k, v in ref.items()})
    state = {k: torch.zeros_like(v) for k, v in ref.items()}
    checkpoint.load(path, state)
    assert all(torch.equal(state[k], ref[k]) for k in ref)

    meta = read_metadata(Storage(path))
    shard = meta["tensors"]["a"]["shards"][0]
    lo, _ = chunk_spans(shard)[-1]
    with open(path / shard["file"], "r+b") as f:  # one flipped bit in the last chunk
        f.seek(shard["start"] + lo)
        byte = f.read(1)
        f.seek(shard["start"] + lo)
        f.write(bytes([byte[0] ^ 1]))
    state = {k: torch.zeros_like(v) for k, v in ref.items()}
    with pytest.raises(CorruptCheckpointError, match="is damaged: checksum mismatch"):
        checkpoint.load(path, state)
    assert all(not state[k].any() for k in ref)  # nothing written
    # in one pass (atomic=False) the same damage is found, on the bytes just read into the target
    with pytest.raises(CorruptCheckpointError, match="is damaged: checksum mismatch"):
        checkpoint.load(path, state, atomic=False)
    assert state["a"].any()  # written before the last chunk was checked: not atomic
