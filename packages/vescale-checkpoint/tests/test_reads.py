"""The local read path: non-contiguous parts of shards, chunked checksums shared out among readers, version 1.

A rank that needs a column block of a row-major stored shard copies just those columns out of the rows it reads, and
the shard's checksum chunks are each checked by exactly one of the ranks reading it; values must equal the reference
(the full tensors built in one process from the same seed) bitwise. Checkpoints written in format version 1 (one
crc32 per shard) still load and verify.
"""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint import CorruptCheckpointError
from vescale.core.testing import multi_rank


def _reference(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"rows": torch.randn(12, 40, generator=g), "plain": torch.randn(700, generator=g),
            "odd": torch.randn(3, generator=g).bfloat16(), "tail": torch.randn(1, generator=g)}


def _sharded(full: dict[str, torch.Tensor], dim: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"tp": dist.get_world_size()})
    state = {k: v.clone() for k, v in full.items()}
    state["rows"] = distribute_tensor(full["rows"].clone(), mesh["tp"], [Shard(dim)])
    return state


@multi_rank(world_sizes=[2])
def test_column_blocks_of_row_shards_and_chunk_checks_spread(tmp_path):
    from vescale.checkpoint import _data_file, _local_read, _reader

    chunk, check = _data_file.CHUNK_BYTES, _reader.check_chunks
    try:  # the ranks are pooled workers: patches are undone before they run the next test
        _column_blocks(tmp_path, _local_read, _reader, _data_file)
    finally:
        _data_file.CHUNK_BYTES, _local_read.check_chunks, _reader.check_chunks = chunk, check, check


def _column_blocks(tmp_path, _local_read, _reader, _data_file) -> None:
    import torch.distributed as dist

    _data_file.CHUNK_BYTES = 256  # several checksum chunks per shard
    rank = dist.get_rank()
    path = os.path.join(tmp_path, "ckpt")
    ref = _reference(0)
    checkpoint.save(path, _sharded(ref, 0))  # row blocks of "rows": [6, 40] each
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["version"] == 2
    assert all(len(s["crc32"]) > 1 for s in meta["tensors"]["rows"]["shards"] + meta["tensors"]["plain"]["shards"])

    checked: list[tuple[str, int, int]] = []
    check = _reader.check_chunks

    def spy(where, shard, stored, which=None):
        checked.extend((shard["file"], shard["start"], i) for i in (range(len(shard["crc32"])) if which is None
                                                                     else which))
        return check(where, shard, stored, which)

    _local_read.check_chunks = _reader.check_chunks = spy  # every rank reading, or read-and-send
    for dedup in (None, True):  # every rank reads the rows its columns span, or one reads and sends
        checked.clear()
        state = _sharded(_reference(1), 1)  # column blocks: [12, 20], a strided part of each stored row block
        checkpoint.load(path, state, dedup_reads=dedup)
        assert torch.equal(state["rows"].full_tensor(), ref["rows"])  # bitwise
        for key in ("plain", "odd", "tail"):
            assert torch.equal(state[key], ref[key]), key
        everyone = [c for part in _gather(checked) for c in part]
        expected = [(s["file"], s["start"], i) for info in meta["tensors"].values() for s in info["shards"]
                    for i in range(len(s["crc32"]))]
        assert sorted(map(tuple, everyone)) == sorted(expected), (dedup, sorted(everyone), sorted(expected))
        if dedup is None:  # both ranks need all of every shard: the chunks are shared out between them
            assert all(_gather(len(checked))), "one rank checked no chunk"

    # damage a byte in the second chunk of a shard of "plain": every rank fails, naming the file
    shard = meta["tensors"]["plain"]["shards"][0]
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, shard["file"]), "r+b") as f:
            f.seek(shard["start"] + 300)
            byte = f.read(1)
            f.seek(shard["start"] + 300)
            f.write(bytes([byte[0] ^ 0x10]))
    dist.barrier()
    for dedup in (None, True):
        with pytest.raises(CorruptCheckpointError, match=f"{shard['file']} is damaged: checksum mismatch in bytes "
                                                         f"\\[{shard['start'] + 256}, {shard['start'] + 512}\\)"):
            checkpoint.load(path, _sharded(_reference(1), 1), dedup_reads=dedup)


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def test_version_1_checkpoint_loads_and_verifies(tmp_path):
    path = tmp_path / "ckpt"
    ref = _reference(0)
    checkpoint.save(path, {k: v.clone() for k, v in ref.items()})
    meta = json.loads((path / "metadata.json").read_text())
    for info in meta["tensors"].values():  # rewrite as version 1: one crc32 over each shard's stored bytes
        for shard in info["shards"]:
            data = (path / shard["file"]).read_bytes()[shard["start"]:shard["end"]]
            del shard["chunk"]
            shard["crc32"] = zlib.crc32(data)
    meta["version"] = 1
    (path / "metadata.json").write_text(json.dumps(meta))

    state = {k: torch.zeros_like(v) for k, v in ref.items()}
    checkpoint.load(path, state)
    for key, value in ref.items():
        assert torch.equal(state[key], value), key  # bitwise
    assert checkpoint.inspect(path)["version"] == 1
    assert checkpoint.verify(path)["tensors"] == 4

    shard = meta["tensors"]["plain"]["shards"][0]
    raw = bytearray((path / shard["file"]).read_bytes())
    raw[shard["start"] + 1000] ^= 0x01
    (path / shard["file"]).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=f"{shard['file']} is damaged: checksum mismatch in bytes "
                                                     f"\\[{shard['start']}, {shard['end']}\\)"):
        checkpoint.load(path, {k: torch.zeros_like(v) for k, v in ref.items()})
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        checkpoint.verify(path)

    meta["version"] = 3
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptCheckpointError, match="format version 3; this vescale.checkpoint reads versions 1, 2"):
        checkpoint.load(path, {k: torch.zeros_like(v) for k, v in ref.items()})


