"""The cold local read: who checks which checksum chunks, and the kernel read-ahead of the check pass.

When several ranks need the same stored bytes, every chunk is checked by exactly one of them, in long runs of
consecutive chunks (each rank reads its share of a file front to back, which the disk and the kernel's readahead
serve at their sequential rate), with the ranks' shares within the plan's run bound of each other. The read-ahead
asks the kernel for exactly the ranges the pass will read, in order, never more than its window ahead of what the
pass has consumed. A load with the read-ahead running still fills the targets bitwise and still fails whole on a
damaged byte.
"""

from __future__ import annotations

import os

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint import CorruptCheckpointError, _load, _local_read
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


def test_read_ahead_advises_the_ranges_in_order_within_its_window(tmp_path, monkeypatch):
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    storage = Storage(tmp_path)
    monkeypatch.setattr(_local_read, "_AHEAD_BYTES", 2000)
    monkeypatch.setattr(_local_read, "_AHEAD_PIECE", 1000)
    advised: list[tuple[str, int, int]] = []
    names: dict[int, str] = {}
    opened = storage._open_read

    def open_read(name):
        fd = opened(name)
        names[fd] = name
        return fd

    monkeypatch.setattr(storage, "_open_read", open_read)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append((names[fd], off, n)))
    ranges = [("a", 100, 2600), ("b", 0, 10), ("b", 2000, 3000), ("a", 4000, 4000)]
    with _local_read.ReadAhead(storage, ranges) as ahead:
        assert sum(n for *_, n in advised) == 2000  # the window, before anything is consumed
        ahead.consumed(1500)
        assert sum(n for *_, n in advised) == 3510  # up to the window past 1500 (a piece at a time): all of it
        ahead.consumed(2000)
    assert advised == [("a", 100, 1000), ("a", 1100, 1000), ("a", 2100, 500), ("b", 0, 10), ("b", 2000, 1000)]
    assert set(names) and all(_closed(fd) for fd in names)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_a_load_with_read_ahead_fills_bitwise_and_fails_whole(tmp_path, monkeypatch):
    from vescale.checkpoint import _data_file

    monkeypatch.setattr(_data_file, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(_local_read, "_AHEAD_BYTES", 8192)  # the window slides many times
    monkeypatch.setattr(_local_read, "_AHEAD_PIECE", 4096)
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
