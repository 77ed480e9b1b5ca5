"""Reading a checkpoint: its metadata, and one stored shard at a time (checked against its crc32)."""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

import torch

from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from vescale.checkpoint.format import METADATA_FILE, check_metadata, dtype_from_name


def read_metadata(storage: Storage) -> dict[str, Any]:
    """Parse and check ``metadata.json``; a checkpoint without it does not exist (it never committed)."""
    where = storage.where(METADATA_FILE)
    try:
        data = storage.read_bytes(METADATA_FILE)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no complete checkpoint at {storage.url}: {where} does not exist (absent, or "
                                      "a save that did not finish)") from None
    try:
        meta = json.loads(data)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {exc}") from None
    return check_metadata(meta, where)


def shard_nbytes(shard: dict[str, Any]) -> int:
    return shard["end"] - shard["start"]


def read_shard(storage: Storage, shard: dict[str, Any], dtype: torch.dtype, *, verify: bool = True,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The shard's box as a tensor of ``lengths``; read into ``out`` (contiguous CPU, right shape) when given.

    Raises :class:`CorruptCheckpointError` naming the file when it is missing, short, or fails its checksum.
    """
    lengths = tuple(shard["lengths"])
    stored = shard_nbytes(shard)
    raw_out = shard["codec"] == "raw" and out is not None
    buf = out.reshape(-1).view(torch.uint8) if raw_out else torch.empty(stored, dtype=torch.uint8)
    if buf.numel() != stored:
        raise CorruptCheckpointError(f"{storage.where(shard['file'])}: shard of {lengths} at {shard['offsets']} "
                                     f"has {stored} stored bytes, expected {buf.numel()}")
    view = memoryview(buf.numpy())
    storage.read_into(shard["file"], shard["start"], view)
    if verify and zlib.crc32(view) != shard["crc32"]:
        raise CorruptCheckpointError(f"checkpoint data file {storage.where(shard['file'])} is damaged: checksum "
                                     f"mismatch in bytes [{shard['start']}, {shard['end']})")
    if raw_out:
        return out
    if shard["codec"] == "zstd":
        import zstandard

        expect = math.prod(lengths) * torch.empty(0, dtype=dtype).element_size()
        try:
            data = zstandard.ZstdDecompressor().decompress(view, max_output_size=expect)
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"{storage.where(shard['file'])}: cannot decompress shard at "
                                         f"{shard['offsets']}: {exc}") from None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    elif shard["codec"] != "raw":
        raise CorruptCheckpointError(f"{storage.where(shard['file'])}: unknown codec {shard['codec']!r}")
    try:
        return buf.view(dtype).reshape(lengths)
    except RuntimeError:
        raise CorruptCheckpointError(f"{storage.where(shard['file'])}: shard at {shard['offsets']} holds "
                                     f"{buf.numel()} bytes, not a {dtype} box of {lengths}") from None


def tensor_dtype(info: dict[str, Any]) -> torch.dtype:
    return dtype_from_name(info["dtype"])