def _spy_reads(monkeypatch) -> list[tuple[int, int, int]]:
    """Every positional read of a local file from now on, as (offset in the file, bytes, address read into)."""
    import numpy as np

    from vescale.checkpoint import _storage

    reads: list[tuple[int, int, int]] = []
    read_into = _storage.FileReader.read_into

    def spy(self, start, out):
        reads.append((start, out.nbytes, np.frombuffer(out, dtype=np.uint8).ctypes.data))
        return read_into(self, start, out)

    monkeypatch.setattr(_storage.FileReader, "read_into", spy)
    return reads


def test_contiguous_parts_are_read_straight_into_their_targets(tmp_path, monkeypatch):
    """A same-layout load reads each shard with one positional read straight into its contiguous target (after
    the check pass); a strided target is not read into (it is copied out of a mapping) and casts (strict=False, one
    of them 0-d) are streamed. Values are bitwise the saved ones (the casts: the saved values cast by torch)."""
    path = os.path.join(tmp_path, "ckpt")
    g = torch.Generator().manual_seed(4)
    saved = {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g),
             "h": torch.randn(16, 8, generator=g).bfloat16(), "c": torch.randint(-9, 9, (5, 6, 7), generator=g),
             "s": torch.tensor(3.5)}
    checkpoint.save(path, saved)
    reads = _spy_reads(monkeypatch)
    state = {k: torch.zeros_like(v) for k, v in saved.items()}
    checkpoint.load(path, state, dedup_reads=False, verify=False)  # no check pass: only the fill's reads
    assert sorted(addr for _, _, addr in reads) == sorted(t.data_ptr() for t in state.values())
    for key in saved:
        assert torch.equal(state[key], saved[key]), key

    reads.clear()
    other = {"w": torch.zeros(48, 64).t(), "b": torch.zeros(48), "h": torch.zeros(16, 8),
             "c": torch.zeros(5, 6, 9, dtype=torch.int64)[:, :, 1:8], "s": torch.tensor(0.0, dtype=torch.float64)}
    assert checkpoint.load(path, other, dedup_reads=False, strict=False, verify=False).missing == []
    direct = {addr for _, _, addr in reads} & {t.data_ptr() for t in other.values()}
    assert direct == {other["b"].data_ptr()}, "only the contiguous target of the stored dtype is read into"
    for key in saved:
        assert torch.equal(other[key], saved[key].to(other[key].dtype)), key


def test_parts_are_streamed_in_pieces_of_the_rows_they_cover(tmp_path, monkeypatch):
    """``read_parts`` on two sub-boxes of one stored [64, 48] shard into transposed targets, rows [0, 2) x all
    columns and rows [5, 40) x columns [8, 18), with pieces of 3 rows: the sub-boxes are bitwise the saved slices,
    and the reads, each of at most 3 rows, cover rows [0, 2) and [5, 40) exactly once (the rows between the parts
    and after them are not read)."""
    from vescale.checkpoint import _local_read
    from vescale.checkpoint._storage import Storage

    path = os.path.join(tmp_path, "ckpt")
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(5))
    checkpoint.save(path, {"w": w})
    with open(os.path.join(path, "metadata.json")) as f:
        (shard,) = json.load(f)["tensors"]["w"]["shards"]
    row = 48 * 4
    monkeypatch.setattr(_local_read, "_PIECE_BYTES", 3 * row + 5)
    top, block = torch.zeros(48, 2).t(), torch.zeros(10, 35).t()
    reads = _spy_reads(monkeypatch)
    _local_read.read_parts(Storage(path), shard, torch.float32, [((0, 0), top), ((5, 8), block)])
    assert torch.equal(top, w[:2]) and torch.equal(block, w[5:40, 8:18])
    spans = sorted((start - shard["start"], start - shard["start"] + n) for start, n, _ in reads)
    assert all(hi - lo <= 3 * row for lo, hi in spans) and len(spans) == 13
    covered = []
    for lo, hi in spans:
        if covered and covered[-1][1] == lo:
            covered[-1] = (covered[-1][0], hi)
        else:
            assert not covered or covered[-1][1] < lo, "pieces overlap"
            covered.append((lo, hi))
    assert covered == [(0, 2 * row), (5 * row, 40 * row)]
