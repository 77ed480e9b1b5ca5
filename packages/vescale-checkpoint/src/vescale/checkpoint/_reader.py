"""Reading a checkpoint: its metadata, and one stored shard at a time (checked against its chunk checksums)."""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from vescale.checkpoint._crc import crc32
from vescale.checkpoint._schema import check_tables
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from vescale.checkpoint.format import METADATA_FILE, check_metadata, dtype_from_name

#: the largest ``metadata.json`` read (a checkpoint of 10**5 tensors over 10**4 files takes tens of MB)
MAX_METADATA_BYTES = 1 << 30
#: the largest safetensors header :func:`read_header` reads (safetensors' own limit)
MAX_HEADER_BYTES = 100 << 20


def read_metadata(storage: Storage) -> dict[str, Any]:
    """Parse ``metadata.json`` and check it against the schema (:func:`format.check_metadata`, then
    :func:`_schema.check_tables`); a checkpoint without it does not exist (it never committed). Anything malformed
    raises :class:`CorruptCheckpointError` naming the file and the field."""
    where = storage.where(METADATA_FILE)
    try:
        data = storage.read_bytes(METADATA_FILE, MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no complete checkpoint at {storage.url}: {where} does not exist (absent, or "
                                      "a save that did not finish)") from None
    try:
        meta = json.loads(data)
    except RecursionError:
        raise CorruptCheckpointError(f"{where} is nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptCheckpointError(f"{where} is not valid JSON: {exc}") from None
    global _schema_checked
    check_metadata(meta, where)  # cheap, and it migrates older versions in place
    if data != _schema_checked:  # the table checks depend on the bytes alone: these bytes passed them last time
        check_tables(meta, where)
        _schema_checked = bytes(data)
    return meta


#: the bytes of the last ``metadata.json`` that passed the table checks (a checkpoint loaded again skips them)
_schema_checked: bytes | None = None


def read_header(storage: Storage, name: str, size: int) -> dict[str, Any]:
    """The JSON header of the safetensors data file ``name`` of ``size`` bytes, with its ``"__header_end"`` (the
    offset its data starts at); a header longer than :data:`MAX_HEADER_BYTES` or the file, or not a JSON object
    of entries with ``dtype``, ``shape`` and two ``data_offsets`` inside the file, raises
    :class:`CorruptCheckpointError` naming the file."""
    where = storage.where(name)
    prefix = bytearray(8)
    storage.read_into(name, 0, memoryview(prefix))
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CorruptCheckpointError(f"checkpoint data file {where}: safetensors header length {n} exceeds the "
                                     f"file ({size} bytes) or the {MAX_HEADER_BYTES}-byte limit")
    body = bytearray(n)
    storage.read_into(name, 8, memoryview(body))
    try:
        header = json.loads(bytes(body))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"checkpoint data file {where}: safetensors header is not valid JSON: "
                                     f"{type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"checkpoint data file {where}: safetensors header is not a JSON object")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str)
                or not isinstance(entry.get("shape"), list) or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1] <= size - 8 - n):
            raise CorruptCheckpointError(f"checkpoint data file {where}: safetensors header entry {key[:80]!r} is "
                                         "malformed (dtype, shape, data_offsets inside the file)")
    header["__header_end"] = 8 + n
    return header


def shard_nbytes(shard: dict[str, Any]) -> int:
    return shard["end"] - shard["start"]


def chunk_spans(shard: dict[str, Any]) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` byte ranges, relative to the shard's start, that its checksums cover, in order."""
    nbytes, chunk = shard_nbytes(shard), shard["chunk"]
    return [(lo, min(lo + chunk, nbytes)) for lo in range(0, nbytes, chunk)] or [(0, 0)]


def check_chunks(where: str, shard: dict[str, Any], stored: memoryview, which: list[int] | None = None) -> None:
    """Check ``stored`` (all of the shard's stored bytes) against the checksums of chunks ``which`` (default all).

    Raises :class:`CorruptCheckpointError` naming ``where`` and the damaged byte range.
    """
    crcs = shard["crc32"]
    if not isinstance(shard.get("chunk"), int) or shard["chunk"] <= 0 or not isinstance(crcs, list):
        raise CorruptCheckpointError(f"checkpoint data file {where}: shard at {shard['offsets']} has malformed "
                                     f"checksums (chunk {shard.get('chunk')!r})")
    spans = chunk_spans(shard)
    if len(crcs) != len(spans):
        raise CorruptCheckpointError(f"checkpoint data file {where}: shard at {shard['offsets']} has {len(crcs)} "
                                     f"checksums for {len(spans)} chunks")
    for i in range(len(spans)) if which is None else which:
        lo, hi = spans[i]
        if crc32(stored[lo:hi]) != crcs[i]:
            raise CorruptCheckpointError(f"checkpoint data file {where} is damaged: checksum mismatch in bytes "
                                         f"[{shard['start'] + lo}, {shard['start'] + hi})")


def read_shard(storage: Storage, shard: dict[str, Any], dtype: torch.dtype, *, verify: bool | list[int] = True,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The shard's box as a tensor of ``lengths``; read into ``out`` (contiguous CPU, right shape) when given.

    ``verify``: check every checksum chunk (True), none (False), or the chunks listed.

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
    if verify:
        check_chunks(storage.where(shard["file"]), shard, view, None if verify is True else verify)
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
